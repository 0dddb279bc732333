"""The fused decode kernel's `attend` variants (ouro_jax.attention.make_paged_attend, Pallas
decode with the K/V write in the kernel): attend.qkv on the decode kernel, and the opt-in
modes around it (the in-kernel split merge, attention + o fused or as one gemv_flow, the
Mosaic GPU kernel, o_merge), with their switches. Split from ouro_jax.attention, which
re-exports these names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ouro_jax import trace_once
from ouro_jax.config import OuroConfig
from ouro_jax.kv_cache import TRASH_PAGE
from ouro_jax.split_attn import SplitAttn

# Pallas decode (fused K/V write): merge the flash-decoding splits inside the decode kernel
# (its last split program) instead of an XLA combine kernel after it. Off: on the H200 it
# is level with the combine (batch 1: 231.8 vs 232.7 tok/s in session 9, 239.8 vs 239.7 in
# session 10; batch 8: 1,499.1 vs 1,496.4); `benchmarks.decode --decode-kernel
# last_combine=1` turns it on for a run. Read when an engine compiles its programs.
LAST_COMBINE = False
# Pallas decode at one row: the attention and the o projection as one gemv_flow kernel of
# two stages ([attention, o], pallas_kernels.gemv_flow): o's programs request their weight
# blocks, then wait for the attention's completion count, so o's 8.4 MB (1.4B) stream while
# the attention's latency chain runs, and the split combine and one kernel boundary go.
# Exact (the attention stage is the decode kernel's body with its in-kernel merge; o is the
# streaming GEMV at FLOW_O_TILING). Off: not faster (session 24, H100: 196.1 / 197.0 against
# 200.6 / 202.2 tok/s at batch 1; even with no waits at all the overlap saves ~1.5 us per
# layer application, docs/performance.md); `benchmarks.decode --decode-kernel
# flow_o=1[,flow_o_block_n=B,flow_o_per_program=P]` turns it on for a run.
FLOW_O = False
FLOW_O_TILING = dict(block_n=8, per_program=1)  # 256 programs of 32 KB at 2048 x 2048


# Pallas decode at one row: the attention and the o projection in one kernel
# (pallas_kernels.attention_o: no split combine, no separate GEMV launch). Off: slower on
# the H200 in every tiling tried (session 19: 204-229 against 241 tok/s at batch 1,
# docs/performance.md); `benchmarks.decode --decode-kernel fuse_o=1` turns it on for a run,
# with the decode kernel's block_t / num_warps / num_stages and o_block_n / o_w_early /
# o_split as its tuning. Read when an engine compiles its programs.
FUSE_O = False
# Pallas decode (fused K/V write), any batch: pallas_kernels.decode_mgpu_paged instead of the
# Triton kernel: the same contract (RoPE, K/V write, paged reads) on Mosaic GPU, one program
# per (row, KV head) with its K/V requested by TMA up front, so no splits and no combine
# kernel (jax >= 0.11, bf16/f16 caches, head_dim 64 or 128). Off: slower at batch 1 (H100,
# session 27: 8.2 against 5.6 us per layer application with the merge at 192 positions; its
# 16 programs each stream a head), level at batch 8; `benchmarks.decode --decode-kernel
# mgpu=1[,mgpu_block=B,mgpu_stages=S]`
# turns it on for a run. Read when an engine compiles its programs.
MGPU_DECODE = False
# Pallas decode at one row (fused K/V write): the decode kernel's split partials go to the o
# projection unmerged (ouro_jax.split_attn.SplitAttn), whose streaming GEMV merges them in
# its prologue (pallas_kernels.gemv_merge) while its first weight blocks are in flight: no
# XLA combine kernel. Off until measured on a GPU; `benchmarks.decode --decode-kernel
# o_merge=1` turns it on for a run. Read when an engine compiles its programs.
O_MERGE = False


def _fused_o_tuning() -> dict:
    """pallas_kernels.attention_o's tuning from the decode kernel's overrides."""
    import pallas_kernels.decode as dk
    t = dk.TUNING
    names = dict(block_t="block_t", num_warps="num_warps", num_stages="num_stages",
                 o_block_n="block_n", o_w_early="w_early", o_split="split_keys")
    return {ours: t[key] for key, ours in names.items() if key in t}


# Unsplit, every program of a head of the fused kernel attends over all of the row's keys
# (the head's K/V is read R = 16 times, from L2 after the first): past this many keys of
# block-table capacity the engine keeps the decode kernel. split_keys has no such cost.
FUSE_O_MAX_KEYS = 1024


def _fused_o_fits(cfg: OuroConfig, capacity: int) -> bool:
    from pallas_kernels.attention_o import config
    return (capacity <= FUSE_O_MAX_KEYS
            or config(cfg.hidden_size, **_fused_o_tuning())["split_keys"])


def _fused_o_counters(cfg: OuroConfig, batch: int) -> jax.Array:
    from pallas_kernels.attention_o import counters_for
    return counters_for(batch, cfg.hidden_size, cfg.num_key_value_heads, **_fused_o_tuning())


def _entry(loop, layer):
    """The kernels' (base, offset) plane operands. An integer goes as an int32 numpy array:
    the kernels take it as an operand either way (a constant in the program), and as an
    array it is not part of trace_once's key, so the 24 layers share one traced kernel."""
    return tuple(np.asarray(x, np.int32) if isinstance(x, (int, np.integer)) else x
                 for x in (loop, layer))


