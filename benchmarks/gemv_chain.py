"""The o -> gate/up persistent kernel (pallas_kernels/gemv_chain.py) against the two streaming
GEMVs the engine runs now, on the 1.4B shapes, bf16, one row.

    python -m benchmarks.gemv_chain --layers 8 --programs 128 --out chain.json

Each variant runs `layers` layer-sized steps in one jit, every layer with its own weights (so
the 54 MB of o and gate/up weights per layer stream from HBM, not L2) and its input being the
previous layer's output, as in decode; the figure is microseconds per layer. The separate
variant uses the engine's tilings (projections.STREAM_TUNING); the fused one the chain's
(gemv_chain.TILING), so a difference is the boundary and the tilings together: the run also
reports the separate kernels with the chain's tilings. Errors are against the separate
kernels with the chain's tilings (the same math and layout: expected 0). Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

K, K_O, INTER = 2048, 2048, 5632


def _weights(layers: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    bf = jnp.bfloat16
    w = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32) * s[-1] ** -0.5, bf)
    return [dict(w_o=w(K, K_O), w_post=jnp.asarray(rng.uniform(0.5, 1.5, K), bf),
                 w_pre=jnp.asarray(rng.uniform(0.5, 1.5, K), bf), w_gu=w(2 * INTER, K))
            for _ in range(layers)]


def separate(ws, attn, h, tiling):
    """The two streaming GEMVs per layer (ws: a list of per-layer weight dicts; tiling: per
    projection, as ((key, value), ...) pairs so that it can be a static jit argument)."""
    from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
    tiling = {n: dict(v) for n, v in tiling}
    for lw in ws:
        o = gemv_stream(attn, lw["w_o"], **tiling["o"])
        y, h = gemv_stream_normed(h, lw["w_pre"], lw["w_gu"], eps=1e-6, branch=o,
                                  branch_w=lw["w_post"], gated=True, **tiling["gate_up"])
        attn = y[:, :K_O]  # the next layer's "attention output", dependent on this layer
    return y, h


def fused(ws, attn, h, state, programs, l2_ahead=0, num_warps=4, spin="atomic", tiling=None):
    """o_gate_up per layer, the barrier state threaded through (tiling: as separate's, or
    None for gemv_chain.TILING)."""
    from pallas_kernels.gemv_chain import o_gate_up
    tiling = None if tiling is None else {n: dict(v) for n, v in tiling}
    for lw in ws:
        y, h, _, state = o_gate_up(attn, lw["w_o"], h, lw["w_post"], lw["w_pre"], lw["w_gu"],
                                   state, eps=1e-6, programs=programs, l2_ahead=l2_ahead,
                                   num_warps=num_warps, spin=spin, tiling=tiling)
        attn = y[:, :K_O]
    return y, h, state


def _time_fused(ws, attn, h, ref, programs, ahead, args, time_threaded, tiling,
                warps=4) -> dict:
    """The fused kernel's us per layer, its largest difference from the separate kernels
    (expected 0 at 4 warps: the same register layout) and the barrier state, keyed by
    l2_ahead and warps (no suffix for 0 and 4, as before)."""
    fus = jax.jit(fused, static_argnums=(4, 5, 6, 7, 8), donate_argnums=3)
    state = jnp.zeros((3,), jnp.int32)
    y, h2, state = fus(ws, attn, h, state, programs, ahead, warps, args.spin, tiling)
    err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
              for g, r in zip((y, h2), ref))
    sfx = (f"_l2_ahead{ahead}" if ahead else "") + (f"_w{warps}" if warps != 4 else "")
    out = {f"max_abs_diff_vs_separate{sfx}": err,
           f"barrier_state{sfx}": jax.device_get(state).tolist()}
    step = lambda st: (lambda r: (r[0], r[2]))(fus(ws, attn, h, st, programs, ahead, warps,
                                                    args.spin, tiling))
    best, state = time_threaded(step, state, args.calls, args.trials)  # state donated
    out[f"fused_us_per_layer{sfx}"] = 1e6 * best / args.layers
    out[f"barrier_state_after{sfx}"] = jax.device_get(state).tolist()
    return out


def main(argv=None) -> int:
    from benchmarks.grid_barrier import require_gpu
    from pallas_kernels.gemv_chain import PROGRAMS

    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemv_chain", description=__doc__)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--programs", default=str(PROGRAMS),
                    help="persistent grid sizes, comma-separated (each must divide the o and "
                         "gate/up block counts: 128 and 256 do)")
    ap.add_argument("--l2-ahead", default="0",
                    help="fused kernel: blocks each program keeps requested into L2 ahead of "
                         "the one in registers, comma-separated (session 14)")
    ap.add_argument("--num-warps", default="4",
                    help="fused kernel: warps per program, comma-separated")
    ap.add_argument("--spin", default="atomic", choices=["atomic", "load", "counter"],
                    help="how the barrier's waiting programs re-read its generation "
                         "(_common.BARRIER)")
    ap.add_argument("--separate", default="engine,chain,grid",
                    help="which separate-kernel baselines to time (engine,chain,grid)")
    ap.add_argument("--block-n", default="",
                    help="the chain's block_n per phase, e.g. o=2,gate_up=1 (default: "
                         "gemv_chain.TILING); finer blocks allow larger grids (512 programs "
                         "needs gate_up=1)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    try:
        _tiling(args)
    except ValueError as e:
        ap.error(str(e))
    require_gpu("gemv_chain", "the fused kernel's barrier spins on programs running at the "
                "same time")
    return _main(args, argv)  # the spin mode goes to the kernel as an argument


def _tiling(args) -> dict:
    """gemv_chain.TILING with --block-n's overrides; ValueError names a bad item."""
    from pallas_kernels.gemv_chain import TILING
    tiling = {n: dict(v) for n, v in TILING.items()}
    for item in filter(None, args.block_n.split(",")):
        name, _, value = item.partition("=")
        if name not in tiling or not (value.isascii() and value.isdigit()) or int(value) < 1 \
                or int(value) & (int(value) - 1):
            raise ValueError(f"--block-n takes NAME=N with NAME in {sorted(tiling)} and N a "
                             f"power of two, got {item!r}")
        tiling[name]["block_n"] = int(value)
    return tiling


