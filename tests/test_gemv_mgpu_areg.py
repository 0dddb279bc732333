"""The Mosaic GPU GEMV with x as the register A operand (pallas_kernels/gemv_mgpu_areg.py):
CPU interpret mode (which stages A through shared memory: its wgmma takes refs only), the
lowering for 'cuda' on a CPU machine (the register path), and the 1.4B shapes on a GPU.

Skipped where jax has no Mosaic GPU Pallas with GPU interpret mode (jax 0.10.2 in CI)."""

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
from pallas_kernels.gemv import gemv_reference
from pallas_kernels.gemv_mgpu_areg import SHAPES, SWEEP, gemv_mgpu_areg, lower_for_h200


def _xw(n, k, dtype=jnp.bfloat16, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (1, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(dtype)
    return x, w


def _f32(a):
    return np.asarray(a, np.float32)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("block_n,block_k,stages", [(8, 64, 2), (16, 128, 2), (32, 64, 3)])
def test_interpret_is_bit_identical_to_xla(gated, block_n, block_k, stages):
    """One split: fp32 accumulation over K in order, rounded once (gated: gemv._silu_mul's
    roundings), so bf16 results equal XLA's on the CPU bit for bit."""
    x, w = _xw(128, 256, seed=block_n)
    y = gemv_mgpu_areg(x, w, gated=gated, block_n=block_n, block_k=block_k, stages=stages,
                       interpret=True)
    ref = gemv_reference(x, w, gated=gated)
    assert y.shape == ref.shape == (1, 64 if gated else 128) and y.dtype == x.dtype
    np.testing.assert_array_equal(_f32(y), _f32(ref))


def test_interpret_split_k_and_fp16():
    x, w = _xw(64, 512, seed=3)
    y = gemv_mgpu_areg(x, w, block_n=16, block_k=64, k_splits=4, stages=2, interpret=True)
    np.testing.assert_allclose(_f32(y), _f32(gemv_reference(x, w)), rtol=1e-2, atol=1e-2)
    x, w = _xw(64, 256, jnp.float16, seed=4)
    y = gemv_mgpu_areg(x, w, block_n=32, block_k=128, stages=2, interpret=True)
    assert y.dtype == jnp.float16
    np.testing.assert_array_equal(_f32(y), _f32(gemv_reference(x, w)))


@pytest.mark.parametrize("kw,msg", [
    (dict(block_n=12), "multiple of 8"), (dict(block_n=512), "multiple of 8"),
    (dict(block_k=96), "multiple of 64"), (dict(block_k=0), "multiple of 64"),
    (dict(k_splits=3), "k_splits=3"), (dict(k_splits=16, block_k=64), "multiple of 128"),
    (dict(stages=1), "stages=1"), (dict(gated=True, k_splits=2), "k_splits=1"),
    (dict(block_n=256, block_k=1024, stages=8), "shared memory")])
def test_rejects_bad_tilings(kw, msg):
    x, w = _xw(256, 1024)
    with pytest.raises(ValueError, match=msg):
        gemv_mgpu_areg(x, w, interpret=True, **kw)


def test_rejects_bad_shapes():
    x, w = _xw(64, 256)
    with pytest.raises(ValueError, match="one row"):
        gemv_mgpu_areg(jnp.concatenate([x, x]), w, interpret=True)
    with pytest.raises(ValueError, match="K = 256"):
        gemv_mgpu_areg(x, w[:, :128], interpret=True)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        gemv_mgpu_areg(x.astype(jnp.float32), w.astype(jnp.float32), interpret=True)
    with pytest.raises(ValueError, match="even row count"):
        gemv_mgpu_areg(x, w[:63], gated=True, block_n=8, interpret=True)


# Lowering (the register A operand, layouts, transforms; ~3 s a case): the first two tilings
# of each projection's sweep.
LOWER_CASES = [(name, t) for name in SHAPES for t in SWEEP[name][:2]]


@pytest.mark.parametrize("name,tiling", LOWER_CASES)
def test_lowers_for_cuda_at_the_1p4b_shapes(name, tiling):
    n, k, gated = SHAPES[name]
    bn, bk, ks, st = tiling
    S = jax.ShapeDtypeStruct
    text = lower_for_h200(S((1, k), jnp.bfloat16), S((n, k), jnp.bfloat16), gated=gated,
                          block_n=bn, block_k=bk, k_splits=ks, stages=st).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name,tiling", [(n, t) for n in SHAPES for t in SWEEP[n]])
def test_gpu_matches_xla_at_the_1p4b_shapes(name, tiling):
    """On the GPU: within one bf16 rounding plus the accumulation order of XLA's GEMV."""
    n, k, gated = SHAPES[name]
    x, w = _xw(n, k, seed=n)
    bn, bk, ks, st = tiling
    y = jax.jit(lambda x, w: gemv_mgpu_areg(x, w, gated=gated, block_n=bn, block_k=bk,
                                            k_splits=ks, stages=st))(x, w)
    ref = gemv_reference(x, w, gated=gated)
    err = np.max(np.abs(_f32(y) - _f32(ref))) / np.max(np.abs(_f32(ref)))
    print(f"{name} {tiling}: rel err {err:.3g}, {int((_f32(y) != _f32(ref)).sum())} of "
          f"{y.size} differ")
    assert err <= 8e-3, err


# Programmatic dependent launch placed by the kernel (pdl_step, session 15).

@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("pdl_step", [0, 1, 9])
def test_interpret_pdl_step_same_result(gated, pdl_step):
    """x read inside step 0 (after the wait) instead of before the pipeline: same result."""
    x, w = _xw(128, 256, seed=7)
    kw = dict(gated=gated, block_n=16, block_k=64, stages=2, interpret=True)
    y = gemv_mgpu_areg(x, w, pdl_step=pdl_step, **kw)
    np.testing.assert_array_equal(_f32(y), _f32(gemv_mgpu_areg(x, w, **kw)))
    np.testing.assert_array_equal(_f32(y), _f32(gemv_reference(x, w, gated=gated)))


@pytest.mark.parametrize("kw,msg", [(dict(pdl_step=-1), "pdl_step"),
                                    (dict(pdl_step=1.0), "pdl_step"),
                                    (dict(pdl_step=0, k_splits=2, block_k=64), "k_splits=1")])
def test_rejects_bad_pdl_step(kw, msg):
    x, w = _xw(64, 256)
    with pytest.raises(ValueError, match=msg):
        gemv_mgpu_areg(x, w, interpret=True, **kw)


def test_pdl_lowering_marks_the_kernel_and_emits_wait_and_trigger():
    """The lowered kernel (serialized in the custom call, so only its string table can be
    read here) carries the PDL module attribute, which makes XLA launch it with programmatic
    stream serialization, and both instructions; without pdl_step none of them. The order
    (wait after the first weight requests) is what the GPU chain test exercises."""
    S = jax.ShapeDtypeStruct
    args = (S((1, 2048), jnp.bfloat16), S((2048, 2048), jnp.bfloat16))
    on = lower_for_h200(*args, block_n=16, block_k=256, stages=4, pdl_step=0).as_text()
    off = lower_for_h200(*args, block_n=16, block_k=256, stages=4).as_text()
    for word in ("griddepcontrol.wait;", "griddepcontrol.launch_dependents;",
                 "mosaic_gpu.uses_pdl"):
        assert word in on and word not in off


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("pdl_step", [0, 3])
def test_gpu_pdl_chain_is_bit_identical(pdl_step):
    """A chain of dependent GEMVs with PDL (each reads the previous one's output after its
    wait; the next launches early) gives the same bits as without: a wait placed too late
    or not at all would let a kernel read x before its producer wrote it. A new input every
    repetition, and the PDL chain first, so that a premature read cannot find the right bits
    left in a buffer by an earlier run."""
    n = k = 2048
    ws = [_xw(n, k, seed=20 + i)[1] for i in range(12)]

    def chain(x, ws, step):
        for w in ws:
            x = gemv_mgpu_areg(x, w, block_n=16, block_k=256, stages=4, pdl_step=step)
        return x
    with_pdl = jax.jit(lambda x, ws: chain(x, ws, pdl_step))
    without = jax.jit(lambda x, ws: chain(x, ws, None))
    for rep in range(4):
        x = _xw(n, k, seed=100 + rep)[0]
        y = np.asarray(with_pdl(x, ws), np.float32)
        np.testing.assert_array_equal(y, _f32(without(x, ws)))