def _with_fused_decode(attend, cfg, block_tables, kv_lens, page_size, page, slot,
                       merge_splits=None):
    """Adds attend.qkv (the decode kernel with RoPE and the K/V write) and, with fuse_o at
    one row, attend.qkv_o (the kernel fused with the o projection; with flow_o, the
    attention and o as one gemv_flow); with last_combine, fuse_o or flow_o, their counters
    ride along with the planes (attend.wrap / unwrap)."""
    import pallas_kernels as pk

    b = kv_lens.shape[0]
    num_layers = cfg.num_hidden_layers
    interpret = jax.default_backend() != "gpu"
    last_combine, fuse_o, flow_o = _fused_decode_modes(
        cfg, b, block_tables.shape[1] * page_size, merge_splits)
    if b == 1:  # the persistent decode kernel's inputs (ouro_jax.persistent)
        attend.chain_attention = _chain_attention(block_tables, kv_lens, page, slot)
    o_merge = bool(pk.decode.TUNING.get("o_merge", O_MERGE))
    tuned = lambda key, default: bool(pk.decode.TUNING.get(key, default))  # as asked
    if o_merge and (last_combine or tuned("fuse_o", FUSE_O) or tuned("flow_o", FLOW_O)
                    or tuned("mgpu", MGPU_DECODE)):
        raise ValueError("decode kernel tuning: o_merge (the o projection merges the splits) "
                         "takes none of last_combine, fuse_o, flow_o, mgpu (or '+flow5')")
    o_merge = o_merge and b == 1
    if _mgpu_decode(last_combine, fuse_o, flow_o):
        attend.qkv = _mgpu_attend_qkv(num_layers, block_tables, kv_lens, page, slot,
                                      interpret)
        return attend
    new_token = dict(rope=None, trash_page=TRASH_PAGE, interpret=interpret,
                     entry_stride=num_layers)

    def attend_qkv(qkv, cos, sin, planes, loop, layer):
        counters = dict(counters=planes[2]) if last_combine else {}
        out, kc, vc, *cnt = trace_once.call(
            pk.paged_decode_attention_qkv, qkv[:, 0], planes[0], planes[1],
            _entry(loop, layer), block_tables, kv_lens, page[:, 0], slot[:, 0],
            **dict(new_token, rope=(cos[:, 0], sin[:, 0])), **counters,
            defer_merge=o_merge)
        # o_merge: (partials, log-sum-exps) when there are splits to merge
        out = SplitAttn(*out, (b, 1), qkv.dtype) if isinstance(out, tuple) else out[:, None]
        return out, (kc, vc, *cnt, *planes[3 if last_combine else 2:])

    if last_combine or fuse_o:
        attend = _with_counters(attend, cfg, b, fuse_o, flow_o)
    attend.qkv = attend_qkv
    if last_combine:
        attend.qkv_stage = qkv_stage = _qkv_stage(num_layers, block_tables, kv_lens, page,
                                                  slot)
    if fuse_o:
        def attend_qkv_o(qkv, w_o, cos, sin, state, loop, layer):
            y, kc, vc, cnt = trace_once.call(
                pk.decode_attention_o, qkv[:, 0], state[0], state[1], _entry(loop, layer),
                block_tables, kv_lens, page[:, 0], slot[:, 0], w_o, state[2],
                **dict(new_token, rope=(cos[:, 0], sin[:, 0])), **_fused_o_tuning())
            return y[:, None], (kc, vc, cnt)
        attend.qkv_o = attend_qkv_o
    if flow_o:
        attend.qkv_o = _flow_o_attend(qkv_stage, b, interpret)
    if b == 1 and not (fuse_o or flow_o):  # the graph loop's attention inputs (graph_loop)
        attend.graph_inputs = dict(block_tables=block_tables, kv_lens=kv_lens,
                                   page=page[:, 0], slot=slot[:, 0], entry_stride=num_layers,
                                   trash_page=TRASH_PAGE, counters_in_state=last_combine)
    return attend


