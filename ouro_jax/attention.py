"""Paged attention for the engine: writes the new K/V into the cache, then attends.

`make_paged_attend` builds the `attend` function that `model.decoder_layer` calls, for a block
of query positions [B, C] (C = 1 for decode, k+1 for verification, a chunk for prefill). The
new tokens' K/V are written first, so a query reads its own key from the cache like any other.
The exception is pallas decode (C = 1): `attend.qkv` hands the unrotated fused projection to the
decode kernel, which applies RoPE, writes the K/V and attends to the new key from registers
(fewer kernels per layer; see make_paged_attend). In the batch-invariant mode `attend.qkv`
(any C) applies RoPE and writes the K/V in one Pallas kernel before the ragged kernel.

Backends:
- "xla": gather each sequence's pages through its block table, mask by position, dense
  attention. Simple and exact; moves the K/V bytes twice (gather, then read).
- "pallas": the kernels in pallas_kernels/, which read pages in place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ouro_jax import trace_once
from ouro_jax.config import OuroConfig
from ouro_jax.kv_cache import TRASH_PAGE, gather_kv, slot_indices, write_kv
from ouro_jax.model import attention_core
from ouro_jax.split_attn import SplitAttn

BACKENDS = ("auto", "xla", "pallas")
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


def resolve_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from {BACKENDS}")
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" and _pallas_available() else "xla"
    return backend


def _pallas_available() -> bool:
    try:
        import pallas_kernels  # noqa: F401
    except Exception:
        return False
    return True


def _entry(loop, layer):
    """The kernels' (base, offset) plane operands. An integer goes as an int32 numpy array:
    the kernels take it as an operand either way (a constant in the program), and as an
    array it is not part of trace_once's key, so the 24 layers share one traced kernel."""
    return tuple(np.asarray(x, np.int32) if isinstance(x, (int, np.integer)) else x
                 for x in (loop, layer))


def make_paged_attend(cfg: OuroConfig, block_tables: jax.Array, positions: jax.Array,
                      page_size: int, backend: str = "xla", fused_kv_write: bool = True,
                      merge_splits: bool | None = None, invariant: bool = False):
    """attend(q, k, v, planes, loop, layer) over query positions [B, C] (all rows have C).

    With the pallas backend, C == 1 (decode, draft) and `fused_kv_write`, the function also
    has `attend.qkv(qkv, cos, sin, planes, loop, layer)`, which takes the fused projection
    [B, 1, H + 2 KVH, hd] before RoPE: the decode kernel applies RoPE and writes the new K/V
    itself, so the RoPE, slice and K/V-write kernels disappear (model.decoder_layer uses it
    when it has the fused qkv). H200, 1.4B, native greedy, fused vs XLA in the same call
    (session 6, benchmarks/results/ab_kvwrite_*_session6_h200.json): batch 1 210.0 vs 192.8
    tok/s, 8 1,488.5 vs 1,442.9, 16 2,741.8 vs 2,636.8, 32 4,873.0 vs 4,716.4, 64 7,607.4
    vs 7,498.5. fused_kv_write=False (engine option '+kvxla') keeps the XLA path.
    merge_splits: the decode kernel merges its splits itself (None: LAST_COMBINE or the
    kernel's TUNING); then `attend.qkv_stage` also gives the decode attention as a gemv_flow
    stage ('+flow5').
    invariant (ouro_jax.invariant; pallas only): every C, decode's included, through the
    ragged kernel at one fixed tuning; with fused_kv_write `attend.qkv` applies RoPE and
    writes the K/V in one Pallas kernel first (pallas_kernels.rope_kv), else XLA does."""
    page, slot = slot_indices(block_tables, positions, page_size)
    if invariant and backend != "pallas":
        raise ValueError(f"batch-invariant attention runs the Pallas ragged kernel, not "
                         f"{backend!r}")
    if backend == "pallas":
        kv_lens = positions[:, -1] + 1
        ragged = invariant or _ragged_decode(positions, fused_kv_write)
        attend = _pallas_attend(cfg, block_tables, positions, kv_lens, page, slot, ragged,
                                fused_kv_write)
        if positions.shape[1] == 1 and fused_kv_write and not ragged:
            attend = _with_fused_decode(attend, cfg, block_tables, kv_lens, page_size, page,
                                        slot, merge_splits)
        return attend
    return _xla_attend(cfg, block_tables, positions, page_size, page, slot)


