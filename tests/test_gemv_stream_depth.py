"""gemv_stream's depth=2 (two blocks' loads in flight ahead of the math, session 35): the
same bits as depth 1 in interpret mode, its refusals, the late PDL trigger and prefetch kept,
and the tiling fit for small models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed

f32 = lambda a: np.asarray(a, np.float32)


def _operands(m, k, n, dtype, seed=3):
    ks = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(ks[0], (m, k)).astype(dtype)
    b = (jax.random.normal(ks[1], (m, k)) * 3).astype(dtype)
    wb, wx = ((1 + 0.1 * jax.random.normal(kk, (k,))).astype(dtype) for kk in ks[2:4])
    w = (jax.random.normal(ks[4], (n, k)) * k ** -0.5).astype(dtype)
    return x, b, wb, wx, w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,n,per_program", [(1, 128, 2), (1, 96, 3), (2, 128, 4),
                                             (1, 128, 8)])
def test_depth_two_is_bit_equal_to_depth_one(dtype, gated, m, n, per_program):
    """Every block's loads and math are depth 1's, only requested earlier: the outputs (and
    the add_norm residual) are equal, plain and with both norm prologues, and the blocks land
    where they belong (checked against the reference on the plain GEMV). Bit-equal in bf16,
    the engine's dtype. In fp32 the CPU interpreter may round a block's sums in the last bit
    differently inside a loop body than in straight-line code (XLA fuses them differently;
    seen with a one-trip loop), so fp32 is held to 1e-6; on a GPU the Triton code is the
    same wherever a block sits, and the GPU test checks the bits."""
    from pallas_kernels.gemv import gemv_reference
    x, b, wb, wx, w = _operands(m, 64, 2 * n if gated else n, dtype)
    kw = dict(gated=gated, interpret=True, block_n=4, block_k=32, per_program=per_program)

    def same(a2, a1):
        if dtype == jnp.bfloat16:
            np.testing.assert_array_equal(f32(a2), f32(a1))
        else:
            np.testing.assert_allclose(f32(a2), f32(a1), rtol=1e-6, atol=1e-6)
    y1 = gemv_stream(x, w, **kw)
    y2 = gemv_stream(x, w, depth=2, **kw)
    same(y2, y1)
    ref = gemv_reference(x, w, gated=gated)
    np.testing.assert_allclose(f32(y2), f32(ref), rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == jnp.bfloat16 else 1e-5)
    for branch in ({}, dict(branch=b, branch_w=wb)):
        r1 = gemv_stream_normed(x, wx, w, eps=1e-6, **branch, **kw)
        r2 = gemv_stream_normed(x, wx, w, eps=1e-6, depth=2, **branch, **kw)
        for a1, a2 in zip(jax.tree.leaves(r1), jax.tree.leaves(r2)):
            same(a2, a1)


@pytest.mark.parametrize("bad,msg", [
    (dict(depth=3), "depth must be one of"),
    (dict(depth=0), "depth must be one of"),
    (dict(depth=True), "depth must be one of"),
    (dict(depth=2.0), "depth must be one of"),
    (dict(depth=2, per_program=1), "depth=2 needs at least that many blocks per program"),
    (dict(depth=2, l2_prefetch=1), "depth=2 takes neither defer_norm nor l2_prefetch"),
])
def test_depth_refusals(bad, msg):
    x, _, _, wx, w = _operands(1, 64, 128, jnp.float32)
    with pytest.raises(ValueError, match=msg):
        gemv_stream(x, w, interpret=True, **dict(dict(block_n=4, block_k=32, per_program=2),
                                                 **bad))
    with pytest.raises(ValueError, match="depth=2 takes neither defer_norm"):
        gemv_stream_normed(x, wx, w, eps=1e-6, interpret=True, block_n=4, block_k=32,
                           per_program=2, depth=2, defer_norm=True)


def test_gemv_queue_refuses_depth_two():
    from pallas_kernels.gemv_queue import gemv_queue
    x, _, _, _, w = _operands(1, 64, 128, jnp.float32)
    with pytest.raises(ValueError, match="takes block_n, block_k and num_warps"):
        gemv_queue(x, w, jnp.zeros((2,), jnp.int32), programs=4, use=0, zero=1,
                   interpret=True, block_n=4, block_k=32, depth=2)


@pytest.mark.parametrize("per_program", [2, 4])
def test_depth_two_keeps_the_late_pdl_trigger_and_prefetch(per_program):
    """The last block's hook (pdl="end") and the late L2 prefetch of next_w (next_at="end")
    are emitted with depth 2 as with depth 1: lowered for 'cuda', the same count of each."""
    from test_pdl import TRIGGER, triton_ir
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16

    def count(depth):
        def f(x, b, bw, nw, w, nxt):
            return gemv_stream_normed(x, nw, w, eps=1e-6, branch=b, branch_w=bw, depth=depth,
                                      block_n=4, block_k=64, per_program=per_program,
                                      pdl="end", next_w=nxt, next_rows=2)
        [ir] = triton_ir(f, s((1, 128), bf), s((1, 128), bf), s((128,), bf), s((128,), bf),
                         s((64, 128), bf), s((256, 128), bf))
        return ir.count(TRIGGER), ir.count("prefetch.L2")
    base = count(1)
    assert base[0] >= 1 and base[1] >= 1
    assert count(2) == base


def test_fit_stream_tuning_caps_depth_at_the_blocks_per_program():
    from ouro_jax.projection_tuning import fit_stream_tuning
    t = dict(block_n=4, block_k=2048, per_program=4, num_warps=8, depth=2)
    assert fit_stream_tuning(t, 6144, 2048)["depth"] == 2
    small = fit_stream_tuning(t, 4, 64)  # one block of 4 rows: one per program
    assert small["per_program"] == 1 and small["depth"] == 1


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_depth_two_is_bit_equal_on_the_gpu(name):
    """The engine's tiling for each 1.4B projection, compiled, at depth 1 and 2 (with the
    add_norm prologue for qkv and gate/up, as the engine calls them): the same bits."""
    from benchmarks.gemv import SHAPES
    from ouro_jax.projections import STREAM_TUNING
    n, k, gated = SHAPES[name]
    x, b, wb, wx, w = _operands(1, k, n, jnp.bfloat16)
    t = dict(STREAM_TUNING[name])
    if name in ("qkv", "gate_up"):
        run = lambda d: gemv_stream_normed(x, wx, w, eps=1e-6, branch=b, branch_w=wb,
                                           gated=gated, **dict(t, depth=d))
    else:
        run = lambda d: gemv_stream(x, w, gated=gated, **dict(t, depth=d))
    for a1, a2 in zip(jax.tree.leaves(run(1)), jax.tree.leaves(run(2))):
        np.testing.assert_array_equal(f32(a2), f32(a1))


def test_engine_tokens_at_depth_two(monkeypatch):
    """The engine's streaming projections ('gemv+norms+stream', interpret mode) with every
    projection at depth 2 give the default's greedy tokens, native and speculative (fp32)."""
    from ouro_jax import projections
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    cfg = PRESETS["tiny-mha"]
    params = random_params(cfg, 0, jnp.float32, 0.003, 0.0)
    sp = [SamplingParams(max_tokens=8, ignore_eos=True)]

    def tokens():
        llm = Ouro(cfg, params, None, attention="xla", projections="gemv+norms+stream",
                   decode_chunk=8)
        return (llm.generate([[3, 1, 4]], sp).outputs[0].token_ids,
                llm.generate([[3, 1, 4]], sp, speculative=SpeculativeConfig(4, 2))
                .outputs[0].token_ids)
    small = dict(block_n=1, block_k=32, per_program=2, num_warps=4)
    for name in projections.STREAM_TUNING:
        monkeypatch.setitem(projections.STREAM_TUNING, name, dict(small))
    base = tokens()
    for name in projections.STREAM_TUNING:
        monkeypatch.setitem(projections.STREAM_TUNING, name, dict(small, depth=2))
    assert tokens() == base
    assert base[0] == base[1]
