"""One-row decode attention on Mosaic GPU, one program per head
(pallas_kernels/decode_mgpu.py): CPU interpret mode against the XLA reference at tiny
shapes, the refusals, the lowering for 'cuda' on a CPU machine, and the 1.4B shape on a GPU.

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
from pallas_kernels import decode_mgpu as dm


def _qkv(n, h, d, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    q = jax.random.normal(ks[0], (1, h * d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (n, h, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (n, h, d), jnp.float32).astype(jnp.bfloat16)
    return q, k, v


def _close(got, ref):
    """Within two bf16 steps of the reference (the online softmax rescales p block by block
    before rounding it to bf16, the reference once)."""
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    return np.all(np.abs(got - ref) <= 2 ** -7 * np.maximum(np.abs(ref), 2 ** -3))


@pytest.mark.parametrize("length", [1, 63, 64, 100, 256])
def test_interpret_matches_the_reference(length):
    """Lengths inside, at and across block ends, up to the capacity: masked positions
    (holding random values here) never count."""
    q, k, v = _qkv(256, 2, 128)
    got = dm.decode_attention_mgpu(q, k, v, length, block=64, stages=2, interpret=True)
    assert _close(got, dm.reference_decode(q, k, v, length))


@pytest.mark.parametrize("length", [100, 128, 200])
def test_interpret_stale_rows_holding_nan_do_not_leak(length):
    """Rows past the length hold NaN (as the engine's stale cache slots do in its tests):
    masked scores, and the last block's V rows zeroed before P @ V."""
    q, k, v = _qkv(256, 2, 128)
    got = dm.decode_attention_mgpu(q, k.at[length:].set(jnp.nan), v.at[length:].set(jnp.nan),
                                   length, block=64, stages=2, interpret=True)
    assert _close(got, dm.reference_decode(q, k, v, length))


def test_interpret_length_zero_gives_zeros_and_longer_is_clipped():
    q, k, v = _qkv(128, 1, 64)
    zero = dm.decode_attention_mgpu(q, k, v, 0, block=64, stages=2, interpret=True)
    assert not np.any(np.asarray(zero, np.float32))
    over = dm.decode_attention_mgpu(q, k, v, 500, block=64, stages=2, interpret=True)
    assert _close(over, dm.reference_decode(q, k, v, 128))


def test_interpret_length_is_traced():
    """One trace serves every length (the block loop's bound is a traced value)."""
    q, k, v = _qkv(128, 1, 64)
    traces = []

    def f(n):
        traces.append(n)
        return dm.decode_attention_mgpu(q, k, v, n, block=64, stages=2, interpret=True)
    f = jax.jit(f)
    for n in (5, 120):
        assert _close(f(jnp.int32(n)), dm.reference_decode(q, k, v, n))
    assert len(traces) == 1


@pytest.mark.parametrize("kw,msg", [
    (dict(block=96), "block=96 must be a multiple of 64"),
    (dict(block=512), "up to 256"),
    (dict(stages=0), "stages=0"),
    (dict(stages=16, block=256), "exceeds"),
])
def test_refusals(kw, msg):  # duplicates: boilerplate (a table of refusal cases)
    q, k, v = _qkv(256, 2, 128)
    with pytest.raises(ValueError, match=msg):
        dm.decode_attention_mgpu(q, k, v, 10, **{"block": 64, "stages": 2, **kw})


def test_refuses_mismatched_operands():
    q, k, v = _qkv(256, 2, 128)
    with pytest.raises(ValueError, match="q must be"):
        dm.decode_attention_mgpu(q[:, :128], k, v, 10)
    with pytest.raises(ValueError, match="share a 16-bit dtype"):
        dm.decode_attention_mgpu(q.astype(jnp.float32), k, v, 10)
    with pytest.raises(ValueError, match="alike"):
        dm.decode_attention_mgpu(q, k, v[:128], 10)
    with pytest.raises(ValueError, match="head_dim=96"):
        dm.decode_attention_mgpu(q[:, :192], k[..., :96], v[..., :96], 10)
    with pytest.raises(ValueError, match="head_dim=256"):
        q2, k2, v2 = _qkv(64, 1, 256)
        dm.decode_attention_mgpu(q2, k2, v2, 10)


def test_lowers_for_cuda_at_the_1p4b_shape():
    """The register-A path (q broadcast, P from the scores), which the interpreter stages
    through SMEM, lowers for sm_90 on a CPU."""
    from pallas_kernels.offline_compile import lower_for_cuda
    q = jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((512, 16, 128), jnp.bfloat16)
    n = jax.ShapeDtypeStruct((), jnp.int32)
    text = lower_for_cuda(dm.decode_attention_mgpu, q, k, k, n).as_text()
    assert "wgmma.mma_async" in text and "cp.async.bulk.tensor" in text


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("block,stages", [(128, 2), (64, 4), (128, 3)])
@pytest.mark.parametrize("length", [1, 300, 2000])
def test_gpu_matches_the_reference_at_the_1p4b_shape(length, block, stages):
    """The benchmark's tilings; 300 and 2000 positions reuse the ring's slots."""
    q, k, v = _qkv(2048, 16, 128, seed=length)
    got = jax.jit(lambda q, k, v: dm.decode_attention_mgpu(q, k, v, length, block=block,
                                                           stages=stages))(q, k, v)
    assert _close(got, dm.reference_decode(q, k, v, length))


def test_reference_takes_a_traced_length():
    q, k, v = _qkv(64, 1, 64)
    f = jax.jit(dm.reference_decode)
    assert not np.any(np.asarray(f(q, k, v, jnp.int32(0)), np.float32))
    np.testing.assert_array_equal(np.asarray(f(q, k, v, jnp.int32(9)), np.float32),
                                  np.asarray(dm.reference_decode(q, k, v, 9), np.float32))
