"""The ticket-ordered GEMV chain (pallas_kernels/gemv_flow.py) against the separate streaming
GEMVs the engine runs now: o -> gate/up -> down -> the next layer's qkv, 1.4B shapes, bf16,
one row (batch-1 decode).

    python -m benchmarks.gemv_flow --layers 8 --out flow.json [--variants flow4,flow4_pid]

Each variant runs `layers` layer-sized steps in one jit, every layer with its own weights (so
its ~102 MB stream from HBM, not L2) and its input being the previous layer's output, as in
decode; the figure is microseconds per layer. `separate` is the engine's four kernels with
its block sizes (projections.STREAM_TUNING) at the flow kernel's 4 warps (since session 31
the engine runs qkv and gate/up at 8: this baseline isolates the handover, not the engine's
speed); a variant that changes a tiling is also timed as four
separate kernels with that tiling (`separate_us_per_layer`), so the difference it reports is
the handover alone. Errors are against those separate kernels (the same math and register
layout: expected 0), and `give_ups` must be 0 (else the results are wrong; such a variant
is not timed, since each give-up spins for seconds). One decode step
runs 96 layer applications: a saving of S us per layer is ~0.1 ms per step per us.
Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

K, INTER = 2048, 5632
NAMES = ("o", "gate_up", "down", "qkv")
# name -> gemv_flow options; "stages": 4 (the chain through the next qkv) or 3 (the MLP,
# then qkv as its own kernel); "tiling": per-projection overrides of ENGINE_TILING.
VARIANTS = {
    "flow4": dict(stages=4),  # the defaults: ticket order, one thread spins
    "flow4_all": dict(stages=4, spin="all"),  # every thread spins (gemv_flow.SPINS)
    "flow3": dict(stages=3),
    "flow4_pid": dict(stages=4, order="program_id"),
    # the first block requested before a relaxed ticket (its misses are reported)
    "flow4_guess": dict(stages=4, order="guess"),
    # its cheaper form: the own index's first block asked into L2 before an ordinary ticket
    "flow4_l2guess": dict(stages=4, l2_guess=True),
    # what the engine runs: a give-up stops the kernel (a trap, then this process's GPU is
    # gone: not among the defaults; put it last in --variants)
    "flow4_trap": dict(stages=4, trap=True),
    "flow4_pf2": dict(stages=4, l2_prefetch=2),
    "flow4_sleep": dict(stages=4, backoff=100),
    # gate/up at 8 blocks per program sets the kernel's registers (146 per thread offline,
    # against o's 68 and down's 95 alone, at session 23's block_k 512): fewer blocks, more
    # programs resident per SM
    "flow4_gu2": dict(stages=4, tiling=dict(gate_up=dict(per_program=2))),
    "flow4_gu4": dict(stages=4, tiling=dict(gate_up=dict(per_program=4))),
    "flow4_gu2_pf1": dict(stages=4, l2_prefetch=1, tiling=dict(gate_up=dict(per_program=2))),
    # every stage at its lighter tiling (offline: 110 registers, as flow4_gu2: 4 per SM)
    "flow4_lean": dict(stages=4, tiling=dict(gate_up=dict(per_program=2),
                                             down=dict(per_program=2),
                                             qkv=dict(block_n=2, per_program=2))),
}
# flow4_pid last: it trusts the start order, so it is the one likeliest to give up
DEFAULT_VARIANTS = ("flow4,flow4_guess,flow4_l2guess,flow4_all,flow3,flow4_pf2,flow4_sleep,flow4_gu2,"
                    "flow4_lean,flow4_pid")


def weights(layers: int, seed: int = 0, k: int = K, inter: int = INTER, dtype=jnp.bfloat16):
    """Per layer: o, the two norms around it, gate/up, down, and the next qkv with its two."""
    rng = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32) * s[-1] ** -0.5, dtype)
    u = lambda: jnp.asarray(rng.uniform(0.5, 1.5, k), dtype)
    return [dict(w_o=w(k, k), w_post=u(), w_pre=u(), w_gu=w(2 * inter, k), w_down=w(k, inter),
                 w_post2=u(), w_in=u(), w_qkv=w(3 * k, k)) for _ in range(layers)]


def layer_inputs(layers: int):
    """(weights(layers), the first layer's attention output, its residual): one bf16 row."""
    rng = np.random.default_rng(1)
    attn = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)
    h = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)
    return weights(layers), attn, h


def tilings(variant: dict) -> dict:
    """Per projection: block_n / block_k / per_program (ENGINE_TILING with the variant's
    overrides)."""
    from pallas_kernels.gemv_flow import ENGINE_TILING
    t = {n: dict(v) for n, v in ENGINE_TILING.items()}
    for name, v in variant.get("tiling", {}).items():
        t[name].update(v)
    return t


def _freeze(t: dict):
    return tuple((n, tuple(sorted(v.items()))) for n, v in t.items())


def _thaw(t) -> dict:
    return {n: dict(v) for n, v in t}


def _qkv(lw, x1, d, t, interpret):
    from pallas_kernels.gemv_stream import gemv_stream_normed
    return gemv_stream_normed(x1, lw["w_in"], lw["w_qkv"], eps=1e-6, branch=d,
                              branch_w=lw["w_post2"], num_warps=4, interpret=interpret,
                              **t["qkv"])


