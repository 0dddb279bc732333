"""Device-time sweeps of the Mosaic GPU GEMV (pallas_kernels/gemv_mgpu_normed.py) at the
engine's four one-row projections, against XLA and the streaming GEMV (session 13).

On the H200:  PYTHONPATH=. python -m pallas_kernels.gemv_mgpu_normed [out.json [NAME...]
              [--device-time]]   (NAME 'down2': session 13's second down sweep)"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.gemv_mgpu_normed import gemv_mgpu_normed, reference

# The engine's one-row calls at the 1.4B shapes: name -> (W rows, K, gated, normed); qkv and
# gate/up run with the add_norm prologue, o and down plain (gemv_mgpu_plain).
BENCH_SHAPES = {"qkv": (6144, 2048, False, True), "o": (2048, 2048, False, False),
                "gate_up": (11264, 2048, True, True), "down": (2048, 5632, False, False)}
NORMED_SWEEP = {  # (block_n, block_k, k_splits, stages); gated streams two W tiles per step
    "qkv": [(64, 256, 1, 4), (64, 128, 1, 4), (64, 128, 1, 6), (128, 128, 1, 4),
            (64, 256, 2, 4), (64, 128, 2, 4), (64, 128, 4, 4)],
    "o": [(64, 128, 1, 4), (64, 128, 2, 4), (64, 128, 4, 4), (64, 256, 4, 2), (64, 64, 8, 4),
          (128, 128, 4, 4)],
    "gate_up": [(64, 128, 1, 4), (64, 256, 1, 2), (64, 128, 1, 6), (64, 64, 1, 8),
                (128, 64, 1, 4), (128, 128, 1, 2), (64, 128, 2, 4), (64, 64, 4, 4)],
    "down": [(64, 256, 1, 3), (64, 128, 2, 4), (64, 128, 4, 4), (64, 64, 8, 4),
             (128, 128, 4, 3), (64, 128, 1, 6)],
}
# Session 13's second sweep, down only (the one projection the kernel won, at 8 splits):
# deeper rings, 11 and 22 splits (352 and 704 programs), 128-row blocks.
DOWN_SWEEP2 = [(64, 64, 8, 6), (64, 64, 8, 8), (128, 64, 8, 4), (64, 128, 11, 4),
               (64, 256, 11, 2), (64, 64, 11, 8), (64, 64, 22, 4), (64, 64, 4, 8),
               (128, 64, 4, 8)]


def _bench_inputs(n, k, min_bytes):
    ks = jax.random.split(jax.random.PRNGKey(n + k), 5)
    x = jax.random.normal(ks[0], (1, k), jnp.float32).astype(jnp.bfloat16)
    b = (jax.random.normal(ks[1], (1, k)) * 3).astype(jnp.bfloat16)
    wb, wx = ((1 + 0.1 * jax.random.normal(kk, (k,))).astype(jnp.bfloat16) for kk in ks[2:4])
    copies = max(2, -(-min_bytes // (n * k * 2)))
    ws = [(jax.random.normal(jax.random.fold_in(ks[4], i), (n, k), jnp.float32)
           * k ** -0.5).astype(jnp.bfloat16) for i in range(copies)]
    return x, b, wb, wx, ws


def benchmark_normed(names=tuple(BENCH_SHAPES), sweep=NORMED_SWEEP, min_bytes=200_000_000,
                     calls=200, eps=1e-6, device_time=False):
    """us per call of the engine's one-row projections: XLA (the reference path), the
    engine's streaming GEMV on STREAM_TUNING (gemv_stream_normed for qkv and gate/up with the
    add_norm prologue, gemv_stream for o and down) and the Mosaic kernel at each tiling
    (normed: overlap off and on; k_splits > 1 includes the XLA sum of the partials); rows as
    gemv_mgpu.benchmark's, with the mismatches against XLA (bf16 elements that differ).
    device_time: also the kernels' own time per call from a profiler trace (device_us, all
    kernels of the call including split-K's XLA sum; span_us, first start to last end),
    which _bench's wall clock does not give for short kernels (see _device_us)."""
    import itertools
    import numpy as np
    from ouro_jax.projections import STREAM_TUNING
    from pallas_kernels.gemv_mgpu import _bench, _device_us
    from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
    rows = []
    for name in names:
        n, k, gated, normed = BENCH_SHAPES[name]
        nbytes = n * k * 2
        x, b, wb, wx, ws = _bench_inputs(n, k, min_bytes)
        reps = max(1, calls // len(ws))
        args = dict(eps=eps, branch=b, branch_w=wb, gated=gated) if normed else \
            dict(eps=eps, gated=gated)
        wx = wx if normed else None
        ref_y, ref_x = (np.asarray(a, np.float32)
                        for a in jax.jit(lambda w: reference(x, wx, w, **args))(ws[0]))

        def record(kernel, fn, **extra):
            try:
                y, xn = (np.asarray(a, np.float32) for a in jax.jit(fn)(ws[0]))
                us = _bench(fn, ws, reps)
                dev_us, span_us = _device_us(fn, ws) if device_time else (None, None)
            except Exception as e:  # noqa: BLE001 - report it and go on
                msg = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  {kernel} {extra}: FAILED {msg}", flush=True)
                rows.append(dict(name=name, n=n, k=k, kernel=kernel, error=msg, **extra))
                return
            row = dict(name=name, n=n, k=k, kernel=kernel, us=us, **extra,
                       max_err=float(np.abs(y - ref_y).max()),
                       y_mismatches=int((y != ref_y).sum()),
                       x_mismatches=int((xn != ref_x).sum()))
            if device_time:
                row.update(device_us=dev_us, span_us=span_us)
                print(f"  {kernel} {extra}: device {dev_us:6.2f} us/call "
                      f"({nbytes / dev_us / 1e6:.2f} TB/s), span {span_us:6.2f}", flush=True)
            print(f"  {kernel} {extra}: {us:7.2f} us {nbytes / us / 1e6:.2f} TB/s | max err "
                  f"{row['max_err']:.3g}, {row['y_mismatches']} y / {row['x_mismatches']} x' "
                  f"elements differ from XLA", flush=True)
            rows.append(row)

        print(f"{name}: N={n} K={k} gated={gated} normed={normed} {nbytes / 1e6:.1f} MB "
              f"x{len(ws)}", flush=True)
        record("xla", lambda w: reference(x, wx, w, **args))
        tuning = STREAM_TUNING[name]
        if normed:
            record("gemv_stream_normed",
                   lambda w: gemv_stream_normed(x, wx, w, **args, **tuning), tiling=tuning)
        else:
            record("gemv_stream", lambda w: (gemv_stream(x, w, gated=gated, **tuning), x),
                   tiling=tuning)
        for (bn, bk, ksp, st), ov in itertools.product(sweep[name],
                                                       (False, True) if normed else (False,)):
            tiling = dict(block_n=bn, block_k=bk, k_splits=ksp, stages=st, overlap=ov)
            record("gemv_mgpu_normed" if normed else "gemv_mgpu_plain",
                   lambda w, t=tiling: gemv_mgpu_normed(x, wx, w, **args, **t),
                   tiling=[bn, bk, ksp, st], overlap=ov)
    return rows


def main(argv, prog="pallas_kernels.gemv_mgpu_normed"):
    import json
    args = [a for a in argv[1:] if a != "--device-time"]
    device_time = "--device-time" in argv[1:]
    names = tuple(args) or tuple(BENCH_SHAPES)
    sweep = NORMED_SWEEP
    if names == ("down2",):  # session 13's second down sweep (with the first's best)
        names, sweep = ("down",), {"down": [(64, 64, 8, 4)] + DOWN_SWEEP2}
    bad = sorted(set(names) - set(BENCH_SHAPES))
    if bad:
        raise SystemExit(f"unknown projection(s) {bad}; choose from {tuple(BENCH_SHAPES)}")
    result = dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
                  command="python -m " + " ".join([prog] + list(argv)),
                  rows=benchmark_normed(names, sweep, device_time=device_time))
    if argv:
        with open(argv[0], "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    import sys
    main(sys.argv[1:], prog="pallas_kernels.gemv_mgpu_sweep")
