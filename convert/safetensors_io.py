"""Minimal safetensors reader/writer on numpy memory maps.

Why not `safetensors.numpy`: numpy has no bfloat16, so that path refuses bf16 files or goes
through fp32. Here a tensor is a zero-copy `np.memmap` view typed with `ml_dtypes.bfloat16`,
so a bf16 checkpoint loads as bf16 without a round trip, and headers can be validated before
any tensor data is touched. The format is the documented one: an 8-byte little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw bytes.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}


class SafetensorsError(ValueError):
    pass


def read_header(path: str | os.PathLike) -> tuple[dict, int]:
    """Returns ({name: {dtype, shape, data_offsets}}, data_start) without reading tensor data."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8:
            raise SafetensorsError(f"{path}: header length {n} exceeds the file size")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise SafetensorsError(f"{path}: unreadable header ({e})") from None
    header.pop("__metadata__", None)
    for name, info in header.items():
        if info.get("dtype") not in DTYPES:
            raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')}")
        begin, end = info["data_offsets"]
        want = int(np.prod(info["shape"], dtype=np.int64)) * DTYPES[info["dtype"]].itemsize
        if end - begin != want or 8 + n + end > size:
            raise SafetensorsError(f"{path}: tensor {name} has inconsistent data offsets")
    return header, 8 + n


def open_tensors(path: str | os.PathLike, names: Iterable[str] | None = None) -> dict[str, np.ndarray]:
    """Zero-copy read-only views of the tensors in one file."""
    header, start = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name in (header if names is None else names):
        info = header[name]
        begin, end = info["data_offsets"]
        buf = mm[start + begin:start + end]
        out[name] = buf.view(DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def save_file(tensors: dict[str, np.ndarray], path: str | os.PathLike,
              metadata: dict[str, str] | None = None) -> None:
    header, offset = {}, 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"cannot save {name}: dtype {arr.dtype}")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)
