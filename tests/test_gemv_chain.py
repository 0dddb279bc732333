"""The o -> gate/up persistent kernel (pallas_kernels/gemv_chain.py): the same results as the
two streaming GEMVs it replaces. On the CPU one program runs both phases (interpret mode runs
programs in turn); the GPU test runs the persistent grid."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels.gemv_chain import o_gate_up
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed


def _case(m, k_o, k, inter, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, dtype)
    return (a(m, k_o), a(k, k_o, scale=k_o ** -0.5), a(m, k),
            jnp.asarray(rng.uniform(0.5, 1.5, k), dtype), jnp.asarray(rng.uniform(0.5, 1.5, k), dtype),
            a(2 * inter, k, scale=k ** -0.5))


def _separate(attn, w_o, h, w_post, w_pre, w_gu, tiling, **kw):
    o = gemv_stream(attn, w_o, per_program=1, **tiling["o"], **kw)
    y, x_new = gemv_stream_normed(h, w_pre, w_gu, eps=1e-6, branch=o, branch_w=w_post,
                                  gated=True, per_program=1, **tiling["gate_up"], **kw)
    return y, x_new, o


TILING = dict(o=dict(block_n=2, block_k=64), gate_up=dict(block_n=2, block_k=64))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_one_program_matches_the_two_kernels(dtype):
    args = _case(1, 128, 128, 192, dtype)
    y, x_new, o, state = o_gate_up(*args, jnp.zeros((3,), jnp.int32), eps=1e-6, programs=1,
                                   tiling=TILING, interpret=True)
    for got, want in zip((y, x_new, o), _separate(*args, TILING, interpret=True)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert state.tolist() == [0, 1, 0]  # one barrier passed, the state ready for the next


def test_l2_ahead_same_results_and_its_prefetches():
    """l2_ahead=N (session 14): in interpret mode (no prefetch emitted) the same bits; lowered
    for 'cuda', N up-front prefetches per phase (gated: two each) and one rolling prefetch in
    each phase's loop body."""
    import re
    from test_pdl import triton_ir
    args = _case(1, 128, 128, 192, jnp.float32)
    state = jnp.zeros((3,), jnp.int32)
    run = lambda **kw: o_gate_up(*args, state, eps=1e-6, programs=1, tiling=TILING,
                                 interpret=True, **kw)[:3]
    for got, want in zip(run(l2_ahead=2), run()):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="l2_ahead"):
        run(l2_ahead=-1)
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    shapes = (s((1, 2048), bf), s((2048, 2048), bf), s((1, 2048), bf), s((2048,), bf),
              s((2048,), bf), s((2 * 5632, 2048), bf), s((3,), jnp.int32))

    def count(n):
        [ir] = triton_ir(lambda *a: o_gate_up(*a, eps=1e-6, programs=128, l2_ahead=n), *shapes)
        return len(re.findall(r"cp\.async\.bulk\.prefetch\.L2", ir))
    # o: 8 blocks per program, gate/up 22: up-front min(n, blocks - 1), +1 in each loop body
    assert count(0) == 0
    assert count(2) == (2 + 1) + 2 * (2 + 1)


