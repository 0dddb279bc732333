"""Load a Hugging Face Ouro checkpoint folder into `OuroParams`.

Supported layouts: `model.safetensors`; a sharded safetensors set with
`model.safetensors.index.json`; `pytorch_model.bin` or a sharded `.bin` set (read by torch
on CPU with `weights_only=True`, so a checkpoint can never run code).

Everything is validated before any tensor is stacked or moved to a device: the complete set
of names and shapes is compared against what the config implies, and one error lists every
missing, unexpected and misshapen tensor. Nothing loads half-way.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from convert.safetensors_io import FLOAT_DTYPES, open_tensors, read_header
from ouro_jax.config import OuroConfig
from ouro_jax.params import (OuroParams, engine_params_from_hf, expected_hf_shapes,
                             params_from_hf)


class CheckpointError(ValueError):
    """The checkpoint folder does not hold a complete, well-formed Ouro model."""


DTYPE_ALIASES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "fp32": jnp.float32,
                 "float32": jnp.float32, "f32": jnp.float32}


def resolve_dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPE_ALIASES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose bf16 or fp32")
        return jnp.dtype(DTYPE_ALIASES[dtype])
    d = jnp.dtype(dtype)
    if d not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"unsupported dtype {d}; choose bfloat16 or float32")
    return d


LAYOUTS = ("stacked", "engine", "engine_unfused")


@dataclass
class LoadedCheckpoint:
    config: OuroConfig
    params: OuroParams
    seconds: float
    files: list[str]
    # seconds per phase (load_checkpoint): open_s (config, file headers or unpickling,
    # validation; safetensors are memory-mapped, not read), backend_s (the JAX backend's
    # start on a process's first use, else ~0), convert_s (the dtype conversion and layout
    # on the host, which reads the mapped bytes, so a cold page cache shows here), put_s
    # (the jax.device_put calls: on a GPU the host-side staging of every byte),
    # check_compile_s (the non-finite check's compile, while the transfers run),
    # transfer_wait_s (what is left of the transfers), check_finite_s (the check itself);
    # they add up to `seconds`
    phases: dict = field(default_factory=dict)


def _weight_files(folder: str) -> tuple[str, list[str]]:
    """('safetensors'|'bin', files) for the folder, preferring safetensors."""
    def index_files(index_name):
        path = os.path.join(folder, index_name)
        try:
            with open(path) as f:
                index = json.load(f)
        except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                       for v in weight_map.values()):
            raise CheckpointError(f"{index_name} has no weight_map of tensor -> file name")
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not os.path.exists(os.path.join(folder, f))]
        if missing:
            raise CheckpointError(f"{index_name} names shard files that do not exist: {missing}")
        if index_name.endswith(".safetensors.index.json"):  # headers only: cheap
            held = {f: set(read_header(os.path.join(folder, f))[0]) - {"__metadata__"}
                    for f in files}
            absent = sorted(f"{n} (in {f})" for n, f in weight_map.items() if n not in held[f])
            if absent:
                raise CheckpointError(f"{index_name} maps {len(absent)} tensor(s) to shards that "
                                      f"do not hold them: {', '.join(absent[:5])}"
                                      + (" ..." if len(absent) > 5 else ""))
        return files

    if os.path.exists(os.path.join(folder, "model.safetensors.index.json")):
        return "safetensors", index_files("model.safetensors.index.json")
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return "safetensors", ["model.safetensors"]
    if os.path.exists(os.path.join(folder, "pytorch_model.bin.index.json")):
        return "bin", index_files("pytorch_model.bin.index.json")
    if os.path.exists(os.path.join(folder, "pytorch_model.bin")):
        return "bin", ["pytorch_model.bin"]
    raise CheckpointError(
        f"no weights in {folder}: expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json")


def _read_safetensors(folder: str, files: list[str]) -> tuple[dict, dict]:
    """({name: memmap view}, {name: (shape, dtype)}) over all shards."""
    tensors, meta = {}, {}
    for fname in files:
        path = os.path.join(folder, fname)
        header, _ = read_header(path)
        for name, info in header.items():
            if name in meta:
                raise CheckpointError(f"tensor {name} appears in more than one shard")
            meta[name] = (tuple(info["shape"]), info["dtype"])
        tensors.update(open_tensors(path))
    return tensors, meta


def _read_bin(folder: str, files: list[str]) -> tuple[dict, dict]:
    try:
        import torch  # only needed for .bin checkpoints
    except ImportError:
        raise CheckpointError(
            f"{folder} holds .bin weights ({files[0]}), which need torch to read: pip install "
            f"torch (the CPU build is enough), or convert them to safetensors") from None

    tensors, meta = {}, {}
    for fname in files:
        try:
            state = torch.load(os.path.join(folder, fname), map_location="cpu",
                               weights_only=True, mmap=True)
        except Exception as e:  # pickles with code objects fail here, by design
            raise CheckpointError(f"{fname}: refused to load ({type(e).__name__}: {e})") from None
        for name, t in state.items():
            if name in meta:
                raise CheckpointError(f"tensor {name} appears in more than one shard")
            if not isinstance(t, torch.Tensor):
                raise CheckpointError(f"{fname}: entry {name} is not a tensor")
            if t.dtype == torch.bfloat16:
                arr = t.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                dt = "BF16"
            else:
                arr = t.contiguous().numpy()
                dt = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                      np.dtype(np.float64): "F64"}.get(arr.dtype, str(arr.dtype))
            tensors[name] = arr
            meta[name] = (tuple(arr.shape), dt)
    return tensors, meta


def validate_tensors(meta: dict[str, tuple], cfg: OuroConfig) -> None:
    expected = expected_hf_shapes(cfg)
    missing = sorted(set(expected) - set(meta))
    unexpected = sorted(set(meta) - set(expected))
    misshapen = sorted(f"{n}: got {list(meta[n][0])}, expected {list(expected[n])}"
                       for n in set(expected) & set(meta) if tuple(meta[n][0]) != expected[n])
    bad_dtype = sorted(f"{n}: {meta[n][1]}" for n in set(expected) & set(meta)
                       if meta[n][1] not in FLOAT_DTYPES)
    problems = []
    for title, items in (("missing", missing), ("unexpected", unexpected),
                         ("misshapen", misshapen), ("non-float", bad_dtype)):
        if items:
            shown = items if len(items) <= 20 else items[:20] + [f"... and {len(items) - 20} more"]
            problems.append(f"{len(items)} {title} tensor(s):\n  " + "\n  ".join(shown))
    if problems:
        raise CheckpointError("checkpoint does not match its config:\n" + "\n".join(problems))


def load_checkpoint(folder: str | os.PathLike, dtype="bf16",
                    layout: str = "stacked") -> LoadedCheckpoint:
    """Reads config.json and the weights of an HF Ouro folder into device arrays of `dtype`.

    layout "stacked": layer weights on an [L] axis (the dense forward, tests, conversion);
    "engine" / "engine_unfused": one LayerParams per layer, q/k/v and gate/up concatenated
    (or not), which is what the engine runs (ouro_jax.params.engine_params_from_hf)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    t0 = time.perf_counter()
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder} "
                              + ("is a file, not a folder" if os.path.exists(folder)
                                 else "does not exist"))
    dtype = resolve_dtype(dtype)
    cfg = OuroConfig.from_json(folder)
    kind, files = _weight_files(folder)
    tensors, meta = (_read_safetensors if kind == "safetensors" else _read_bin)(folder, files)
    validate_tensors(meta, cfg)
    t = [t0, time.perf_counter()]
    jax.devices()  # the backend's start (CUDA context, XLA client) on a process's first use
    t.append(time.perf_counter())
    times = {}
    if layout == "stacked":
        params = params_from_hf(tensors, cfg, dtype, times=times)
    else:
        params = engine_params_from_hf(tensors, cfg, dtype, fuse=layout == "engine",
                                       times=times)
    t.append(time.perf_counter())
    check = _compiled_check(params)  # while the transfers run
    t.append(time.perf_counter())
    jax.block_until_ready(params)
    t.append(time.perf_counter())
    try:
        check_finite(params, check)
    except CheckpointError:
        names = _nonfinite_names(tensors, dtype)
        if not names:  # (cannot happen: the device saw the same values)
            raise
        raise CheckpointError(
            f"non-finite weights (NaN or inf, in {np.dtype(dtype).name}) in {len(names)} "
            f"checkpoint tensor(s): {', '.join(names[:5])}" + (" ..." if len(names) > 5 else "")
        ) from None
    t.append(time.perf_counter())
    step = [b - a for a, b in zip(t, t[1:])]
    put = min(times["put_s"], step[2])  # the convert step's device_put calls
    phases = dict(open_s=step[0], backend_s=step[1], convert_s=step[2] - put, put_s=put,
                  check_compile_s=step[3], transfer_wait_s=step[4], check_finite_s=step[5])
    return LoadedCheckpoint(cfg, params, t[-1] - t0, files, phases)