# Decode (C == 1) of this many sequences or more runs RoPE and the K/V write in one kernel
# (pallas_kernels.rope_kv) and the attention in the ragged kernel at the batch-invariant
# mode's tuning (one split, the direct store) rather than the fused decode kernel. At batch
# 64 the ragged kernel reads the K/V faster (34.6 against 38.9 us per call on an H100,
# kernel_trace_{inv,default}_b64_k4_dec_session43_h100.json). End to end on one H100 with
# the '+inv' projections (session 43, decode_r64_*/decode_inv_b8_b64_session43_h100.json):
# batch 64 native 7,003.6 tok/s against 7,008.8, k=4 7,103.6 against 6,719.4 (the decode
# kernel); from batch 8 up (decode_invr_session43_h100.json) batch 8 and 32 lost 3.4% and 2.0%
# native. pallas_kernels.decode.TUNING["ragged_from"] overrides it (0: never).
RAGGED_FROM = 64


def _ragged_decode(positions, fused_kv_write: bool) -> bool:
    """Whether decode rows (C == 1) of this batch go to the RoPE/K/V-write kernel and the
    ragged kernel rather than the decode kernel (RAGGED_FROM)."""
    import pallas_kernels as pk
    start = pk.decode.TUNING.get("ragged_from", RAGGED_FROM)
    b, c = positions.shape
    return bool(start) and fused_kv_write and c == 1 and b >= int(start)


def _pallas_attend(cfg, block_tables, positions, kv_lens, page, slot, invariant=False,
                   fused_kv_write=True):
    """The Pallas kernels over K/V written by XLA: decode (C == 1) or ragged (C > 1, or
    any C when invariant, at ouro_jax.invariant's fixed tuning). Invariant with
    fused_kv_write: also attend.qkv, whose RoPE and K/V write are one Pallas kernel
    (ouro_jax.invariant.attend_qkv)."""
    import pallas_kernels as pk

    b, c = positions.shape
    num_layers = cfg.num_hidden_layers
    interpret = jax.default_backend() != "gpu"  # CPU: the kernels' interpret mode
    from ouro_jax.invariant import ragged_tuning
    fixed = ragged_tuning(cfg) if invariant else {}  # (num_splits, block_q: fixed)

    def attend(q, k, v, planes, loop, layer):
        planes = write_kv(planes, loop * num_layers + layer, page, slot, k, v)
        # The kernels compute the plane from (loop, layer) themselves: handing them a
        # precomputed index costs one tiny XLA kernel per layer application on the GPU.
        if c == 1 and not invariant:
            out = trace_once.call(pk.paged_decode_attention, q[:, 0], planes[0], planes[1],
                                  block_tables=block_tables, kv_lens=kv_lens,
                                  interpret=interpret, entry=_entry(loop, layer),
                                  entry_stride=num_layers)[:, None]
        else:
            out = ragged(q.reshape(b * c, *q.shape[2:]), planes, loop, layer)
        return out, planes

    def ragged(q, planes, loop, layer):
        """The ragged kernel on packed queries q [B*C, H, hd] -> [B, C, H, hd]. Every
        sequence has C rows (q_len=c): the kernel finds its tile and, with one split, writes
        the packed output without the XLA tile map and gather (the same bits)."""
        out = trace_once.call(pk.ragged_paged_attention, q, planes[0], planes[1],
                              block_tables=block_tables, kv_lens=kv_lens, q_len=c,
                              interpret=interpret, entry=_entry(loop, layer),
                              entry_stride=num_layers, **fixed)
        return out.reshape(b, c, *q.shape[1:])
    attend.ragged = ragged
    if invariant and fused_kv_write:
        from ouro_jax.invariant import attend_qkv
        attend.qkv = attend_qkv(attend, cfg, page, slot, interpret)
    return attend


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


def _xla_attend(cfg, block_tables, positions, page_size, page, slot):
    """Plain JAX: gather the sequence's keys and values, masked attention."""
    num_layers = cfg.num_hidden_layers
    key_pos = jnp.arange(block_tables.shape[1] * page_size, dtype=jnp.int32)
    mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, C, S]
    # Slots no query may see (stale, trash) are zeroed in V: a masked probability is exactly 0,
    # but 0 * inf or 0 * NaN would still poison the row.
    visible = jnp.any(mask, axis=1)[:, :, None, None]  # [B, S, 1, 1]

    def attend(q, k, v, planes, loop, layer):
        entry = loop * num_layers + layer
        planes = write_kv(planes, entry, page, slot, k, v)
        keys, values = gather_kv(planes, entry, block_tables)
        values = jnp.where(visible, values, jnp.zeros((), values.dtype))
        return attention_core(q, keys, values, mask), planes
    return attend
