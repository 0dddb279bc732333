"""The gemv_flow kernels' targets for `python -m pallas_kernels.offline_compile --flow` and
`--flow-o` (benchmarks.gemv_flow's variants, the whole-layer flow, the attention + o flow),
at the 1.4B shapes and one row; the capture and compile machinery is offline_compile's."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import offline_compile as oc


def check_flow():
    """Every benchmarks/gemv_flow.py variant of the ticket-ordered chain (gemv_flow) on the
    1.4B shapes at one row: one kernel, whose registers are the largest stage's."""
    from ouro_jax.projections import FLOW_NUM_WARPS
    from benchmarks.gemv_flow import INTER, K, VARIANTS, tilings
    from pallas_kernels.gemv_flow import gemv_flow, mlp_stages, state_size
    S, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    vec, sq = S((K,), bf), S((K, K), bf)
    for vname, v in VARIANTS.items():
        def f(attn, h, w_o, w_gu, w_down, w_qkv, n, state, v=v):
            nxt = (n, n, w_qkv) if v["stages"] == 4 else None
            st = mlp_stages(w_o, n, n, w_gu, w_down, next_qkv=nxt, tiling=tilings(v))
            opts = {k: x for k, x in v.items() if k not in ("stages", "tiling")}
            return gemv_flow(attn, st, state, h=h, **opts)
        jax.jit(f).trace(S((1, K), bf), S((1, K), bf), sq, S((2 * INTER, K), bf),
                         S((K, INTER), bf), S((3 * K, K), bf), vec,
                         S((state_size(v["stages"]),), jnp.int32)).lower(
            lowering_platforms=("cuda",))
        oc.compile_captured(f"flow {vname}", num_warps=FLOW_NUM_WARPS, num_stages=1)
    check_flow_layer()


def check_flow_layer():
    """benchmarks.flow_layer's whole-layer kernel (the attention as a fifth stage) at the 1.4B
    shapes and one row, at num_stages 1 and 2."""
    from ouro_jax.projections import FLOW_NUM_WARPS
    from benchmarks.flow_layer import CTX, HD, KVH, PAGE
    from benchmarks.gemv_flow import INTER, K
    from pallas_kernels.flow_attention import AttnStage
    from pallas_kernels.gemv_flow import gemv_flow, mlp_stages, state_size
    S, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    vec, sq = S((K,), bf), S((K, K), bf)
    pages = -(-(CTX + 1) // PAGE) + 1
    cache = S((8, pages, PAGE, KVH, HD), bf)
    for ns in (1, 2):
        def f(attn, h, w_o, w_gu, w_down, w_qkv, n, kc, vc, bt, lens, page, slot, cnt, cos,
              sin, state, ns=ns):
            att = AttnStage(kc, vc, jnp.int32(3), bt, lens, page, slot, cnt, rope=(cos, sin),
                            trash_page=0)
            st = mlp_stages(w_o, n, n, w_gu, w_down, next_qkv=(n, n, w_qkv), attention=att)
            return gemv_flow(attn, st, state, h=h, num_stages=ns, trap=True)
        jax.jit(f).trace(S((1, K), bf), S((1, K), bf), sq, S((2 * INTER, K), bf),
                         S((K, INTER), bf), S((3 * K, K), bf), vec, cache, cache,
                         S((1, pages), i32), S((1,), i32), S((1,), i32), S((1,), i32),
                         S((1, KVH), i32), S((1, HD), bf), S((1, HD), bf),
                         S((state_size(5),), i32)).lower(lowering_platforms=("cuda",))
        oc.compile_captured(f"flow_layer flow5 ns{ns}", num_warps=FLOW_NUM_WARPS, num_stages=ns)


def check_flow_o():
    """[attention, o] as one gemv_flow (ouro_jax.attention's flow_o, benchmarks.flow_layer's
    ao arms) at the 1.4B shapes and one row, per o tiling (block_n, per_program)."""
    from benchmarks.flow_layer import CTX, HD, KVH, PAGE
    from benchmarks.gemv_flow import K
    from pallas_kernels.flow_attention import AttnStage
    from pallas_kernels.gemv_flow import Stage, gemv_flow, state_size
    S, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    pages = -(-(CTX + 1) // PAGE) + 1
    cache = S((8, pages, PAGE, KVH, HD), bf)
    for bn, pp in ((2, 2), (4, 1), (8, 1), (16, 1)):
        def f(qkv, w_o, kc, vc, bt, lens, page, slot, cnt, cos, sin, state, bn=bn, pp=pp):
            att = AttnStage(kc, vc, jnp.int32(3), bt, lens, page, slot, cnt, rope=(cos, sin),
                            trash_page=0)
            st = [att, Stage(w_o, tiling=dict(block_n=bn, block_k=512, per_program=pp))]
            return gemv_flow(qkv, st, state, trap=True)
        jax.jit(f).trace(S((1, 3 * K), bf), S((K, K), bf), cache, cache, S((1, pages), i32),
                         S((1,), i32), S((1,), i32), S((1,), i32), S((1, KVH), i32),
                         S((1, HD), bf), S((1, HD), bf), S((state_size(2),), i32)).lower(
            lowering_platforms=("cuda",))
        oc.compile_captured(f"flow_o block_n {bn} per_program {pp}", num_warps=4, num_stages=1)