def _qkv_stage(num_layers: int, block_tables, kv_lens, page, slot):
    """qkv_stage(cos, sin, state, loop, layer): the decode attention of (loop, layer) as a
    gemv_flow stage on the packed projection the previous stage computes
    (flow_attention.AttnStage: the same kernel body, merge and K/V write as the decode
    kernel's attend_qkv); the call's caches (k, v, counters) replace state[:3]."""
    def qkv_stage(cos, sin, state, loop, layer):
        from pallas_kernels.flow_attention import AttnStage
        return AttnStage(state[0], state[1], _entry(loop, layer), block_tables, kv_lens,
                         page[:, 0], slot[:, 0], state[2], rope=(cos[:, 0], sin[:, 0]),
                         trash_page=TRASH_PAGE, entry_stride=num_layers)
    return qkv_stage


def _with_counters(plain, cfg, b: int, fuse_o: bool, flow_o: bool):
    """`plain` with its counters kept in the state. The decode kernel merges its splits
    itself (or the fused kernel sums its heads' partials); its counters (zeros, left at zero
    by every call) ride along with the planes through the layers and loops, so each forward
    block makes them once (one memset)."""
    from pallas_kernels.gemv_flow import state_for
    counters = (_fused_o_counters(cfg, b) if fuse_o else
                jnp.zeros((b, cfg.num_key_value_heads), jnp.int32))

    def attend(q, k, v, state, loop, layer):  # same, counters kept
        out, planes = plain(q, k, v, state[:2], loop, layer)
        return out, (*planes, *state[2:])
    extra = (state_for(2),) if flow_o else ()  # the flow's counters, kept at zero
    attend.wrap = lambda planes: (*planes, counters, *extra)
    attend.unwrap = lambda state: state[:2]
    return attend


def _mgpu_decode(last_combine: bool, fuse_o: bool, flow_o: bool) -> bool:
    """Whether decode runs on decode_mgpu_paged (TUNING's mgpu, else MGPU_DECODE); it
    replaces the Triton kernel, so it takes none of that kernel's merge or fusion modes."""
    import pallas_kernels as pk
    mgpu = bool(pk.decode.TUNING.get("mgpu", MGPU_DECODE))
    if mgpu and (last_combine or fuse_o or flow_o):
        raise ValueError("decode kernel tuning: mgpu replaces the Triton decode kernel; it "
                         "takes none of last_combine, fuse_o, flow_o (or merge_splits)")
    return mgpu


def _mgpu_attend_qkv(num_layers, block_tables, kv_lens, page, slot, interpret):
    """attend.qkv on pallas_kernels.decode_mgpu_paged (MGPU_DECODE)."""
    import pallas_kernels.decode as dk
    try:
        from pallas_kernels.decode_mgpu_paged import paged_decode_attention_mgpu
    except ImportError as e:  # jax 0.10's Mosaic GPU Pallas needs absl, and lacks pieces
        raise ValueError(f"decode kernel mgpu needs Mosaic GPU Pallas (jax >= 0.11): {e}") \
            from e
    tiling = {key: int(dk.TUNING[f"mgpu_{key}"]) for key in ("block", "stages")
              if f"mgpu_{key}" in dk.TUNING}

    def attend_qkv(qkv, cos, sin, planes, loop, layer):
        out, kc, vc = trace_once.call(
            paged_decode_attention_mgpu, qkv[:, 0], planes[0], planes[1], _entry(loop, layer),
            block_tables, kv_lens, page[:, 0], slot[:, 0], rope=(cos[:, 0], sin[:, 0]),
            trash_page=TRASH_PAGE, entry_stride=num_layers, interpret=interpret, **tiling)
        return out[:, None], (kc, vc, *planes[2:])
    return attend_qkv


