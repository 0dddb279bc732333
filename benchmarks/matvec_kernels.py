"""Few-row projections on the GPU: XLA (rms_norm + dot) vs the fused Pallas kernel's variants.

    python benchmarks/matvec_kernels.py --out matvec.json

Shapes of the 1.4B model: qkv (6144 x 2048, input norm only) and gate/up (2 x 5632 x 2048,
residual + two norms + SiLU gate). R calls on R different weight copies run unrolled in one
jit (their weights together exceed the 50 MB L2), so each call streams its weight from HBM.
Reported: microseconds per call and weight bytes / time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.matvec import fused_norm_matvec, fused_norm_matvec_reference

REPS = 6


def _time(f, *args, runs=15):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) / REPS


def case(m, name, rng, small=False):
    k = 64 if small else 2048
    n, gated, res = {"qkv": (6144, False, False), "gate_up": (5632, True, True)}[name]
    n = 64 if small else n
    rows = 2 * n if gated else n
    ws = [jnp.asarray(rng.standard_normal((rows, k)) / 45, jnp.bfloat16) for _ in range(REPS)]
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    d = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) if res else None
    w_in = jnp.ones((k,), jnp.bfloat16)
    return x, d, w_in, ws, gated, rows * k * 2


def bench(fn, x, d, w_in, ws, gated):
    def many(x, d, ws):
        out = []
        for w in ws:  # unrolled: R kernels on R weights
            kw = dict(d=d, w_res=w_in if d is not None else None, gated=gated, eps=1e-6)
            out.append(fn(x, w_in, w, **kw)[1])
        return out
    return _time(jax.jit(many), x, d, ws)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--small", action="store_true", help="tiny shapes (CPU smoke test)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    interpret = jax.default_backend() != "gpu"
    results = []
    for m, name in itertools.product([int(r) for r in args.rows.split(",")], ["qkv", "gate_up"]):
        x, d, w_in, ws, gated, nbytes = case(m, name, rng, args.small)
        variants = [("xla", fused_norm_matvec_reference)]
        for stats, bn, warps, stages in itertools.product(["kernel", "xla"], [16, 32, 64],
                                                          [4, 8], [3, 5]):
            def f(*a, stats=stats, bn=bn, warps=warps, stages=stages, **kw):
                return fused_norm_matvec(*a, stats=stats, block_n=bn, num_warps=warps,
                                         num_stages=stages, interpret=interpret, **kw)
            variants.append((f"pallas stats={stats} bn={bn} w={warps} s={stages}", f))
        for label, fn in variants:
            try:
                sec = bench(fn, x, d, w_in, ws, gated)
                row = dict(rows=m, proj=name, impl=label, us=sec * 1e6, GBps=nbytes / sec / 1e9)
            except Exception as e:  # a variant that does not compile is reported, not fatal
                row = dict(rows=m, proj=name, impl=label, error=str(e)[:200])
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"jax_version": jax.__version__, "device": jax.devices()[0].device_kind,
                       "command": " ".join(["benchmarks/matvec_kernels.py", *(argv or sys.argv[1:])]),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
