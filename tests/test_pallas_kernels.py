"""Paged-attention kernels vs the plain-JAX reference, and the reference vs a NumPy oracle.

CPU: the Pallas kernels run in interpret mode on tiny shapes. Every test poisons the trash
page 0 and every slot at or past kv_len with NaN, so a kernel that reads a slot it must not
(or lets 0 * NaN through) fails. The GPU tests (marked `gpu`) compiling the real Triton
kernels are in test_pallas_kernels_gpu.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import pallas_call_eqns
from pallas_kernels import (paged_decode_attention, paged_decode_attention_qkv,
                            paged_decode_attention_reference, ragged_paged_attention,
                            ragged_paged_attention_reference)


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


# ---------------------------------------------------------------- reference vs NumPy oracle
def test_reference_decode_matches_numpy():
    rng = np.random.default_rng(0)
    q, k, v, bt, lens = make_case(rng, kv_lens=[0, 1, 4, 9], kvh=2, group=2, hd=8, page_size=4,
                                  dtype=jnp.float32)
    out = np.asarray(paged_decode_attention_reference(q, k, v, 1, bt, lens))
    tables = np.asarray(bt)
    for b, n in enumerate(np.asarray(lens)):
        want = numpy_attention(np.asarray(q)[b:b + 1], [n - 1], seq_kv(k, 1, tables, b, n),
                               seq_kv(v, 1, tables, b, n), 2)
        np.testing.assert_allclose(out[b:b + 1], want, atol=2e-5)


def test_reference_ragged_matches_numpy():
    rng = np.random.default_rng(1)
    q_lens, kv_lens = [2, 0, 1, 4], [6, 3, 1, 4]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q, k, v, bt, lens = make_case(rng, kv_lens=kv_lens, kvh=1, group=2, hd=8, page_size=2,
                                  dtype=jnp.float32, n_q=int(cu[-1]) + 2)
    out = np.asarray(ragged_paged_attention_reference(q, k, v, 2, bt, lens, jnp.asarray(cu),
                                                      max_q_len=4))
    tables = np.asarray(bt)
    for b in range(len(q_lens)):
        rows = slice(cu[b], cu[b + 1])
        pos = [kv_lens[b] - q_lens[b] + i for i in range(q_lens[b])]
        want = numpy_attention(np.asarray(q)[rows], pos, seq_kv(k, 2, tables, b, kv_lens[b]),
                               seq_kv(v, 2, tables, b, kv_lens[b]), 2)
        np.testing.assert_allclose(out[rows], want, atol=2e-5)
    assert np.all(out[cu[-1]:] == 0)


# ---------------------------------------------------------------- kernels, interpret mode (CPU)
# kv_lens: empty, single token, exact page ends (4, 8), ragged, > one split
DECODE_CASES = [
    # (dtype, kvh, group, kwargs)
    (jnp.float32, 2, 1, dict(block_t=4, num_splits=2)),                  # MHA, dot path, split
    (jnp.float32, 2, 1, dict(block_t=4, num_splits=1, use_dot=False, rowwise=True)),
    (jnp.bfloat16, 1, 2, dict(block_t=8, num_splits=3, use_dot=False)),  # CUDA-core path
    (jnp.bfloat16, 2, 4, dict(block_t=4, num_splits=2)),                 # GQA 4, dot path
    # One split (the batch-64 default): the kernel writes bf16 and only the real rows.
    (jnp.bfloat16, 2, 1, dict(block_t=4, num_splits=1)),
    (jnp.bfloat16, 2, 4, dict(block_t=4, num_splits=1)),
]


@pytest.mark.parametrize("dtype,kvh,group,kw", DECODE_CASES)
def test_decode_kernel_interpret(dtype, kvh, group, kw):
    rng = np.random.default_rng(2)
    q, k, v, bt, lens = make_case(rng, kv_lens=[0, 1, 4, 8, 13, 23], kvh=kvh, group=group, hd=16,
                                  page_size=4, dtype=dtype)
    out = paged_decode_attention(q, k, v, jnp.int32(2), bt, lens, interpret=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    check(out, paged_decode_attention_reference(q, k, v, 2, bt, lens), dtype)
    assert np.all(np.asarray(out[0], np.float32) == 0)  # kv_len 0 -> zeros


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


@pytest.mark.parametrize("dtype,kvh,group,kw", [
    (jnp.float32, 2, 1, dict(block_t=4, num_splits=3)),
    (jnp.bfloat16, 2, 4, dict(block_t=4, num_splits=2)),
    (jnp.bfloat16, 2, 1, dict(block_t=4, num_splits=1)),
])
def test_decode_kernel_with_fused_kv_write(dtype, kvh, group, kw):
    """paged_decode_attention_qkv writes the new token's K/V into the cache (the slot held
    NaN, so reading it instead of using the registers would poison the output) and attends to
    it; the result matches attention over the written cache, every other slot is untouched,
    and the padding row (kv_len 0, trash page) writes nothing and gives zeros."""
    rng = np.random.default_rng(7)
    (qkv, k, v, bt, lens), (page, slot), (q, k_want, v_want) = fused_write_case(
        rng, dtype, kvh, group, [0, 1, 4, 8, 13, 23], hd=16, page_size=4)
    out, k2, v2 = paged_decode_attention_qkv(qkv, k, v, jnp.int32(2), bt, lens, page, slot,
                                             trash_page=0, interpret=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    check(out, paged_decode_attention_reference(q, k_want, v_want, 2, bt, lens), dtype)
    assert np.all(np.asarray(out[0], np.float32) == 0)
    for got, want in ((k2, k_want), (v2, v_want)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype,kvh,group,splits", [
    (jnp.float32, 2, 1, 3), (jnp.bfloat16, 2, 4, 2), (jnp.bfloat16, 2, 1, 4),
    (jnp.bfloat16, 2, 1, 1),
])
def test_decode_kernel_merges_splits_itself(dtype, kvh, group, splits):
    """counters: the last split program merges the partials (no XLA combine). The output
    matches the reference (and the XLA combine's result to fp32 rounding: the same math in
    another summation order), the cache is written as before, and the counters come back at
    zero for the next call (one split: nothing to merge, the counters pass through)."""
    rng = np.random.default_rng(5)
    (qkv, k, v, bt, lens), (page, slot), (q, k_want, v_want) = fused_write_case(
        rng, dtype, kvh, group, [0, 1, 4, 8, 13, 23], hd=16, page_size=4)
    args = (qkv, k, v, jnp.int32(2), bt, lens, page, slot)
    kw = dict(trash_page=0, interpret=True, block_t=4, num_splits=splits)
    counters = jnp.zeros((6, kvh), jnp.int32)
    out, k2, v2, cnt = paged_decode_attention_qkv(*args, counters=counters, **kw)
    xla_out, _, _ = paged_decode_attention_qkv(*args, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_array_equal(np.asarray(cnt), np.zeros((6, kvh), np.int32))
    check(out, paged_decode_attention_reference(q, k_want, v_want, 2, bt, lens), dtype)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(xla_out, np.float32),
                               rtol=tol, atol=tol)
    assert np.all(np.asarray(out[0], np.float32) == 0)
    for got, want in ((k2, k_want), (v2, v_want)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_decode_kernel_counters_are_checked():
    rng = np.random.default_rng(5)
    (qkv, k, v, bt, lens), (page, slot), _ = fused_write_case(
        rng, jnp.float32, 2, 1, [1, 4], hd=16, page_size=4)
    with pytest.raises(ValueError, match="counters must be int32 \\[2, 2\\]"):
        paged_decode_attention_qkv(qkv, k, v, jnp.int32(2), bt, lens, page, slot,
                                   counters=jnp.zeros((2, 1), jnp.int32), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_kernel_with_fused_rope(dtype):
    """rope=(cos, sin): q and the new k arrive unrotated; the kernel rotates both as
    model.apply_rope does (the written key: see assert_rope_equal) and attends as the
    unfused path would."""
    from ouro_jax.model import apply_rope, rope_cos_sin
    rng = np.random.default_rng(11)
    kv_lens = [0, 1, 4, 8, 13, 23]
    (qkv, k, v, bt, lens), (page, slot), (q, k_want, v_want) = fused_write_case(
        rng, dtype, 2, 2, kv_lens, hd=16, page_size=4)
    cos, sin = rope_cos_sin(jnp.asarray(np.maximum(np.asarray(kv_lens) - 1, 0)), 16, 10000.0,
                            dtype)
    h = q.shape[1]
    out, k2, _ = paged_decode_attention_qkv(qkv, k, v, jnp.int32(2), bt, lens, page, slot,
                                            rope=(cos, sin), trash_page=0, interpret=True,
                                            block_t=4)
    # The oracle is the jitted model function (XLA's fusion of it), as the +kvxla path runs it.
    rot = jax.jit(lambda x: apply_rope(x[:, None], cos[:, None], sin[:, None])[:, 0])
    q_rot, k_rot = rot(qkv[:, :h]), rot(qkv[:, h:h + 2])
    real = np.asarray(kv_lens) > 0
    assert_rope_equal(k2[2, page[real], slot[real]], k_rot[real], dtype)
    k_want = k_want.at[2, page[real], slot[real]].set(k_rot[real])
    check(out, paged_decode_attention_reference(q_rot, k_want, v_want, 2, bt, lens), dtype)


def assert_rope_equal(got, want, dtype):
    """bf16: bit-identical (every op is rounded to bf16 in both). fp32: XLA may contract
    x*cos + r*sin into an FMA, so within an ulp or two."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if dtype == jnp.bfloat16:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_fused_kv_write_padding_rows_and_trash_page_none():
    """A padding row (trash page) with kv_len 1 writes nothing and attends to nothing, as on
    the XLA path (output 0); with trash_page=None page 0 is an ordinary page and is written."""
    rng = np.random.default_rng(12)
    (qkv, k, v, bt, lens), (page, slot), (q, k_want, v_want) = fused_write_case(
        rng, jnp.float32, 2, 1, [1, 6], hd=16, page_size=4)
    trash = jnp.asarray([0, page[1]], jnp.int32)  # row 0 aimed at the trash page
    out, k2, _ = paged_decode_attention_qkv(qkv, k, v, 2, bt, lens, trash, slot, trash_page=0,
                                            interpret=True)
    assert np.all(np.asarray(out[0]) == 0)
    assert np.isnan(np.asarray(k2[2, 0])).all()  # trash page untouched (still NaN)
    _, k3, _ = paged_decode_attention_qkv(qkv, k, v, 2, bt, lens, trash, slot, interpret=True)
    np.testing.assert_array_equal(np.asarray(k3[2, 0, slot[0]]), np.asarray(qkv[0, 2:4]))


