"""Paged decode attention: one query per sequence, flash-decoding splits, GQA per KV head.

Pallas with the Triton lowering (docs/kernels.md says why). Grid (B, KVH, S): program
(b, h, s) reads the keys of split s of sequence b for KV head h (all `group` query heads of
that KV head share each K/V tile), gathering token rows through the block table straight
out of plane `entry` of the full cache (the plane is a pointer offset, never a copy). Each
program writes a normalised partial output and its log-sum-exp; a small XLA combine merges
the S partials (skipped when S == 1), or, in paged_decode_attention_qkv with `counters`,
the last split program to finish merges them in the kernel (split_merge.py; opt-in: no
gain on the H200 at batch 1).

`paged_decode_attention_qkv` is the engine's decode entry point: the same kernel reads q, k and
v of the new token from the packed projection, applies RoPE, writes the new K/V into the caches
(aliased outputs, updated in place) and folds the new key into the softmax from registers (see
its docstring and docs/kernels.md).

Two inner products:
  * use_dot=True (default, any group): tensor-core dots on a [max(16, group_padded), head_dim]
    query tile (MHA pads the single query row to 16; the wasted MMA work is free in a
    memory-bound kernel). Triton software-pipelines the K/V tile loads that feed dots
    (cp.async, num_stages deep), which keeps enough bytes in flight to hide HBM/TLB latency.
  * use_dot=False (group <= 8 sensible): fp32 multiply-reduce on the CUDA cores, loads into
    registers with no pipelining; rowwise=True keeps a softmax state per token slot of the tile
    (no cross-warp reduction in the loop), rowwise=False is the classic per-block online
    softmax. Measured slower on the H200 at long contexts (docs/kernels.md), kept as an option.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (NEG_INF, choose_num_splits, finish, flash_tile,
                                    load_kv_block, next_pow2, online_softmax_step, pdl_trigger,
                                    pdl_wait, pl,
                                    plane_index, plane_operands, split_partials_call,
                                    split_range)
from pallas_kernels.new_token import fold_new_key, new_token_kv, query_tile
# a module global, so that tests can count the merges by patching it here
from pallas_kernels.split_merge import merge_if_last as _merge_if_last


def _decode_kernel(*refs, group: int, group_pad: int, use_dot: bool, page_size: int,
                   block_t: int, num_splits: int, scale: float, rowwise: bool, entry_stride: int,
                   write_new: bool = False, rope: bool = False, trash_page: int = 0,
                   last_combine: bool = False, gpu_sync: bool = True, pdl: bool = False,
                   ids=None):
    """write_new: q_ref is the packed projection qkv [B, H + 2 KVH, hd] of the new token,
    whose K/V the kernel writes at (page, slot) [B] into the caches (aliased outputs); with
    `rope` the kernel also applies RoPE (cos, sin [B, hd]) to q and k. See
    paged_decode_attention_qkv. last_combine (with write_new): the last split program of each
    (row, KV head) to finish merges the partials (see _merge_if_last); gpu_sync: emit its CTA
    barriers (interpret mode has no lowering for them and runs programs in order). ids: (row,
    KV head, split) when the body runs inside another kernel (gemv_flow's attention stage,
    flow_attention.py) rather than as program (row, head, split) of its own grid."""
    out_ref = cnt_ref = None
    if write_new:
        (base_ref, off_ref, bt_ref, lens_ref, q_ref, k_ref, v_ref, *rest) = refs
        if last_combine:
            # Inputs end with the counters (aliased to the last output); the outputs are
            # (o, lse, k cache, v cache, out, counters).
            out_ref, cnt_ref = rest[-2:]
            rest = rest[:-7] + rest[-6:-2]
        cos_ref, sin_ref = rest[:2] if rope else (None, None)
        wpage_ref, wslot_ref, o_ref, lse_ref, kout_ref, vout_ref = rest[2:] if rope else rest
    else:
        base_ref, off_ref, bt_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, lse_ref = refs
    # PDL (_common.PDL, off by default): every read below depends on `after`, so none is
    # issued before the wait; the row index and the plane operands carry it.
    if ids is None:
        after = pdl_wait(pdl_trigger(pl.program_id(2), interpret=not (gpu_sync and pdl)))
        b, kvh, sp = pl.program_id(0) + after, pl.program_id(1), pl.program_id(2)
    else:
        (b, kvh, sp), after = ids, 0
    entry = plane_index(base_ref, off_ref, entry_stride, after, row=b)
    kv_len = lens_ref[b]
    # With write_new the newest key is not read from the cache (this call writes it, and
    # programs do not see each other's stores): the loop covers the kv_len - 1 cached keys
    # and split 0 folds the new one in from registers after its loop.
    cached = jnp.maximum(kv_len - 1, 0) if write_new else kv_len
    start, end, n_blocks = split_range(cached, sp, num_splits, block_t)
    hd = q_ref.shape[-1]
    offs = lax.iota(jnp.int32, block_t)
    if rope:
        swap = (lax.iota(jnp.int32, hd) + hd // 2) % hd  # column order, halves swapped
    extra = None
    if write_new:
        cdt = kout_ref.dtype
        k_new, v_new, cos, sin = new_token_kv(q_ref, cos_ref, sin_ref, b, kvh, k_ref.shape[3],
                                              cdt, swap if rope else None)
        page = wpage_ref[b]

        @pl.when((sp == 0) & (page != trash_page))
        def _():
            slot = wslot_ref[b]
            kout_ref[entry, page, slot, kvh, :] = k_new
            vout_ref[entry, page, slot, kvh, :] = v_new

        def extra(m, l, acc):
            """The new key, for split 0 of a real row only: padding rows (trash page)
            attend to nothing new, as on the XLA path, where the write is dropped."""
            return fold_new_key(qt, k_new, v_new, lambda: (sp == 0) & (kv_len > 0) &
                                (page != trash_page), scale, m, l, acc)

    def kv_block(i):
        t = start + i * block_t + offs
        k, v = load_kv_block(k_ref, v_ref, bt_ref, entry, b, kvh, t, end - 1, page_size)
        return t < end, k, v

    if use_dot:
        qt = query_tile(q_ref, b, kvh, group, group_pad,
                        (swap, cos, sin) if write_new and rope else None)

        def block(i):
            mask, k, v = kv_block(i)
            return k, v, lambda: mask[None, :]

        o, lse = flash_tile(qt, n_blocks, block, scale, extra)
        if group_pad == group:
            o_ref[b, kvh, sp, :, :] = o.astype(o_ref.dtype)
            lse_ref[b, kvh, sp, :] = lse
        else:
            # Only the `group` real rows go out (1 of 16 for MHA): padded rows repeat head
            # group-1, so storing every row at min(row, group-1) writes identical values.
            rows = jnp.minimum(lax.iota(jnp.int32, group_pad), group - 1)
            o_ref[b, kvh, sp, rows, :] = o.astype(o_ref.dtype)
            lse_ref[b, kvh, sp, rows] = lse
        if last_combine:
            _merge_if_last(o_ref, lse_ref, out_ref, cnt_ref, b, kvh, group, num_splits, gpu_sync)
        return

    qs = [q_ref[b, kvh * group + g, :].astype(jnp.float32) * scale for g in range(group)]

    def block_f32(i):
        """Validity mask and the K, V tiles of key block i in fp32."""
        mask, k, v = kv_block(i)
        return mask, k.astype(jnp.float32), v.astype(jnp.float32)

    def scores(k, g):
        return jnp.sum(k * qs[g][None, :], axis=1)  # [T]

    def store(g, o, lse):
        o_ref[b, kvh, sp, g, :] = o.astype(o_ref.dtype)
        lse_ref[b, kvh, sp, g] = lse

    if rowwise:
        # Per-row online softmax: token slot j of the tile keeps its own (m, l, acc[hd]) across
        # iterations, so the loop body has no cross-thread reduction except the q.k dot over hd
        # (inside a warp); the block_t partial states are merged once after the loop.
        def body(i, carry):
            mask, k, v = block_f32(i)
            out = []
            for g, (m, l, acc) in enumerate(carry):
                sc = scores(k, g)
                m_new = jnp.where(mask, jnp.maximum(m, sc), m)
                alpha = jnp.exp(m - m_new)
                p = jnp.where(mask, jnp.exp(sc - m_new), 0.0)
                out.append((m_new, l * alpha + p, acc * alpha[:, None] + p[:, None] * v))
            return tuple(out)

        init = tuple((jnp.full((block_t,), NEG_INF, jnp.float32), jnp.zeros((block_t,), jnp.float32),
                      jnp.zeros((block_t, hd), jnp.float32)) for _ in range(group))
        carry = lax.fori_loop(0, n_blocks, body, init)
        for g, (m_rows, l_rows, acc_rows) in enumerate(carry):
            m = jnp.max(m_rows)
            w = jnp.exp(m_rows - m)
            store(g, *finish(jnp.sum(acc_rows * w[:, None], axis=0), m, jnp.sum(l_rows * w)))
        return

    def body(i, carry):
        mask, k, v = block_f32(i)
        out = []
        for g, (m, l, acc) in enumerate(carry):
            m, alpha, p, l = online_softmax_step(m, l, scores(k, g), mask)
            out.append((m, l, acc * alpha + jnp.sum(p[:, None] * v, axis=0)))
        return tuple(out)

    init = tuple((jnp.full((), NEG_INF, jnp.float32), jnp.zeros((), jnp.float32),
                  jnp.zeros((hd,), jnp.float32)) for _ in range(group))
    carry = lax.fori_loop(0, n_blocks, body, init)
    for g, (m, l, acc) in enumerate(carry):
        store(g, *finish(acc, m, l))


# Process-wide overrides of the tuning defaults below (block_t, num_splits, num_warps,
# num_stages), read at trace time: for end-to-end A/B runs (`benchmarks.decode
# --decode-kernel block_t=32,num_warps=2`); arguments passed explicitly win. The key
# last_combine (0/1) is read by ouro_jax.attention, which then passes counters; pdl (0/1)
# emits the PDL trigger (_common.PDL) and needs last_combine. Programs an
# engine has already compiled keep the settings they were traced with.
TUNING: dict = {}
# The bf16 tensor-core path's defaults: 32-key blocks at every batch size; 4 warps per
# program at one row, MULTI_ROW_WARPS from 2 rows up. History: the 32-key block at one row
# is session 10's (H200, native greedy batch 1 240.4 / 241.2 tok/s against 240.1 / 239.6 for
# 64 keys; ab2_*_session10_h200.json); from 2 rows up 64 keys with 4 warps served until
# session 45 (at batch 8 level with 32 keys at 4 warps, session 11; at batch 64, 32 keys at
# 4 warps lost 1.4%). Session 45 (H100, the 1.4B shape, native greedy, four interleaved
# passes, ab_decode_warps_short_session45_h100.json and ab_decode_bw_k4_session45_h100.json):
# 32 keys at 2 warps, median tok/s batch 8 1,351 against 1,343 (+0.6%), batch 32 4,551
# against 4,462 (+2.0%); k=4 d=2 +0.6% (batch 8) and +0.9% (batch 32) over two passes;
# level at a 2048-token prompt (batch 8, ab_decode_warps_long_session45_h100.json). Other
# batch sizes below 64 take it unmeasured. Not measured on an H200 (its one 2-warp record,
# session 10, is at batch 1, where 4 warps stay). Batch 64 decode runs the ragged kernel
# (ouro_jax.attention.RAGGED_FROM). fp32 caches and the CUDA-core path keep 4 warps. Measured
# through paged_decode_attention_qkv (the default fused write); paged_decode_attention
# (the --kv-write xla path) takes the same defaults, unmeasured.
WIDE_BLOCK_T = 32
MULTI_ROW_WARPS = 2


def _wide(cache_dtype) -> bool:
    """16-bit caches: the ones the tensor-core path's defaults above are tuned for."""
    return jnp.dtype(cache_dtype).itemsize <= 2


