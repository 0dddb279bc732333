"""The decode kernel's fused paths, interpret mode (CPU): the new token's K/V write, RoPE,
and the split merge done by the kernel itself (last_combine). Cases: paged_cases.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_cases import assert_rope_equal, check, fused_write_case
from pallas_kernels import paged_decode_attention_qkv, paged_decode_attention_reference


@pytest.mark.parametrize("dtype,kvh,group,kw", [
    (jnp.float32, 2, 1, dict(block_t=4, num_splits=3)),
    (jnp.bfloat16, 2, 4, dict(block_t=4, num_splits=2)),
    (jnp.bfloat16, 2, 1, dict(block_t=4, num_splits=1)),
    # one split reading the whole context in one tile wider than it (the longest row has 23
    # keys), or in two: session 31's prepared batch-1 arms (block_t 256 / 128 at 192 keys)
    (jnp.bfloat16, 2, 1, dict(block_t=32, num_splits=1)),
    (jnp.float32, 2, 1, dict(block_t=16, num_splits=1)),
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


def test_offline_compile_lowers_the_batch1_tilings(monkeypatch):
    """`python -m pallas_kernels.offline_compile --decode-b1` (the sm_90 pre-flight of the
    batch-1 attention tilings the next GPU call times): each lowers to one Triton kernel at
    the 1.4B shapes, and the tag names the split and block it resolved to (the default
    splits a 13-page table six ways at 32 keys; the others run unsplit)."""
    from engine_helpers import offline_compile_tags
    from pallas_kernels import offline_compile as oc
    tags = [(tag, n, kw["num_warps"])
            for tag, n, kw in offline_compile_tags(monkeypatch, oc.check_decode_b1)]
    assert tags == [("decode b1 block_t 32 splits 6 warps 4", 1, 4),
                    ("decode b1 block_t 256 splits 1 warps 4", 1, 4),
                    ("decode b1 block_t 256 splits 1 warps 8", 1, 8),
                    ("decode b1 block_t 128 splits 1 warps 4", 1, 4),
                    ("decode b1 block_t 128 splits 1 warps 8", 1, 8)]