def test_fused_kv_write_rejects_bad_input():
    rng = np.random.default_rng(8)
    (qkv, k, v, bt, lens), (page, slot), _ = fused_write_case(
        rng, jnp.float32, 2, 1, [3, 5], hd=16, page_size=4)
    with pytest.raises(ValueError, match="H \\+ 2 KVH"):
        paged_decode_attention_qkv(qkv[:, :3], k, v, 2, bt, lens, page, slot, interpret=True)
    with pytest.raises(ValueError, match="page .* and slot"):
        paged_decode_attention_qkv(qkv, k, v, 2, bt, lens, page[:1], slot, interpret=True)
    with pytest.raises(ValueError, match="tensor-core path"):
        paged_decode_attention_qkv(qkv, k, v, 2, bt, lens, page, slot, interpret=True,
                                   use_dot=False)
    with pytest.raises(ValueError, match="batch size"):
        paged_decode_attention_qkv(qkv, k, v, 2, bt, lens[:1], page, slot, interpret=True)
    with pytest.raises(ValueError, match="rowwise=False"):
        paged_decode_attention_qkv(qkv, k, v, 2, bt, lens, page, slot, interpret=True,
                                   rowwise=True)
    with pytest.raises(ValueError, match="cos"):
        paged_decode_attention_qkv(qkv, k, v, 2, bt, lens, page, slot, interpret=True,
                                   rope=(jnp.ones((2, 8)), jnp.ones((2, 8))))


