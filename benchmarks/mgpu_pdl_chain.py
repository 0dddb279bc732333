"""Programmatic dependent launch placed by the kernel: a chain of the four 1.4B one-row
projections per layer, on the Mosaic GPU GEMV (pallas_kernels/gemv_mgpu_areg.py) with and
without `pdl_step`, against the engine's streaming GEMV (Triton, where XLA puts PDL's wait at
every kernel's start). Needs a GPU and jax >= 0.11 (Mosaic GPU).

    python -m benchmarks.mgpu_pdl_chain --layers 24 --steps 0,2,last --out chain.json

Why: batch-1 decode pays ~17 us per layer application in per-call costs (each kernel's ramp
and tail, benchmarks.gemv_scaling). With the wait after the first weight requests and an
early trigger, a kernel's weight stream can start under the previous kernel's tail.

Each layer: qkv (6144 x 2048), o (2048 x 2048) on the first 2048 of qkv's outputs, gate/up
(gated, 11264 x 2048), down (2048 x 5632); down's output is the next layer's input. Every
layer has its own weights (2.5 GB for 24), so they stream from HBM; every kernel reads its
input as the first K values of the previous kernel's output (no slicing kernels in between).
No norms here (plain GEMVs in every arm). Figures: us per layer, from the wall clock of the
whole jitted chain and from the profiler's span (benchmarks.timing.device_seconds). Outputs
of the PDL arms are compared bit for bit with the Mosaic arm without PDL (same input: a weak
check of the wait; tests/test_gemv_mgpu_areg.py's GPU chain test is the strong one).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gemv import SHAPES  # name -> (N, K, gated), the 1.4B projections

# Mosaic tilings (block_n, block_k, stages), one split: the session-13 device-time bests
# (gemv_mgpu_areg_session13_h200.json; down's best one-split tiling)
MGPU = {"qkv": (32, 256, 4), "o": (16, 256, 4), "gate_up": (16, 128, 4), "down": (16, 512, 3)}


def weights(layers: int, seed: int = 0):
    """Per layer {projection: W [N, K] bf16}, each its own draw (so a chain streams them all
    from HBM), scaled by K ** -0.5. benchmarks.gemv_timeline uses them too."""
    key = jax.random.PRNGKey(seed)
    out = []
    for i in range(layers):
        lw = {}
        for j, (name, (n, k, _)) in enumerate(SHAPES.items()):
            lw[name] = (jax.random.normal(jax.random.fold_in(key, 4 * i + j), (n, k),
                                          jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        out.append(lw)
    return out


def _stream(name, x, w):
    from ouro_jax.projections import STREAM_TUNING
    from pallas_kernels import gemv_stream as gs
    n, k, gated = SHAPES[name]
    cfg = gs._config(dict(STREAM_TUNING[name]), k)
    return gs._call((x, w), m=1, k=k, n_out=n // 2 if gated else n, gated=gated, prologue="",
                    eps=0.0, interpret=False, cfg=cfg)


def _mgpu(name, x, w, pdl_step):
    from pallas_kernels.gemv_mgpu_areg import _build
    n, k, gated = SHAPES[name]
    bn, bk, st = MGPU[name]
    call = _build(n // 2 if gated else n, k, jnp.dtype(jnp.bfloat16), gated, bn, bk, 1, st,
                  None, pdl_step)
    return call(x, w)


def chain(ws, x, arm: tuple):
    """arm: per projection, "stream" or ("mgpu", pdl_step or None)."""
    for lw in ws:
        for name, how in zip(SHAPES, arm):
            x = _stream(name, x, lw[name]) if how == "stream" else \
                _mgpu(name, x, lw[name], how[1])
    return x


def arms(steps):
    out = {"stream": ("stream",) * 4, "mgpu": (("mgpu", None),) * 4}
    for s in steps:
        out[f"mgpu_pdl{s}"] = tuple(("mgpu", _step(s, name)) for name in SHAPES)
    if steps:  # Mosaic with PDL on the big two (level with streaming there), streaming else
        s = steps[0]
        out[f"mixed_pdl{s}"] = tuple(("mgpu", _step(s, n)) if n in ("qkv", "gate_up")
                                     else "stream" for n in SHAPES)
    return out


def _step(s, name):
    if s != "last":
        return int(s)
    n, k, _ = SHAPES[name]
    return k // MGPU[name][1] - 1


def run(layers: int, steps, reps: int):
    from benchmarks.timing import device_seconds
    ws = weights(layers)
    x = (jax.random.normal(jax.random.PRNGKey(1), (1, 2048), jnp.float32)).astype(jnp.bfloat16)
    results, ref = [], None
    for label, arm in arms(steps).items():
        fn = jax.jit(lambda ws, x, arm=arm: chain(ws, x, arm))
        try:
            y = np.asarray(fn(ws, x), np.float32)
            t = time.perf_counter()
            for _ in range(reps):
                out = fn(ws, x)
            jax.block_until_ready(out)
            wall = (time.perf_counter() - t) / reps / layers * 1e6
            kernel, span = device_seconds(fn, ws, x, calls=4, units=layers)
        except Exception as e:  # noqa: BLE001 - report it and go on
            msg = f"{type(e).__name__}: {str(e)[:400]}"
            print(f"{label}: FAILED {msg}", flush=True)
            results.append(dict(arm=label, error=msg))
            continue
        if label == "mgpu":
            ref = y
        row = dict(arm=label, wall_us_per_layer=wall, kernel_us_per_layer=kernel * 1e6,
                   span_us_per_layer=span * 1e6, finite=bool(np.isfinite(y).all()))
        if label not in ("stream", "mgpu"):
            if ref is None:
                row["error"] = "no Mosaic arm without PDL to compare with (it failed)"
            else:
                row["mismatches_vs_mgpu"] = int((y != ref).sum())
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", default="0,2,last",
                    help="comma list of pdl_step values (ints or 'last': the last step)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    steps = [s.strip() for s in a.steps.split(",") if s.strip()]
    for s in steps:
        if s != "last" and not (s.isascii() and s.isdigit()):
            ap.error(f"--steps takes ints >= 0 or 'last', got {s!r}")
    if a.layers < 1 or a.reps < 1:
        ap.error("--layers and --reps must be >= 1")
    from benchmarks.grid_barrier import require_gpu
    require_gpu("mgpu_pdl_chain", "it times Mosaic GPU kernels, which need a Hopper GPU")
    rows = run(a.layers, steps, a.reps)
    result = dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
                  command="python -m benchmarks.mgpu_pdl_chain " + " ".join(sys.argv[1:]),
                  layers=a.layers, mgpu_tilings=MGPU, rows=rows)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
