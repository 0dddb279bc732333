"""Plain-JAX paged attention: the oracle for the Pallas kernels and the engine's "xla" backend.

Cache layout (fixed by the engine):
  k_cache, v_cache  [E, P, page_size, KVH, head_dim]   E = loops * layers planes, P pages
  block_tables      [B, max_pages_per_seq] int32        physical page ids (page 0 = trash page)
  kv_lens           [B] int32                            valid tokens, new query tokens included
  entry             int32 scalar (traced)               which plane to read
Token p of sequence b lives at page block_tables[b, p // page_size], slot p % page_size.

Both functions gather the sequence's pages with ONE XLA gather straight out of the full cache
(`cache[entry, block_tables]`: the plane is never sliced out, so it is never copied), then run
masked fp32 softmax attention with GQA (query head h reads KV head h // group).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

NEG_INF = -1e30  # finite "minus infinity": keeps empty rows NaN-free


def gather_pages(cache: jax.Array, entry, block_tables: jax.Array, kv_lens=None) -> jax.Array:
    """[E, P, ps, KVH, hd] -> [B, max_pages * ps, KVH, hd] for plane `entry` (one gather).

    With kv_lens, slots at positions >= kv_len read as 0 (stale or trash-page data, even NaN,
    must not leak through 0 * NaN in p @ v); XLA fuses the select into the gather.
    """
    _, _, ps, kvh, hd = cache.shape
    b, max_pages = block_tables.shape
    kv = cache[jnp.asarray(entry, jnp.int32), block_tables]  # [B, maxp, ps, KVH, hd]
    kv = kv.reshape(b, max_pages * ps, kvh, hd)
    if kv_lens is not None:
        valid = jnp.arange(max_pages * ps, dtype=jnp.int32)[None, :] < kv_lens[:, None]
        kv = jnp.where(valid[:, :, None, None], kv, jnp.zeros((), kv.dtype))
    return kv


def _softmax_pv(s: jax.Array, mask: jax.Array, v: jax.Array, v_spec: str, out_spec: str):
    """Masked fp32 softmax of scores s, then p @ v; fully masked rows give zeros.

    out_spec names the output axes with 'd' = head_dim; the scores use 't' in its place.
    """
    s = jnp.where(mask, s, NEG_INF)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(l > 0, l, 1.0)
    # 16-bit caches: p in the cache dtype with fp32 accumulation (as the kernels do).
    pv_dtype = v.dtype if jnp.dtype(v.dtype).itemsize == 2 else jnp.float32
    s_spec = out_spec.replace("d", "t")
    return jnp.einsum(f"{s_spec},{v_spec}->{out_spec}", p.astype(pv_dtype), v.astype(pv_dtype),
                      preferred_element_type=jnp.float32, precision=_precision(pv_dtype))


def _precision(dtype):
    """fp32 in full precision (GPU default for fp32 matmuls is TF32); 16-bit as is."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def paged_decode_attention_reference(q, k_cache, v_cache, entry, block_tables, kv_lens):
    """q [B, H, hd] (one query per sequence, at position kv_len - 1) -> [B, H, hd] in q.dtype."""
    b, h, hd = q.shape
    kvh = k_cache.shape[3]
    group = h // kvh
    k = gather_pages(k_cache, entry, block_tables)  # [B, T, KVH, hd]
    v = gather_pages(v_cache, entry, block_tables, kv_lens)
    t = k.shape[1]
    qg = q.reshape(b, kvh, group, hd)
    cdt = jnp.promote_types(q.dtype, k.dtype)
    s = jnp.einsum("bkgd,btkd->bkgt", qg.astype(cdt), k.astype(cdt),
                   preferred_element_type=jnp.float32, precision=_precision(cdt)) * (hd ** -0.5)
    mask = (jnp.arange(t, dtype=jnp.int32)[None, :] < kv_lens[:, None])[:, None, None, :]
    o = _softmax_pv(s, mask, v, "btkd", "bkgd")
    return o.reshape(b, h, hd).astype(q.dtype)


def ragged_rows(cu_q_lens: jax.Array, n_rows: int):
    """For each packed row n: (sequence b, index i inside the sequence's queries, valid)."""
    nseq = cu_q_lens.shape[0] - 1
    n = jnp.arange(n_rows, dtype=jnp.int32)
    b = jnp.searchsorted(cu_q_lens[1:], n, side="right").astype(jnp.int32)
    b = jnp.minimum(b, nseq - 1)
    i = n - cu_q_lens[b]
    valid = n < cu_q_lens[nseq]
    return b, i, valid


def ragged_paged_attention_reference(q, k_cache, v_cache, entry, block_tables, kv_lens, cu_q_lens,
                                     *, max_q_len: Optional[int] = None):
    """Packed multi-query paged attention.

    q [N, H, hd]; sequence b owns rows cu_q_lens[b]:cu_q_lens[b+1]; its query i is at position
    kv_lens[b] - q_len_b + i and sees keys at positions <= its own. Returns [N, H, hd] in q.dtype;
    rows past cu_q_lens[B] are zeros.

    max_q_len (static): an upper bound on every q_len_b. The queries are laid out padded as
    [B, max_q_len], so the work is B * max_q_len * context; the default (N) is always correct
    but wasteful when B > 1: pass k+1 for verification or the chunk size for chunked prefill.
    """
    n_rows, h, hd = q.shape
    nseq = kv_lens.shape[0]
    kvh = k_cache.shape[3]
    group = h // kvh
    qm = n_rows if max_q_len is None else int(max_q_len)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    ii = jnp.arange(qm, dtype=jnp.int32)
    idx = jnp.clip(cu_q_lens[:-1, None] + ii[None, :], 0, n_rows - 1)  # [B, Qm]
    qp = q[idx].reshape(nseq, qm, kvh, group, hd)
    pos = (kv_lens - q_lens)[:, None] + ii[None, :]  # [B, Qm]

    k = gather_pages(k_cache, entry, block_tables)  # [B, T, KVH, hd]
    v = gather_pages(v_cache, entry, block_tables, kv_lens)
    t = jnp.arange(k.shape[1], dtype=jnp.int32)
    cdt = jnp.promote_types(q.dtype, k.dtype)
    s = jnp.einsum("bqkgd,btkd->bkgqt", qp.astype(cdt), k.astype(cdt),
                   preferred_element_type=jnp.float32, precision=_precision(cdt)) * (hd ** -0.5)
    mask = (t[None, None, :] <= pos[:, :, None]) & (t[None, None, :] < kv_lens[:, None, None])
    mask = mask[:, None, None, :, :]  # [B, 1, 1, Qm, T]
    o = _softmax_pv(s, mask, v, "btkd", "bkgqd")  # [B, KVH, G, Qm, hd]
    o = o.transpose(0, 3, 1, 2, 4).reshape(nseq, qm, h, hd)

    b, i, valid = ragged_rows(cu_q_lens, n_rows)
    out = o[b, jnp.clip(i, 0, qm - 1)]
    return jnp.where(valid[:, None, None], out, 0.0).astype(q.dtype)