RAGGED_CASES = [
    # (dtype, kvh, group, q_lens, kv_lens, kwargs)
    (jnp.float32, 2, 1, [0, 1, 5, 3, 8], [2, 1, 8, 12, 8], dict(block_q=4, block_t=4, num_splits=2)),
    (jnp.bfloat16, 1, 2, [3, 3, 3], [3, 7, 16], dict(block_t=4)),        # verification-like
    (jnp.bfloat16, 2, 4, [6, 1], [17, 9], dict(block_t=8, num_splits=1)),
]


@pytest.mark.parametrize("dtype,kvh,group,q_lens,kv_lens,kw", RAGGED_CASES)
def test_ragged_kernel_interpret(dtype, kvh, group, q_lens, kv_lens, kw):
    rng = np.random.default_rng(3)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    n_q = int(cu[-1]) + 3  # padding rows
    q, k, v, bt, lens = make_case(rng, kv_lens=kv_lens, kvh=kvh, group=group, hd=16, page_size=4,
                                  dtype=dtype, n_q=n_q)
    out = ragged_paged_attention(q, k, v, jnp.int32(1), bt, lens, cu, interpret=True, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = ragged_paged_attention_reference(q, k, v, 1, bt, lens, cu)
    check(out[: int(cu[-1])], ref[: int(cu[-1])], dtype)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))


