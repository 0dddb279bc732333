"""A cost model for the one-row projections: the streaming GEMV's device time per call against
the bytes it reads, fitted as time = fixed + bytes / bandwidth.

    python -m benchmarks.gemv_scaling --out benchmarks/results/gemv_scaling_h200.json

Each projection shape of the 1.4B model runs with the engine's tiling (ouro_jax.projections.
STREAM_TUNING) at 1, 2 and 4 times its output rows (the same K), plain and, for qkv and
gate/up, with the engine's add_norm prologue. Calls are chained over distinct weights (at
least ~200 MB per program) so that no call finds its weight in L2; the time is the GPU's own
kernel time (benchmarks.timing.device_seconds). A least-squares line through the points gives
the fixed cost per call (launch, ramp, tail, prologue latency) and the steady bandwidth.
For scale, the same trace times XLA reading a 1 GiB bf16 array (a sum: reads only) and adding 1
to it (reads and writes). Why: batch-1 decode at ~241 tok/s spends ~43 us per layer application
against ~24 us of bytes at 4.3 TB/s; this says how much of the gap is per call and how much
per byte, which decides whether fewer kernels or faster streaming is the lever.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.record import save_record
from benchmarks.gemv import SHAPES
from benchmarks.timing import device_seconds

SCALES = (1, 2, 4)
MIN_CHAIN_BYTES = 200e6


def chain(name: str, scale: int, prologue: bool):
    """(fn, args, calls per fn, weight bytes per call) for `scale` x the projection's rows."""
    from ouro_jax.projections import STREAM_TUNING
    from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
    n, k, gated = SHAPES[name]
    n *= scale
    nbytes = n * k * 2
    layers = max(2, int(np.ceil(MIN_CHAIN_BYTES / nbytes)))
    keys = jax.random.split(jax.random.PRNGKey(scale), layers + 2)
    ws = [jax.random.normal(kk, (n, k), jnp.float32).astype(jnp.bfloat16) for kk in keys[:layers]]
    x = jax.random.normal(keys[-2], (1, k)).astype(jnp.bfloat16)
    b = jax.random.normal(keys[-1], (1, k)).astype(jnp.bfloat16)
    nw = jnp.full((k,), 0.7, jnp.bfloat16)
    t = STREAM_TUNING[name]

    def fn(x, b, ws):
        out = []
        for w in ws:
            if prologue:
                out.append(gemv_stream_normed(x, nw, w, eps=1e-6, branch=b, branch_w=nw,
                                              gated=gated, **t)[0])
            else:
                out.append(gemv_stream(x, w, gated=gated, **t))
        return out
    return jax.jit(fn), (x, b, ws), layers, nbytes


def fit(points):
    """Least squares of us = fixed + MB / (TB/s): (fixed us, TB/s)."""
    mb = np.array([p["bytes"] / 1e6 for p in points])
    us = np.array([p["device_us"] for p in points])
    slope, fixed = np.polyfit(mb, us, 1)
    return float(fixed), float(1.0 / slope) if slope > 0 else float("nan")


def xla_reference() -> dict:
    a = jnp.ones((512 * 1024 * 1024,), jnp.bfloat16)  # 1 GiB
    read = jax.jit(lambda v: jnp.sum(v, dtype=jnp.float32))
    copy = jax.jit(lambda v: v + 1)
    out = {}
    for label, fn, moved in (("read_tb_s", read, a.nbytes), ("copy_tb_s", copy, 2 * a.nbytes)):
        kernel, _ = device_seconds(fn, a, calls=4)
        out[label] = moved / kernel / 1e12
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemv_scaling", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    bad = set(names) - set(SHAPES)
    if bad:
        raise SystemExit(f"--shapes: unknown {sorted(bad)}; valid: {sorted(SHAPES)}")
    if jax.default_backend() != "gpu":
        raise SystemExit("benchmarks.gemv_scaling times GPU kernels: run it on a GPU")
    rows = []
    for name in names:
        for prologue in (False, True) if name in ("qkv", "gate_up") else (False,):
            points = []
            for s in SCALES:
                fn, fargs, layers, nbytes = chain(name, s, prologue)
                kernel, _ = device_seconds(fn, *fargs, calls=3, units=layers)
                points.append(dict(scale=s, bytes=nbytes, device_us=kernel * 1e6,
                                   tb_s=nbytes / kernel / 1e12))
            fixed, bw = fit(points)
            row = dict(shape=name, prologue="add_norm" if prologue else "", points=points,
                       fixed_us=fixed, steady_tb_s=bw)
            rows.append(row)
            print(f"{name:8s} {row['prologue']:8s} " + "  ".join(
                f"x{p['scale']}: {p['device_us']:6.2f} us {p['tb_s']:.2f} TB/s" for p in points)
                + f"  -> fixed {fixed:.2f} us, steady {bw:.2f} TB/s", flush=True)
    ref = xla_reference()
    print(f"XLA 1 GiB: read {ref['read_tb_s']:.2f} TB/s, copy {ref['copy_tb_s']:.2f} TB/s "
          "(read + write bytes)", flush=True)
    save_record("benchmarks.gemv_scaling", argv, args.out, rows=rows, xla=ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
