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
  * q_len (every sequence the same length, as the engine's decode and verification): a tile's
    sequence and rows are arithmetic, so no tile map; with one split each program stores its
    real (row, head) pairs straight into the packed output, so no gather either. On the GPU
    these were two small XLA kernels per call (~2.1 us per layer application in the
    batch-invariant mode's batch-1 decode, session 40's trace).
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (cdiv, choose_num_splits, compiler_params, flash_tile,
                                    load_kv_block, next_pow2, pl, plt, plane_index, plane_operands,
                                    split_partials_call, split_range)
from pallas_kernels.reference import ragged_rows

_NO_TILE = 1 << 30


def _attend_tile(base_ref, off_ref, bt_ref, lens_ref, q_ref, k_ref, v_ref, b, q0, row0, q_len, *,
                 group: int, group_pad: int, block_q: int, page_size: int, block_t: int,
                 num_splits: int, scale: float, entry_stride: int):
    """One program's work: query rows q0.. of sequence b (packed from row0, q_len rows), the
    `group` heads of KV head program_id(1), keys of split program_id(2). Returns the
    normalised output [M, hd] (fp32), its log-sum-exp [M], and per row of M its packed row,
    its head and whether it is a real (row, head) pair (rows past the tile's queries and the
    padded heads repeat a real one, clamped)."""
    kvh = pl.program_id(1)
    sp = pl.program_id(2)
    n_rows, _, hd = q_ref.shape
    entry = plane_index(base_ref, off_ref, entry_stride, row=b)  # (a base per sequence)
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
    return o, lse, rows, heads, (r < nq) & (g < group)


def _ragged_kernel(base_ref, off_ref, bt_ref, lens_ref, cu_ref, tseq_ref, tq0_ref, q_ref, k_ref,
                   v_ref, o_ref, lse_ref, **kw):
    """Tiles from the XLA tile map; a dense [M, hd] partial per (tile, KV head, split)."""
    j, kvh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    b = tseq_ref[j]
    row0 = cu_ref[b]
    o, lse, *_ = _attend_tile(base_ref, off_ref, bt_ref, lens_ref, q_ref, k_ref, v_ref, b,
                              tq0_ref[j], row0, cu_ref[b + 1] - row0, **kw)
    o_ref[j, kvh, sp, :, :] = o.astype(o_ref.dtype)
    lse_ref[j, kvh, sp, :] = lse


def _uniform_tile(q_len: int, block_q: int):
    """Tile j -> (sequence, first query index, first packed row) when every sequence has
    q_len rows: cdiv(q_len, block_q) tiles each, no tile map."""
    j = pl.program_id(0)
    per_seq = cdiv(q_len, block_q)
    b = lax.div(j, per_seq)
    return b, lax.rem(j, per_seq) * block_q, b * q_len


def _uniform_kernel(base_ref, off_ref, bt_ref, lens_ref, q_ref, k_ref, v_ref, *out_refs,
                    q_len: int, direct: bool, **kw):
    """Tiles by arithmetic (q_len rows per sequence). direct (one split): the output rows go
    straight to their packed [N, H, hd] places, masked to the real (row, head) pairs; else a
    dense partial per (tile, KV head, split), as _ragged_kernel."""
    b, q0, row0 = _uniform_tile(q_len, kw["block_q"])
    o, lse, rows, heads, live = _attend_tile(base_ref, off_ref, bt_ref, lens_ref, q_ref, k_ref,
                                             v_ref, b, q0, row0, q_len, **kw)
    if direct:
        (out_ref,) = out_refs
        # Whole-array indices (the CPU interpreter stores through no mix of arrays and
        # slices), and the repeated pairs sent past the last row: masked on the GPU, dropped
        # by the interpreter, which would otherwise let a repeat's old value win the scatter.
        n_rows, _, hd = out_ref.shape
        shape = (rows.shape[0], hd)
        at = (jnp.broadcast_to(jnp.where(live, rows, n_rows)[:, None], shape),
              jnp.broadcast_to(heads[:, None], shape),
              jnp.broadcast_to(lax.iota(jnp.int32, hd)[None, :], shape))
        plt.store(out_ref.at[at], o.astype(out_ref.dtype),
                  mask=jnp.broadcast_to(live[:, None], shape))
        return
    o_ref, lse_ref = out_refs
    j, kvh, sp = pl.program_id(0), pl.program_id(1), pl.program_id(2)
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
# q_len calls without the tile map (and, with one split, without the gather): the same bits
# (tests/test_ragged_uniform.py, interpret mode and its gpu tests, which passed on an H100
# in session 42) and, there, end to end against direct=0 (benchmarks --ragged-kernel
# direct=0; the same tokens): the batch-invariant mode at batch 1 native 169.0 against
# 165.8 tok/s (+1.9%; means of two runs), k=4 233.2 against 229.2; at batch 64 native
# 7,133.8 against 6,445.1 (+10.7%: there the tile map's searchsorted over 64 sequences and
# the gather cost more),
# k=4 6,539.3 against 5,996.0; the default's k=4 at batch 64 7,074.4 against 6,992.0
# (+1.2%), at batch 8 1,515.5 against 1,495.9, at batch 1 274.8 against 273.7
# (decode_direct{0,1}_*_session42_h100.json, decode_inv_noroutes{,_direct1}_session42_h100.json).
# Off (0), a q_len call runs as the cu_q_lens call it stands for.
DIRECT = 1


def ragged_paged_attention(q, k_cache, v_cache, entry, block_tables, kv_lens, cu_q_lens=None, *,
                           interpret: bool = False, block_q=None, block_t=None,
                           num_splits=None, num_warps=None, num_stages=None,
                           entry_stride: int = 1, q_len=None):
    """Packed ragged paged attention. q [N, H, hd] -> [N, H, hd] in q.dtype.

    k_cache/v_cache [E, P, page_size, KVH, hd]; entry int32 scalar, or (base, offset) with
    entry_stride as in paged_decode_attention (the base may be an int32 [B], one loop per
    sequence); block_tables [B, max_pages];
    kv_lens [B] (new tokens included); cu_q_lens [B+1] (cu_q_lens[0] == 0). Rows past
    cu_q_lens[B] return zeros. Tuning: block_q query rows per tile (power of 2; default 16
    rows of M for short queries, up to 64 for long chunks), block_t keys per step (64 for 16-bit
    caches, 32 for fp32), num_splits,
    num_warps (default 4, or 8 when M > 32), num_stages.

    q_len (a static int, instead of cu_q_lens): every sequence has q_len rows, N = B * q_len
    (the engine's decode and verification). With direct on (TUNING / DIRECT) the kernel
    finds its tile by arithmetic, without the XLA tile map, and with one split writes the
    packed output itself, without the XLA gather: two small XLA kernels fewer per call, the
    same bits.
    """
    n_rows, h, hd = q.shape
    _, _, page_size, kvh, hd_c = k_cache.shape
    assert hd == hd_c and h % kvh == 0, (q.shape, k_cache.shape)
    nseq = kv_lens.shape[0]
    _check_rows(n_rows, nseq, cu_q_lens, q_len)
    q_len = None if q_len is None else int(q_len)
    if q_len is not None and not TUNING.get("direct", DIRECT):  # (the tile map and gather)
        cu_q_lens, q_len = jnp.arange(nseq + 1, dtype=jnp.int32) * q_len, None
    group = h // kvh
    group_pad = next_pow2(group)
    block_q, block_t, num_splits, num_warps, num_stages, num_tiles = _tiling(
        dict(block_q=block_q, block_t=block_t, num_splits=num_splits, num_warps=num_warps,
             num_stages=num_stages), n_rows, nseq, kvh, group_pad, q_len, k_cache.dtype,
        block_tables.shape[1] * page_size)
    mdim = block_q * group_pad

    kw = dict(group=group, group_pad=group_pad, block_q=block_q, page_size=page_size,
              block_t=block_t, num_splits=num_splits, scale=float(hd) ** -0.5,
              entry_stride=entry_stride)
    operands = (*plane_operands(entry, entry_stride, rows=nseq), block_tables.astype(jnp.int32),
                kv_lens.astype(jnp.int32))
    if q_len is not None and num_splits == 1:
        return _direct_call(kw, q_len, num_tiles, kvh, num_warps, num_stages, interpret,
                            q.shape, q.dtype)(*operands, q, k_cache, v_cache)
    if q_len is None:
        cu = cu_q_lens.astype(jnp.int32)
        tseq, tq0, tile_begin = _tile_map(cu, num_tiles, block_q)
        kernel = functools.partial(_ragged_kernel, **kw)
        operands += (cu, tseq, tq0)
    else:
        kernel = functools.partial(_uniform_kernel, q_len=q_len, direct=False, **kw)
    call = split_partials_call(kernel, rows=num_tiles, kvh=kvh, num_splits=num_splits, m=mdim,
                               hd=hd, name="ragged_paged_attention", num_warps=num_warps,
                               num_stages=num_stages, interpret=interpret, out_dtype=q.dtype)
    o = call(*operands, q, k_cache, v_cache)  # [tiles, KVH, M, hd]
    o = o.reshape(num_tiles, kvh, block_q, group_pad, hd)
    if q_len is None:
        b, i, valid = ragged_rows(cu, n_rows)
        tile = jnp.clip(tile_begin[b] + i // block_q, 0, num_tiles - 1)
    else:
        n = jnp.arange(n_rows, dtype=jnp.int32)
        i, valid = n % q_len, None
        tile = (n // q_len) * cdiv(q_len, block_q) + i // block_q
    return _gather_rows(o, tile, i, valid, block_q, group, h, q.dtype)


def _tiling(given: dict, n_rows: int, nseq: int, kvh: int, group_pad: int, q_len,
            cache_dtype, max_tokens: int):
    """(block_q, block_t, num_splits, num_warps, num_stages, num_tiles): the arguments given,
    else TUNING's, else the defaults (ragged_paged_attention's docstring)."""
    pick = lambda key, default=None: (TUNING.get(key, default) if given[key] is None  # noqa: E731
                                      else given[key])
    block_q, block_t, num_splits = pick("block_q"), pick("block_t"), pick("num_splits")
    num_warps, num_stages = pick("num_warps"), pick("num_stages", 2)
    if block_t is None:  # fp32 tiles are twice the shared memory of bf16 ones
        block_t = 64 if jnp.dtype(cache_dtype).itemsize <= 2 else 32
    if block_q is None:  # M = block_q * group_pad rows per dot: >= 16 for the tensor cores
        target_m = 16 if cdiv(n_rows, nseq) <= 16 else 64
        block_q = max(1, target_m // group_pad)
    block_q = next_pow2(block_q)
    if q_len is None:
        num_tiles = int(min(n_rows, cdiv(n_rows, block_q) + nseq))
    else:
        num_tiles = nseq * cdiv(q_len, block_q)
    if num_splits is None:
        busy_tiles = min(num_tiles, max(nseq, cdiv(n_rows, block_q)))
        num_splits = choose_num_splits(busy_tiles * kvh, max_tokens, block_t)
    if num_warps is None:
        num_warps = 4 if block_q * group_pad <= 32 else 8
    return block_q, block_t, num_splits, num_warps, num_stages, num_tiles


def _gather_rows(o, tile, i, valid, block_q: int, group: int, h: int, dtype):
    """The packed [N, H, hd] output from the tiles o [tiles, KVH, block_q, group_pad, hd]:
    row n is query i[n] of tile tile[n]; rows not valid (None: all are) give zeros."""
    r = jnp.clip(i % block_q, 0, block_q - 1)
    hh = jnp.arange(h, dtype=jnp.int32)
    out = o[tile[:, None], (hh // group)[None, :], r[:, None], (hh % group)[None, :]]
    if valid is not None:
        out = jnp.where(valid[:, None, None], out, 0.0)
    return out.astype(dtype)


def _check_rows(n_rows: int, nseq: int, cu_q_lens, q_len) -> None:
    """cu_q_lens or q_len, exactly one; q_len a positive int with N = B * q_len."""
    if (cu_q_lens is None) == (q_len is None):
        raise ValueError("ragged_paged_attention takes cu_q_lens or q_len (every sequence "
                         "the same length), exactly one of them")
    if cu_q_lens is not None:
        return
    if isinstance(q_len, bool) or not isinstance(q_len, numbers.Integral) or q_len < 1:
        raise ValueError(f"q_len must be a positive int (rows per sequence), got {q_len!r}")
    if n_rows != nseq * q_len:
        raise ValueError(f"q_len={q_len} with {nseq} sequences needs {nseq * q_len} query "
                         f"rows, got {n_rows}")


def _direct_call(kw, q_len: int, num_tiles: int, kvh: int, num_warps: int, num_stages: int,
                 interpret: bool, shape, dtype):
    """The one-split uniform kernel writing the packed output [N, H, hd] itself. Every row of
    the output belongs to one tile and every head to one KV head's program, so each element
    is written exactly once."""
    kernel = functools.partial(_uniform_kernel, q_len=q_len, direct=True, **kw)
    return pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct(shape, dtype), grid=(num_tiles, kvh, 1),
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="ragged_paged_attention")