def default_num_warps(bsz: int, cache_dtype, use_dot: bool) -> int:
    """The decode kernel's warps per program when neither the call nor TUNING sets them."""
    return MULTI_ROW_WARPS if _wide(cache_dtype) and use_dot and bsz > 1 else 4


def paged_decode_attention(q, k_cache, v_cache, entry, block_tables, kv_lens, *,
                           interpret: bool = False, block_t=None, num_splits=None,
                           num_warps=None, num_stages=None, use_dot: bool = True,
                           rowwise: bool = False, entry_stride: int = 1):
    """Decode attention over a paged KV cache.

    q [B, H, hd]; k_cache/v_cache [E, P, page_size, KVH, hd]; entry: the plane, an int32
    scalar, or a pair (base, offset) meaning base * entry_stride + offset (see
    _common.plane_operands; the base may be an int32 [B], one loop per row);
    block_tables [B, max_pages] int32; kv_lens [B] int32 (the new token included; 0 gives
    zeros). Returns [B, H, hd] in q.dtype; scale hd**-0.5, fp32 softmax.

    Tuning: block_t keys per inner step (power of 2), num_splits flash-decoding splits per
    sequence (default: enough programs to fill the GPU), num_warps / num_stages (Triton),
    use_dot (tensor-core path, default) and rowwise (see module doc).
    """
    bsz, h, hd = q.shape
    _, _, _, kvh, hd_c = k_cache.shape
    assert hd == hd_c and h % kvh == 0, (q.shape, k_cache.shape)
    out = _call(q, h, k_cache, v_cache, entry, block_tables, kv_lens, (), interpret=interpret,
                block_t=block_t, num_splits=num_splits, num_warps=num_warps,
                num_stages=num_stages, use_dot=use_dot, rowwise=rowwise,
                entry_stride=entry_stride)
    return out.reshape(bsz, h, hd).astype(q.dtype)


