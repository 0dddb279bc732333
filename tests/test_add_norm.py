"""pallas_kernels.add_norm: the batch-invariant mode's residual add and RMSNorms, one row
per program. Against the XLA oracle (model.rms_norm, gemm.sum_splits), a row's bits alone
and among others, the split-K partials' order, and refusals. Interpret mode on the CPU; the
`gpu` test compiles it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels.add_norm import add_norm, reference

EPS = 1e-6


def _operands(m, k, dtype, splits=1, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    x = jax.random.normal(ks[0], (m, k), jnp.float32).astype(dtype)
    shape = (m, splits * k)
    b = jax.random.normal(ks[1], shape, jnp.float32) * 3
    b = b if splits > 1 else b.astype(dtype)
    wb = (1 + 0.1 * jax.random.normal(ks[2], (k,))).astype(dtype)
    wx = (1 + 0.1 * jax.random.normal(ks[3], (k,))).astype(dtype)
    return x, b, wb, wx


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("k,splits", [(64, 1), (48, 1), (64, 3), (48, 4)])
def test_matches_xla_and_rows_stand_alone(dtype, k, splits):
    """bf16: the same bits as XLA's model.rms_norm on the CPU (the roundings are the
    model's); fp32 within 2e-6. Any row's outputs alone equal its outputs among 7 (48: K
    padded). In interpret mode every program runs apart, so there this pins the wrapper
    (padding, slicing, the row mapping); the `gpu` test checks the compiled kernel."""
    x, b, wb, wx = _operands(7, k, dtype, splits)
    interp = not has_gpu()
    h, y = add_norm(x, wx, eps=EPS, branch=b, branch_w=wb, interpret=interp)
    hr, yr = reference(x, wx, eps=EPS, branch=b, branch_w=wb)
    tol = 0 if dtype == jnp.bfloat16 and not has_gpu() else 2e-6
    for got, want in ((h, hr), (y, yr)):
        assert got.dtype == dtype and got.shape == (7, k)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=tol, atol=tol)
    for r in (0, 3, 6):
        h1, y1 = add_norm(x[r:r + 1], wx, eps=EPS, branch=b[r:r + 1], branch_w=wb,
                          interpret=interp)
        np.testing.assert_array_equal(np.asarray(h1), np.asarray(h[r:r + 1]))
        np.testing.assert_array_equal(np.asarray(y1), np.asarray(y[r:r + 1]))


def test_norm_only_and_add_only():
    x, b, wb, wx = _operands(5, 64, jnp.bfloat16)
    h, y = add_norm(x, wx, eps=EPS, interpret=True)
    assert h is x
    np.testing.assert_array_equal(np.asarray(y), np.asarray(reference(x, wx, eps=EPS)[1]))
    h, y = add_norm(x, None, eps=EPS, branch=b, branch_w=wb, interpret=True)
    assert y is None
    np.testing.assert_array_equal(
        np.asarray(h), np.asarray(reference(x, None, eps=EPS, branch=b, branch_w=wb)[0]))


def test_partials_are_added_left_to_right():
    """Three partials p0 = 1, p1 = 2^-24, p2 = 2^-24 in fp32: (p0 + p1) + p2 rounds to 1
    twice, p0 + (p1 + p2) gives 1 + 2^-23. The branch must come out as the left-to-right
    sum (gemm.sum_splits): with a pairwise or right-to-left order the h row changes."""
    k = 16
    x = jnp.zeros((1, k), jnp.float32)
    col = jnp.zeros((1, k), jnp.float32).at[0, 0].set(1.0).at[0, 1].set(1.0)
    tiny = col.at[0, 0].set(2.0 ** -24).at[0, 1].set(0.0)
    parts = jnp.concatenate([col, tiny, tiny], axis=1)
    w = jnp.ones((k,), jnp.float32)
    h, _ = add_norm(x, None, eps=0.0, branch=parts, branch_w=w, interpret=True)
    # left to right, both columns hold 1.0 exactly, so they normalise to the same value
    assert float(h[0, 0]) == float(h[0, 1])
    h_tree, _ = reference(x, None, eps=0.0,
                          branch=jnp.concatenate([col, tiny + tiny], axis=1), branch_w=w)
    assert float(h_tree[0, 0]) != float(h_tree[0, 1])  # the control: another order differs


def test_bad_operands_are_refused_by_name():
    x, b, wb, wx = _operands(3, 64, jnp.bfloat16)
    cases = [
        (dict(norm_w=None), "give norm_w"),
        (dict(norm_w=wx[:32]), "norm weight shape"),
        (dict(norm_w=wx, branch=b), "together"),
        (dict(norm_w=wx, branch=b, branch_w=wb[:8]), "branch weight shape"),
        (dict(norm_w=wx, branch=b[:, :40], branch_w=wb), "neither"),
        (dict(norm_w=wx, branch=jnp.concatenate([b, b], 1), branch_w=wb), "float32"),
    ]
    for kw, words in cases:
        with pytest.raises(ValueError, match=words):
            add_norm(x, kw.pop("norm_w"), eps=EPS, interpret=True, **kw)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        add_norm(x[0], wx, eps=EPS, interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_rows_alone_equal_rows_among_320_at_2048(splits):
    """Compiled at the 1.4B width: 1, 5 and 64 rows against the same rows of a 320-row call."""
    x, b, wb, wx = _operands(320, 2048, jnp.bfloat16, splits)
    h, y = add_norm(x, wx, eps=EPS, branch=b, branch_w=wb)
    hr, yr = reference(x, wx, eps=EPS, branch=b, branch_w=wb)
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(yr, np.float32),
                               rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(h, np.float32), np.asarray(hr, np.float32),
                               rtol=2e-2, atol=2e-2)
    for rows in (slice(0, 1), slice(9, 14), slice(100, 164)):
        h1, y1 = add_norm(x[rows], wx, eps=EPS, branch=b[rows], branch_w=wb)
        np.testing.assert_array_equal(np.asarray(h1), np.asarray(h[rows]))
        np.testing.assert_array_equal(np.asarray(y1), np.asarray(y[rows]))