def _chain_attention(block_tables, kv_lens, page, slot):
    """attend.chain_attention(cos, sin, state, loop, **tiling): the one row's attention
    inputs for the persistent decode kernel (pallas_kernels.chain_attention), on the planes
    in state[:2]."""
    def chain_attention(cos, sin, state, loop, **tiling):
        from pallas_kernels.chain_attention import ChainAttention
        return ChainAttention(state[0], state[1], block_tables, kv_lens[0], page[0, 0],
                              slot[0, 0], loop, cos[:, 0], sin[:, 0], trash_page=TRASH_PAGE,
                              **tiling)
    return chain_attention


def _fused_decode_modes(cfg, b: int, capacity: int, merge_splits) -> tuple:
    """(last_combine, fuse_o, flow_o) for a decode block of b rows over `capacity` keys of
    block table: the decode kernel's tuning (else LAST_COMBINE / FUSE_O / FLOW_O), fuse_o
    and flow_o at one row only; flow_o turns last_combine on (its attention stage merges
    its splits). ValueError for combinations that are alternatives."""
    import pallas_kernels as pk
    last_combine = bool(pk.decode.TUNING.get("last_combine", LAST_COMBINE)) \
        if merge_splits is None else merge_splits
    fuse_o = bool(pk.decode.TUNING.get("fuse_o", FUSE_O))
    if fuse_o and last_combine:
        raise ValueError("decode kernel tuning: fuse_o and last_combine are alternatives (the "
                         "fused kernel sums its own partials; '+flow5' projections turn "
                         "last_combine on); set one of them")
    flow_o = bool(pk.decode.TUNING.get("flow_o", FLOW_O))
    if flow_o and fuse_o:  # as asked, before either is narrowed to where it applies
        raise ValueError("decode kernel tuning: flow_o and fuse_o are alternatives (both "
                         "compute the o projection with the attention); set one of them")
    fuse_o = fuse_o and b == 1 and _fused_o_fits(cfg, capacity)
    flow_o = flow_o and b == 1
    return last_combine or flow_o, fuse_o, flow_o


def _flow_o_attend(qkv_stage, b: int, interpret: bool):
    """attend.qkv_o for FLOW_O: [attention, o] as one gemv_flow; state[3] is the flow's
    counter state (kept at zero between calls). A handover that gives up stops the kernel
    (trap): an error, never wrong tokens."""
    def attend_qkv_o_flow(qkv, w_o, cos, sin, state, loop, layer):
        from pallas_kernels.gemv_flow import Stage, gemv_flow
        stages = [qkv_stage(cos, sin, state, loop, layer),
                  Stage(w_o, tiling=_flow_o_tiling(w_o), name="o")]
        ys, _, fstate, caches = trace_once.call(
            gemv_flow, qkv[:, 0].reshape(b, -1), stages, state[3], trap=not interpret,
            interpret=interpret)
        return ys[1][:, None], (*caches[0], fstate, *state[4:])
    return attend_qkv_o_flow


def _flow_o_tiling(w_o) -> dict:
    """The flow's o stage tiling: the streaming GEMV's for o (fitted to the shape) with
    FLOW_O_TILING's block_n / per_program, the decode kernel's overrides winning."""
    import pallas_kernels.decode as dk
    from ouro_jax.projections import flow_tiling
    override = dict(FLOW_O_TILING)
    override.update({key: int(dk.TUNING[f"flow_o_{key}"]) for key in FLOW_O_TILING
                     if f"flow_o_{key}" in dk.TUNING})
    return flow_tiling("o", w_o.shape[0], w_o.shape[1], **override)
