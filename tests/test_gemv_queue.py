"""The work-queue streaming GEMV (pallas_kernels/gemv_queue.py, prototype): interpret mode
against gemv_stream, the counters' bookkeeping, errors, the CUDA lowering, and a GPU chain."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels.gemv_queue import gemv_queue
from pallas_kernels.gemv_stream import gemv_stream


def _xw(n, k, seed, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((1, k)), dtype),
            jnp.asarray(rng.standard_normal((n, k)) * k ** -0.5, dtype))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("programs", [1, 3, 40])
def test_interpret_matches_the_streaming_gemv(gated, programs):
    """Same blocks, same per-block math: bit-identical to gemv_stream at one block per
    program. The queue's slot ends at blocks + 2 x programs (each program's two failed
    grabs), the slot it zeroes is 0, the others are untouched."""
    x, w = _xw(64, 256, seed=programs)
    counters = jnp.asarray([7, 0, 5, 9], jnp.int32)
    y, c = gemv_queue(x, w, counters, programs=programs, use=1, zero=0, gated=gated,
                      block_n=4, block_k=128, interpret=True)
    ref = gemv_stream(x, w, gated=gated, block_n=4, block_k=128, per_program=1,
                      interpret=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(ref))
    blocks = (32 if gated else 64) // 4
    assert c.tolist() == [0, blocks + 2 * programs, 5, 9]


def test_interpret_reads_the_first_k_of_a_wider_row():
    x, w = _xw(32, 128, seed=3)
    wide = jnp.concatenate([x, 100 + x], axis=1)
    y, _ = gemv_queue(wide, w, jnp.zeros((2,), jnp.int32), programs=2, use=0, zero=1,
                      block_n=2, block_k=64, interpret=True)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(
        gemv_stream(x, w, block_n=2, block_k=64, per_program=1, interpret=True)))


@pytest.mark.parametrize("kw,msg", [
    (dict(use=1, zero=1), "use != zero"), (dict(use=4, zero=0), "use != zero"),
    (dict(programs=0), "programs"), (dict(block_n=3), "power of two"),
    (dict(num_warps=3), "power of two"), (dict(x_first=True), "not \\['x_first'\\]"),
    (dict(timeline=True), "interpret")])
def test_rejects_bad_arguments(kw, msg):
    x, w = _xw(64, 256, seed=0)
    args = dict(programs=2, use=0, zero=1, interpret=True)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        gemv_queue(x, w, jnp.zeros((4,), jnp.int32), **args)
    with pytest.raises(ValueError, match="w needs K"):
        gemv_queue(x[:, :128], w, jnp.zeros((4,), jnp.int32), programs=2, use=0, zero=1,
                   interpret=True)
    with pytest.raises(ValueError, match="counters"):
        gemv_queue(x, w, jnp.zeros((4,), jnp.float32), programs=2, use=0, zero=1,
                   interpret=True)


def test_cuda_lowering_grabs_in_the_loop_with_masked_loads():
    """Lowered for 'cuda': the zeroing store under program 0, two grabs before the loop and
    one inside it, and the loop's weight loads masked."""
    from test_pdl import triton_ir
    S = jax.ShapeDtypeStruct
    [ir] = triton_ir(lambda x, w, c: gemv_queue(x, w, c, programs=264, use=2, zero=1,
                                                block_n=4, block_k=512),
                     S((1, 2048), jnp.bfloat16), S((2048, 2048), jnp.bfloat16),
                     S((4,), jnp.int32))
    lines = ir.splitlines()
    [loop] = [i for i, line in enumerate(lines) if "scf.while" in line]
    atomics = [i for i, line in enumerate(lines) if "tt.atomic_rmw" in line]
    assert len(atomics) == 3 and atomics[1] < loop < atomics[2]
    masked = [line for line in lines[loop:] if "tt.load" in line and line.count("%") >= 3]
    assert masked, "the loop's weight loads carry a mask"


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("programs", [132, 264, 396])
def test_gpu_chain_matches_the_streaming_gemv(programs):
    """A chain of the 1.4B projections (each reads the previous output), 3 layers, on the
    queue with the slots rotating as the benchmark does: bit-identical to the streaming GEMV
    with the same block sizes, over repeated calls with a new input each; every slot of the
    last projection ends at its block count + 2 x programs."""
    shapes = [(6144, 2048, False, 4), (2048, 2048, False, 4), (11264, 2048, True, 2),
              (2048, 5632, False, 2)]
    ws = [_xw(n, k, seed=10 * layer + i, dtype=jnp.bfloat16)[1]
          for layer in range(3) for i, (n, k, _, _) in enumerate(shapes)]

    def queue(x, ws, c):
        for j, w in enumerate(ws):
            n, k, gated, bn = shapes[j % 4]
            x, c = gemv_queue(x, w, c, programs=programs, use=j % 4, zero=(j - 1) % 4,
                              gated=gated, block_n=bn, block_k=512)
        return x, c

    def stream(x, ws):
        for j, w in enumerate(ws):
            n, k, gated, bn = shapes[j % 4]
            x = gemv_stream(x[:, :k], w, gated=gated, block_n=bn, block_k=512, per_program=1)
        return x
    f, g = jax.jit(queue, donate_argnums=2), jax.jit(stream)
    c = jnp.zeros((4,), jnp.int32)
    for rep in range(4):
        x = _xw(1, 2048, seed=100 + rep, dtype=jnp.bfloat16)[0]
        y, c = f(x, ws, c)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(g(x, ws), np.float32))
        # down's slot holds its count (zeroed next by qkv); the others were zeroed after use
        assert c.tolist() == [0, 0, 0, 2048 // 2 + 2 * programs]
