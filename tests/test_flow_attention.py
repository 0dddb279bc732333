"""gemv_flow's attention stage (pallas_kernels/flow_attention.py): the bits of the decode
kernel it runs (paged_decode_attention_qkv with the split merge in the kernel), the new
token's K/V written as that kernel writes them, the whole layer in one kernel equal to the
engine's kernels one by one (benchmarks.flow_layer's arms, small shapes), the wait before
its first read in the kernel lowered for 'cuda', and its errors. Interpret mode (CPU):
programs run in index order, so every wait is already met."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import pytest

from paged_cases import fused_write_case
from pallas_kernels import paged_decode_attention_qkv
from pallas_kernels.flow_attention import AttnStage, FlatView  # noqa: F401
from pallas_kernels.gemv_flow import Stage, gemv_flow, mlp_stages, state_for
from pallas_kernels.gemv_stream import gemv_stream

O_TILE = dict(block_n=2, block_k=16, per_program=2)


def _attn_case(dtype, kvh, group, kv_lens, rope, seed=5):
    rng = np.random.default_rng(seed)
    (qkv, k, v, bt, lens), (page, slot), _ = fused_write_case(
        rng, dtype, kvh, group, kv_lens, hd=16, page_size=4)
    m, hd = qkv.shape[0], qkv.shape[2]
    r = (lambda: jnp.asarray(rng.standard_normal((m, hd)), dtype)) if rope else None
    w_o = jnp.asarray(rng.standard_normal((32, kvh * group * hd)) / 8, dtype)
    return dict(qkv=qkv, k=k, v=v, bt=bt, lens=lens, page=jnp.asarray(page),
                slot=jnp.asarray(slot), rope=(r(), r()) if rope else None, w_o=w_o)


def _stage(c, **kw):
    kvh = c["k"].shape[3]
    return AttnStage(c["k"], c["v"], jnp.int32(2), c["bt"], c["lens"], c["page"], c["slot"],
                     jnp.zeros((c["qkv"].shape[0], kvh), jnp.int32), rope=c["rope"],
                     trash_page=0, block_t=4, **kw)


def _same(got, want):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype,group,splits,rope", [
    (jnp.float32, 1, 3, True), (jnp.bfloat16, 4, 2, True), (jnp.bfloat16, 1, 1, False),
    (jnp.float32, 2, 4, False)])
def test_attention_then_o_matches_the_decode_kernel_and_the_gemv(dtype, group, splits, rope):
    """[attention, o] on the packed qkv: the attention output has the bits of
    paged_decode_attention_qkv(counters=) at the same block_t and splits (one split: its
    unmerged path), o has gemv_stream's; the caches hold the same new K/V (the slot held NaN
    before), the padding row (kv_len 0, trash page) writes nothing and gives zeros; the merge
    counters and the state come back at zero."""
    c = _attn_case(dtype, 2, group, [0, 6, 13], rope)
    m = c["qkv"].shape[0]
    want, k2, v2, *_ = paged_decode_attention_qkv(
        c["qkv"], c["k"], c["v"], jnp.int32(2), c["bt"], c["lens"], c["page"], c["slot"],
        rope=c["rope"], trash_page=0, interpret=True, block_t=4, num_splits=splits,
        counters=jnp.zeros((m, 2), jnp.int32))
    want = want.reshape(m, -1)
    stages = [_stage(c, num_splits=splits), Stage(c["w_o"], tiling=O_TILE, name="o")]
    ys, xs, state, [(kc, vc, cnt)] = gemv_flow(c["qkv"].reshape(m, -1), stages, state_for(2),
                                               interpret=True)
    assert xs == [] and ys[0].shape == want.shape and ys[0].dtype == dtype
    _same(ys[0], want)
    _same(ys[1], gemv_stream(want, c["w_o"], interpret=True, **O_TILE))
    _same(kc, k2)  # NaN where the stale slots were, in both
    _same(vc, v2)
    assert np.all(np.asarray(ys[0][0], np.float32) == 0)
    assert not np.asarray(cnt).any() and not np.asarray(state).any()


def _layer_case(seed=0):
    from benchmarks.flow_layer import kv_case
    from benchmarks.gemv_flow import _freeze, weights
    rng = np.random.default_rng(seed)
    ws = weights(2, k=128, inter=192, seed=seed)
    a = lambda: jnp.asarray(rng.standard_normal((1, 128)), jnp.bfloat16)
    tiling = _freeze(dict(o=dict(block_n=2, block_k=64, per_program=2),
                          gate_up=dict(block_n=2, block_k=64, per_program=3),
                          down=dict(block_n=1, block_k=64, per_program=4),
                          qkv=dict(block_n=4, block_k=64, per_program=2)))
    new = lambda: kv_case(2, ctx=37, kvh=2, hd=64)  # (caches, fixed): one plane per layer
    return ws, a(), a(), tiling, new


def test_the_whole_layer_in_one_kernel_matches_the_engines_kernels():
    """benchmarks.flow_layer's arms at small shapes (bf16, two layers, each its own plane):
    o -> gate/up -> down -> next qkv -> its attention as one gemv_flow per layer ('flow5')
    gives the attention output, the residual and the written caches of the engine's kernels
    one by one with the split merge in the attention kernel, as does '+flow4' + the
    attention kernel; the XLA combine's output ('separate') is the same math. Then under jit
    with the caches and the state donated and threaded, a second token one position on (its
    own page and slot): the same as the separate kernels' second call, state back at zero."""
    from benchmarks import flow_layer as fl
    ws, attn, h, t, new = _layer_case()
    fx = new()[1]
    kv_case_at = lambda ctx: fl.kv_case(2, ctx=ctx, kvh=2, hd=64)[1]
    ref_attn, ref_h, ref_caches = fl.separate(ws, attn, h, new()[0], fx, t, True, True)
    xla_attn = fl.separate(ws, attn, h, new()[0], fx, t, False, True)[0]
    np.testing.assert_allclose(np.asarray(xla_attn, np.float32),
                               np.asarray(ref_attn, np.float32), atol=2e-2, rtol=2e-2)
    fx2 = kv_case_at(38)
    ref2 = fl.separate(ws, attn, h, ref_caches, fx2, t, True, True)
    f = jax.jit(lambda c, s, x, st: fl.flow(ws, attn, h, c, s, x, t, st, (), True),
                static_argnums=3, donate_argnums=(0, 1))
    for stages in (4, 5):
        caches, state = new()[0], state_for(stages)
        for want in ((ref_attn, ref_h, ref_caches), ref2):
            out, h2, caches, state = f(caches, state, fx if want[0] is ref_attn else fx2,
                                       stages)
            for got, w in zip((out, h2, *caches), (want[0], want[1], *want[2]), strict=True):
                _same(got, w)
            assert not np.asarray(state).any()


