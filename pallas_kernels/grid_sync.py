"""Grid-wide and group-wide synchronisation inside one Pallas (Triton) kernel: the grid barrier
(three spin modes) and the "counter" handover that attention_o's per-head merge reuses.
Moved out of _common.py, which re-exports every name here."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


GEN_MASK = (1 << 30) - 1  # the barrier's generation stays in [0, 2**30)
# How a waiting program re-reads the generation: "atomic" (an atomic add of 0, acquire; the
# session-11 barrier, 2.84 us) or "load" (ld.relaxed.gpu through pallas_kernels.ref_ptx: a
# plain read, which does not queue read-modify-writes on the line the arrivals update; session
# 14: 2.71-2.92 us against the atomic spin's 2.63-2.78 in session 15, no gain) or "counter"
# (session 15: no generation; the arrivals word only grows, each barrier by exactly
# COUNTER_STEP, and a program waits with acquire loads for the next multiple of it above
# what its arrival saw: one atomic per program per barrier, no reset by the last arrival).
# Read at trace time, like PDL; grid_barrier's spin= overrides it.
BARRIER = {"spin": "atomic"}
SPIN_MODES = ("atomic", "load", "counter")
# What one "counter" barrier adds to the arrivals word whatever the grid (program 0 adds
# COUNTER_STEP - programs + 1, the others 1): a power of two, so the word's multiples of it
# survive the int32 wrap, and the same for every grid size, so grids may share a state.
COUNTER_STEP = 1024


def counter_target(before):
    """The "counter" barrier's target from the arrivals word as this program's arrival found
    it (`before`): the next multiple of COUNTER_STEP. Between two barriers the word is a
    multiple of it; during one it is below the next (the arrivals add up to exactly one
    step), so every program of the barrier computes the same target; int32 wrap included."""
    return (before & jnp.int32(-COUNTER_STEP)) + jnp.int32(COUNTER_STEP)


SPIN_LIMIT = 1 << 22  # re-reads before a waiting program gives up (seconds, not a hang)


def grid_barrier(state_ref, programs, *, gpu_sync: bool = True, spin: str | None = None,
                 program=None):
    """Every program of the grid waits here until all `programs` have arrived. state_ref:
    int32 [3] (arrivals, generation, give-ups), zeros when first used; each barrier leaves
    the arrivals at 0 and advances the generation, so the state is reused across barriers
    and calls without being reset (a sense-reversing barrier).

    Built on the split merge's counter pattern (split_merge.merge_if_last): a CTA barrier orders
    every warp's stores before one thread's atomics, which Pallas lowers to atom.acq_rel.gpu.
    Each program reads the generation, then arrives; the last to arrive takes the arrivals
    back to 0 and then advances the generation (release: every program's stores, and the
    reset, are visible GPU-wide first; nobody else changes either in between); the others
    re-read the generation by atomic adds of 0 (acquire), or with BARRIER["spin"] = "load"
    by relaxed GPU-scope loads in every thread (then one atomic re-read: the acquire, and a
    give-up decision that is the program's, not each thread's), until it moves, and a second
    CTA barrier holds their other warps until then. spin: one of SPIN_MODES; None reads
    BARRIER. A program that re-reads SPIN_LIMIT times without seeing it move (some program
    never arrived: the grid was not all resident) counts itself in the third word and goes
    on, so a broken barrier shows as a nonzero count and wrong results, not as a hung GPU.
    Returns the generation this barrier passed.

    Deadlock-free only if every program of the grid is resident at once (at most the SM
    count times the programs an SM holds): the caller sizes the grid for that. Interpret
    mode runs programs one after another and has no lowering for the CTA barriers: with
    gpu_sync=False there is no spin, which is right for a one-program grid only (callers
    refuse more in interpret mode).

    spin "counter": the state is (arrivals, unused, give-ups). Each program arrives with one
    atomic add (program 0 adds COUNTER_STEP - programs + 1, the others 1, so a barrier adds
    exactly COUNTER_STEP), which nobody resets, and waits until the word reaches
    counter_target(what its add returned), re-reading it with ld.acquire.gpu in every
    thread; a program that gives up counts itself in the third word as above. After n
    barriers the state is (n * COUNTER_STEP mod 2**32, 0, 0). Needs programs <=
    COUNTER_STEP. program: pl.program_id(0), read by the counter spin (pass it from outside a
    loop body: interpret mode cannot lower program_id inside one). Returns the target."""
    zero, one, two = jnp.int32(0), jnp.int32(1), jnp.int32(2)
    spin = BARRIER["spin"] if spin is None else spin
    if spin not in SPIN_MODES:
        raise ValueError(f"grid_barrier spin (_common.BARRIER['spin']) must be one of "
                         f"{SPIN_MODES}, got {spin!r}")
    if spin == "counter" and isinstance(programs, int) and not 1 <= programs <= COUNTER_STEP:
        raise ValueError(f"grid_barrier spin 'counter' takes 1..{COUNTER_STEP} programs, got "
                         f"{programs}")
    if gpu_sync:
        plt.debug_barrier()
    if spin == "counter":
        return _counter_barrier(state_ref, programs, gpu_sync,
                                pl.program_id(0) if program is None else program)
    gen = plt.atomic_add(state_ref, (one,), zero)
    arrived = plt.atomic_add(state_ref, (zero,), one) + 1

    @pl.when(arrived == programs)
    def _():  # adds, not exchanges: interpret mode has no exchange; the values are known
        plt.atomic_add(state_ref, (zero,), jnp.int32(-programs))
        plt.atomic_add(state_ref, (one,), jnp.where(gen == GEN_MASK, jnp.int32(-GEN_MASK), one))

    if gpu_sync:
        if spin == "load":
            from pallas_kernels.ref_ptx import gpu_load
            looked, _ = lax.while_loop(  # every thread spins on its own relaxed GPU loads
                lambda c: (c[0] == gen) & (c[1] < SPIN_LIMIT),
                lambda c: (gpu_load(state_ref, 1), c[1] + 1), (gen, zero))
            # Then one atomic re-read (acq_rel, as the atomic spin's reads are): the acquire
            # for the program, as in the atomic spin, and the give-up decided on one value
            # for the whole program (threads may disagree at SPIN_LIMIT) before the CTA
            # barriers below. Its index uses the loop's result (times 0): JAX's dead-code
            # elimination would otherwise drop the loop, whose loads it treats as removable.
            seen = plt.atomic_add(state_ref, (one + 0 * looked,), zero)
        else:
            seen, _ = lax.while_loop(
                lambda c: (c[0] == gen) & (c[1] < SPIN_LIMIT),
                lambda c: (plt.atomic_add(state_ref, (one,), zero), c[1] + 1), (gen, zero))

        @pl.when(seen == gen)
        def _():
            plt.atomic_add(state_ref, (two,), one)
        plt.debug_barrier()
    return gen


def _counter_barrier(state_ref, programs, gpu_sync, program, *, word=None, give_up=None,
                     flat=None):
    """grid_barrier's "counter" spin, after the first CTA barrier: `programs` programs (this
    one is `program`) arrive on the arrivals word state_ref[word] and wait for each other;
    one that gives up counts itself in state_ref[give_up]. Defaults: words 0 and 2 of a
    1-D state; another caller (attention_o's per-head handover) names its words, with `flat`
    the arrivals word's flat element offset (for the spin's loads)."""
    zero, two = jnp.int32(0), jnp.int32(2)
    word = (zero,) if word is None else word
    give_up = (two,) if give_up is None else give_up
    # program 0: COUNTER_STEP - programs + 1, the others 1
    weight = 1 + (program == 0).astype(jnp.int32) * (COUNTER_STEP - programs)
    before = plt.atomic_add(state_ref, word, weight)
    target = counter_target(before)
    if not gpu_sync:
        return target
    from pallas_kernels.ref_ptx import gpu_load
    at = (lambda i: 0 * i) if flat is None else (lambda i: flat + 0 * i)
    # (seen - target) < 0 rather than seen < target: right across the int32 wrap
    seen, _ = lax.while_loop(
        lambda c: (c[0] - target < 0) & (c[1] < SPIN_LIMIT),
        lambda c: (gpu_load(state_ref, at(c[1]), sem="acquire"), c[1] + 1),
        (before + weight, zero))
    # The give-up count as an unconditional add (0 when the barrier held): every thread takes
    # the same path (threads may disagree at SPIN_LIMIT), and with its result unused the add
    # need not wait for a reply.
    plt.atomic_add(state_ref, give_up, (seen - target < 0).astype(jnp.int32))
    plt.debug_barrier()
    return target