def separate(ws, attn, h, tiling, interpret: bool = False):
    """The engine's four kernels per layer at 4 warps, the flow kernel's (tiling: _freeze'd,
    a static jit argument); returns the last layer's qkv output and x'."""
    from pallas_kernels.gemv_stream import gemv_stream
    t, k = _thaw(tiling), attn.shape[1]
    for lw in ws:
        o = gemv_stream(attn, lw["w_o"], num_warps=4, interpret=interpret, **t["o"])
        q, h = after_o(lw, o, h, t, interpret)
        attn = q[:, :k]  # the next layer's "attention output", dependent on this layer
    return q, h


def after_o(lw, o, h, t, interpret):
    """The engine's kernels after a layer's o projection: gate/up (add_norm prologue on the
    residual h and the branch o), down, then the next qkv; returns (qkv output, x')."""
    from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
    y, x1 = gemv_stream_normed(h, lw["w_pre"], lw["w_gu"], eps=1e-6, branch=o,
                               branch_w=lw["w_post"], gated=True, num_warps=4,
                               interpret=interpret, **t["gate_up"])
    d = gemv_stream(y, lw["w_down"], num_warps=4, interpret=interpret, **t["down"])
    return _qkv(lw, x1, d, t, interpret)


def flow(ws, attn, h, state, tiling, stages: int, options, interpret: bool = False):
    """gemv_flow per layer (stages 3: then qkv as its own kernel), the state threaded."""
    from pallas_kernels.gemv_flow import gemv_flow, mlp_stages
    t, k = _thaw(tiling), attn.shape[1]
    for lw in ws:
        nxt = (lw["w_post2"], lw["w_in"], lw["w_qkv"]) if stages == 4 else None
        st = mlp_stages(lw["w_o"], lw["w_post"], lw["w_pre"], lw["w_gu"], lw["w_down"],
                        next_qkv=nxt, tiling=t)
        ys, xs, state = gemv_flow(attn, st, state, h=h, interpret=interpret, **dict(options))
        q, h = (ys[3], xs[1]) if stages == 4 else _qkv(lw, xs[0], ys[2], t, interpret)
        attn = q[:, :k]
    return q, h, state


def _variant_row(name, v, ws, attn, h, sep_times, args, timers) -> dict:
    from pallas_kernels.flow_sync import WORD
    from pallas_kernels.gemv_flow import give_ups, misses, state_for
    time_calls, time_threaded = timers
    t = _freeze(tilings(v))
    if t not in sep_times:  # the separate kernels at this tiling: reference and baseline
        sep = jax.jit(separate, static_argnums=3)
        sep_times[t] = (sep(ws, attn, h, t), 1e6 * time_calls(
            lambda a, x: sep(ws, a, x, t), (attn, h), args.calls, args.trials) / args.layers)
    ref, sep_us = sep_times[t]
    options = tuple(sorted((k, val) for k, val in v.items() if k not in ("stages", "tiling")))
    f = jax.jit(flow, static_argnums=(4, 5, 6), donate_argnums=3)
    q, x, state = f(ws, attn, h, state_for(v["stages"]), t, v["stages"], options)
    err = max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - r.astype(jnp.float32))))
              for g, r in zip((q, x), ref))
    row = dict(variant=name, **{k: val for k, val in v.items() if k != "tiling"},
               tiling=tilings(v), max_abs_diff_vs_separate=err,
               give_ups_first_call=int(give_ups(state)),
               guess_misses_first_call=int(misses(state)), separate_us_per_layer=sep_us)
    if err or row["give_ups_first_call"]:  # wrong, and each give-up spins for seconds
        row["flow_us_per_layer"] = None
        return row
    step = lambda st: (lambda r: (r[0], r[2]))(f(ws, attn, h, st, t, v["stages"], options))
    best, state = time_threaded(step, state, args.calls, args.trials)  # state donated
    row["flow_us_per_layer"] = 1e6 * best / args.layers
    row["saving_us_per_layer"] = sep_us - row["flow_us_per_layer"]
    row["state_words_after"] = jax.device_get(state)[::WORD].tolist()  # 0 but give-ups
    return row


def main(argv=None) -> int:
    from benchmarks.grid_barrier import require_gpu
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemv_flow", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help=f"comma-separated, from {sorted(VARIANTS)}")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    names = [n for n in args.variants.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        ap.error(f"--variants: unknown {unknown}; valid: {sorted(VARIANTS)}")
    if args.layers < 1 or args.calls < 1 or args.trials < 1:
        ap.error("--layers, --calls and --trials must be >= 1")
    require_gpu("gemv_flow", "its stages wait for each other's programs")
    return _main(args, argv, names)


def _main(args, argv, names) -> int:
    from benchmarks.grid_barrier import time_calls, time_threaded
    from benchmarks.record import save_record
    ws, attn, h = layer_inputs(args.layers)
    sep_times, rows = {}, []
    for name in names:
        row = _variant_row(name, VARIANTS[name], ws, attn, h, sep_times, args,
                           (time_calls, time_threaded))
        rows.append(row)
        print(json.dumps(row), flush=True)
        # saved after every row: a call that runs out of time keeps what it measured
        save_record("benchmarks.gemv_flow", argv, args.out, layers=args.layers, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
