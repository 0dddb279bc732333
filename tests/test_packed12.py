"""Lossless 12-bit weight packing (pallas_kernels/packed12.py): bit-exact round trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.packed12 import Packed12, pack, unpack

bits = lambda a: np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))


def _every_bf16(shuffle: bool):
    b = jnp.arange(65536, dtype=jnp.uint32).astype(jnp.uint16)
    if shuffle:
        b = b[jax.random.permutation(jax.random.PRNGKey(2), 65536)]
    return jax.lax.bitcast_convert_type(b.reshape(128, 512), jnp.bfloat16)


@pytest.mark.parametrize("shuffle,block_k", [(False, 512), (True, 128), (True, 32)])
def test_every_bf16_bit_pattern_round_trips(shuffle, block_k):
    """All 65,536 patterns (zeros, denormals, infinities, NaN payloads included), in order
    (few escapes) and shuffled (every chunk escapes)."""
    w = _every_bf16(shuffle)
    p = pack(w, block_k)
    np.testing.assert_array_equal(bits(unpack(p)), bits(w))
    chunks = 128 * 512 // block_k
    assert (p.escapes == chunks) if shuffle else (p.escapes == 0)


@pytest.mark.parametrize("block_k", [512, 64])
def test_gaussian_weights_pack_to_about_three_quarters(block_k):
    w = (jax.random.normal(jax.random.PRNGKey(0), (256, 2048)) * 0.02).astype(jnp.bfloat16)
    w = w.at[3, 5].set(0.0).at[7, 600].set(-1e-30)  # an exact zero and a tiny value escape
    p = pack(w, block_k)
    np.testing.assert_array_equal(bits(unpack(p)), bits(w))
    assert p.escapes >= 2 and p.escapes < 0.1 * p.meta.size
    assert 0.75 < p.nbytes / (w.size * 2) < (0.82 if block_k == 512 else 0.85)
    assert p.shape == (256, 2048) and p.lo.dtype == jnp.uint32 and p.meta.dtype == jnp.int32


def test_packed_is_a_pytree_with_static_shape_fields():
    w = jnp.ones((8, 64), jnp.bfloat16)
    p = pack(w, 64)
    leaves, tree = jax.tree_util.tree_flatten(p)
    assert len(leaves) == 4
    q = jax.tree_util.tree_unflatten(tree, leaves)
    assert (q.n, q.k, q.block_k, q.escapes) == (8, 64, 64, 0)
    np.testing.assert_array_equal(bits(jax.jit(unpack)(p)), bits(w))


@pytest.mark.parametrize("w,block_k,msg", [
    (jnp.ones((4, 64), jnp.float32), 64, "bf16"),
    (jnp.ones((4, 2, 64), jnp.bfloat16), 64, "2-D"),
    (jnp.ones((4, 96), jnp.bfloat16), 64, "must divide"),
    (jnp.ones((4, 64), jnp.bfloat16), 48, "multiple of 32"),
])
def test_bad_input_is_refused(w, block_k, msg):
    with pytest.raises(ValueError, match=msg):
        pack(w, block_k)
    assert isinstance(pack(jnp.ones((4, 64), jnp.bfloat16), 64), Packed12)
