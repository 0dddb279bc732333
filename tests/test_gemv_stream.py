"""The streaming GEMV (pallas_kernels/gemv_stream.py): interpret mode on CPU, compiled on a GPU."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels.gemv import gemv, gemv_normed, gemv_reference
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed

f32 = lambda a: np.asarray(a, np.float32)


def _xw(m, k, n, dtype=jnp.float32, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(dtype)
    return x, w


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,block_n,per_program", [(1, 4, 4), (3, 2, 2), (1, 1, 16), (4, 8, 1)])
def test_stream_matches_the_model_projection_fp32(m, block_n, per_program, gated):
    x, w = _xw(m, 256, 128)
    y = gemv_stream(x, w, gated=gated, interpret=True, block_n=block_n, block_k=64,
                    per_program=per_program)
    ref = gemv_reference(x, w, gated=gated)
    assert y.shape == ref.shape and y.dtype == ref.dtype
    np.testing.assert_allclose(f32(y), f32(ref), rtol=1e-5, atol=1e-5)


def test_stream_bf16_matches_the_gemv_and_the_model():
    """bf16: the same bits as gemv.py's CUDA-core path at the same block_k (same chunk order)
    and within one bf16 rounding of XLA's projection."""
    x, w = _xw(2, 512, 256, jnp.bfloat16)
    for gated in (False, True):
        y = gemv_stream(x, w, gated=gated, interpret=True, block_n=4, block_k=128, per_program=4)
        old = gemv(x, w, gated=gated, interpret=True, use_dot=False, block_n=4, block_k=128)
        np.testing.assert_array_equal(f32(y), f32(old))
        ref = f32(gemv_reference(x, w, gated=gated))
        assert np.max(np.abs(f32(y) - ref)) <= 2 ** -7 * np.max(np.abs(ref))


@pytest.mark.parametrize("prologue", ["", "norm", "add_norm"])
def test_stream_row2d_is_the_same_math(prologue):
    """row2d (rows loaded as [1, block_k] tiles) changes the register layout, not the math:
    identical results in interpret mode, every prologue, gated and not."""
    x, w = _xw(2, 256, 64, jnp.bfloat16, seed=3)
    b = (x * 0.5)[::-1]
    nw = jnp.linspace(0.5, 1.5, 256).astype(jnp.bfloat16)
    for gated in (False, True):
        kw = dict(gated=gated, interpret=True, block_n=4, block_k=64, per_program=2)
        if not prologue:
            outs = [gemv_stream(x, w, row2d=r2, **kw) for r2 in (False, True)]
        else:
            br = dict(branch=b, branch_w=nw[::-1]) if prologue == "add_norm" else {}
            outs = [gemv_stream_normed(x, nw, w, eps=1e-6, row2d=r2, **br, **kw)
                    for r2 in (False, True)]
        for a, c in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1])):
            np.testing.assert_array_equal(f32(a), f32(c))
    with pytest.raises(ValueError, match="row2d must be a bool"):
        gemv_stream(x, w, interpret=True, block_n=4, block_k=64, row2d=1)