def _nonfinite_names(tensors: dict, dtype) -> list[str]:
    """The checkpoint's names for the tensors that hold NaN or inf once in `dtype` (a value
    may overflow in the conversion). Only on the error path: it reads every weight on the
    host, where the device check names the engine's fused and stacked arrays."""
    bad = []
    for name, arr in tensors.items():
        with np.errstate(over="ignore", invalid="ignore"):
            if not np.isfinite(np.asarray(arr).astype(np.dtype(dtype))).all():
                bad.append(name)
    return sorted(bad)


@jax.jit
def _finite_leaves(params):
    return jax.tree.map(lambda x: jnp.all(jnp.isfinite(x)), params)


_CHECKS: dict = {}


def _compiled_check(params):
    """_finite_leaves compiled ahead for params' structure, shapes, dtypes and shardings (a
    load compiles it while its transfers run, which a jitted call, made after them, would
    not), kept per process like the jit's own cache."""
    leaves, tree = jax.tree.flatten(params)
    key = (tree, tuple((x.shape, str(x.dtype), str(getattr(x, "sharding", ""))) for x in leaves))
    if key not in _CHECKS:
        _CHECKS[key] = _finite_leaves.lower(params).compile()
    return _CHECKS[key]


def check_finite(params, compiled=None) -> None:
    """CheckpointError naming the weights that hold NaN or inf (after the dtype conversion):
    they would run, and give NaN logits whose argmax, token 0, reads as an end of sequence.
    One small program over every weight, one fetch. compiled: that program compiled ahead
    for these params (`_finite_leaves.lower(params).compile()`), else it is jitted here."""
    ok = jax.device_get((compiled or _finite_leaves)(params))
    bad = [jax.tree_util.keystr(path) for path, fine in
           jax.tree_util.tree_flatten_with_path(ok)[0] if not fine]
    if bad:
        raise CheckpointError(f"non-finite weights (NaN or inf) in {len(bad)} tensor(s): "
                              f"{', '.join(bad[:5])}" + (" ..." if len(bad) > 5 else ""))
