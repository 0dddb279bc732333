"""The engine's one-row streaming GEMVs chained as a decoder layer's projections, inside one
jitted JAX program, launched by JAX (`xla`) or by our PDL launcher (pallas_kernels/pdl_launch.py)
without PDL (`ffi`), with PDL and the trigger at the kernel's start (`pdl_start`) or once the
last weight block has arrived (`pdl_end`). Per layer: qkv -> (slice of q, an XLA kernel) -> o
-> gate/up -> down -> the next layer's qkv, over --layers layers of distinct weights (1.4B
shapes, bf16), --loops times. The launcher's arms must give one another's bits (the same
Triton compiles them), and `xla` arms theirs; the run fails if not. Between the two families
the kernels come from two Triton versions, so the rounding may differ (max_diff_to_first_arm).

    python3 -m benchmarks.pdl_jax_chain --out benchmarks/results/pdl_jax_chain_h200.json
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.pdl_chain import SHAPES
from ouro_jax.projection_tuning import STREAM_TUNING
from pallas_kernels import pdl_launch
from pallas_kernels.gemv_stream import gemv_stream

ARMS = {"xla": (None, False), "ffi": (False, False), "pdl_start": ("start", True),
        "pdl_end": ("end", True)}
ORDER = ("qkv", "o", "gate_up", "down")


def make_weights(n_layers, seed=0):
    key = jax.random.PRNGKey(seed)
    layers = []
    for _ in range(n_layers):
        lw = {}
        for name in ORDER:
            n, k, gated = SHAPES[name]
            key, sub = jax.random.split(key)
            scale = k ** -0.5
            lw[name] = (jax.random.normal(sub, (2 * n if gated else n, k), jnp.float32)
                        * scale).astype(jnp.bfloat16)
        layers.append(lw)
    return layers


def projection(name, kernel_pdl, launch_pdl, kernels):
    n, k, gated = SHAPES[name]
    tuning = dict(STREAM_TUNING[name])
    if kernel_pdl is None:  # JAX's own launch
        return functools.partial(gemv_stream, gated=gated, **tuning)
    tuning["pdl"] = kernel_pdl
    key = (name, kernel_pdl)
    if key not in kernels:
        f = functools.partial(gemv_stream, gated=gated, **tuning)
        x = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
        w = jax.ShapeDtypeStruct((2 * n if gated else n, k), jnp.bfloat16)
        kernels[key] = pdl_launch.compile_pallas(f, x, w, num_warps=tuning["num_warps"],
                                                 num_stages=1)
    kern = kernels[key]
    out = jax.ShapeDtypeStruct((1, n), jnp.bfloat16)
    return lambda x, w: pdl_launch.call(kern, out, x, w, pdl=launch_pdl)


def chain_fn(arm, loops, kernels):
    kernel_pdl, launch_pdl = ARMS[arm]
    proj = {name: projection(name, kernel_pdl, launch_pdl, kernels) for name in ORDER}

    def f(x, layers):
        for _ in range(loops):
            for lw in layers:
                y = proj["qkv"](x, lw["qkv"])
                y = proj["o"](y[:, :2048], lw["o"])
                y = proj["gate_up"](y, lw["gate_up"])
                x = proj["down"](y, lw["down"])
        return x
    return jax.jit(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--arms", default="xla,ffi,pdl_start,pdl_end,xla")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; choose from {sorted(ARMS)}")
    layers = make_weights(args.layers)
    x0 = jax.random.normal(jax.random.PRNGKey(1), (1, 2048), jnp.float32).astype(jnp.bfloat16)
    mb = sum(w.size * 2 for lw in layers for w in lw.values()) / args.layers / 1e6
    kernels, rows, ref = {}, [], {}
    for arm in arms:
        t0 = time.perf_counter()
        f = chain_fn(arm, args.loops, kernels)
        out = jax.block_until_ready(f(x0, layers))
        compile_s = time.perf_counter() - t0
        family = "xla" if arm == "xla" else "launcher"
        got = np.asarray(out)
        ref.setdefault(family, got)
        same = bool(np.array_equal(got, ref[family]))
        first = next(iter(ref.values())).astype(np.float64)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            jax.block_until_ready(f(x0, layers))
            times.append((time.perf_counter() - t) * 1e6 / (args.loops * args.layers))
        med = statistics.median(times)
        row = dict(arm=arm, us_per_layer=round(med, 3), us_min=round(min(times), 3),
                   us_max=round(max(times), 3), tb_s=round(mb / med, 3),
                   compile_s=round(compile_s, 2), bit_equal_in_family=same,
                   max_diff_to_first_arm=float(np.max(np.abs(got.astype(np.float64) - first))),
                   result_rms=float(np.sqrt(np.mean(np.asarray(out, np.float64) ** 2))))
        print(json.dumps(row), flush=True)
        rows.append(row)
    kinfo = {f"{k[0]}:{k[1]}": dict(grid=v.grid, threads=v.threads, shared=v.shared,
                                    params=v.n_params, wait=v.has_wait, trigger=v.has_trigger)
             for k, v in kernels.items()}
    meta = dict(command="python3 -m benchmarks.pdl_jax_chain " + " ".join(argv or sys.argv[1:]),
                device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                layers=args.layers, loops=args.loops, mb_per_layer=mb, kernels=kinfo,
                tiling={k: STREAM_TUNING[k] for k in ORDER})
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(meta, rows=rows), fh, indent=1)
    if not all(r["bit_equal_in_family"] for r in rows):
        print("ERROR: an arm's result differs from its family's first (JAX's launch, or the "
              "launcher's)", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
