"""Write HF-layout Ouro checkpoint folders (config.json + weights) from numpy tensors."""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from convert.safetensors_io import save_file
from ouro_jax.config import OuroConfig


def save_checkpoint(tensors: dict[str, np.ndarray], cfg: OuroConfig, folder: str | os.PathLike,
                    fmt: str = "safetensors", shard_bytes: int | None = None,
                    extra_config: dict | None = None) -> list[str]:
    """Saves tensors under their HF names. `shard_bytes` splits into several files plus an
    index, as HF does for large models. Returns the weight file names written."""
    if fmt not in ("safetensors", "bin"):
        raise ValueError(f"unknown checkpoint format {fmt!r}")
    os.makedirs(folder, exist_ok=True)
    config = cfg.to_hf_dict()
    # torch_dtype says what the tensors hold (to_hf_dict assumes bf16, as HF's Ouro ships;
    # the CLI reads it to suggest --dtype bf16)
    stored = {np.dtype(a.dtype) for a in tensors.values()}
    torch_names = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                   np.dtype(ml_dtypes.bfloat16): "bfloat16"}
    if len(stored) == 1 and next(iter(stored)) in torch_names:
        config["torch_dtype"] = torch_names[next(iter(stored))]
    config.update(extra_config or {})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if shard_bytes and size and size + arr.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes

    ext = "safetensors" if fmt == "safetensors" else "bin"
    stem = "model" if fmt == "safetensors" else "pytorch_model"
    if len(shards) == 1:
        names = [f"{stem}.{ext}"]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}.{ext}" for i in range(len(shards))]
    for shard, fname in zip(shards, names):
        path = os.path.join(folder, fname)
        if fmt == "safetensors":
            save_file(shard, path, metadata={"format": "pt"})
        else:
            _save_bin(shard, path)
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
                 "weight_map": {n: fname for shard, fname in zip(shards, names) for n in shard}}
        with open(os.path.join(folder, f"{stem}.{ext}.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return names


def _save_bin(tensors: dict[str, np.ndarray], path: str) -> None:
    import torch

    state = {}
    for name, arr in tensors.items():
        if arr.dtype == np.dtype(ml_dtypes.bfloat16):
            state[name] = torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
        else:
            state[name] = torch.from_numpy(np.ascontiguousarray(arr))
    torch.save(state, path)