def test_bad_inputs_are_refused():
    args = _case(1, 128, 128, 192, jnp.float32)
    state = jnp.zeros((3,), jnp.int32)
    with pytest.raises(ValueError, match="programs=1"):
        o_gate_up(*args, state, eps=1e-6, programs=2, tiling=TILING, interpret=True)
    with pytest.raises(ValueError, match="multiple of 3 blocks"):
        o_gate_up(*args, state, eps=1e-6, programs=3, tiling=TILING)
    with pytest.raises(ValueError, match="but h is"):
        o_gate_up(args[0], args[1], args[2][:, :64], *args[3:], state, eps=1e-6, programs=1,
                  tiling=TILING, interpret=True)
    with pytest.raises(ValueError, match="barrier state"):
        o_gate_up(*args, jnp.zeros((2,), jnp.int32), eps=1e-6, programs=1, tiling=TILING,
                  interpret=True)


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
def test_persistent_grid_matches_the_two_kernels_on_the_gpu():
    """1.4B shapes, bf16, 128 programs: the fused kernel's results equal the two kernels' with
    the same tilings (same math, same register layouts offline), with a new attention output
    every call (so a phase-2 read that raced phase 1 cannot find last call's values), and no
    program gave up at the barrier."""
    args = list(_case(1, 2048, 2048, 5632, jnp.bfloat16, seed=1))
    tiling = dict(o=dict(block_n=2, block_k=512), gate_up=dict(block_n=2, block_k=512))
    f = jax.jit(lambda *a: o_gate_up(*a, eps=1e-6), donate_argnums=6)
    f4 = jax.jit(lambda *a: o_gate_up(*a, eps=1e-6, l2_ahead=4), donate_argnums=6)
    separate = jax.jit(lambda *a: _separate(*a, tiling))
    state = jnp.zeros((3,), jnp.int32)
    rng = np.random.default_rng(7)
    for call in range(10):
        f = f4 if call == 5 else f  # the second half with L2 prefetch ahead
        args[0] = jnp.asarray(rng.standard_normal((1, 2048)), jnp.bfloat16)
        want = separate(*args)
        y, x_new, o, state = f(*args, state)
        assert state.tolist() == [0, call + 1, 0], "a program gave up waiting at the barrier"
        for name, got, ref in zip(("y", "x'", "o"), (y, x_new, o), want):
            diff = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32))))
            print(f"call {call} {name}: max |fused - separate| = {diff}")
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_the_benchmark_refuses_a_cpu():
    from benchmarks.gemv_chain import main
    if has_gpu():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="needs a GPU"):
        main(["--layers", "1"])


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
def test_counter_barrier_matches_the_two_kernels_on_the_gpu():
    """The same with the "counter" barrier (session 15): the arrivals word grows by
    COUNTER_STEP per call and nobody gave up."""
    args = list(_case(1, 2048, 2048, 5632, jnp.bfloat16, seed=2))
    tiling = dict(o=dict(block_n=2, block_k=512), gate_up=dict(block_n=2, block_k=512))
    f = jax.jit(lambda *a: o_gate_up(*a, eps=1e-6, spin="counter"), donate_argnums=6)
    separate = jax.jit(lambda *a: _separate(*a, tiling))
    state = jnp.zeros((3,), jnp.int32)
    rng = np.random.default_rng(8)
    for call in range(6):
        args[0] = jnp.asarray(rng.standard_normal((1, 2048)), jnp.bfloat16)
        want = separate(*args)
        y, x_new, o, state = f(*args, state)
        assert state.tolist() == [1024 * (call + 1), 0, 0], "a program gave up at the barrier"
        for got, ref in zip((y, x_new, o), want):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_the_benchmark_block_n_option():
    """benchmarks.gemv_chain --block-n: overrides per phase, bad items refused before any
    GPU work."""
    import argparse
    from benchmarks.gemv_chain import _tiling, main
    from pallas_kernels.gemv_chain import TILING as CHAIN
    t = _tiling(argparse.Namespace(block_n="o=1,gate_up=4"))
    assert t["o"]["block_n"] == 1 and t["gate_up"]["block_n"] == 4
    assert t["o"]["block_k"] == CHAIN["o"]["block_k"] and CHAIN["o"]["block_n"] == 2
    for bad in ("o=3", "qkv=2", "o=", "o=x"):
        with pytest.raises(SystemExit):
            main(["--block-n", bad])


def test_finer_blocks_match_the_separate_kernels_in_interpret_mode():
    """block_n=1 for both phases (what a 512-program grid needs): same results as the two
    kernels with that tiling."""
    args = _case(1, 256, 128, 64, jnp.float32, seed=5)
    tiling = dict(o=dict(block_n=1, block_k=128), gate_up=dict(block_n=1, block_k=128))
    y, x_new, o, _ = o_gate_up(*args, jnp.zeros((3,), jnp.int32), eps=1e-6, programs=1,
                               tiling=tiling, interpret=True)
    want = _separate(*args, tiling, interpret=True)
    for got, ref in zip((y, x_new, o), want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
