"""The packed-weight GEMV (pallas_kernels/gemv_packed.py): interpret mode on CPU, compiled on a
GPU. packed12 groups each chunk's weights so that the kernel's sum runs over the same
[block_n, block_k / 8] tiles in the same order as the streaming GEMV at block_k / 8, so in
interpret mode the two agree bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels.gemv import gemv_reference
from pallas_kernels.gemv_packed import gemv_packed, gemv_packed_normed
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
from pallas_kernels.packed12 import pack

f32 = lambda a: np.asarray(a, np.float32)


def _xw(m, k, n, seed=0, zeros=True):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed))
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
    if zeros:  # chunks that escape (an exact zero spans every exponent)
        w = w.at[1, 3].set(0.0).at[n - 1, k - 1].set(0.0)
    return x, w


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,block_n,per_program,zeros", [
    (1, 2, 2, True), (1, 4, 1, False), (2, 1, 4, True), (3, 8, 2, True)])
def test_packed_is_the_streaming_gemv_bit_for_bit(m, block_n, per_program, zeros, gated):
    x, w = _xw(m, 512, 128, zeros=zeros)
    p = pack(w, 256)
    assert p.escapes > 0 or not zeros
    y = gemv_packed(x, p, gated=gated, interpret=True, block_n=block_n,
                    per_program=per_program)
    ref = gemv_stream(x, w, gated=gated, interpret=True, block_n=block_n, block_k=32,
                      per_program=per_program)
    assert y.shape == ref.shape and y.dtype == jnp.bfloat16
    np.testing.assert_array_equal(f32(y), f32(ref))
    model = f32(gemv_reference(x, w, gated=gated))
    assert np.max(np.abs(f32(y) - model)) <= 2 ** -7 * np.max(np.abs(model))


@pytest.mark.parametrize("prologue", ["norm", "add_norm"])
def test_packed_prologues_match_the_streaming_gemv(prologue):
    x, w = _xw(2, 512, 64, seed=3)
    b = (x * 0.5)[::-1]
    nw = jnp.linspace(0.5, 1.5, 512).astype(jnp.bfloat16)
    br = dict(branch=b, branch_w=nw[::-1]) if prologue == "add_norm" else {}
    for gated in (False, True):
        kw = dict(gated=gated, interpret=True, block_n=4, per_program=2)
        y, xo = gemv_packed_normed(x, nw, pack(w, 512), eps=1e-6, **br, **kw)
        ry, rxo = gemv_stream_normed(x, nw, w, eps=1e-6, block_k=64, **br, **kw)
        np.testing.assert_array_equal(f32(y), f32(ry))
        np.testing.assert_array_equal(f32(xo), f32(rxo))


def test_packed_reuses_its_compile_for_new_weights_with_the_same_escape_count():
    x, w = _xw(1, 256, 32)
    f = jax.jit(lambda x, p: gemv_packed(x, p, interpret=True, block_n=2, per_program=2))
    p1, p2 = pack(w, 64), pack(-w, 64)  # the same exponents: the same escapes
    assert p1.escapes == p2.escapes
    y1, y2 = f(x, p1), f(x, p2)
    assert f._cache_size() == 1
    np.testing.assert_array_equal(f32(y2), -f32(y1))


def test_bad_input_is_refused():
    x, w = _xw(1, 256, 32)
    p = pack(w, 64)
    with pytest.raises(TypeError, match="Packed12"):
        gemv_packed(x, w, interpret=True)
    with pytest.raises(ValueError, match="does not match"):
        gemv_packed(x[:, :128], p, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        gemv_packed(x, p, interpret=True, block_n=3)
    with pytest.raises(ValueError, match="per_program=5 must divide the 16 output blocks"):
        gemv_packed(x, p, interpret=True, block_n=2, per_program=5)
    with pytest.raises(ValueError, match="block_n=64 must divide the 32 outputs"):
        gemv_packed(x, p, interpret=True, block_n=64, per_program=1)
    with pytest.raises(ValueError, match="unknown gemv_packed tuning"):
        gemv_packed(x, p, interpret=True, block_k=64)
    with pytest.raises(ValueError, match="1..4 rows"):
        gemv_packed(jnp.zeros((5, 256), jnp.bfloat16), p, interpret=True)
    with pytest.raises(ValueError, match="block_k >= 64"):
        gemv_packed(x, pack(w, 32), interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("name,n,k,gated", [("qkv", 6144, 2048, False), ("o", 2048, 2048, False),
                                            ("gate_up", 11264, 2048, True),
                                            ("down", 2048, 5632, False)])
def test_gpu_packed_matches_the_streaming_gemv(name, n, k, gated):
    """Compiled: within one bf16 rounding of the streaming GEMV on the unpacked weights (the
    register layouts, and so the fp32 sum trees, differ), escapes included."""
    from benchmarks.gemv_packed import TILINGS
    x, w = _xw(1, k, n)
    p = pack(w)
    assert p.escapes > 0
    ref = f32(gemv_stream(x, w, gated=gated))
    scale = np.max(np.abs(ref))
    for label in ("b2_p4_w4", "b4_p2_w4"):  # the escape path is slow to compile: two tilings
        y = f32(gemv_packed(x, p, gated=gated, **TILINGS[label]))
        assert np.max(np.abs(y - ref)) <= 2 ** -7 * scale, label
