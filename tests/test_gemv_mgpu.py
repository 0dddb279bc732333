"""The Mosaic GPU GEMV prototype (pallas_kernels/gemv_mgpu.py): CPU interpret mode, lowering
for 'cuda' on a CPU machine, and the real shapes on a GPU.

Skipped where jax has no Mosaic GPU Pallas with GPU interpret mode (jax 0.10.2 in CI: the
import of jax.experimental.pallas.mosaic_gpu fails there for want of absl)."""

from __future__ import annotations

import pytest

try:
    import jax.experimental.pallas.mosaic_gpu as plgpu
    plgpu.InterpretGPUParams  # noqa: B018 - GPU interpret mode (jax >= 0.11)
except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the jax install
    pytest.skip(f"no Mosaic GPU Pallas with interpret mode: {e}", allow_module_level=True)

import jax
import jax.numpy as jnp
import numpy as np

from engine_helpers import has_gpu
from pallas_kernels.gemv_mgpu import (SHAPES, XROWS, gemv_mgpu, gemv_mgpu_raw,
                                      gemv_reference, lower_for_h200, pad_x)


def _xw(n, k, dtype=jnp.bfloat16, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (1, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(dtype)
    return x, w


def _assert_close(y, ref):
    # bf16 output of an fp32 accumulation: a different summation order (K chunks, split-K
    # partials) can move the result across a rounding boundary, one bf16 ulp (2^-8 relative)
    # at most; 1e-2 relative plus a small absolute term for results near zero covers it.
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("n,k,block_n,block_k,k_splits,stages", [
    (128, 256, 64, 64, 1, 2),
    (128, 256, 128, 128, 2, 3),
    (128, 512, 64, 128, 2, 4),
    (256, 256, 64, 64, 4, 2),
    (64, 768, 64, 256, 1, 2),  # more steps than stages, K not a power of two
])
def test_interpret_matches_reference(n, k, block_n, block_k, k_splits, stages):
    x, w = _xw(n, k)
    y = gemv_mgpu(x, w, block_n=block_n, block_k=block_k, k_splits=k_splits, stages=stages,
                  interpret=True)
    ref = gemv_reference(x, w)
    assert y.shape == ref.shape == (1, n) and y.dtype == jnp.bfloat16
    _assert_close(y, ref)


def test_interpret_fp16():
    x, w = _xw(128, 256, jnp.float16)
    _assert_close(gemv_mgpu(x, w, block_n=64, block_k=128, stages=2, interpret=True),
                  gemv_reference(x, w))


def test_interpret_no_races():
    # The race detector sees TMA and SMEM accesses; it runs wgmma synchronously, so it cannot
    # check the wgmma_wait(1) / delay_release=1 pairing (that is left to the GPU test).
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
    x, w = _xw(128, 512)
    y = gemv_mgpu(x, w, block_n=64, block_k=64, k_splits=2, stages=3,
                  interpret=plgpu.InterpretGPUParams(detect_races=True))
    jax.block_until_ready(y)
    assert not gpu_callbacks.get_races().races_found
    _assert_close(y, gemv_reference(x, w))


def test_padding_rows_never_reach_the_answer():
    # MMA columns are independent: NaN in x's padding rows stays out of column 0.
    x, w = _xw(128, 256)
    xp = pad_x(x).at[1:].set(jnp.nan)
    raw = gemv_mgpu_raw(xp, w, block_n=64, block_k=128, stages=2, interpret=True)
    assert raw.shape == (1, 128, XROWS)
    _assert_close(raw[0, :, 0][None], gemv_reference(x, w))


@pytest.mark.parametrize("shape_x,shape_w,kw,msg", [
    ((2, 256), (128, 256), {}, "one row"),
    ((1, 256), (128, 512), {}, "must be \\[N, K\\]"),
    ((1, 256), (96, 256), dict(block_n=64), "block_n"),
    ((1, 256), (128, 256), dict(block_n=32), "block_n"),
    ((1, 320), (128, 320), dict(block_k=128), "block_k"),
    ((1, 256), (128, 256), dict(block_k=128, k_splits=4), "k_splits"),
    ((1, 256), (128, 256), dict(block_k=32), "multiple of 64"),
    ((1, 256), (128, 256), dict(block_k=64, stages=1), "stages"),
    ((1, 2048), (2048, 2048), dict(block_n=128, block_k=256, stages=4), "shared memory"),
])
def test_bad_shapes_raise(shape_x, shape_w, kw, msg):
    x = jnp.zeros(shape_x, jnp.bfloat16)
    w = jnp.zeros(shape_w, jnp.bfloat16)
    tiling = dict(dict(block_n=64, block_k=64, k_splits=1, stages=2), **kw)
    with pytest.raises(ValueError, match=msg):
        gemv_mgpu(x, w, interpret=True, **tiling)


def test_bad_dtypes_raise():
    x, w = _xw(128, 256)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemv_mgpu(x.astype(jnp.float32), w.astype(jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemv_mgpu(x, w.astype(jnp.float16), interpret=True)


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("block_n,block_k,k_splits,stages", [
    (64, 256, 1, 4), (128, 128, 2, 4), (64, 128, 4, 6)])
def test_lowers_for_cuda_at_the_1p4b_shapes(n, k, block_n, block_k, k_splits, stages):
    # The Pallas -> Mosaic GPU lowering (layout inference, wgmma operand checks, the shared
    # memory budget) runs on a CPU; PTX generation (CUDA plugin) does not.
    x = jax.ShapeDtypeStruct((1, k), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((n, k), jnp.bfloat16)
    text = lower_for_h200(x, w, block_n=block_n, block_k=block_k, k_splits=k_splits,
                          stages=stages).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("block_n,block_k,k_splits,stages", [
    (64, 256, 1, 4), (64, 128, 2, 4), (128, 128, 2, 4), (64, 128, 4, 6)])
def test_gpu_matches_reference_at_the_1p4b_shapes(n, k, block_n, block_k, k_splits, stages):
    x, w = _xw(n, k, seed=n + k)
    y = jax.jit(lambda x, w: gemv_mgpu(x, w, block_n=block_n, block_k=block_k,
                                       k_splits=k_splits, stages=stages))(x, w)
    _assert_close(y, gemv_reference(x, w))
