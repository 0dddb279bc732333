"""The grid barrier (pallas_kernels._common.grid_barrier) and its benchmark. On the CPU only a
one-program grid can run (interpret mode runs programs in turn, so a second program would
wait forever); the GPU test runs a grid of one program per SM and checks every phase's
neighbour reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.grid_barrier import barrier_call, boundary_chain, expected
from engine_helpers import has_gpu


def test_one_program_passes_its_barriers_and_leaves_the_state_reusable():
    f = jax.jit(barrier_call(1, 3, interpret=True))
    out, state = f(jnp.zeros((3,), jnp.int32))
    assert out.tolist() == expected(1, 3) == [6]
    assert state.tolist() == [0, 3, 0]  # arrivals back at 0, three generations on
    out, state = f(state)
    assert out.tolist() == [6] and state.tolist() == [0, 6, 0]
    from pallas_kernels._common import GEN_MASK
    out, state = f(jnp.array([0, GEN_MASK - 1, 0], jnp.int32))  # the generation wraps to 0
    assert state.tolist() == [0, 1, 0]  # GEN_MASK - 1 -> GEN_MASK -> 0 -> 1


def test_interpret_mode_refuses_a_grid_that_would_need_to_wait():
    with pytest.raises(ValueError, match="takes one program"):
        barrier_call(2, 1, interpret=True)


def test_expected_values_name_the_neighbour():
    assert expected(3, 2) == [2 * 3, 3 * 3, 1 * 3]


def test_boundary_chain_is_the_dependent_sum():
    x = np.arange(4, dtype=np.int32)
    want = x.copy()
    for _ in range(3):
        want = want + np.roll(want, -1)
    got = jax.jit(boundary_chain(4, 3, interpret=True))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), want)


def test_the_benchmark_refuses_a_cpu():
    from benchmarks.grid_barrier import main
    if has_gpu():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="needs a GPU"):
        main(["--programs", "2"])


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("programs", [8, 132])
@pytest.mark.parametrize("spin", ["atomic", "load", "counter", "counter_wrap"])
def test_grid_barrier_orders_every_phase_on_the_gpu(programs, spin):
    """counter_wrap: the counter spin from a state 3 barriers short of the int32 wrap."""
    from pallas_kernels import _common
    step = _common.COUNTER_STEP
    start = 2**31 - 3 * step if spin == "counter_wrap" else 0
    mode = "counter" if spin == "counter_wrap" else spin
    before, _common.BARRIER["spin"] = _common.BARRIER["spin"], mode
    try:
        f = jax.jit(barrier_call(programs, 16))
        state = jnp.asarray(np.array([start, 0, 0], np.int64).astype(np.int32))
        for call in range(5):  # the state carries over from call to call
            out, state = f(state)
            n = 16 * (call + 1)
            word = int(np.array(start + n * step, np.int64).astype(np.int32))
            want = [word, 0, 0] if mode == "counter" else [0, n, 0]
            assert state.tolist() == want, "a program gave up waiting"
            assert out.tolist() == expected(programs, 16)
    finally:
        _common.BARRIER["spin"] = before


def test_the_gpu_kernel_spins_on_an_acq_rel_counter_between_cta_barriers():
    """The lowering for CUDA (no GPU needed): a CTA barrier; the generation read and the
    arrival; the last arrival's reset and generation step under an scf.if; a while loop
    re-reading the generation; a CTA barrier after it. All atomics acq_rel at GPU scope."""
    from test_pdl import triton_ir
    [ir] = triton_ir(barrier_call(132, 2), jax.ShapeDtypeStruct((3,), jnp.int32))
    lines = ir.splitlines()
    atomics = [i for i, line in enumerate(lines) if "tt.atomic_rmw" in line]
    barriers = [i for i, line in enumerate(lines) if "gpu.barrier" in line]
    branch, give_up = [i for i, line in enumerate(lines) if "scf.if" in line]
    [loop] = [i for i, line in enumerate(lines) if "scf.while" in line]
    assert len(atomics) == 6
    read, arrive, reset, flip, spin, count = atomics
    assert barriers[0] < read < arrive < branch < reset < flip < loop < spin < give_up < count
    assert all("add" in lines[i] for i in atomics)
    assert any(b > spin for b in barriers)
    for i in atomics:
        assert "acq_rel" in lines[i] and "gpu" in lines[i], lines[i]


def test_the_timing_helpers_thread_the_state():
    from benchmarks.grid_barrier import time_calls, time_threaded
    assert time_calls(lambda x: x + 1, (jnp.ones(3),), 2, 2) > 0
    seconds, state = time_threaded(lambda s: (s * 2, s + 1), jnp.int32(0), 3, 2)
    assert seconds > 0 and int(state) == 6  # 3 calls x 2 trials, the state carried through


def test_load_spin_reads_the_generation_with_gpu_loads():
    """_common.BARRIER['spin'] = 'load' (session 14): the barrier's spin loop re-reads the
    generation with ld.relaxed.gpu loads instead of atomic adds of 0 (checked in the Triton IR
    lowered for 'cuda'); an unknown mode is refused when the kernel is traced."""
    from pallas_kernels import _common
    from test_pdl import triton_ir
    state = jax.ShapeDtypeStruct((3,), jnp.int32)

    def ir():
        return triton_ir(barrier_call(8, 2), state)[0]
    before = _common.BARRIER["spin"]
    try:
        atomic = ir()
        _common.BARRIER["spin"] = "load"
        load = ir()
        _common.BARRIER["spin"] = "sleep"
        with pytest.raises(ValueError, match="BARRIER"):
            ir()
    finally:
        _common.BARRIER["spin"] = before
    def loop(ir):  # the spin loop's text: from scf.while to its body's scf.yield
        a = ir.index("scf.while")
        return ir[a:ir.index("scf.yield", a)]
    assert "ld.relaxed.gpu" in loop(load) and "tt.atomic_rmw" not in loop(load)
    assert "tt.atomic_rmw" in loop(atomic) and "ld.relaxed.gpu" not in atomic
    # the loop's atomic becomes one re-read after it, which decides the give-up for the
    # whole program (threads may see different values at the spin limit)
    assert load.count("tt.atomic_rmw") == atomic.count("tt.atomic_rmw") == 6


def test_counter_spin_arrives_once_and_waits_on_acquire_loads():
    """BARRIER['spin'] = 'counter' (session 15), in the Triton IR lowered for 'cuda': per
    barrier one arrival before the spin loop, whose body loads with ld.acquire.gpu and has
    no atomic, and one unconditional give-up add after it; CTA barriers before the arrival
    and after the give-up add. More programs than COUNTER_STEP are refused."""
    from pallas_kernels import _common
    from test_pdl import triton_ir
    before, _common.BARRIER["spin"] = _common.BARRIER["spin"], "counter"
    try:
        [ir] = triton_ir(barrier_call(132, 2), jax.ShapeDtypeStruct((3,), jnp.int32))
        with pytest.raises(ValueError, match="1..1024 programs"):
            triton_ir(barrier_call(1025, 2), jax.ShapeDtypeStruct((3,), jnp.int32))
    finally:
        _common.BARRIER["spin"] = before
    lines = ir.splitlines()
    atomics = [i for i, line in enumerate(lines) if "tt.atomic_rmw" in line]
    barriers = [i for i, line in enumerate(lines) if "gpu.barrier" in line]
    [loop] = [i for i, line in enumerate(lines) if "scf.while" in line]
    end = next(i for i in range(loop, len(lines)) if "scf.yield" in lines[i])
    assert len(atomics) == 2 and "scf.if" not in ir
    arrive, give_up = atomics
    assert barriers[0] < arrive < loop < end < give_up < barriers[-1]
    assert any("ld.acquire.gpu" in lines[i] for i in range(loop, end))


@pytest.mark.parametrize("programs", [1, 2, 128, 132, 1024])
@pytest.mark.parametrize("start", [0, 5 * 1024, 2**31 - 1024, 2**32 - 2 * 1024])
def test_counter_targets_agree_within_a_barrier_and_across_the_wrap(programs, start):
    """The counter barrier's arithmetic on the CPU: arrivals in any order (program 0's
    weighted add anywhere among them) from a word at a multiple of COUNTER_STEP, int32
    wrap included: every program computes the same target, which the word reaches exactly
    when the last one arrives, and that target is where the next barrier starts."""
    from pallas_kernels._common import COUNTER_STEP, counter_target
    i32 = lambda v: int(np.array(v, np.int64).astype(np.int32))
    rng = np.random.default_rng(programs + start % 97)
    word = i32(start)
    for _ in range(3):  # three barriers in a row
        order = rng.permutation(programs)
        befores, w = [], word
        for p in order:
            befores.append(w)
            w = i32(w + (COUNTER_STEP - programs + 1 if p == 0 else 1))
        targets = {int(counter_target(jnp.int32(b))) for b in befores}
        assert targets == {i32(word + COUNTER_STEP)} and w == i32(word + COUNTER_STEP)
        # before the last arrival the word is still short of the target (wrap-aware)
        assert all(i32(b - i32(word + COUNTER_STEP)) < 0 for b in befores)
        word = w


def test_counter_barrier_in_interpret_mode_counts_the_arrivals():
    """One program in interpret mode: the arrivals word grows by COUNTER_STEP per barrier,
    across the int32 wrap too."""
    from pallas_kernels._common import COUNTER_STEP
    f = jax.jit(barrier_call(1, 5, interpret=True, spin="counter"))
    out, state = f(jnp.zeros((3,), jnp.int32))
    assert out.tolist() == expected(1, 5) and state.tolist() == [5 * COUNTER_STEP, 0, 0]
    start = 2**31 - 2 * COUNTER_STEP
    out, state = f(jnp.asarray([start, 0, 0], jnp.int32))
    assert state.tolist() == [int(np.array(start + 5 * COUNTER_STEP, np.int64).astype(np.int32)),
                              0, 0]
