"""Ragged paged attention: packed multi-token queries (speculative verification, chunked prefill).

Sequence b owns packed query rows cu_q_lens[b]:cu_q_lens[b+1]; its query i sits at position
kv_lens[b] - q_len_b + i and sees every key at a position <= its own (the committed context
plus the causal part of the new tokens, whose K/V are already in the cache).

Work decomposition (Pallas, Triton lowering):
  * query tiles: each sequence's rows are cut into tiles of block_q rows, never straddling two
    sequences. A tiny XLA prologue maps tile -> (sequence, first row); the static tile count is
    an upper bound (min(N, cdiv(N, block_q) + B)) and surplus tiles exit at once.
  * GQA: the rows of a tile times the `group` query heads of one KV head form the M dimension
    (block_q * group_pad rows) of tensor-core dots against each K/V tile.
  * flash-decoding splits over the keys for small batches, merged by the shared XLA combine.
  * each program writes a dense [M, hd] tile; an XLA gather moves the rows back to the packed
    [N, H, hd] layout (cheap: N*H*hd outputs against context*KVH*hd K/V bytes per sequence).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (cdiv, choose_num_splits, flash_tile, load_kv_block,
                                    next_pow2, pl, plane_index, plane_operands,
                                    split_partials_call, split_range)
from pallas_kernels.reference import ragged_rows

_NO_TILE = 1 << 30


def _ragged_kernel(base_ref, off_ref, bt_ref, lens_ref, cu_ref, tseq_ref, tq0_ref, q_ref, k_ref,
                   v_ref, o_ref, lse_ref, *, group: int, group_pad: int, block_q: int, page_size: int,
                   block_t: int, num_splits: int, scale: float, entry_stride: int):
    j = pl.program_id(0)
    kvh = pl.program_id(1)
    sp = pl.program_id(2)
    n_rows, _, hd = q_ref.shape
    entry = plane_index(base_ref, off_ref, entry_stride)
    b = tseq_ref[j]
    q0 = tq0_ref[j]
    row0 = cu_ref[b]
    q_len = cu_ref[b + 1] - row0
    kv_len = lens_ref[b]
    nq = jnp.clip(q_len - q0, 0, block_q)  # 0 for surplus tiles
    first_pos = kv_len - q_len + q0  # position of the tile's first query

    mm = lax.iota(jnp.int32, block_q * group_pad)
    r = lax.div(mm, group_pad)
    g = lax.rem(mm, group_pad)
    rows = jnp.clip(row0 + q0 + jnp.minimum(r, jnp.maximum(nq - 1, 0)), 0, n_rows - 1)
    heads = kvh * group + jnp.minimum(g, group - 1)
    qt = q_ref[rows, heads, :]  # [M, hd]
    pos = first_pos + r  # [M]

    kv_end = jnp.where(nq > 0, jnp.minimum(first_pos + nq, kv_len), 0)
    start, end, n_blocks = split_range(kv_end, sp, num_splits, block_t)
    offs = lax.iota(jnp.int32, block_t)

    def block(i):
        t = start + i * block_t + offs
        k, v = load_kv_block(k_ref, v_ref, bt_ref, entry, b, kvh, t, end - 1, page_size)
        return k, v, lambda: (t[None, :] <= pos[:, None]) & (t[None, :] < end)  # mask [M, T]

    o, lse = flash_tile(qt, n_blocks, block, scale)
    o_ref[j, kvh, sp, :, :] = o.astype(o_ref.dtype)
    lse_ref[j, kvh, sp, :] = lse


def _tile_map(cu_q_lens, num_tiles: int, block_q: int):
    """tile -> (sequence, first query index); surplus tiles get q0 = _NO_TILE (no rows)."""
    nseq = cu_q_lens.shape[0] - 1
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    per_seq = cdiv(q_lens, block_q)
    tile_end = jnp.cumsum(per_seq).astype(jnp.int32)
    tile_begin = tile_end - per_seq
    jj = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(tile_end, jj, side="right").astype(jnp.int32)
    valid = seq < nseq
    seq = jnp.minimum(seq, nseq - 1)
    q0 = jnp.where(valid, (jj - tile_begin[seq]) * block_q, _NO_TILE).astype(jnp.int32)
    return seq, q0, tile_begin


# Process-wide overrides of the tuning defaults (block_q, block_t, num_splits, num_warps,
# num_stages), read at trace time, as decode.TUNING; explicit arguments win.
TUNING: dict = {}


def ragged_paged_attention(q, k_cache, v_cache, entry, block_tables, kv_lens, cu_q_lens, *,
                           interpret: bool = False, block_q=None, block_t=None,
                           num_splits=None, num_warps=None, num_stages=None,
                           entry_stride: int = 1):
    """Packed ragged paged attention. q [N, H, hd] -> [N, H, hd] in q.dtype.

    k_cache/v_cache [E, P, page_size, KVH, hd]; entry int32 scalar, or (base, offset) with
    entry_stride as in paged_decode_attention; block_tables [B, max_pages];
    kv_lens [B] (new tokens included); cu_q_lens [B+1] (cu_q_lens[0] == 0). Rows past
    cu_q_lens[B] return zeros. Tuning: block_q query rows per tile (power of 2; default 16
    rows of M for short queries, up to 64 for long chunks), block_t keys per step (64 for 16-bit
    caches, 32 for fp32), num_splits,
    num_warps (default 4, or 8 when M > 32), num_stages.
    """
    n_rows, h, hd = q.shape
    _, _, page_size, kvh, hd_c = k_cache.shape
    assert hd == hd_c and h % kvh == 0, (q.shape, k_cache.shape)
    nseq = kv_lens.shape[0]
    group = h // kvh
    block_q = TUNING.get("block_q") if block_q is None else block_q
    block_t = TUNING.get("block_t") if block_t is None else block_t
    num_splits = TUNING.get("num_splits") if num_splits is None else num_splits
    num_warps = TUNING.get("num_warps") if num_warps is None else num_warps
    num_stages = TUNING.get("num_stages", 2) if num_stages is None else num_stages
    group_pad = next_pow2(group)
    if block_t is None:  # fp32 tiles are twice the shared memory of bf16 ones
        block_t = 64 if jnp.dtype(k_cache.dtype).itemsize <= 2 else 32
    if block_q is None:  # M = block_q * group_pad rows per dot: >= 16 for the tensor cores
        target_m = 16 if cdiv(n_rows, nseq) <= 16 else 64
        block_q = max(1, target_m // group_pad)
    block_q = next_pow2(block_q)
    num_tiles = int(min(n_rows, cdiv(n_rows, block_q) + nseq))
    max_tokens = block_tables.shape[1] * page_size
    if num_splits is None:
        busy_tiles = min(num_tiles, max(nseq, cdiv(n_rows, block_q)))
        num_splits = choose_num_splits(busy_tiles * kvh, max_tokens, block_t)
    mdim = block_q * group_pad
    if num_warps is None:
        num_warps = 4 if mdim <= 32 else 8

    cu = cu_q_lens.astype(jnp.int32)
    tseq, tq0, tile_begin = _tile_map(cu, num_tiles, block_q)
    kernel = functools.partial(
        _ragged_kernel, group=group, group_pad=group_pad, block_q=block_q, page_size=page_size,
        block_t=block_t, num_splits=num_splits, scale=float(hd) ** -0.5,
        entry_stride=entry_stride)
    call = split_partials_call(kernel, rows=num_tiles, kvh=kvh, num_splits=num_splits, m=mdim,
                               hd=hd, name="ragged_paged_attention", num_warps=num_warps,
                               num_stages=num_stages, interpret=interpret, out_dtype=q.dtype)
    o = call(*plane_operands(entry, entry_stride), block_tables.astype(jnp.int32),
             kv_lens.astype(jnp.int32), cu, tseq, tq0, q, k_cache, v_cache)  # [tiles, KVH, M, hd]
    o = o.reshape(num_tiles, kvh, block_q, group_pad, hd)

    b, i, valid = ragged_rows(cu, n_rows)
    tile = jnp.clip(tile_begin[b] + i // block_q, 0, num_tiles - 1)
    r = jnp.clip(i % block_q, 0, block_q - 1)
    hh = jnp.arange(h, dtype=jnp.int32)
    out = o[tile[:, None], (hh // group)[None, :], r[:, None], (hh % group)[None, :]]  # [N, H, hd]
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)