def paged_decode_attention_qkv(qkv, k_cache, v_cache, entry, block_tables, kv_lens, page, slot,
                               *, rope=None, trash_page=None, interpret: bool = False,
                               entry_stride: int = 1, counters=None, defer_merge=False,
                               **tuning):
    """Decode attention for a new token that is not in the cache yet, which the kernel writes.

    qkv [B, H + 2 KVH, hd]: the token's q heads, then its k and v heads (the fused projection,
    reshaped). The kernel writes k and v at (entry, page, slot) [B] int32 (rows whose page is
    `trash_page`, the engine's padding, write nothing and attend only to cached keys; None:
    no such page) and attends over the kv_len - 1 cached keys plus the new one from registers, so neither the K/V write nor slicing q/k/v out of the projection
    needs an XLA kernel of its own. rope=(cos, sin) [B, hd]: q and k are unrotated and the
    kernel applies model.apply_rope (each op rounded to qkv's dtype, as XLA rounds it).
    The caches are updated in place (aliased outputs; donate them). Returns (out [B, H, hd],
    k_cache, v_cache). Other arguments as paged_decode_attention (tensor-core path only).

    counters: an int32 [B, KVH] array of zeros (donate it; the engine makes one per forward
    block and threads it through the layers). With it and more than one split, the kernel
    merges the splits itself (the last split program of each row and KV head to finish,
    _merge_if_last) instead of an XLA combine after it, and the call returns (out, k_cache,
    v_cache, counters), the counters back at zero.

    defer_merge (no counters): with more than one split, `out` is the kernel's unmerged
    (partials [B, KVH, S, G, hd] fp32, log-sum-exps [B, KVH, S, G]) for the o projection to
    merge (pallas_kernels.gemv_merge); with one split it is the output as usual.
    """
    bsz, rows, hd = qkv.shape
    _, _, _, kvh, hd_c = k_cache.shape
    h = rows - 2 * kvh
    if hd != hd_c or h < kvh or h % kvh:
        raise ValueError(f"paged_decode_attention_qkv: qkv {qkv.shape} does not hold H + 2 KVH "
                         f"heads of {hd_c} for a cache with KVH = {kvh}")
    if page.shape != (bsz,) or slot.shape != (bsz,):
        raise ValueError(f"paged_decode_attention_qkv: page {page.shape} and slot {slot.shape} "
                         f"must be [{bsz}]")
    if kv_lens.shape != (bsz,) or block_tables.shape[0] != bsz:
        raise ValueError(f"paged_decode_attention_qkv: kv_lens {kv_lens.shape} and block_tables "
                         f"{block_tables.shape} must have the batch size {bsz} of qkv")
    if not tuning.pop("use_dot", True) or tuning.pop("rowwise", False):
        raise ValueError("paged_decode_attention_qkv: the fused K/V write needs the tensor-core "
                         "path (use_dot=True, rowwise=False)")
    extra = ()
    if rope is not None:
        cos, sin = rope
        if cos.shape != (bsz, hd) or sin.shape != (bsz, hd):
            raise ValueError(f"paged_decode_attention_qkv: cos {cos.shape} / sin {sin.shape} "
                             f"must be [{bsz}, {hd}]")
        extra = (cos.astype(qkv.dtype), sin.astype(qkv.dtype))
    extra += (page.astype(jnp.int32), slot.astype(jnp.int32))
    if counters is not None and (counters.shape != (bsz, kvh) or counters.dtype != jnp.int32):
        raise ValueError(f"paged_decode_attention_qkv: counters must be int32 [{bsz}, {kvh}], "
                         f"got {counters.dtype} {counters.shape}")
    if defer_merge and counters is not None:
        raise ValueError("paged_decode_attention_qkv: defer_merge leaves the splits to a later "
                         "kernel; counters make this one merge them: pass one")
    out, kc, vc, *cnt = _call(qkv, h, k_cache, v_cache, entry, block_tables, kv_lens, extra,
                              interpret=interpret, entry_stride=entry_stride,
                              rope=rope is not None, counters=counters,
                              trash_page=-1 if trash_page is None else int(trash_page),
                              defer_merge=defer_merge, **tuning)
    if isinstance(out, tuple):  # defer_merge, several splits
        return out, kc, vc
    out = out.reshape(bsz, h, hd).astype(qkv.dtype)
    return (out, kc, vc) if counters is None else (out, kc, vc, cnt[0] if cnt else counters)