def test_plane_given_as_base_and_offset():
    """entry=(base, offset) with entry_stride reads plane base * stride + offset, as the engine
    passes (loop, layer) with stride num_layers; both kernels, traced base included."""
    rng = np.random.default_rng(4)
    q, k, v, bt, lens = make_case(rng, kv_lens=[5, 9], kvh=2, group=2, hd=16, page_size=4,
                                  dtype=jnp.float32, planes=5)
    want = paged_decode_attention_reference(q, k, v, 3, bt, lens)
    for entry, stride in (((1, 1), 2), ((0, 3), 4), (3, 1)):
        got = jax.jit(lambda base, q: paged_decode_attention(
            q, k, v, (base, entry[1]) if isinstance(entry, tuple) else base, bt, lens,
            entry_stride=stride, interpret=True, block_t=4))(
                jnp.int32(entry[0] if isinstance(entry, tuple) else entry), q)
        check(got, want, jnp.float32)
    cu = jnp.array([0, 1, 2], jnp.int32)
    got = ragged_paged_attention(q, k, v, (jnp.int32(1), 1), bt, lens, cu, entry_stride=2,
                                 interpret=True, block_t=4)
    check(got, want, jnp.float32)
    with pytest.raises(ValueError, match="entry_stride"):
        paged_decode_attention(q, k, v, (1, 1), bt, lens, entry_stride=0, interpret=True)
    with pytest.raises(ValueError, match="plain entry"):  # a scalar is the plane itself
        paged_decode_attention(q, k, v, 1, bt, lens, entry_stride=3, interpret=True)


class _StrictRef:
    """A NumPy-backed stand-in for a kernel ref whose reads fail when an index is out of
    bounds (interpret mode would clamp them silently; a GPU would read past the buffer)."""

    def __init__(self, a):
        self.a = np.asarray(a)
        self.shape = self.a.shape

    def __getitem__(self, idx):
        idx = tuple(i if isinstance(i, slice) else np.asarray(i) for i in idx)
        for dim, i in zip(self.shape, idx):
            if not isinstance(i, slice) and (np.any(i < 0) or np.any(i >= dim)):
                raise IndexError(f"index {i.max()} out of bounds for size {dim}")
        return jnp.asarray(self.a[idx])


def test_kv_block_reads_stay_inside_the_block_table():
    """A padded prefill chunk can end past the block table (kv_len = chunk end): the page
    lookup is clamped to the table's last column instead of reading past it."""
    from pallas_kernels._common import load_kv_block

    cache = np.arange(2 * 5 * 4 * 1 * 2, dtype=np.float32).reshape(2, 5, 4, 1, 2)
    bt = _StrictRef(np.array([[3, 1]], np.int32))  # 2 pages of 4 tokens: positions 0..7
    t = jnp.arange(6, 14)  # keys of a chunk ending at 14 > 8
    k, v = load_kv_block(_StrictRef(cache), _StrictRef(cache), bt, 1, 0, 0, t, 13, 4)
    assert k.shape == (8, 2)
    np.testing.assert_array_equal(np.asarray(k[:2]), cache[1, 1, 2:4, 0])  # positions 6, 7


@pytest.mark.parametrize("group,splits,want_dtype", [(1, 1, jnp.bfloat16), (4, 1, jnp.bfloat16),
                                                     (1, 3, jnp.float32)])
