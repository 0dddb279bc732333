"""Paged-attention kernels vs the plain-JAX reference, and the reference vs a NumPy oracle.

CPU: the Pallas kernels run in interpret mode on tiny shapes. Every test poisons the trash
page 0 and every slot at or past kv_len with NaN, so a kernel that reads a slot it must not
(or lets 0 * NaN through) fails. The GPU tests (marked `gpu`) compiling the real Triton
kernels are in test_pallas_kernels_gpu.py, the decode kernel's fused K/V write, RoPE and
split merge in test_decode_fused_write.py, the shared cases in paged_cases.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import pallas_call_eqns
from paged_cases import check, make_case, numpy_attention, seq_kv
from pallas_kernels import (paged_decode_attention, paged_decode_attention_reference,
                            ragged_paged_attention, ragged_paged_attention_reference)


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


@pytest.mark.parametrize("rows,dtype,use_dot,warps", [
    (1, jnp.bfloat16, True, 4), (2, jnp.bfloat16, True, 2), (8, jnp.bfloat16, True, 2),
    (8, jnp.float16, True, 2), (8, jnp.float32, True, 4), (8, jnp.bfloat16, False, 4)])
def test_decode_default_tiling(rows, dtype, use_dot, warps, monkeypatch):
    """The decode kernel's defaults: 32-key blocks at every batch size, seen through the split
    count (a 256-token table caps the splits at 256 / block_t = 8, one block per split, below
    what the GPU-filling target asks here); 4 warps at one row, for fp32 caches and on the
    CUDA-core path (use_dot=False), decode.MULTI_ROW_WARPS (2) for 16-bit caches on the
    tensor-core path from 2 rows up. TUNING and the call's arguments override both."""
    from engine_helpers import pallas_call_eqns
    from pallas_kernels import decode as dk
    assert dk.WIDE_BLOCK_T == 32 and dk.MULTI_ROW_WARPS == 2
    kc = jnp.zeros((1, 16, 16, 1, 16), dtype)
    bt = jnp.zeros((rows, 16), jnp.int32)
    lens = jnp.full((rows,), 200, jnp.int32)
    q = jnp.zeros((rows, 1, 16), dtype)

    def params(**kw):
        (eqn,) = pallas_call_eqns(lambda q: dk.paged_decode_attention(
            q, kc, kc, 0, bt, lens, interpret=True, use_dot=use_dot, **kw), q)
        return eqn.params["grid_mapping"].grid, eqn.params["compiler_params"].num_warps

    monkeypatch.setattr(dk, "TUNING", {})
    # (the CUDA-core path's block: 64 keys for one query per KV head, as before)
    splits = 8 if use_dot else 4
    assert params() == ((rows, 1, splits), warps)
    assert params(num_warps=8, block_t=64) == ((rows, 1, 4), 8)
    monkeypatch.setattr(dk, "TUNING", {"num_warps": 1, "block_t": 128})
    assert params() == ((rows, 1, 2), 1)
