"""The ragged kernel's q_len form (every sequence the same number of query rows, as the
engine's decode and verification): the same bits as the cu_q_lens form, the reference's
values, no XLA tile map or gather with one split, and clear errors.

CPU: the kernels run in interpret mode on tiny shapes, over paged_cases' caches (NaN in the
trash page and past every kv_len, so a stray read shows)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu, pallas_call_eqns, primitives_outside_kernels
from paged_cases import check, make_case
from pallas_kernels import ragged, ragged_paged_attention, ragged_paged_attention_reference

CASES = [
    # (dtype, kvh, group, q_len, nseq, kwargs): decode rows, verification rows, tiles cut
    # inside a sequence, padded GQA groups (3 -> 4), several splits (the gather path)
    (jnp.bfloat16, 2, 1, 1, 3, dict(num_splits=1)),
    (jnp.bfloat16, 1, 2, 5, 2, dict(block_q=2, num_splits=1)),
    (jnp.bfloat16, 2, 3, 5, 3, dict(block_q=4, num_splits=1, block_t=8)),
    (jnp.float32, 2, 4, 3, 2, dict(num_splits=2, block_t=4)),
    (jnp.float32, 2, 1, 5, 3, dict(block_q=2, num_splits=2, block_t=4)),  # 3 tiles a sequence
    (jnp.bfloat16, 2, 1, 5, 2, dict()),
]


def _bits(x):
    return np.asarray(x).view(np.uint16 if x.dtype == jnp.bfloat16 else np.uint32)


@pytest.mark.parametrize("dtype,kvh,group,q_len,nseq,kw", CASES)
def test_q_len_gives_the_cu_q_lens_bits(dtype, kvh, group, q_len, nseq, kw, monkeypatch):
    rng = np.random.default_rng(5)
    kv_lens = q_len + rng.integers(0, 20, nseq)
    q, k, v, bt, lens = make_case(rng, kv_lens=kv_lens, kvh=kvh, group=group, hd=16,
                                  page_size=4, dtype=dtype, n_q=nseq * q_len)
    cu = jnp.arange(nseq + 1, dtype=jnp.int32) * q_len
    monkeypatch.setitem(ragged.TUNING, "direct", 1)
    want = ragged_paged_attention(q, k, v, jnp.int32(1), bt, lens, cu, interpret=True, **kw)
    got = ragged_paged_attention(q, k, v, jnp.int32(1), bt, lens, q_len=q_len, interpret=True,
                                 **kw)
    assert got.shape == q.shape and got.dtype == q.dtype
    np.testing.assert_array_equal(_bits(got), _bits(want))
    check(got, ragged_paged_attention_reference(q, k, v, 1, bt, lens, cu), dtype)


def _xla_ops(fn, *args) -> set:
    return primitives_outside_kernels(jax.make_jaxpr(fn)(*args).jaxpr)


def test_one_split_q_len_runs_no_tile_map_and_no_gather(monkeypatch):
    rng = np.random.default_rng(6)
    q, k, v, bt, lens = make_case(rng, kv_lens=[7, 12], kvh=2, group=2, hd=16, page_size=4,
                                  dtype=jnp.bfloat16, n_q=6)
    cu = jnp.array([0, 3, 6], jnp.int32)
    monkeypatch.setitem(ragged.TUNING, "direct", 1)
    run = lambda **kw: (lambda q: ragged_paged_attention(
        q, k, v, jnp.int32(1), bt, lens, interpret=True, num_splits=1, **kw))
    direct = _xla_ops(run(q_len=3), q)
    mapped = _xla_ops(run(cu_q_lens=cu), q)
    assert "gather" in mapped and "cumsum" in mapped  # the test sees the XLA kernels it counts
    assert not {"gather", "cumsum", "searchsorted", "select_n"} & direct, direct
    assert len(pallas_call_eqns(run(q_len=3), q)) == 1
    # direct=0 (the benchmarks' A/B arm) brings the tile map and gather back; the shipped
    # default (ragged.DIRECT) is the direct store
    monkeypatch.setitem(ragged.TUNING, "direct", 0)
    assert "gather" in _xla_ops(run(q_len=3), q)
    monkeypatch.delitem(ragged.TUNING, "direct")
    assert ragged.DIRECT == 1 and "gather" not in _xla_ops(run(q_len=3), q)


def test_engine_attention_calls_the_kernel_by_q_len(monkeypatch):
    """attention.py's ragged calls (verification; every call in the batch-invariant mode)
    pass q_len, so they get the direct store (ragged.DIRECT)."""
    from ouro_jax import attention
    seen = []
    real = ragged_paged_attention

    def spy(*a, **kw):
        seen.append((kw.get("q_len"), kw.get("cu_q_lens")))
        return real(*a, **kw)
    monkeypatch.setattr("pallas_kernels.ragged_paged_attention", spy)
    from ouro_jax.config import OuroConfig
    cfg = OuroConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     total_ut_steps=2)
    rng = np.random.default_rng(7)
    _, k, v, bt, _ = make_case(rng, kv_lens=[9, 6], kvh=2, group=2, hd=8, page_size=4,
                               dtype=jnp.float32, planes=4)
    positions = jnp.array([[6, 7, 8], [3, 4, 5]], jnp.int32)
    attend = attention.make_paged_attend(cfg, bt, positions, 4, backend="pallas")
    q = jnp.asarray(rng.standard_normal((2, 3, 4, 8)), jnp.float32)
    out = attend.ragged(q.reshape(6, 4, 8), (k, v), jnp.int32(1), 0)
    assert out.shape == (2, 3, 4, 8) and seen == [(3, None)]


@pytest.mark.parametrize("args,match", [
    (dict(), "exactly one"),
    (dict(cu_q_lens=jnp.array([0, 2, 4], jnp.int32), q_len=2), "exactly one"),
    (dict(q_len=0), "positive int"),
    (dict(q_len=2.0), "positive int"),
    (dict(q_len=True), "positive int"),
    (dict(q_len=np.int64(3)), "needs 6 query rows, got 4"),  # numpy ints are ints
    (dict(q_len=3), "needs 6 query rows, got 4"),
])
def test_bad_row_arguments_are_refused_by_name(args, match):
    rng = np.random.default_rng(8)
    q, k, v, bt, lens = make_case(rng, kv_lens=[4, 5], kvh=1, group=2, hd=8, page_size=4,
                                  dtype=jnp.float32, n_q=4)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(q, k, v, jnp.int32(1), bt, lens, interpret=True, **args)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nseq,q_len,group,kw", [
    (1, 1, 1, dict(num_splits=1, block_q=16)),   # the batch-invariant mode's decode, batch 1
    (64, 1, 1, dict(num_splits=1, block_q=16)),  # and batch 64
    (64, 5, 1, dict(num_splits=1, block_q=16)),  # its k=4 verification
    (64, 5, 1, dict()),                          # the default's verification, its own tuning
    (1, 5, 1, dict()),                           # batch 1: several splits, the gather path
    (8, 5, 3, dict(num_splits=1, block_q=4)),    # GQA, padded heads masked, 2 tiles a sequence
])
def test_gpu_q_len_gives_the_cu_q_lens_bits(nseq, q_len, group, kw, monkeypatch):
    """The compiled Triton kernels at head_dim 128 (bf16, 16-key pages; the 1.4B shapes: 16
    KV heads, no GQA): the direct store's masked scatter writes every real (row, head) once,
    bit-equal to the tile map and gather."""
    rng = np.random.default_rng(9)
    kv_lens = q_len + rng.integers(100, 300, nseq)
    q, k, v, bt, lens = make_case(rng, kv_lens=kv_lens, kvh=16 // group, group=group, hd=128,
                                  page_size=16, dtype=jnp.bfloat16, n_q=nseq * q_len)
    cu = jnp.arange(nseq + 1, dtype=jnp.int32) * q_len
    monkeypatch.setitem(ragged.TUNING, "direct", 1)
    want = jax.jit(lambda *a: ragged_paged_attention(*a, cu, **kw))(
        q, k, v, jnp.int32(1), bt, lens)
    got = jax.jit(lambda *a: ragged_paged_attention(*a, q_len=q_len, **kw))(
        q, k, v, jnp.int32(1), bt, lens)
    np.testing.assert_array_equal(_bits(got), _bits(want))
    check(got, ragged_paged_attention_reference(q, k, v, 1, bt, lens, cu), jnp.bfloat16)
