"""The handover between gemv_flow's stages: the counter state's layout, the ticket, the wait
on a stage's done count, the done count itself and the reset (pallas_kernels/gemv_flow.py
says why; docs/kernels.md how).

State: int32 [(stages + 3) * WORD], one word per 128-byte line so that the ticket's atomics,
each stage's count and the spins on it do not share a line: word 0 the ticket, word 1 + s
stage s's done count, word stages + 1 the give-ups, word stages + 2 the guesses missed
(order "guess": programs whose ticket was not their index). Word w is element w * WORD.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import pl, plt

WORD = 32  # int32 elements per state word: 128 bytes, an L2 line
SPIN_LIMIT = 1 << 22  # re-reads before a waiting program gives up (seconds, not a hang)
# How a program waits: "thread0" (one thread spins in PTX on relaxed loads, acquires once,
# then a CTA barrier releases the others: one L2 read per program per round, the pattern of
# CUTLASS's semaphore wait; the acquire invalidates the SM's L1 for every thread) or "all"
# (every thread re-reads the count with ld.acquire.gpu, as the grid barrier's counter spin
# does, plus an acq_rel give-up add per program whose fence may wait for the weight loads in
# flight).
SPINS = ("thread0", "all")


def state_size(stages: int) -> int:
    return (stages + 3) * WORD


def state_for(stages: int) -> jax.Array:
    """The zeroed state for a chain of `stages` (the module docstring's layout). Each call
    leaves it as it found it but for the give-ups and the misses."""
    return jnp.zeros((state_size(stages),), jnp.int32)


def give_ups(state) -> jax.Array:
    """Programs that stopped waiting without seeing their input complete, or that drew a
    ticket past the grid (a state not zeroed, e.g. after an earlier give-up): 0 when the
    handover held; nonzero means wrong results (start from a fresh state_for)."""
    return state[-2 * WORD]


def misses(state) -> jax.Array:
    """order "guess": programs whose ticket was not their own index (each dropped a
    requested block and loaded its ticket's), summed over the calls the state saw."""
    return state[-WORD]


def count_miss(state_ref, stages: int):
    """One program whose guess missed (off the usual path: its acq_rel fence is no cost)."""
    plt.atomic_add(state_ref, _at(stages + 2), jnp.int32(1))


def _at(word: int):
    return (jnp.int32(word * WORD),)


def ticket(state_ref, *, relaxed: bool = False):
    """This program's place in start order (one atomic add by one thread): acq_rel, or with
    relaxed (GPU only) a relaxed one, which later loads need not wait for."""
    if relaxed:
        from pallas_kernels.ref_ptx import relaxed_atomic_add
        return relaxed_atomic_add(state_ref, 0, 1)
    return plt.atomic_add(state_ref, _at(0), jnp.int32(1))


def count_stray(state_ref, stages: int, *, trap: bool = False):
    """A ticket past the grid (the state was not zeroed): counted as a give-up (and with
    trap the kernel stops, see trap_now)."""
    plt.atomic_add(state_ref, _at(stages + 1), jnp.int32(1))
    if trap:
        trap_now(state_ref)


# PTX trap: the kernel stops and CUDA reports an error at the next synchronisation (the
# process's GPU context is lost). What the engine asks for on a give-up: results computed
# from an input that was not complete must never pass for tokens.
_TRAP = "trap;\n\tmov.u32 $0, 0; // $1 (unused)"


def trap_now(state_ref):
    """Stops the kernel (GPU only; kept by its write effect)."""
    from pallas_kernels.ref_ptx import ref_asm
    ref_asm(state_ref, 0, _TRAP, writes=True)


def _sleep_zero(state_ref, ns: int):
    """nanosleep.u32 ns in every thread; returns an int32 zero to keep it in the spin."""
    from pallas_kernels.ref_ptx import ref_asm
    return ref_asm(state_ref, 0, f"nanosleep.u32 {ns};\n\tmov.u32 $0, 0; // $1 (unused)")


# The thread-0 wait: %d target, %s the backoff, %d re-reads before giving up, %d the give-up
# word's byte offset from the awaited one, %s what follows the give-up's count ("trap;" or
# "") (labels are scoped by the braces, as in CUTLASS).
# It re-reads with relaxed GPU-scope loads (an acquire load invalidates the SM's L1 on every
# read) and acquires once when the count is there (counts only grow within a call).
_SPIN0 = ("{\n\t.reg .pred %%p_w0, %%p_w1;\n\t.reg .s32 %%v_w, %%n_w, %%t_w;\n\t"
          "mov.u32 $0, 0;\n\tmov.u32 %%t_w, %%tid.x;\n\tsetp.ne.s32 %%p_w0, %%t_w, 0;\n\t"
          "@%%p_w0 bra W_DONE;\n\tmov.s32 %%n_w, 0;\nW_LOOP:\n\t"
          "ld.relaxed.gpu.global.b32 %%v_w, [$1];\n\tsetp.ge.s32 %%p_w1, %%v_w, %d;\n\t"
          "@%%p_w1 bra W_SEEN;\n\t%s"
          "add.s32 %%n_w, %%n_w, 1;\n\tsetp.lt.s32 %%p_w1, %%n_w, %d;\n\t"
          "@%%p_w1 bra W_LOOP;\n\tred.relaxed.gpu.global.add.u32 [$1+%d], 1;\n\t%s"
          "bra W_DONE;\nW_SEEN:\n\tld.acquire.gpu.global.b32 %%v_w, [$1];\nW_DONE:\n\t}")


def wait(state_ref, stage: int, target: int, stages: int, *, gpu_sync: bool, backoff: int,
         spin: str, trap: bool = False):
    """Waits until stage `stage`'s done count reaches target. Returns an int32 zero for the
    offsets of the awaited output's reads (a plain 0 with "thread0"; with "all" a product of
    the read, which Triton folds away). What keeps those reads after the wait on the GPU is
    the impure asm (LLVM moves no memory access across it) and the CTA barrier. Interpret
    mode: one read (programs ran in order); a count short of target is a give-up. trap: a
    give-up also stops the kernel (trap_now; gemv_flow passes it on the GPU only)."""
    word, give_up = (1 + stage) * WORD, (stages + 1) * WORD
    if gpu_sync and spin == "thread0":
        from pallas_kernels.ref_ptx import ref_asm
        sleep = f"nanosleep.u32 {backoff};\n\t" if backoff else ""
        # writes=True (its give-up add): kept without a consumer, so the reads that follow
        # keep their alignment hints (an asm zero in their offsets would hide them)
        ref_asm(state_ref, word, _SPIN0 % (target, sleep, SPIN_LIMIT, 4 * (give_up - word),
                                           "trap;\n\t" if trap else ""), writes=True)
        plt.debug_barrier()  # the other threads wait here for thread 0
        return jnp.int32(0)
    if gpu_sync:
        from pallas_kernels.ref_ptx import gpu_load
        pause = (lambda i: _sleep_zero(state_ref, backoff) + 0 * i) if backoff else \
            (lambda i: 0 * i)
        seen, _ = lax.while_loop(
            lambda c: (c[0] < target) & (c[1] < SPIN_LIMIT),
            lambda c: (gpu_load(state_ref, word + pause(c[1]), sem="acquire"), c[1] + 1),
            (gpu_load(state_ref, word, sem="acquire"), jnp.int32(0)))
    else:
        seen = plt.atomic_add(state_ref, (jnp.int32(word),), jnp.int32(0))
    # unconditional (0 when the wait held): every thread takes the same path
    plt.atomic_add(state_ref, (jnp.int32(give_up),), (seen < target).astype(jnp.int32))
    if trap:
        pl.when(seen < target)(lambda: trap_now(state_ref))
    if gpu_sync:
        plt.debug_barrier()
    return 0 * seen


# The reset: thread 0 stores 0 to each listed byte offset (relaxed: every other update of
# these words happened before it, through the acquire chain that made this program the last;
# the kernel's end publishes it). Stores, not adds: a state off by a stray count is healed.
_RESET = ("{\n\t.reg .pred %%p_r;\n\t.reg .u32 %%t_r;\n\tmov.u32 %%t_r, %%tid.x;\n\t"
          "setp.eq.u32 %%p_r, %%t_r, 0;\n\t%s\tmov.u32 $0, 0;\n\t}")


def finish(state_ref, stage: int, programs: tuple, *, gpu_sync: bool, order: str):
    """Counts this program done in `stage` (release: a CTA barrier orders every warp's stores
    before one thread's acq_rel atomic); the last program of the last stage puts the ticket
    and the done counts back to zero. programs: every stage's program count."""
    if gpu_sync:
        plt.debug_barrier()
    old = plt.atomic_add(state_ref, _at(1 + stage), jnp.int32(1))
    if stage != len(programs) - 1:
        return

    @pl.when(old == programs[-1] - 1)
    def _():
        ticketed = order != "program_id"
        words = ([0] if ticketed else []) + [1 + j for j in range(len(programs))]
        if gpu_sync:
            from pallas_kernels.ref_ptx import ref_asm
            stores = "".join(f"@%p_r st.relaxed.gpu.global.b32 [$1+{4 * w * WORD}], 0;\n\t"
                             for w in words)
            ref_asm(state_ref, 0, _RESET % stores, writes=True)  # (stores: no % escapes)
            return
        # interpret mode (no asm): adds of what each word holds, which the atomics report
        if ticketed:
            plt.atomic_add(state_ref, _at(0), jnp.int32(-sum(programs)))
        for j, p in enumerate(programs):
            plt.atomic_add(state_ref, _at(1 + j), jnp.int32(-p))