def test_decode_kernel_writes_only_real_rows(group, splits, want_dtype):
    """The tensor-core path pads the query tile to 16 rows; the kernel's output holds only the
    `group` real rows, and with one split it is already in the query dtype (no slice or
    convert kernel after every attention call on the GPU)."""
    rng = np.random.default_rng(3)
    q, k, v, bt, lens = make_case(rng, kv_lens=[5, 9], kvh=2, group=group, hd=16, page_size=4,
                                  dtype=jnp.bfloat16)
    fn = lambda q, k, v, bt, lens: paged_decode_attention(q, k, v, jnp.int32(1), bt, lens,
                                                          interpret=True, num_splits=splits)
    (eqn,) = pallas_call_eqns(fn, q, k, v, bt, lens)
    (o_shape, o_dtype), (lse_shape, _) = [(v.aval.shape, v.aval.dtype) for v in eqn.outvars]
    assert o_shape == (2, 2, splits, group, 16) and lse_shape == (2, 2, splits, group)
    assert o_dtype == want_dtype


def test_decode_equals_ragged_with_one_query():
    rng = np.random.default_rng(4)
    q, k, v, bt, lens = make_case(rng, kv_lens=[5, 1, 12], kvh=2, group=1, hd=16, page_size=4,
                                  dtype=jnp.float32)
    cu = jnp.arange(4, dtype=jnp.int32)
    a = paged_decode_attention_reference(q, k, v, 0, bt, lens)
    b = ragged_paged_attention_reference(q, k, v, 0, bt, lens, cu, max_q_len=1)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.parametrize("batch", [1, 16])
@pytest.mark.parametrize("fused", [True, False])
def test_decode_layer_fuses_rope_and_kv_write(batch, fused):
    """A pallas decode layer (C = 1) with the fused qkv: with fused_kv_write (the default)
    it has no XLA scatter (K/V write) and no concatenate (RoPE's rotate_half) left; with the
    XLA path ('+kvxla') it has both."""
    from ouro_jax.attention import make_paged_attend
    from ouro_jax.config import PRESETS
    from ouro_jax.model import decoder_layer, rope_cos_sin, unstack_layers
    from ouro_jax.params import random_params

    cfg = PRESETS["tiny-gqa"]
    lp = unstack_layers(random_params(cfg, 0, jnp.float32, 0.003, 0.0), fuse=True).layers[0]
    shape = (2, 1 + batch * 2, 4, cfg.num_key_value_heads, cfg.head_dim)
    planes = (jnp.zeros(shape), jnp.zeros(shape))
    tables = 1 + jnp.arange(batch * 2, dtype=jnp.int32).reshape(batch, 2)
    positions = jnp.full((batch, 1), 5, jnp.int32)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, jnp.float32)
    attend = make_paged_attend(cfg, tables, positions, 4, "pallas", fused_kv_write=fused)
    assert hasattr(attend, "qkv") == fused
    x = jnp.ones((batch, 1, cfg.hidden_size))
    jaxpr = jax.make_jaxpr(lambda x, p: decoder_layer(lp, x, cos, sin, cfg, attend, p,
                                                      jnp.int32(0), 0))(x, planes)
    names = {e.primitive.name for e in jaxpr.jaxpr.eqns}  # the layer's top-level ops
    assert ("scatter" in names) != fused and ("concatenate" in names) != fused, names


@pytest.mark.parametrize("rows,dtype,splits", [
    (1, jnp.bfloat16, 8), (2, jnp.bfloat16, 4), (8, jnp.bfloat16, 4), (8, jnp.float32, 8)])
def test_decode_block_default_is_32_keys_at_one_row(rows, dtype, splits):
    """decode.SMALL_BATCH_ROWS: 16-bit caches take 32-key blocks at one row and 64 above
    (fp32 always 32). Seen through the split count: a 256-token table caps the splits at
    256 / block_t (one block per split), below what the GPU-filling target asks here."""
    from engine_helpers import pallas_call_eqns
    from pallas_kernels import decode as dk
    assert dk.SMALL_BATCH_ROWS == 1
    kc = jnp.zeros((1, 16, 16, 1, 16), dtype)
    bt = jnp.zeros((rows, 16), jnp.int32)
    lens = jnp.full((rows,), 200, jnp.int32)
    q = jnp.zeros((rows, 1, 16), dtype)
    (eqn,) = pallas_call_eqns(
        lambda q: dk.paged_decode_attention(q, kc, kc, 0, bt, lens, interpret=True), q)
    assert eqn.params["grid_mapping"].grid == (rows, 1, splits)