def _freeze(t):
    return tuple((n, tuple(sorted(v.items()))) for n, v in t.items())


def _main(args, argv) -> int:
    from benchmarks.record import save_record
    from benchmarks.grid_barrier import time_calls, time_threaded
    from ouro_jax.projections import STREAM_TUNING
    tiling = _tiling(args)  # gemv_chain.TILING with --block-n

    ws = _weights(args.layers)
    rng = np.random.default_rng(1)
    attn = jnp.asarray(rng.standard_normal((1, K_O)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)
    engine = {n: dict(STREAM_TUNING[n]) for n in ("o", "gate_up")}
    chain = {n: dict(tiling[n], per_program=1) for n in ("o", "gate_up")}
    # weights as jit arguments: closed over, XLA would compile 432 MB of them in as constants
    sep = jax.jit(separate, static_argnums=3)
    run_sep = lambda t: (lambda a, x: sep(ws, a, x, t))
    ref = sep(ws, attn, h, _freeze(chain))
    rows = []
    for programs in [int(x) for x in args.programs.split(",")]:
        grid = {n: dict(tiling[n], per_program=blocks // programs)
                for n, blocks in (("o", K // tiling["o"]["block_n"]),
                                  ("gate_up", INTER // tiling["gate_up"]["block_n"]))}
        row = dict(layers=args.layers, programs=programs)
        for name, t in (("engine", engine), ("chain", chain), ("grid", grid)):
            if name in args.separate.split(","):
                row[f"separate_{name}_us_per_layer"] = 1e6 * time_calls(
                    run_sep(_freeze(t)), (attn, h), args.calls, args.trials) / args.layers
        for warps in [int(x) for x in args.num_warps.split(",")]:
            for ahead in [int(x) for x in args.l2_ahead.split(",")]:
                row.update(_time_fused(ws, attn, h, ref, programs, ahead, args,
                                       time_threaded, _freeze(tiling), warps))
        rows.append(row)
        print(json.dumps(row), flush=True)
    save_record("benchmarks.gemv_chain", argv, args.out, rows=rows, tiling_engine=engine,
                tiling_chain=tiling, barrier_spin=args.spin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