def test_the_attention_stage_waits_before_its_first_read():
    """Lowered for 'cuda' (Triton IR), [qkv, attention, o]: in the attention stage's region
    the thread-0 spin on the qkv stage's count (with its trap) comes before every load
    (nothing is read before its input is complete), the split merge's counter atomic and the
    done count follow its stores, and the cache write is there (a scatter of hd values)."""
    from test_gemv_flow import _regions
    from test_pdl import triton_ir
    s, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    k, kvh, hd = 128, 2, 64
    kc = s((3, 8, 16, kvh, hd), bf)

    def f(x, w_q, w_o, kc_, vc_, bt, lens, page, slot, cnt, cos, sin, st):
        stages = [Stage(w_q, tiling=dict(block_n=4, block_k=64, per_program=2), name="qkv"),
                  AttnStage(kc_, vc_, jnp.int32(1), bt, lens, page, slot, cnt,
                            rope=(cos, sin), trash_page=0, block_t=16, num_splits=2),
                  Stage(w_o, tiling=dict(block_n=2, block_k=64, per_program=2), name="o")]
        return gemv_flow(x, stages, st, trap=True)
    [ir] = triton_ir(f, s((1, k), bf), s((3 * k, k), bf), s((k, k), bf), kc, kc,
                     s((1, 8), i32), s((1,), i32), s((1,), i32), s((1,), i32), s((1, kvh), i32),
                     s((1, hd), bf), s((1, hd), bf), s((state_for(3).shape[0],), i32))
    *stages, _stray = _regions(ir)
    assert len(stages) == 3
    attn = stages[1]
    spin = next(i for i, ln in enumerate(attn) if "W_LOOP" in ln)
    assert not any("tt.load" in ln for ln in attn[:spin]), "a read before the wait"
    assert "trap;" in attn[spin]
    assert any("tt.load" in ln for ln in attn[spin:])
    stores = [i for i, ln in enumerate(attn) if "tt.store" in ln]
    atomics = [i for i, ln in enumerate(attn) if "tt.atomic_rmw add" in ln]
    # the merge counter's atomic after the partials' stores, the merged output's store
    # between it and the done count, which follows every store
    merge, done = atomics[0], atomics[-1]
    assert len(atomics) == 2 and min(stores) < merge < done and max(stores) < done
    assert any(merge < i < done for i in stores)
    assert any(f"tensor<{hd}x!tt.ptr<bf16>>" in attn[i] for i in stores)  # the K/V write