def test_stream_rows_do_not_depend_on_row_count_or_schedule():
    """Interpreted, a row's result depends on block_k only: not on the rows in the call,
    block_n, per_program or num_warps. (Compiled, the register layout also orders the final
    sum; the GPU test checks the row count alone.)"""
    x, w = _xw(3, 256, 64, jnp.bfloat16, seed=1)
    base = f32(gemv_stream(x, w, interpret=True, block_n=2, block_k=64, per_program=2))
    for kw in (dict(block_n=8, per_program=1), dict(block_n=1, per_program=8, num_warps=2)):
        np.testing.assert_array_equal(
            f32(gemv_stream(x[1:2], w, interpret=True, block_k=64, **kw))[0], base[1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,eps", [(1, 1e-6), (2, 1e-6), (1, 0.5)])
def test_stream_norm_prologues_match_the_layer_math(dtype, gated, m, eps):
    """'norm' and 'add_norm' prologues: the same as model.rms_norm + the projection (bf16:
    bit-identical to gemv_normed on these inputs; fp32 within accumulation order), and the
    new residual stream x + rms_norm(branch, wb)."""
    from ouro_jax.model import rms_norm
    ks = jax.random.split(jax.random.PRNGKey(m), 5)
    x = jax.random.normal(ks[0], (m, 256)).astype(dtype)
    b = (jax.random.normal(ks[1], (m, 256)) * 3).astype(dtype)
    wb, wx = ((1 + 0.1 * jax.random.normal(kk, (256,))).astype(dtype) for kk in ks[2:4])
    w = (jax.random.normal(ks[4], (128, 256)) * 0.06).astype(dtype)
    kw = dict(gated=gated, interpret=True, block_n=4, block_k=64)
    if eps > 0.1:  # a large eps moves the result: the prologue must use it in both norms
        b = b * 0.1
    y, x_new = gemv_stream_normed(x, wx, w, eps=eps, branch=b, branch_w=wb, per_program=2, **kw)
    y2, same = gemv_stream_normed(x, wx, w, eps=eps, per_program=4, **kw)
    assert same is x
    x_ref = x + rms_norm(b, wb, eps)
    ref = gemv_reference(rms_norm(x_ref, wx, eps), w, gated=gated)
    ref2 = gemv_reference(rms_norm(x, wx, eps), w, gated=gated)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=0, atol=0)
    np.testing.assert_allclose(f32(x_new), f32(x_ref), **tol)
    np.testing.assert_allclose(f32(y), f32(ref), **tol)
    np.testing.assert_allclose(f32(y2), f32(ref2), **tol)
    if dtype == jnp.bfloat16:
        old, _ = gemv_normed(x, wx, w, eps=eps, branch=b, branch_w=wb, use_dot=False, **kw)
        np.testing.assert_array_equal(f32(y), f32(old))
    if eps > 0.1:  # and the eps did matter on these inputs
        tiny = gemv_reference(rms_norm(x + rms_norm(b, wb, 1e-6), wx, 1e-6), w, gated=gated)
        assert np.max(np.abs(f32(tiny) - f32(ref))) > 1e-2


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,per_program", [(1, 1), (1, 4), (2, 2)])
def test_stream_defer_norm_is_the_same_math(gated, m, per_program):
    """defer_norm: the RMS scale applied to the outputs, not the input. fp32: the layer's math
    within accumulation order (1e-5); bf16: within one rounding of the output of the
    default's bits (the input is no longer rounded before the multiply), and not bit-equal
    everywhere (else the switch would do nothing). The residual x' keeps its bits; a plain
    GEMV (no prologue) ignores the switch."""
    from ouro_jax.model import rms_norm
    ks = jax.random.split(jax.random.PRNGKey(7), 5)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(ks[0], (m, 256)).astype(dtype)
        b = (jax.random.normal(ks[1], (m, 256)) * 3).astype(dtype)
        wb, wx = ((1 + 0.1 * jax.random.normal(kk, (256,))).astype(dtype) for kk in ks[2:4])
        w = (jax.random.normal(ks[4], (128, 256)) * 0.06).astype(dtype)
        kw = dict(eps=1e-6, gated=gated, interpret=True, block_n=4, block_k=64,
                  per_program=per_program)
        for branch in (None, b):
            bk = {} if branch is None else dict(branch=branch, branch_w=wb)
            y0, x0 = gemv_stream_normed(x, wx, w, **bk, **kw)
            y1, x1 = gemv_stream_normed(x, wx, w, defer_norm=True, **bk, **kw)
            np.testing.assert_array_equal(f32(x1), f32(x0))
            if dtype == jnp.float32:
                xr = x if branch is None else x + rms_norm(b, wb, 1e-6)
                ref = gemv_reference(rms_norm(xr, wx, 1e-6), w, gated=gated)
                np.testing.assert_allclose(f32(y1), f32(ref), rtol=1e-5, atol=1e-5)
            else:
                np.testing.assert_allclose(f32(y1), f32(y0), rtol=2 ** -7, atol=2 ** -7)
                assert np.any(f32(y1) != f32(y0))
    plain = dict(interpret=True, block_n=4, block_k=64)
    np.testing.assert_array_equal(f32(gemv_stream(x, w, defer_norm=True, **plain)),
                                  f32(gemv_stream(x, w, **plain)))
    with pytest.raises(ValueError, match="defer_norm must be a bool"):
        gemv_stream_normed(x, wx, w, eps=1e-6, defer_norm=1, **plain)


@pytest.mark.parametrize("gated", [False, True])
def test_stream_fold_sums_is_the_same_math(gated, monkeypatch):
    """fold_sums: each row statistic through one reduction (the chunks' squares added first).
    The same terms in another order: fp32 within 1e-5 of the layer's math, bf16 within one
    rounding of the default (outputs and x'), for both prologues; it reaches the kernel (a
    spy on _sum_sq sees fold=True, one call per statistic per row) and a plain GEMV has no
    statistic to fold."""
    from ouro_jax.model import rms_norm
    from pallas_kernels import gemv_rows as gs
    ks = jax.random.split(jax.random.PRNGKey(11), 5)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jax.random.normal(ks[0], (2, 256)).astype(dtype)
        b = (jax.random.normal(ks[1], (2, 256)) * 3).astype(dtype)
        wb, wx = ((1 + 0.1 * jax.random.normal(kk, (256,))).astype(dtype) for kk in ks[2:4])
        w = (jax.random.normal(ks[4], (128, 256)) * 0.06).astype(dtype)
        kw = dict(eps=1e-6, gated=gated, interpret=True, block_n=4, block_k=64, per_program=2)
        for branch in (None, b):
            bk = {} if branch is None else dict(branch=branch, branch_w=wb)
            y0, x0 = gemv_stream_normed(x, wx, w, **bk, **kw)
            y1, x1 = gemv_stream_normed(x, wx, w, fold_sums=True, **bk, **kw)
            if dtype == jnp.float32:
                xr = x if branch is None else x + rms_norm(b, wb, 1e-6)
                ref = gemv_reference(rms_norm(xr, wx, 1e-6), w, gated=gated)
                np.testing.assert_allclose(f32(y1), f32(ref), rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(f32(x1), f32(xr), rtol=1e-6, atol=1e-6)
            else:
                np.testing.assert_allclose(f32(y1), f32(y0), rtol=2 ** -7, atol=2 ** -7)
                np.testing.assert_allclose(f32(x1), f32(x0), rtol=2 ** -8, atol=2 ** -8)
    seen = []
    real = gs._sum_sq
    monkeypatch.setattr(gs, "_sum_sq", lambda vs, fold: (seen.append((len(vs), fold)),
                                                         real(vs, fold))[1])
    gemv_stream_normed(x, wx, w, branch=b, branch_w=wb, fold_sums=True, **kw)
    assert seen == [(4, True)] * 4  # 2 rows x (branch, x') statistics, 4 chunks each
    vs = [jax.random.normal(kk, (64,)) for kk in jax.random.split(ks[0], 4)]
    assert float(real(vs, True)) == float(jnp.sum(((vs[0] ** 2 + vs[1] ** 2) + vs[2] ** 2)
                                                  + vs[3] ** 2))
    np.testing.assert_allclose(float(real(vs, True)), float(real(vs, False)), rtol=1e-6)
    plain = dict(interpret=True, block_n=4, block_k=64)
    np.testing.assert_array_equal(f32(gemv_stream(x, w, fold_sums=True, **plain)),
                                  f32(gemv_stream(x, w, **plain)))
    with pytest.raises(ValueError, match="fold_sums must be a bool"):
        gemv_stream_normed(x, wx, w, eps=1e-6, fold_sums=1, **plain)


def test_stream_one_chunk_block_k_equal_to_k():
    """block_k = K (session 30's fifth-round tilings for qkv and gate/up): one chunk, so
    the prologue reduces and converts once. bf16 within one rounding of four chunks, and
    fold_sums changes nothing at one chunk (the same single reduction)."""
    ks = jax.random.split(jax.random.PRNGKey(5), 4)
    x = jax.random.normal(ks[0], (1, 256)).astype(jnp.bfloat16)
    b = (jax.random.normal(ks[1], (1, 256)) * 3).astype(jnp.bfloat16)
    nw = (1 + 0.1 * jax.random.normal(ks[2], (256,))).astype(jnp.bfloat16)
    w = (jax.random.normal(ks[3], (128, 256)) * 0.06).astype(jnp.bfloat16)
    for gated in (False, True):
        kw = dict(eps=1e-6, gated=gated, interpret=True, block_n=4, per_program=2,
                  branch=b, branch_w=nw[::-1])
        y4, x4 = gemv_stream_normed(x, nw, w, block_k=64, **kw)
        y1, x1 = gemv_stream_normed(x, nw, w, block_k=256, **kw)
        yf, xf = gemv_stream_normed(x, nw, w, block_k=256, fold_sums=True, **kw)
        np.testing.assert_allclose(f32(y1), f32(y4), rtol=2 ** -7, atol=2 ** -7)
        np.testing.assert_allclose(f32(x1), f32(x4), rtol=2 ** -8, atol=2 ** -8)
        np.testing.assert_array_equal(f32(yf), f32(y1))
        np.testing.assert_array_equal(f32(xf), f32(x1))


@pytest.mark.parametrize("bad,msg", [
    (dict(block_n=3), "block_n must be a power of two"),
    (dict(block_k=96), "block_k must be a power of two"),
    (dict(num_warps=3), "num_warps must be a power of two"),
    (dict(per_program=0), "per_program must be an int"),
    (dict(per_program=3), "per_program=3 must divide the 16 output blocks"),
    (dict(block_n=4, block_k=512), "block_k=512 must divide K=256"),
    (dict(num_stages=2), "unknown gemv_stream tuning"),
    (dict(num_warps=32), "num_warps must be at most 16"),
])
def test_stream_rejects_bad_tilings(bad, msg):
    x, w = _xw(1, 256, 64)
    with pytest.raises(ValueError, match=msg):
        gemv_stream(x, w, interpret=True, **dict(dict(block_n=4, block_k=64), **bad))


def test_stream_rejects_bad_shapes():
    x, w = _xw(1, 256, 64)
    with pytest.raises(ValueError, match="shape mismatch"):
        gemv_stream(x, w[:, :128], interpret=True)
    with pytest.raises(ValueError, match="1..4 rows"):
        gemv_stream(jnp.zeros((5, 256)), w, interpret=True, block_n=4, block_k=64)
    with pytest.raises(ValueError, match="even row count"):
        gemv_stream(x, w[:63], gated=True, interpret=True)
    with pytest.raises(ValueError, match="floating-point"):
        gemv_stream(jnp.ones((1, 256), jnp.int32), w, interpret=True)
    # with no block_k given it adapts to K (512 does not divide 256), as gemv() does
    np.testing.assert_allclose(f32(gemv_stream(x, w, interpret=True, block_n=4)),
                               f32(gemv_reference(x, w)), rtol=1e-5, atol=1e-5)
    nw = jnp.ones((256,))
    with pytest.raises(ValueError, match="norm weight shape"):
        gemv_stream_normed(x, nw[:128], w, eps=1e-6, interpret=True, block_n=4, block_k=64)
    with pytest.raises(ValueError, match="together"):
        gemv_stream_normed(x, nw, w, eps=1e-6, branch=x, interpret=True, block_n=4, block_k=64)


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_stream_variants_on_the_gpu(name):
    """The engine's tiling and a few others (with and without row2d), compiled, in bf16:
    within about one bf16 rounding of XLA, and a row's bits do not depend on the call's row
    count. (Compiled, the final in-program sum's order follows the register layout, which
    block_n and num_warps set: bits can differ between tilings and from gemv.py's kernel, as
    they did in session 7's first GPU run.)"""
    from benchmarks.gemv import SHAPES, STREAM_VARIANTS
    from ouro_jax.projections import STREAM_TUNING
    from pallas_kernels.gemv_stream import check_supported
    n, k, gated = SHAPES[name]
    x, w = _xw(3, k, n, jnp.bfloat16)
    ref = f32(gemv_reference(x, w, gated=gated))
    ran = 0
    picks = [STREAM_TUNING[name], dict(STREAM_TUNING[name], row2d=True)] + [
        STREAM_VARIANTS[v] for v in ("st1_k512_p1_w4", "st4_k256_p1_w4", "st4_k256_p1_w4_x2d",
                                     "st2_k512_p2_w4", "st2_k512_p2_w4_x2d")]
    for kw in picks:
        try:
            check_supported(3, k, n // (2 if gated else 1), **kw)
        except ValueError:  # a tiling this shape does not divide
            continue
        y = f32(gemv_stream(x, w, gated=gated, **kw))
        err = np.max(np.abs(y - ref)) / np.max(np.abs(ref))
        assert err <= 8e-3, (kw, err)
        one = f32(gemv_stream(x[1:2], w, gated=gated, **kw))
        np.testing.assert_array_equal(one[0], y[1], err_msg=str(kw))
        ran += 1
    assert ran >= 5


# Tilings with more rows per program, the candidates for the add_norm projections (their
# prologue is paid once per program; docs/kernels.md), next to the engine's.
PROLOGUE_CANDIDATES = ("st2_k512_p4_w4", "st2_k512_p8_w4", "st2_k512_p16_w4", "st4_k512_p4_w4",
                       "st4_k512_p4_w8", "st8_k512_p4_w8", "st1_k512_p8_w2",
                       # third round (session 9's picks were st4_k512_p4_w4 and st2_k512_p8_w4)
                       "st4_k512_p2_w4", "st4_k512_p8_w4", "st8_k512_p2_w4", "st4_k512_p4_w2",
                       "st2_k512_p8_w2", "st8_k512_p2_w8")


def test_prologue_candidates_fit_the_add_norm_projections():
    """The GPU test's candidate tilings exist and divide the 1.4B qkv and gate/up shapes."""
    from benchmarks.gemv import SHAPES, STREAM_VARIANTS
    from pallas_kernels.gemv_stream import check_supported
    for v in PROLOGUE_CANDIDATES:
        kw = STREAM_VARIANTS[v]
        for name in ("qkv", "gate_up"):
            n, k, gated = SHAPES[name]
            check_supported(1, k, n // (2 if gated else 1), **kw)


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "gate_up"])
def test_stream_add_norm_tilings_on_the_gpu(name):
    """The add_norm prologue compiled at the engine's tiling and the candidates, one row in
    bf16: the new residual stream within one bf16 rounding of the model's ops (the row
    statistic is summed chunk by chunk and rsqrt is Triton's, so the fp32 scale can differ
    from XLA's in the last bit and flip a rounding), the projection within about one bf16
    rounding of XLA's."""
    from benchmarks.gemv import SHAPES, STREAM_VARIANTS
    from ouro_jax.model import rms_norm
    from ouro_jax.projections import STREAM_TUNING
    n, k, gated = SHAPES[name]
    x, w = _xw(1, k, n, jnp.bfloat16, seed=4)
    b = (jax.random.normal(jax.random.PRNGKey(5), (1, k)) * 3).astype(jnp.bfloat16)
    wb = jnp.full((k,), 0.7, jnp.bfloat16)
    wx = (1 + 0.1 * jax.random.normal(jax.random.PRNGKey(6), (k,))).astype(jnp.bfloat16)
    x_ref = x + rms_norm(b, wb, 1e-6)
    ref = f32(gemv_reference(rms_norm(x_ref, wx, 1e-6), w, gated=gated))
    for kw in [STREAM_TUNING[name]] + [STREAM_VARIANTS[v] for v in PROLOGUE_CANDIDATES]:
        y, x_new = gemv_stream_normed(x, wx, w, eps=1e-6, branch=b, branch_w=wb, gated=gated,
                                      **kw)
        np.testing.assert_allclose(f32(x_new), f32(x_ref), rtol=2 ** -7, atol=1e-2,
                                   err_msg=str(kw))
        err = np.max(np.abs(f32(y) - ref)) / np.max(np.abs(ref))
        assert err <= 8e-3, (kw, err)


def test_stream_spec_parses_and_routes():
    from ouro_jax.projections import STREAM_TUNING, fit_stream_tuning, parse
    p = parse("gemv+norms+stream")
    assert p.stream and p.fuse_norms and parse(p.spec) == p and "stream" in p.spec
    assert not parse("gemv").stream
    for bad in ("stream", "gemm+stream", "gemv+stream+stream", "gemv+stream+pf2"):
        with pytest.raises(ValueError, match="stream|gemv"):
            parse(bad)
    # tilings shrink to divide a small model's shape; per_program to a divisor of the blocks
    t = fit_stream_tuning(dict(block_n=2, block_k=512, per_program=4, num_warps=4), 96, 64)
    assert t == dict(block_n=2, block_k=64, per_program=4, num_warps=4)
    t = fit_stream_tuning(STREAM_TUNING["o"], 6, 64)
    assert t["block_n"] == 2 and t["per_program"] == 1  # 3 blocks: 2 does not divide
    # only one-row calls stream (STREAM_MAX_ROWS); 'gemv@5' sends 2..5 rows per block
    from engine_helpers import pallas_call_names
    x, w = _xw(3, 64, 32)
    p5 = parse("gemv@5+stream")
    assert pallas_call_names(lambda a: p5.project("o", a, w), x[:1]) == ["gemv_stream"]
    assert pallas_call_names(lambda a: p5.project("o", a, w), x) == ["gemv"]
    # 'stream@N' streams calls of up to N rows (pipelined speculation's 2-row calls)
    p2 = parse("gemv@2+norms+stream@2+inv@3-64")
    assert p2.stream_rows == 2 and parse(p2.spec) == p2 and "stream@2" in p2.spec
    assert pallas_call_names(lambda a: p2.project("o", a, w), x[:2]) == ["gemv_stream"]
    assert pallas_call_names(lambda a: p5.project("o", a, w), x[:2]) == ["gemv"]
    assert parse("gemv+stream@1") == parse("gemv+stream")
    for bad in ("gemv+stream@2", "gemv@2+stream@5", "gemv@2+stream@2+stream",
                "gemv@2+norms+stream@2+flow", "gemv@2+stream@x"):
        with pytest.raises(ValueError, match="stream"):
            parse(bad)


def test_stream_layer_kernels_and_engine_tokens():
    """'gemv+stream' runs the four projections through gemv_stream (with '+norms' the
    prologue versions); greedy decode, native and speculative, fp32: the same tokens as XLA."""
    from engine_helpers import pallas_call_names
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.model import decoder_layer, dense_causal_attend, rope_cos_sin, unstack_layers
    from ouro_jax.params import random_params
    from ouro_jax.projections import parse
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    cfg = PRESETS["tiny-mha"]
    params = random_params(cfg, 0, jnp.float32, 0.003, 0.0)
    lp = unstack_layers(params, fuse=True).layers[0]
    cos, sin = rope_cos_sin(jnp.zeros((1,), jnp.int32), cfg.head_dim, cfg.rope_theta, jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, cfg.hidden_size))

    def names(spec):
        return pallas_call_names(lambda a: decoder_layer(
            lp, a, cos, sin, cfg, dense_causal_attend, None, 0, 0, parse(spec))[0], x)
    assert names("gemv+stream") == ["gemv_stream", "gemv_stream", "gemv_stream_silu",
                                    "gemv_stream"]
    assert names("gemv+norms+stream") == ["gemv_stream_norm", "gemv_stream",
                                          "gemv_stream_silu_add_norm", "gemv_stream"]

    def rsqrts(spec):  # RMSNorm statistics left outside the Pallas kernels
        def walk(jaxpr):
            n = 0
            for e in jaxpr.eqns:
                if e.primitive.name == "pallas_call":
                    continue
                n += e.primitive.name == "rsqrt"
                for v in e.params.values():  # sub-jaxprs (jit, cond, ...) on jax 0.10 and 0.11
                    for item in v if isinstance(v, (tuple, list)) else (v,):
                        sub = getattr(item, "jaxpr", item)
                        n += walk(sub) if hasattr(sub, "eqns") else 0
            return n
        return walk(jax.make_jaxpr(lambda a: decoder_layer(
            lp, a, cos, sin, cfg, dense_causal_attend, None, 0, 0, parse(spec))[0])(x).jaxpr)
    assert rsqrts("gemv+stream") == 4 and rsqrts("gemv+norms+stream") == 0

    # The token check below runs small branches (branch scale 0.003, as the benchmark); the
    # layers' outputs themselves, at branch scale 1 where every projection moves them, must
    # match XLA too (fp32), through a whole loop with the deferred residual.
    from ouro_jax.model import run_loop
    big = unstack_layers(random_params(cfg, 1, jnp.float32, 1.0, 0.1), fuse=True)
    h0 = jax.random.normal(jax.random.PRNGKey(2), (1, 1, cfg.hidden_size))
    cos1, sin1 = rope_cos_sin(jnp.zeros((1, 1), jnp.int32), cfg.head_dim, cfg.rope_theta,
                              jnp.float32)
    ref_h, _ = run_loop(big, h0, cos1, sin1, cfg, dense_causal_attend, None, 0)
    for spec in ("gemv+stream", "gemv+norms+stream"):
        h, _ = run_loop(big, h0, cos1, sin1, cfg, dense_causal_attend, None, 0, parse(spec))
        np.testing.assert_allclose(np.asarray(h), np.asarray(ref_h), rtol=2e-5, atol=2e-5,
                                   err_msg=spec)

    sp = [SamplingParams(max_tokens=10, ignore_eos=True)]
    out = {}
    for p in ("xla", "gemv+stream", "gemv+norms+stream"):
        llm = Ouro(cfg, params, None, attention="xla", projections=p, decode_chunk=8)
        out[p] = (llm.generate([[3, 1, 4]], sp).outputs[0].token_ids,
                  llm.generate([[3, 1, 4]], sp, speculative=SpeculativeConfig(4, 2))
                  .outputs[0].token_ids)
    assert llm.backend == "xla+gemv+norms+stream"
    assert out["xla"] == out["gemv+stream"] == out["gemv+norms+stream"]
    assert out["xla"][0] == out["xla"][1]


@pytest.mark.parametrize("per_program", [1, 2])
def test_defer_norm_keeps_the_late_pdl_trigger_and_prefetch(per_program):
    """defer_norm peels the first block off the loop; at one block per program that block is
    the last, so the late PDL trigger (pdl="end") and the late L2 prefetch of next_w
    (next_at="end") must still be emitted: lowered for 'cuda', the same count of each as
    without defer_norm."""
    from pallas_kernels.gemv_stream import gemv_stream_normed
    from test_pdl import TRIGGER, triton_ir
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16

    def count(defer):
        def f(x, b, bw, nw, w, nxt):
            return gemv_stream_normed(x, nw, w, eps=1e-6, branch=b, branch_w=bw,
                                      defer_norm=defer, block_n=4, block_k=64,
                                      per_program=per_program, pdl="end", next_w=nxt,
                                      next_rows=2)
        [ir] = triton_ir(f, s((1, 128), bf), s((1, 128), bf), s((128,), bf), s((128,), bf),
                         s((64, 128), bf), s((256, 128), bf))
        return ir.count(TRIGGER), ir.count("prefetch.L2")
    base = count(False)
    assert base[0] >= 1 and base[1] >= 1
    assert count(True) == base
