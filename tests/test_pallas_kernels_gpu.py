"""The paged-attention kernels compiled for the GPU (marked `gpu`, skipped without one):
the real Triton kernels at head_dim 128 against the plain-JAX reference. Their CPU
(interpret-mode) tests and the shared case builders are in test_pallas_kernels.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels import (paged_decode_attention, paged_decode_attention_qkv,
                            paged_decode_attention_reference, ragged_paged_attention,
                            ragged_paged_attention_reference)
from paged_cases import assert_rope_equal, check, fused_write_case, make_case

gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")


# ---------------------------------------------------------------- real kernels on the GPU
def _gpu_case(seed, dtype, kvh, group, kv_lens, page_size=16, n_q=None):
    return make_case(np.random.default_rng(seed), kv_lens=kv_lens, kvh=kvh, group=group, hd=128,
                     page_size=page_size, dtype=dtype, n_q=n_q, planes=2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kvh,group", [(jnp.bfloat16, 16, 1), (jnp.bfloat16, 4, 4),
                                             (jnp.bfloat16, 2, 16), (jnp.float32, 16, 1),
                                             (jnp.float32, 4, 4)])
def test_decode_kernel_gpu(dtype, kvh, group):
    kv_lens = [0, 1, 16, 17, 300, 1024, 2047, 2100]
    q, k, v, bt, lens = _gpu_case(5, dtype, kvh, group, kv_lens)
    for kw in (dict(), dict(num_splits=7, block_t=32, num_stages=3),
               dict(use_dot=False, rowwise=(group == 1), num_splits=3)):
        if not kw.get("use_dot", True) and group > 4:  # CUDA-core path: small groups only
            continue
        out = jax.jit(lambda *a: paged_decode_attention(*a, **kw))(q, k, v, jnp.int32(1), bt, lens)
        check(out, paged_decode_attention_reference(q, k, v, 1, bt, lens), dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kvh,group", [(jnp.bfloat16, 16, 1), (jnp.bfloat16, 4, 4)])
def test_decode_kernel_merges_splits_itself_gpu(dtype, kvh, group):
    """The compiled last-program combine (atomics and CTA barriers): over 20 calls with a
    fresh query each (a partial read before its store landed would hold the previous call's
    values), batch 1 and 8, default and 7 splits, the output matches the XLA combine's to
    bf16 rounding and the counters are back at zero after every call."""
    kv_lens = [0, 1, 16, 17, 300, 1024, 2047, 2100]
    case, (page, slot), _ = fused_write_case(np.random.default_rng(9), dtype, kvh, group,
                                             kv_lens, hd=128, page_size=16)
    qkv, k, v, bt, lens = case
    rng = np.random.default_rng(3)
    for rows in (slice(7, 8), slice(0, 8)):
        for kw in (dict(), dict(num_splits=7, block_t=32)):
            # Every array is an argument: closed over, the caches would be compiled in as
            # constants (hundreds of MB), which stalls XLA's compile for minutes.
            args = (k, v, jnp.int32(2), bt[rows], lens[rows], page[rows], slot[rows])
            merged = jax.jit(lambda q, c, *a: paged_decode_attention_qkv(
                q, *a, trash_page=0, counters=c, **kw))
            xla = jax.jit(lambda q, *a: paged_decode_attention_qkv(q, *a, trash_page=0, **kw))
            counters = jnp.zeros((lens[rows].shape[0], kvh), jnp.int32)
            for _ in range(20):
                q = jnp.asarray(rng.standard_normal(qkv[rows].shape), dtype)
                out, _, _, counters = merged(q, counters, *args)
                want = xla(q, *args)[0]
                np.testing.assert_allclose(np.asarray(out, np.float32),
                                           np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
                assert not np.any(np.asarray(counters))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kvh,group", [(jnp.bfloat16, 16, 1), (jnp.bfloat16, 4, 4),
                                             (jnp.float32, 16, 1)])
def test_decode_kernel_with_fused_kv_write_gpu(dtype, kvh, group):
    """The compiled fused-write kernel: the write lands, the rest of the cache is untouched,
    and the output matches attention over the written cache (default and 7-split tilings);
    with rope the written key equals XLA's apply_rope bit for bit."""
    from ouro_jax.model import apply_rope, rope_cos_sin
    kv_lens = [0, 1, 16, 17, 300, 1024, 2047, 2100]
    case, (page, slot), (q, k_want, v_want) = fused_write_case(
        np.random.default_rng(9), dtype, kvh, group, kv_lens, hd=128, page_size=16)
    qkv, k, v, bt, lens = case
    ref = paged_decode_attention_reference(q, k_want, v_want, 2, bt, lens)
    for kw in (dict(), dict(num_splits=7, block_t=32)):
        f = jax.jit(lambda *a: paged_decode_attention_qkv(*a, trash_page=0, **kw))
        out, k2, v2 = f(qkv, k, v, jnp.int32(2), bt, lens, page, slot)
        check(out, ref, dtype)
        for got, want in ((k2, k_want), (v2, v_want)):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    cos, sin = rope_cos_sin(jnp.asarray(np.maximum(np.asarray(kv_lens) - 1, 0)), 128, 1e6, dtype)
    f = jax.jit(lambda *a: paged_decode_attention_qkv(*a[:8], rope=a[8:], trash_page=0))
    out, k2, _ = f(qkv, k, v, jnp.int32(2), bt, lens, page, slot, cos, sin)
    h = q.shape[1]
    rot = lambda x: apply_rope(x[:, None], cos[:, None], sin[:, None])[:, 0]
    real = np.asarray(kv_lens) > 0
    k_rot = rot(qkv[:, h:h + kvh])
    assert_rope_equal(k2[2, page[real], slot[real]], k_rot[real], dtype)
    k_want = k_want.at[2, page[real], slot[real]].set(k_rot[real])
    check(out, paged_decode_attention_reference(rot(qkv[:, :h]), k_want, v_want, 2, bt, lens),
          dtype)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype,kvh,group", [(jnp.bfloat16, 16, 1), (jnp.bfloat16, 4, 4),
                                             (jnp.float32, 16, 1)])
def test_ragged_kernel_gpu(dtype, kvh, group):
    q_lens = [5, 5, 1, 0, 64, 300, 5]
    kv_lens = [5, 900, 1, 10, 2048, 300, 2100]
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q, k, v, bt, lens = _gpu_case(6, dtype, kvh, group, kv_lens, n_q=int(cu[-1]) + 7)
    ref = ragged_paged_attention_reference(q, k, v, 1, bt, lens, cu)
    for kw in (dict(), dict(block_q=32, num_splits=1), dict(num_splits=4, block_t=32)):
        out = jax.jit(lambda *a: ragged_paged_attention(*a, **kw))(q, k, v, jnp.int32(1), bt, lens, cu)
        check(out[: int(cu[-1])], ref[: int(cu[-1])], dtype)
        assert np.all(np.isfinite(np.asarray(out, np.float32)))
