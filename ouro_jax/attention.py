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
- "pallas": the kernels in pallas_kernels/, which read pages in place. The fused decode
  kernel's attend variants and opt-in modes are in ouro_jax.attention_decode.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ouro_jax import trace_once
from ouro_jax.config import OuroConfig
from ouro_jax.kv_cache import gather_kv, slot_indices, write_kv
from ouro_jax.model import attention_core
# The fused decode kernel's attend variants and switches live in attention_decode;
# re-exported here, where callers and benchmarks have always found them.
from ouro_jax.attention_decode import (  # noqa: F401
    FLOW_O, FLOW_O_TILING, FUSE_O, FUSE_O_MAX_KEYS, LAST_COMBINE, MGPU_DECODE, O_MERGE,
    _entry, _flow_o_tiling, _fused_o_tuning, _with_fused_decode)

BACKENDS = ("auto", "xla", "pallas")


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


def make_paged_attend(cfg: OuroConfig, block_tables: jax.Array, positions: jax.Array,
                      page_size: int, backend: str = "xla", fused_kv_write: bool = True,
                      merge_splits: bool | None = None, invariant: bool = False,
                      active: jax.Array | None = None, row_loops: bool = False):
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
    writes the K/V in one Pallas kernel first (pallas_kernels.rope_kv), else XLA does.
    active [B] bool (None: all): with the pallas backend and skip_done(), rows not active
    (finished rows, or pipelined speculation's stage rows with no position: rows whose
    outputs are discarded) attend over at most C + 1 keys instead of their whole context.
    Their K/V still go to the same slots, now computed from that short context: slots at or
    past a row's length are rewritten before anything reads them.
    row_loops: the `loop` the layers pass is an int32 [B], one loop per row
    (ouro_jax.pipelined; C == 1): every kernel here then reads and writes each row's own
    plane (the decode, ragged and RoPE/K/V-write kernels take a base per row)."""
    page, slot = slot_indices(block_tables, positions, page_size)
    if row_loops and positions.shape[1] != 1:
        raise ValueError(f"rows at different loops run one query each, got "
                         f"{positions.shape[1]} per row")
    if row_loops and backend == "pallas":
        import pallas_kernels as pk
        if pk.decode.TUNING.get("mgpu", MGPU_DECODE):
            raise ValueError("rows at different loops (pipelined speculation) need a decode "
                             "kernel that reads a plane per row; the Mosaic GPU decode "
                             "kernel (decode tuning mgpu=1) reads one per call")
    if invariant and backend != "pallas":
        raise ValueError(f"batch-invariant attention runs the Pallas ragged kernel, not "
                         f"{backend!r}")
    if backend == "pallas":
        kv_lens = positions[:, -1] + 1
        if active is not None and positions.shape[0] > 1 and skip_done():
            # (one row never runs finished: its loops stop first; batch-1 programs unchanged)
            kv_lens = jnp.where(active, kv_lens, jnp.minimum(kv_lens, positions.shape[1] + 1))
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


def ragged_from() -> int:
    """The decode batch from which the ragged kernel runs decode (0: never): the decode
    kernel's TUNING["ragged_from"], else RAGGED_FROM. Read at trace time."""
    import pallas_kernels as pk
    return int(pk.decode.TUNING.get("ragged_from", RAGGED_FROM))


# Rows that are done (finished, still in the batch while others run on) attend over at most
# C + 1 keys rather than their whole context: their outputs are discarded, and speculative
# decoding runs a batch's rounds until its slowest row is done. At batch 8-64 k=4 on an H100
# the batches ran 19 rounds while 16-19% of their row-rounds were finished rows, each
# reading its whole K/V in every draft and verification attention (session 44,
# decode_{skip,noskip}*_session44_h100.json): k=4 +1.0% at batch 8, +3.0-3.2% at 32,
# +5.4-5.7% at 64, the same tokens. Any kv_len >= C is valid for the kernels; C + 1 keeps
# each query at least one key and reads one page. Exact: the active rows' inputs do not
# change. pallas_kernels.decode.TUNING["skip_done"] = 0 turns it off.
SKIP_DONE = True


def skip_done() -> bool:
    """Whether finished rows skip their context in the Pallas attention (SKIP_DONE, or the
    decode kernel's TUNING["skip_done"]). Read at trace time."""
    import pallas_kernels as pk
    return bool(pk.decode.TUNING.get("skip_done", SKIP_DONE))


def _ragged_decode(positions, fused_kv_write: bool) -> bool:
    """Whether decode rows (C == 1) of this batch go to the RoPE/K/V-write kernel and the
    ragged kernel rather than the decode kernel (ragged_from())."""
    start = ragged_from()
    b, c = positions.shape
    return bool(start) and fused_kv_write and c == 1 and b >= start


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
        planes = write_kv(planes, row_entry(loop, layer, num_layers), page, slot, k, v)
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


def row_entry(loop, layer, num_layers: int):
    """The plane loop * L + layer for the XLA scatter and gather: a scalar, or with one loop
    per row ([B]) a [B, 1] index that pairs with the [B, C] pages."""
    entry = loop * num_layers + layer
    return entry[:, None] if jnp.ndim(entry) == 1 else entry


def _xla_attend(cfg, block_tables, positions, page_size, page, slot):
    """Plain JAX: gather the sequence's keys and values, masked attention."""
    num_layers = cfg.num_hidden_layers
    key_pos = jnp.arange(block_tables.shape[1] * page_size, dtype=jnp.int32)
    mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, C, S]
    # Slots no query may see (stale, trash) are zeroed in V: a masked probability is exactly 0,
    # but 0 * inf or 0 * NaN would still poison the row.
    visible = jnp.any(mask, axis=1)[:, :, None, None]  # [B, S, 1, 1]

    def attend(q, k, v, planes, loop, layer):
        entry = row_entry(loop, layer, num_layers)
        planes = write_kv(planes, entry, page, slot, k, v)
        keys, values = gather_kv(planes, entry, block_tables)
        values = jnp.where(visible, values, jnp.zeros((), values.dtype))
        return attention_core(q, keys, values, mask), planes
    return attend
