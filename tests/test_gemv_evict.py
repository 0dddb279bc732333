"""The streaming GEMV's evict_first switch (gemv_stream DEFAULTS): the weight loads in the
Triton IR lowered for 'cuda' carry the evict_first policy (and only they), and the engine's
--stream-set reaches it. Whether it pays is a benchmark
(`benchmarks.decode --stream-set qkv.evict_first=1,...`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
from test_pdl import triton_ir

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16
LOAD = re.compile(r"tt\.load %\S+( evictionPolicy = (\w+))?.* : tensor<([0-9x]+)x!tt\.ptr")


def loads(ir: str) -> list[tuple[str, str]]:
    """(eviction policy or '', tile shape) of every pointer-tensor load."""
    return [(m.group(2) or "", m.group(3)) for m in LOAD.finditer(ir)]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("prologue", ["", "add_norm"])
def test_weight_loads_carry_evict_first(gated, prologue):
    k, n = 256, 64
    kw = dict(block_n=2, block_k=128, per_program=4, gated=gated)

    def ir(**t):
        if not prologue:
            [out] = triton_ir(lambda x, w: gemv_stream(x, w, **kw, **t), S((1, k), BF),
                              S((2 * n if gated else n, k), BF))
            return out
        [out] = triton_ir(lambda x, w, b, nw: gemv_stream_normed(
            x, nw, w, eps=1e-6, branch=b, branch_w=nw, **kw, **t), S((1, k), BF),
            S((2 * n if gated else n, k), BF), S((1, k), BF), S((k,), BF))
        return out
    base, ev = loads(ir()), loads(ir(evict_first=True))
    assert all(policy == "" for policy, _ in base)
    weights = [shape for policy, shape in ev if policy == "evict_first"]
    # one 2 x 128 tile per K chunk (two chunks), gate and up when gated, for the first block
    # and the loop's next block
    assert weights and set(weights) == {"2x128"}
    assert len(weights) == len([s for _, s in base if s == "2x128"])
    # everything else (x, the branch, the norm weights) as before
    assert sorted(s for p, s in ev if p != "evict_first") == \
        sorted(s for _, s in base if s != "2x128")


def test_interpret_mode_ignores_it_and_bad_values_are_refused():
    """In interpret mode (no cache) the switch emits nothing, so the results there are the
    default's by construction; on a GPU the bits are the decode benchmark's check (the
    greedy token digest of arm `ev`). A non-bool is refused."""
    k, n = 256, 64
    key = jax.random.split(jax.random.PRNGKey(5), 2)
    x = jax.random.normal(key[0], (1, k)).astype(BF)
    w = jax.random.normal(key[1], (n, k)).astype(BF)
    kw = dict(block_n=2, block_k=128, per_program=4, interpret=True)
    np.testing.assert_array_equal(np.asarray(gemv_stream(x, w, **kw), np.float32),
                                  np.asarray(gemv_stream(x, w, evict_first=True, **kw),
                                             np.float32))
    with pytest.raises(ValueError, match="evict_first must be a bool"):
        gemv_stream(x, w, evict_first=1, **kw)


def test_stream_set_reaches_the_switch():
    from benchmarks.tuning import apply_kernel_tuning
    from ouro_jax import projections
    # shipped on for every projection (session 34)
    assert all(t["evict_first"] is True for t in projections.STREAM_TUNING.values())
    try:
        apply_kernel_tuning("", "", stream_set="qkv.evict_first=0,down.evict_first=0")
        assert projections.STREAM_TUNING["qkv"]["evict_first"] is False
        assert projections.STREAM_TUNING["down"]["evict_first"] is False
        assert projections.STREAM_TUNING["o"]["evict_first"] is True
        # a tiling override keeps the shipped policy
        apply_kernel_tuning("", "", stream_spec="qkv=st2_k512_p1_w4")
        assert projections.STREAM_TUNING["qkv"]["evict_first"] is True
        assert projections.STREAM_TUNING["qkv"]["block_k"] == 512
    finally:
        apply_kernel_tuning("", "")
    assert projections.STREAM_TUNING["qkv"]["evict_first"] is True
