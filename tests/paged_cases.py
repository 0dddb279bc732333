"""Paged-attention test cases shared by the kernel tests (CPU and GPU): NaN-poisoned paged
caches, a NumPy oracle and the tolerance check."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def make_case(rng, *, kv_lens, kvh, group, hd, page_size, dtype, planes=3, n_q=None,
              spare_pages=3):
    """Cache [E, P, ps, KVH, hd] with shuffled non-contiguous pages; NaN in page 0 and past kv_len."""
    kv_lens = np.asarray(kv_lens, np.int32)
    nseq = len(kv_lens)
    max_pages = max(1, int(-(-kv_lens.max() // page_size))) + 1  # one spare table column
    n_pages = 1 + nseq * max_pages + spare_pages
    shape = (planes, n_pages, page_size, kvh, hd)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    perm = rng.permutation(np.arange(1, n_pages))[: nseq * max_pages]
    tables = perm.reshape(nseq, max_pages).astype(np.int32)
    for b in range(nseq):  # unused table columns point at the trash page, as in the engine
        tables[b, -(-kv_lens[b] // page_size):] = 0
        stale = np.arange(kv_lens[b], max_pages * page_size)
        pages, slots = tables[b, stale // page_size], stale % page_size
        k[:, pages, slots] = np.nan  # stale slots of the last page (page 0 gets NaN below)
        v[:, pages, slots] = np.nan
    k[:, 0] = np.nan
    v[:, 0] = np.nan
    h = kvh * group
    q_shape = (nseq, h, hd) if n_q is None else (n_q, h, hd)
    q = rng.standard_normal(q_shape, dtype=np.float32)
    cast = lambda x: jnp.asarray(x, dtype)
    return cast(q), cast(k), cast(v), jnp.asarray(tables), jnp.asarray(kv_lens)


def numpy_attention(q_rows, positions, k_seq, v_seq, group):
    """fp64 oracle for one sequence: q_rows [n, H, hd] at positions [n]; k/v [T, KVH, hd]."""
    n, h, hd = q_rows.shape
    out = np.zeros((n, h, hd))
    for i in range(n):
        for head in range(h):
            keys = k_seq[: positions[i] + 1, head // group].astype(np.float64)
            vals = v_seq[: positions[i] + 1, head // group].astype(np.float64)
            if len(keys) == 0:
                continue
            s = keys @ q_rows[i, head].astype(np.float64) * hd ** -0.5
            p = np.exp(s - s.max())
            out[i, head] = (p / p.sum()) @ vals
    return out


def seq_kv(cache, entry, tables, b, length):
    ps = cache.shape[2]
    c = np.asarray(cache.astype(jnp.float32))
    return np.stack([c[entry, tables[b, p // ps], p % ps] for p in range(length)]) if length else \
        np.zeros((0,) + c.shape[3:])


def check(out, ref, dtype):
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert np.all(np.isfinite(out)), "non-finite output"
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-6)
    assert err < TOL[dtype], err


def fused_write_case(rng, dtype, kvh, group, kv_lens, hd, page_size):
    """A decode case whose newest token (kv_len - 1) is not in the cache yet: its slot holds
    NaN. Returns the case with q replaced by the packed qkv [B, H + 2 KVH, hd] of the new
    token, its (page, slot) (trash page for rows with kv_len 0), and the cache as it should
    be after the write."""
    q, k, v, bt, lens = make_case(rng, kv_lens=kv_lens, kvh=kvh, group=group, hd=hd,
                                  page_size=page_size, dtype=dtype)
    pos = np.maximum(np.asarray(kv_lens) - 1, 0)
    real = np.asarray(kv_lens) > 0
    page = np.where(real, np.asarray(bt)[np.arange(len(pos)), pos // page_size], 0)
    page, slot = page.astype(np.int32), (pos % page_size).astype(np.int32)
    k_new = jnp.where(real[:, None, None], k[2, page, slot], 0)  # the true values
    v_new = jnp.where(real[:, None, None], v[2, page, slot], 0)
    poisoned = lambda c: c.at[2, page[real], slot[real]].set(jnp.nan)
    qkv = jnp.concatenate([q, k_new, v_new], axis=1)
    return (qkv, poisoned(k), poisoned(v), bt, lens), (page, slot), (q, k, v)


def assert_rope_equal(got, want, dtype):
    """bf16: bit-identical (every op is rounded to bf16 in both). fp32: XLA may contract
    x*cos + r*sin into an FMA, so within an ulp or two."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