def key_tiling(bsz: int, kvh: int, group: int, cache_dtype, max_tokens: int, use_dot: bool,
               *, block_t=None, num_splits=None):
    """(block_t, num_splits, group_pad): the keys per inner step, the flash-decoding splits
    and the query tile's rows; the arguments given (else TUNING's, else the defaults) win."""
    block_t = TUNING.get("block_t") if block_t is None else block_t
    num_splits = TUNING.get("num_splits") if num_splits is None else num_splits
    if block_t is None:  # fp32 IEEE dots at 64 keys spill registers: 32 there
        block_t = ((WIDE_BLOCK_T if _wide(cache_dtype) else 32) if use_dot
                   else (64 if group == 1 else 32))
    group_pad = max(16, next_pow2(group)) if use_dot else group
    if num_splits is None:
        # One key block per split is enough for decode: at batch 1 (16 programs unsplit) the
        # 2-block floor left 1-2 splits for a 256-token table; 4 splits took batch-1 decode
        # from 163.5 to 170.2 tok/s on the H200 (benchmarks/results/ab_splits*_b1_h200.json).
        num_splits = choose_num_splits(bsz * kvh, max_tokens, block_t, min_blocks_per_split=1)
    return block_t, num_splits, group_pad


def _call(q, h, k_cache, v_cache, entry, block_tables, kv_lens, write_args, *, interpret,
          block_t=None, num_splits=None, num_warps=None, num_stages=None, use_dot=True,
          rowwise=False, entry_stride=1, rope=False, trash_page=0, counters=None,
          defer_merge=False):
    """The pallas_call for q [B, H (+ 2 KVH with write_args), hd]; write_args non-empty:
    the fused-write mode's extra inputs ([cos, sin,] page, slot); counters (fused-write mode):
    merge the splits in the kernel when there are several (then also returned)."""
    bsz, hd = q.shape[0], q.shape[-1]
    page_size, kvh = k_cache.shape[2], k_cache.shape[3]
    group = h // kvh
    use_dot = bool(use_dot)
    if num_warps is None:
        num_warps = TUNING.get("num_warps", default_num_warps(bsz, k_cache.dtype, use_dot))
    num_stages = TUNING.get("num_stages", 2) if num_stages is None else num_stages
    block_t, num_splits, group_pad = key_tiling(
        bsz, kvh, group, k_cache.dtype, block_tables.shape[1] * page_size, use_dot,
        block_t=block_t, num_splits=num_splits)
    write_new = bool(write_args)
    last_combine = write_new and counters is not None and num_splits > 1
    # (the fused-write entry point takes the tensor-core path only, the one that merges)
    assert use_dot or not last_combine
    # PDL trigger (_common.PDL): only for one row with the kernel merging its own splits, so
    # that the next kernel is the o projection's streaming GEMV (which waits; the engine sends
    # only one-row calls there), not the XLA combine or an XLA GEMM.
    pdl = bool(TUNING.get("pdl", 0))
    if pdl and not (last_combine and bsz == 1):
        raise ValueError(
            f"decode kernel pdl=1 needs one row and the in-kernel split merge (last_combine=1, "
            f"counters, more than one split); this call has {bsz} rows, {num_splits} splits, "
            f"counters {'given' if counters is not None else 'missing'}: its next kernel "
            f"must be one that waits")
    if last_combine:
        write_args = (*write_args, counters)
    sd = lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype)
    # The caches follow the two plane operands, block tables, kv_lens and q.
    updated = ((5, sd(k_cache)), (6, sd(v_cache))) if write_new else ()
    kernel = functools.partial(
        _decode_kernel, group=group, group_pad=group_pad, use_dot=use_dot, page_size=page_size,
        block_t=block_t, num_splits=num_splits, scale=float(hd) ** -0.5, rowwise=rowwise,
        entry_stride=entry_stride, write_new=write_new, rope=rope, trash_page=trash_page,
        last_combine=last_combine, gpu_sync=not interpret, pdl=pdl)
    # Output rows: the group's real query heads (the tensor-core tile's padding stays on chip).
    call = split_partials_call(kernel, rows=bsz, kvh=kvh, num_splits=num_splits, m=group,
                               hd=hd, name="paged_decode_attention", num_warps=num_warps,
                               num_stages=num_stages, interpret=interpret, out_dtype=q.dtype,
                               updated=updated, defer_merge=defer_merge,
                               counters_index=7 + len(write_args) - 1 if last_combine else None)
    return call(*plane_operands(entry, entry_stride, rows=bsz), block_tables.astype(jnp.int32),
                kv_lens.astype(jnp.int32), q, k_cache, v_cache, *write_args)  # [B, KVH, G, hd]