def test_flat_view_indexes_like_the_3d_array():
    """FlatView: ints, broadcast int arrays and trailing full slices address the flat row as
    the same index would address its [M, *inner] reshape (read and write)."""
    x = jnp.arange(2 * 24, dtype=jnp.float32).reshape(2, 24)
    want = x.reshape(2, 2, 3, 4)

    def kernel(x_ref, o_ref):
        v, o = FlatView(x_ref, (2, 3, 4)), FlatView(o_ref, (2, 3, 4))
        rows = (lax.iota(jnp.int32, 3) + 2) % 3  # [2, 0, 1] (no captured constants)
        o[1, 0, rows, :] = v[1, 1, rows, :]  # [3, 4]
        o[0, 1, :, :] = v[0, 0, :, :]
        o[0, 0, rows[:, None], (3 - lax.iota(jnp.int32, 4))[None, :]] = v[1, 0, :, :]
        o[1, 1, 2, :] = v[0, 1, 0, :]

    from jax.experimental import pallas as pl
    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                         interpret=True)(x)
    got = np.asarray(out).reshape(2, 2, 3, 4)
    w = np.asarray(want)
    np.testing.assert_array_equal(got[1, 0, [2, 0, 1]], w[1, 1, [2, 0, 1]])
    np.testing.assert_array_equal(got[0, 1], w[0, 0])
    np.testing.assert_array_equal(got[0, 0][np.ix_([2, 0, 1], [3, 2, 1, 0])], w[1, 0])
    np.testing.assert_array_equal(got[1, 1, 2], w[0, 1, 0])


def test_bad_attention_stages_are_named():
    c = _attn_case(jnp.float32, 2, 1, [3, 6], True)
    x = c["qkv"].reshape(2, -1)
    o = Stage(c["w_o"], tiling=O_TILE, name="o")
    run = lambda stages, **kw: gemv_flow(x, stages, state_for(len(stages)), interpret=True,
                                         **kw)
    with pytest.raises(ValueError, match="order 'ticket' or 'program_id'"):
        run([_stage(c), o], order="guess")
    with pytest.raises(ValueError, match="counters must be int32 \\[2, 2\\]"):
        run([_stage(c)._replace(counters=jnp.zeros((2, 1), jnp.int32)), o])
    with pytest.raises(ValueError, match="stage 0 \\(attention\\).*not H \\+ 2 KVH heads"):
        gemv_flow(x[:, :-16], [_stage(c), o], state_for(2), interpret=True)
    with pytest.raises(ValueError, match="rope's cos and sin must be \\[2, 16\\]"):
        run([_stage(c)._replace(rope=(c["rope"][0][:1], c["rope"][1])), o])
    with pytest.raises(ValueError, match="num_stages must be an int in 1..4"):
        run([_stage(c), o], num_stages=0)
    with pytest.raises(ValueError, match="attention stage reads the next layer's qkv"):
        mlp_stages(c["w_o"], None, None, None, None, attention=_stage(c))


def test_the_layer_benchmark_refuses_unknown_arms_and_a_cpu():
    from benchmarks.flow_layer import main
    from engine_helpers import has_gpu
    with pytest.raises(SystemExit):
        main(["--arms", "flow9"])
    with pytest.raises(SystemExit):
        main(["--layers", "0"])
    if has_gpu():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="needs a GPU"):
        main(["--layers", "1"])
