"""The whole decode layer in one kernel (gemv_flow with flow_attention's attention stage)
against what the engine runs now, 1.4B shapes, bf16, one row (batch-1 decode).

    python -m benchmarks.flow_layer --layers 8 --out flow_layer.json [--arms flow5,flow5_ns2]

Each arm runs `layers` layer applications in one jit, every layer with its own weights and
its own KV-cache plane (so weights stream from HBM, not L2), each layer's input the previous
one's output: o -> gate/up -> down -> the next layer's qkv -> its attention over CTX cached
keys plus the new one (RoPE, the K/V write, the split merge). The figure is microseconds per
layer application (a batch-1 decode step runs 96; session 20's engine: 43.5 us each).

Arms:
  separate  the engine's default kernels: four streaming GEMVs, the decode attention kernel
            and its XLA split combine (6 kernels per layer);
  merged    the same with the attention's splits merged in its kernel (last_combine: the
            bits every flow arm must match, so errors are against it: expected 0);
  flow4     the engine's opt-in '+flow4' (o -> gate/up -> down -> next qkv in one kernel),
            then the attention kernel (merged): 2 kernels per layer;
  flow5     the attention as a fifth stage: 1 kernel per layer; flow5_ns2: the kernel at
            Triton's num_stages=2 (the attention kernel's; the GEMV stages were measured at
            1); flow5_pf2: each waiting GEMV program also asks L2 for 2 more blocks;
  ao*       the attention and the next layer's o in one gemv_flow ([attention, o]), the
            other three projections as the engine's kernels (4 kernels per layer). In
            flow5 the cut falls between the attention and o, so o's weights never stream
            while the attention's latency chain runs; here o's programs request their
            weights before they wait for it. ao: o at the engine's tiling (bits: merged's);
            ao_nB: o in blocks of B rows, one block per program (B=8: 256 programs, 32 KB
            each, all of o's 8.4 MB requested at once; another summation tree, so the
            bits may differ from merged's by rounding); _ns2: Triton num_stages 2; _pid:
            roles by program index, no ticket (safe only while every program is resident
            at once: 96 + 256 here; a give-up says otherwise); ao_nBpP: B-row blocks, P per
            program (128 programs at n4p4 / n2p8 / n8p2: o's stream throttled to one block
            in flight per program, so that the attention's dependent loads queue behind
            less of it); _bo: waiting programs sleep 200 ns between re-reads of the
            attention's count;
  *_nowait  DIAGNOSTIC, wrong results: no stage waits for the one before (gemv_flow's
            diag_no_wait), the time of the stages overlapped with no handover at all (is it
            the handover or the overlap itself that does not pay?).
Every flow arm's give-ups must be 0 (else its results are wrong and it is not timed).
Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gemv_flow import layer_inputs, tilings

KVH, HD, PAGE = 16, 128, 16
CTX = 160  # keys before the new one: the protocol's 128-token prompt, mid-way through 64
ARMS = {
    "separate": dict(kind="separate"),
    "merged": dict(kind="separate", merged=True),
    "flow4": dict(kind="flow", stages=4),
    "flow5": dict(kind="flow", stages=5),
    "flow5_ns2": dict(kind="flow", stages=5, num_stages=2),
    "flow5_pf2": dict(kind="flow", stages=5, l2_prefetch=2),
    "ao": dict(kind="ao", stages=2),
    "ao_n4": dict(kind="ao", stages=2, o_block_n=4, o_per_program=1),
    "ao_n8": dict(kind="ao", stages=2, o_block_n=8, o_per_program=1),
    "ao_n16": dict(kind="ao", stages=2, o_block_n=16, o_per_program=1),
    "ao_n8_pid": dict(kind="ao", stages=2, o_block_n=8, o_per_program=1, order="program_id"),
    "ao_n8_bo": dict(kind="ao", stages=2, o_block_n=8, o_per_program=1, backoff=200),
    "ao_n8_ns2": dict(kind="ao", stages=2, o_block_n=8, o_per_program=1, num_stages=2),
    "ao_n4p4": dict(kind="ao", stages=2, o_block_n=4, o_per_program=4),
    "ao_n2p8": dict(kind="ao", stages=2, o_block_n=2, o_per_program=8),
    "ao_n8p2": dict(kind="ao", stages=2, o_block_n=8, o_per_program=2),
    "ao_n4p2": dict(kind="ao", stages=2, o_block_n=4, o_per_program=2),
    "ao_n4p4_nowait": dict(kind="ao", stages=2, o_block_n=4, o_per_program=4,
                           diag_no_wait=True),
    "ao_n8_nowait": dict(kind="ao", stages=2, o_block_n=8, o_per_program=1,
                         diag_no_wait=True),
    "flow5_nowait": dict(kind="flow", stages=5, diag_no_wait=True),
}
AO_KEYS = ("o_block_n", "o_per_program")
DEFAULT_ARMS = "separate,merged,flow4,flow5,flow5_ns2,flow5_pf2"


def kv_case(layers: int, seed: int = 2, ctx: int = CTX, kvh: int = KVH, hd: int = HD):
    """Caches [layers, pages, PAGE, KVH, HD] (one plane per layer), the table, the lengths
    (ctx + the new token), where the new token goes, RoPE's cos/sin, the merge counters."""
    rng = np.random.default_rng(seed)
    pages = -(-(ctx + 1) // PAGE) + 1
    cache = lambda: jnp.asarray(rng.standard_normal((layers, pages, PAGE, kvh, hd)),
                                jnp.bfloat16)
    ang = rng.uniform(0, 6.28, (1, hd // 2))
    cos = jnp.asarray(np.cos(np.concatenate([ang, ang], 1)), jnp.bfloat16)
    sin = jnp.asarray(np.sin(np.concatenate([ang, ang], 1)), jnp.bfloat16)
    i32 = lambda x: jnp.asarray(x, jnp.int32)
    fixed = dict(bt=i32(np.arange(1, pages + 1)[None] % pages), lens=i32([ctx + 1]),
                 page=i32([1 + ctx // PAGE]), slot=i32([ctx % PAGE]), cos=cos, sin=sin)
    return (cache(), cache(), jnp.zeros((1, kvh), jnp.int32)), fixed


def _attention(q, caches, fx, layer, merged: bool, interpret: bool = False):
    from pallas_kernels import paged_decode_attention_qkv
    kc, vc, cnt = caches
    args = (q.reshape(1, -1, kc.shape[-1]), kc, vc, jnp.int32(layer), fx["bt"], fx["lens"],
            fx["page"], fx["slot"])
    kw = dict(rope=(fx["cos"], fx["sin"]), trash_page=0, interpret=interpret)
    if merged:
        out, kc, vc, cnt = paged_decode_attention_qkv(*args, counters=cnt, **kw)
    else:
        out, kc, vc = paged_decode_attention_qkv(*args, **kw)
    return out.reshape(1, -1), (kc, vc, cnt)


def _attn_stage(caches, fx, layer: int):
    """The decode attention of plane `layer` as a gemv_flow stage (the merge in-kernel)."""
    from pallas_kernels.flow_attention import AttnStage
    return AttnStage(caches[0], caches[1], jnp.int32(layer), fx["bt"], fx["lens"], fx["page"],
                     fx["slot"], caches[2], rope=(fx["cos"], fx["sin"]), trash_page=0)


def separate(ws, attn, h, caches, fx, tiling, merged: bool, interpret: bool = False):
    """The engine's kernels per layer; returns (the last attention output, x', caches)."""
    from benchmarks.gemv_flow import separate as gemvs
    for layer, lw in enumerate(ws):
        q, h = gemvs([lw], attn, h, tiling, interpret=interpret)
        attn, caches = _attention(q, caches, fx, layer, merged, interpret)
    return attn, h, caches


def flow(ws, attn, h, caches, state, fx, tiling, stages: int, options,
         interpret: bool = False):
    """gemv_flow per layer (stages 4: then the attention kernel, merged)."""
    from benchmarks.gemv_flow import _thaw
    from pallas_kernels.gemv_flow import gemv_flow, mlp_stages
    t = _thaw(tiling)
    for layer, lw in enumerate(ws):
        att = None
        if stages == 5:
            att = _attn_stage(caches, fx, layer)
        st = mlp_stages(lw["w_o"], lw["w_post"], lw["w_pre"], lw["w_gu"], lw["w_down"],
                        next_qkv=(lw["w_post2"], lw["w_in"], lw["w_qkv"]), tiling=t,
                        attention=att)
        out = gemv_flow(attn, st, state, h=h, trap=False, interpret=interpret,
                        **dict(options))
        ys, xs, state = out[:3]
        h = xs[1]
        if stages == 5:
            attn, caches = ys[4], out[3][0]
        else:
            attn, caches = _attention(ys[3], caches, fx, layer, True, interpret)
    return attn, h, caches, state


def attn_o(ws, attn, h, caches, state, fx, tiling, o_tiling, options, interpret=False):
    """Per layer gate/up, down and qkv as the engine's kernels, then one gemv_flow of
    [this layer's attention, the next layer's o] (the last layer: the attention kernel
    alone, merged); the first layer's o is its own kernel. The same work as `separate`.
    o_tiling: (block_n, per_program) of the flow's o stage (None: the engine's)."""
    from benchmarks.gemv_flow import _thaw, after_o
    from pallas_kernels.gemv_flow import Stage, gemv_flow
    from pallas_kernels.gemv_stream import gemv_stream
    t = _thaw(tiling)
    ot = dict(t["o"]) if o_tiling is None else dict(t["o"], block_n=o_tiling[0],
                                                     per_program=o_tiling[1])
    o = gemv_stream(attn, ws[0]["w_o"], num_warps=4, interpret=interpret, **t["o"])
    for layer, lw in enumerate(ws):
        q, h = after_o(lw, o, h, t, interpret)
        if layer == len(ws) - 1:
            attn, caches = _attention(q, caches, fx, layer, True, interpret)
            break
        st = [_attn_stage(caches, fx, layer),
              Stage(ws[layer + 1]["w_o"], tiling=ot, name="o")]
        ys, _, state, cs = gemv_flow(q, st, state, trap=False, interpret=interpret,
                                     **dict(options))
        attn, o, caches = ys[0], ys[1], cs[0]
    return attn, h, caches, state


def _row(name, arm, ws, attn, h, fx, ref, args, timers) -> dict:
    from benchmarks.gemv_flow import _freeze
    from pallas_kernels.gemv_flow import give_ups, state_for
    time_threaded = timers
    t = _freeze(tilings({}))
    caches, _ = kv_case(args.layers)
    row = dict(arm=name, **arm)
    if arm["kind"] == "separate":
        f = jax.jit(separate, static_argnums=(5, 6), donate_argnums=3)
        step = lambda c: (lambda r: (r[0], r[2]))(f(ws, attn, h, c, fx, t,
                                                      arm.get("merged", False)))
        got, caches = step(caches)
    else:
        options = tuple(sorted((k, v) for k, v in arm.items()
                               if k not in ("kind", "stages") + AO_KEYS))
        if arm["kind"] == "ao":
            o_t = (arm["o_block_n"], arm["o_per_program"]) if "o_block_n" in arm else None
            f = jax.jit(lambda ws_, a, h_, c, s, x, t_, _, opt:
                        attn_o(ws_, a, h_, c, s, x, t_, o_t, opt),
                        static_argnums=(6, 7, 8), donate_argnums=(3, 4))
        else:
            f = jax.jit(flow, static_argnums=(6, 7, 8), donate_argnums=(3, 4))
        s0 = state_for(arm["stages"])
        got, _, caches, state = f(ws, attn, h, caches, s0, fx, t, arm["stages"], options)
        row["give_ups_first_call"] = int(give_ups(state))
        step = lambda cs: (lambda r: (r[0], (r[2], r[3])))(
            f(ws, attn, h, cs[0], cs[1], fx, t, arm["stages"], options))
        caches = (caches, state)
    row["diagnostic_wrong_results"] = bool(arm.get("diag_no_wait"))
    row["max_abs_diff_vs_merged"] = float(jnp.max(jnp.abs(
        got.astype(jnp.float32) - ref.astype(jnp.float32))))
    if row.get("give_ups_first_call"):
        row["us_per_layer"] = None  # wrong, and each give-up spins for seconds
        return row, got
    best, last = time_threaded(step, caches, args.calls, args.trials)
    row["us_per_layer"] = 1e6 * best / args.layers
    if arm["kind"] != "separate":  # every timed call's give-ups add up in the state
        row["give_ups_after_timing"] = int(give_ups(last[1]))
    return row, got


def main(argv=None) -> int:
    from benchmarks.grid_barrier import require_gpu
    ap = argparse.ArgumentParser(prog="python -m benchmarks.flow_layer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, from {list(ARMS)}")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    names = [n for n in args.arms.split(",") if n]
    if not names or any(n not in ARMS for n in names):
        ap.error(f"--arms: from {list(ARMS)}, got {args.arms!r}")
    if min(args.layers, args.calls, args.trials) < 1:
        ap.error("--layers, --calls and --trials must be >= 1")
    require_gpu("flow_layer", "its stages wait for each other's programs")
    return _main(args, argv, names)


def _main(args, argv, names) -> int:
    from benchmarks.grid_barrier import time_threaded
    from benchmarks.gemv_flow import _freeze
    from benchmarks.record import save_record
    ws, attn, h = layer_inputs(args.layers)
    _, fx = kv_case(args.layers)
    # the reference bits: the separate kernels with the merge in the attention kernel
    ref = jax.jit(separate, static_argnums=(5, 6))(ws, attn, h, kv_case(args.layers)[0], fx,
                                                   _freeze(tilings({})), True)[0]
    rows = []
    for name in names:
        row, _ = _row(name, ARMS[name], ws, attn, h, fx, ref, args, time_threaded)
        rows.append(row)
        print(json.dumps(row), flush=True)
        save_record("benchmarks.flow_layer", argv, args.out, layers=args.layers, ctx=CTX,
                    rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
