"""Make a random-weight Ouro checkpoint in the HF layout, at a preset or custom shape.

    python -m convert.synthesize --preset 1.4b --out /tmp/ouro-1.4b --seed 0
    python -m convert.synthesize --preset tiny-gqa --num-hidden-layers 5 --out DIR
    python -m convert.synthesize --preset 1.4b --branch-scale 0.003 --out DIR  # ~80% draft acceptance

Used by tests, benchmarks and anyone without real weights. `--branch-scale` scales the two
post-branch norms so later loops change the state little (see params.random_params_numpy).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import ml_dtypes
import numpy as np

from convert.save import save_checkpoint
from ouro_jax.config import PRESETS, OuroConfig
from ouro_jax.params import random_params_numpy

_NP_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "fp32": np.dtype(np.float32)}
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "total_ut_steps")


def synthesize(out: str, preset: str = "tiny-gqa", seed: int = 0, dtype: str = "bf16",
               branch_scale: float = 1.0, fmt: str = "safetensors",
               shard_mb: float | None = None, gate_bias: float | None = None,
               norm_jitter: float = 0.1, **overrides) -> OuroConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if dtype not in _NP_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose bf16 or fp32")
    for name, v in (("branch_scale", branch_scale), ("gate_bias", gate_bias),
                    ("norm_jitter", norm_jitter)):
        # (the loader refuses non-finite weights, so such a checkpoint could never load)
        if v is not None and not math.isfinite(v):
            raise ValueError(f"{name} must be a finite number, got {v!r}")
    if shard_mb is not None and not shard_mb > 0:
        raise ValueError(f"shard_mb must be a positive size in MiB, got {shard_mb!r}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is a file, not a folder")
    cfg = PRESETS[preset].replace(**{k: v for k, v in overrides.items() if v is not None})
    tensors = random_params_numpy(cfg, seed=seed, dtype=np.float32, branch_scale=branch_scale,
                                  norm_jitter=norm_jitter)
    if gate_bias is not None:
        tensors["model.early_exit_gate.bias"][:] = gate_bias
    tensors = {k: v.astype(_NP_DTYPES[dtype]) for k, v in tensors.items()}
    shard_bytes = int(shard_mb * 2**20) if shard_mb else None
    save_checkpoint(tensors, cfg, out, fmt=fmt, shard_bytes=shard_bytes)
    return cfg


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m convert.synthesize", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-gqa", choices=sorted(PRESETS))
    p.add_argument("--out", required=True, help="folder to write (created if missing)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bf16", choices=sorted(_NP_DTYPES))
    p.add_argument("--format", dest="fmt", default="safetensors", choices=["safetensors", "bin"])
    p.add_argument("--shard-mb", type=float, default=None, help="split weights into shards")
    p.add_argument("--branch-scale", type=float, default=1.0,
                   help="scale of the post-branch norms; small values raise draft acceptance")
    p.add_argument("--gate-bias", type=float, default=None, help="fixed exit-gate bias")
    p.add_argument("--norm-jitter", type=float, default=0.1,
                   help="spread of norm weights around 1 (use 0 with --branch-scale, as the "
                        "reference engine's 0.003 setup does)")
    for name in _SHAPE_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    kw = {k: getattr(args, k) for k in _SHAPE_FIELDS}
    try:
        cfg = synthesize(args.out, args.preset, args.seed, args.dtype, args.branch_scale,
                         args.fmt, args.shard_mb, args.gate_bias, args.norm_jitter, **kw)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    shape = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
             if f.name in _SHAPE_FIELDS}
    print(f"wrote {args.out}: {cfg.num_params() / 1e6:.2f}M parameters, {args.dtype}, {shape} "
          f"in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
