"""A chain of streaming GEMVs in one kernel, handed over through completion counters taken in
ticket order (experimental: batch-1 decode's o -> gate/up -> down [-> the next layer's qkv]).

Batch-1 decode runs a kernel per projection, and each pays a boundary, a ramp and a tail
(session 15's in-kernel timeline: 0.54-0.58 us gap per kernel, 0.5-1.4 us tail, ~1 us for each
program's first weights). Session 11/15's persistent kernel (gemv_chain) removed a boundary
with a grid barrier: every program of a resident grid waited for all, so each phase's tail
still idled the GPU, and the barrier cost about what the boundary did. This kernel keeps the
separate kernels' grids, laid end to end, and drops the barrier:

    ticket = atomic_add(state[0], 1)         which program this is, in start order
    stage s, block q = the ticket's range     stage 0's programs first, then stage 1's, ...
    request block q's first weight slab       (weights: nothing to wait for)
    wait until state[s] == programs of s - 1  (every block of the input stored; acquire loads)
    prologue, stream the blocks, store        (gemv_stream's helpers: the same bits)
    count itself done in state[1 + s]         (release)

A program waits only for programs holding lower tickets, which took theirs before it, so they
are running or finished: no deadlock whatever the number of programs or the scheduler's order,
and the grid need not be resident at once (unlike a grid barrier). What it buys: a stage's
programs start on free SMs and put their weight requests in flight while the previous stage's
tail drains, with no kernel boundary in between. The last program of the last stage puts the
state back to zeros (all others are past their waits by then), so it is threaded through calls.
order="guess" requests the first weight slab of the program's own index (the ticket it
usually draws; unmeasured) before drawing a relaxed ticket, so the ticket's round trip does
not delay the first request; a program whose ticket differs runs as the ticket says (the
default order="ticket": the ticket first). order="program_id" draws no ticket and relies on the
hardware starting programs in index order, which CUDA does not promise. A program that
waits too long (SPIN_LIMIT) counts itself in the give-up word and goes on, so a broken order
shows as a nonzero count and wrong results, not a hang.

Stages: stage 0 reads the kernel's input x; a plain stage reads the previous stage's output;
an add_norm stage (the sandwich layer's residual add and RMSNorms, gemv_stream's prologue)
reads the residual h (the first) or the previous add_norm stage's x' (later ones) plus the
previous stage's output as the branch, and stores x' too. So the MLP chain is
[o, gate_up(add_norm, gated), down] and with the next layer [.., qkv(add_norm)].

In the engine as the opt-in projections '+flow' / '+flow4' / '+flow5'
(ouro_jax/projections.py); `benchmarks.gemv_flow` times it against the separate kernels on
the GPU: exact there, and 4-15 us per layer slower (session 23, H100; docs/performance.md),
so it stays opt-in. In interpret mode (CPU tests) programs run in index order, so every wait
is already met.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import flow_attention, flow_sync
from pallas_kernels._common import compiler_params, pl
from pallas_kernels.flow_attention import AttnPlan, AttnStage  # noqa: F401
# the stages (re-exported: the chain's callers have always found them here)
from pallas_kernels.flow_stages import ENGINE_TILING, Stage, mlp_stages  # noqa: F401
from pallas_kernels.flow_sync import (SPIN_LIMIT, SPINS, give_ups, misses,  # noqa: F401
                                      state_for, state_size)
from pallas_kernels.gemv import check_norm_operands, check_operands
from pallas_kernels.gemv_blocks import block_loader, stream_blocks
from pallas_kernels.gemv_rows import row_inputs
from pallas_kernels.gemv_stream import check_supported
from pallas_kernels.l2_prefetch import prefetch_block, prefetch_blocks

# "guess": the first weight block of the program's index (the ticket it usually draws: how
# often is unmeasured; misses() counts the others) is requested before a relaxed ticket is
# drawn; a program whose ticket differs drops that block and runs as its ticket says (the
# "ticket" path), so the guess costs nothing in safety. It saves the ticket's round trip
# before the first request (_guessed), at twice the code (each stage's body twice).
ORDERS = ("ticket", "program_id", "guess")
TILING_KEYS = ("block_n", "block_k", "per_program")


class _Plan(NamedTuple):
    """A stage's static layout in the grid (hashable: a kernel parameter)."""
    gated: bool
    add_norm: bool
    n_out: int
    k: int
    block_n: int
    block_k: int
    per_program: int
    programs: int
    start: int  # its first ticket


def _loader(refs: dict, pl_, s: int):
    return block_loader(refs["w"][s], block_n=pl_.block_n, block_k=pl_.block_k,
                        nk=pl_.k // pl_.block_k, gated=pl_.gated, up_offset=pl_.n_out)


def _stage(q, s: int, refs: dict, plans, *, eps, gpu_sync, order, backoff, l2_prefetch, spin,
           trap, first=None, no_wait=False):
    """Program q of stage s: its first weight slab requested (unless `first` holds it), the
    wait for stage s - 1, the prologue and its blocks (gemv_stream's code), then its done
    count."""
    pl_ = plans[s]
    wait = functools.partial(flow_sync.wait, refs["state"], s - 1, plans[s - 1].programs,
                             len(plans), gpu_sync=gpu_sync, backoff=backoff, spin=spin,
                             trap=trap) if s and not no_wait else (lambda: jnp.int32(0))
    if isinstance(pl_, AttnPlan):  # nothing to request before its input is there
        wait()
        flow_attention.run(q, pl_, refs["attn_in"][s], refs["attn_out"][s],
                           refs["y"][s - 1] if s else refs["x"], refs["y"][s],
                           gpu_sync=gpu_sync)
        flow_sync.finish(refs["state"], s, tuple(p.programs for p in plans),
                         gpu_sync=gpu_sync, order=order)
        return
    nk = pl_.k // pl_.block_k
    w_ref = refs["w"][s]
    load = _loader(refs, pl_, s)
    first = load(q) if first is None else first  # in flight during the wait
    after = jnp.int32(0)
    if s:  # the prefetches kept by their write effect: their zeros stay out of `after`
        prefetch_blocks(w_ref, q, pl_.programs, min(l2_prefetch, pl_.per_program - 1),
                        k=pl_.k, block_n=pl_.block_n, gated=pl_.gated, up_offset=pl_.n_out,
                        interpret=not gpu_sync, keep=True)
        after = wait()
    y_prev = refs["y"][s - 1] if s else None
    if pl_.add_norm:
        src = (refs["resid"][s], y_prev, *refs["norms"][s], refs["xo"][s])
        prologue = "add_norm"
    else:
        src = (refs["x"] if s == 0 else y_prev, None, None, None, None)
        prologue = ""
    xs = row_inputs(src, m=refs["m"], nk=nk, block_k=pl_.block_k, k=pl_.k,
                    dt=refs["y"][s].dtype, prologue=prologue, eps=eps, first_program=q == 0,
                    row2d=False, after=after)
    stream_blocks(load, first, xs, refs["y"][s], p=q, programs=pl_.programs,
                  per_program=pl_.per_program, block_n=pl_.block_n, block_k=pl_.block_k,
                  nk=nk, gated=pl_.gated)
    flow_sync.finish(refs["state"], s, tuple(p.programs for p in plans), gpu_sync=gpu_sync,
                     order=order)


def _sort_refs(refs, plans, m: int) -> dict:
    """The kernel's refs by role: x, [h], per stage its weight (and branch_w, norm_w; an
    attention stage its flow_attention.operands), the state in; per stage y, per add_norm
    stage x', per attention stage its flow_attention.outputs, the state out."""
    it = iter(refs)
    out = {"m": m, "x": next(it)}
    h = next(it) if any(p.add_norm for p in plans) else None
    out["w"], out["norms"], out["attn_in"], out["attn_out"] = [], [], {}, {}
    for s, p in enumerate(plans):
        if isinstance(p, AttnPlan):
            out["w"].append(None)
            out["norms"].append(None)
            out["attn_in"][s] = [next(it) for _ in range(flow_attention.n_inputs(p))]
            continue
        out["w"].append(next(it))
        out["norms"].append((next(it), next(it)) if p.add_norm else None)
    next(it)  # the state in, aliased with the state out: the atomics go through that
    out["y"] = [next(it) for _ in plans]
    xo = {s: next(it) for s, p in enumerate(plans) if p.add_norm}
    for s, p in enumerate(plans):
        if isinstance(p, AttnPlan):
            out["attn_out"][s] = [next(it) for _ in range(flow_attention.n_outputs(p))]
    out["state"] = next(it)
    # an add_norm stage's residual: h for the first, the previous add_norm stage's x' after
    out["resid"], out["xo"], last = {}, {}, h
    for s in sorted(xo):
        out["resid"][s], out["xo"][s], last = last, xo[s], xo[s]
    return out


def _kernel(*refs, plans, m, eps, gpu_sync, order, backoff, l2_prefetch, spin, l2_guess,
            trap, no_wait=False):
    r = _sort_refs(refs, plans, m)
    run = functools.partial(_stage, refs=r, plans=plans, eps=eps, gpu_sync=gpu_sync,
                            order=order, backoff=backoff, l2_prefetch=l2_prefetch, spin=spin,
                            trap=trap, no_wait=no_wait)
    within = lambda t, p: (t >= p.start) & (t < p.start + p.programs)

    def dispatch(t):  # run as ticket t says
        for s, p in enumerate(plans):
            pl.when(within(t, p))(functools.partial(
                lambda s_, p_: run(t - p_.start, s_), s, p))

    pid = pl.program_id(0)
    if order == "guess":
        guess = _guess(pid, sum(p.programs for p in plans))
        ticket = _guessed(guess, r, plans, run, gpu_sync)

        @pl.when(ticket != guess)
        def _():
            flow_sync.count_miss(r["state"], len(plans))
            dispatch(ticket)
    else:
        if l2_guess:  # the block of ticket == pid asked into L2 before the ticket is drawn
            def ask(s_, p_):  # (kept by its write effect; a pl.when body returns nothing)
                prefetch_block(r["w"][s_], pid - p_.start, p_.programs, 0, k=p_.k,
                               block_n=p_.block_n, gated=p_.gated, up_offset=p_.n_out,
                               interpret=not gpu_sync, keep=True)
            for s, p in enumerate(plans):
                pl.when(within(pid, p))(functools.partial(ask, s, p))
        ticket = pid if order == "program_id" else flow_sync.ticket(r["state"])
        dispatch(ticket)
    pl.when(ticket >= sum(p.programs for p in plans))(
        lambda: flow_sync.count_stray(r["state"], len(plans), trap=trap))


def _guess(pid, programs: int):
    """The ticket a program bets on: its own index (a test patches this to make every guess
    miss, which interpret mode's in-order tickets never do)."""
    del programs
    return pid


def _guessed(guess, r, plans, run, gpu_sync):
    """order "guess": the first weight block of ticket `guess` is requested, then the ticket
    is drawn (a relaxed atomic: a fence before it would wait for those loads; Triton
    broadcasts a scalar atomic's result through a CTA barrier, so loads placed after it
    would wait for its round trip), and the stage runs with that block if the guess held.
    Returns the ticket. (Interpret mode has no relaxed atomic: the acq_rel one there.)"""
    def branch(s, p):
        def f():
            first = _loader(r, p, s)(guess - p.start)
            t = flow_sync.ticket(r["state"], relaxed=gpu_sync)
            pl.when(t == guess)(lambda: run(guess - p.start, s, first=first))
            return t
        return f
    stage = sum((guess >= p.start).astype(jnp.int32) for p in plans[1:])
    return lax.switch(stage, [branch(s, p) for s, p in enumerate(plans)])


def _plan(stages, x, h, num_warps: int) -> tuple:
    """The stages' static layout; ValueError names the first thing that does not chain."""
    m = x.shape[0]
    plans, start, width = [], 0, x.shape[1]
    for s, st in enumerate(stages):
        label = f"gemv_flow stage {s}" + (f" ({st.name})" if st.name else "")
        if isinstance(st, AttnStage):
            plans.append(flow_attention.plan(st, m, width, start, label))
            start, width = start + plans[-1].programs, plans[-1].n_out
            continue
        if (st.branch_w is None) != (st.norm_w is None):
            raise ValueError(f"{label}: an add_norm stage takes both branch_w and norm_w")
        if st.add_norm and s == 0:
            raise ValueError(f"{label}: the first stage cannot be add_norm (its branch is the "
                             f"previous stage's output)")
        if st.add_norm:
            if h is None:
                raise ValueError(f"{label} is add_norm: pass the residual h")
            if width != h.shape[1]:
                raise ValueError(f"{label}: the previous stage gives [{m}, {width}] as the "
                                 f"branch, but the residual h is {tuple(h.shape)}")
            check_norm_operands(label, h, st.norm_w, h, st.branch_w)
        ref_x = h if st.add_norm else jax.ShapeDtypeStruct((m, width), x.dtype)
        try:
            n_out = check_operands(ref_x, st.w, st.gated)
        except ValueError as e:
            raise ValueError(f"{label}: {e}") from None
        t = dict(st.tiling or {})
        unknown = set(t) - set(TILING_KEYS)
        if unknown or set(TILING_KEYS) - set(t):
            raise ValueError(f"{label}: tiling takes exactly {list(TILING_KEYS)}, got "
                             f"{sorted(t)}")
        k = st.w.shape[1]
        check_supported(m, k, n_out, num_warps=num_warps, **t)
        programs = n_out // t["block_n"] // t["per_program"]
        plans.append(_Plan(st.gated, st.add_norm, n_out, k, t["block_n"], t["block_k"],
                           t["per_program"], programs, start))
        start, width = start + programs, n_out
    return tuple(plans)


def gemv_flow(x, stages, state, *, h=None, eps: float = 1e-6, interpret: bool = False,
              num_warps: int = 4, order: str = "ticket", backoff: int = 0,
              l2_prefetch: int = 0, spin: str = "thread0", l2_guess: bool = False,
              trap: bool = False, num_stages: int = 1, diag_no_wait: bool = False):
    """The chain of Stage GEMVs (see the module docstring) on x [M, K0] (M up to
    gemv_stream.MAX_ROWS), h [M, K] the residual for the add_norm stages, state: int32
    [state_size(len(stages))] (state_for; donate it). Returns (ys, xs, state): every stage's output
    (gated: silu(gate) * up), every add_norm stage's x' in order, and the state (zeros but
    the give-up count, give_ups()). The bits are gemv_stream's / gemv_stream_normed's for the
    same tilings, call by call. order: ORDERS; backoff: nanoseconds a waiting program sleeps
    between re-reads (0: none); l2_prefetch: blocks a waiting program requests into L2 beyond
    the one in registers, before it waits; spin: SPINS (how a program waits); l2_guess: with
    order "ticket" / "program_id", each program first asks L2 for the first block of the
    ticket it usually draws (its index), a cheaper bet than "guess" (no second copy of the
    stage bodies; a miss wastes one prefetch); trap: a give-up (see give_ups) also stops the
    kernel with a PTX trap, an error at the next synchronisation instead of results computed
    from an incomplete input (the engine's choice; GPU only: interpret mode counts).
    num_stages: Triton's pipelining depth for the kernel (1: the GEMV stages' measured
    setting; the separate attention kernel runs 2). diag_no_wait: a DIAGNOSTIC that gives
    wrong results: no stage waits for the one before (it reads whatever its input holds),
    to time the stages' overlap without the handover (benchmarks.flow_layer's _nowait
    arms); never for results. A stage may also be a
    flow_attention.AttnStage (decode attention on the previous stage's
    packed qkv, or on x when first); then the call returns (ys, xs, state, caches), caches
    per attention stage its (k_cache, v_cache, counters), updated in place."""
    stages = list(stages)
    if not stages:
        raise ValueError("gemv_flow needs at least one stage")
    if order not in ORDERS:
        raise ValueError(f"gemv_flow order must be one of {ORDERS}, got {order!r}")
    if spin not in SPINS:
        raise ValueError(f"gemv_flow spin must be one of {SPINS}, got {spin!r}")
    if not isinstance(trap, bool):
        raise ValueError(f"gemv_flow trap must be a bool, got {trap!r}")
    if not isinstance(l2_guess, bool) or (l2_guess and order == "guess"):
        raise ValueError(f"gemv_flow l2_guess must be a bool, and not with order 'guess' "
                         f"(which loads that block itself), got {l2_guess!r}")
    if not isinstance(diag_no_wait, bool):
        raise ValueError(f"gemv_flow diag_no_wait must be a bool, got {diag_no_wait!r}")
    if type(num_stages) is not int or not 1 <= num_stages <= 4:
        raise ValueError(f"gemv_flow num_stages must be an int in 1..4, got {num_stages!r}")
    for name, v in (("backoff", backoff), ("l2_prefetch", l2_prefetch)):
        if type(v) is not int or v < 0:
            raise ValueError(f"gemv_flow {name} must be an int >= 0, got {v!r}")
    if type(num_warps) is not int or num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"gemv_flow num_warps must be a power of two up to 16, got "
                         f"{num_warps!r}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim != 2:
        raise ValueError(f"gemv_flow takes floating-point x [M, K], got {x.dtype} {x.shape}")
    if h is not None and (h.shape[0] != x.shape[0] or h.dtype != x.dtype):
        raise ValueError(f"gemv_flow: h must be {x.dtype} with x's {x.shape[0]} rows, got "
                         f"{h.dtype} {h.shape}")
    if state.shape != (state_size(len(stages)),) or state.dtype != jnp.int32:
        raise ValueError(f"gemv_flow: the state must be int32 [{state_size(len(stages))}] "
                         f"(state_for({len(stages)})), got {state.dtype} {state.shape}")
    plans = _plan(stages, x, h, num_warps)
    attn = [s for s, p in enumerate(plans) if isinstance(p, AttnPlan)]
    if attn and (order == "guess" or l2_guess):
        raise ValueError("gemv_flow: an attention stage runs with order 'ticket' or "
                         "'program_id' and without l2_guess (their first-block bets are "
                         "GEMV blocks)")
    m, dt = x.shape[0], x.dtype
    operands = [x] + ([h] if h is not None and any(p.add_norm for p in plans) else [])
    in_at = {}
    for s, st in enumerate(stages):
        if s in attn:
            in_at[s] = len(operands)
            operands += flow_attention.operands(st, dt)
            continue
        operands.append(st.w.astype(dt))
        if st.add_norm:
            operands += [st.branch_w.astype(dt), st.norm_w.astype(dt)]
    sd = jax.ShapeDtypeStruct
    out_shape = [sd((m, p.n_out), dt) for p in plans]
    out_shape += [sd((m, p.k), dt) for p in plans if p.add_norm]
    aliases = {}
    for s in attn:
        for i, o in flow_attention.aliased(plans[s]):
            aliases[in_at[s] + i] = len(out_shape) + o
        out_shape += flow_attention.outputs(plans[s], stages[s], m)
    aliases[len(operands)] = len(out_shape)
    out_shape.append(sd(state.shape, jnp.int32))
    kernel = functools.partial(_kernel, plans=plans, m=m, eps=float(eps),
                               gpu_sync=not interpret, order=order, backoff=backoff,
                               l2_prefetch=l2_prefetch, spin=spin, l2_guess=l2_guess,
                               trap=trap and not interpret,  # no trap to run there
                               no_wait=diag_no_wait)
    outs = pl.pallas_call(
        kernel, grid=(sum(p.programs for p in plans),), out_shape=tuple(out_shape),
        input_output_aliases=aliases,
        compiler_params=compiler_params(num_warps, num_stages), interpret=interpret,
        name="gemv_flow",
    )(*operands, state)
    n, n_x = len(plans), sum(p.add_norm for p in plans)
    ys, xs, rest = list(outs[:n]), list(outs[n:n + n_x]), list(outs[n + n_x:-1])
    if not attn:
        return ys, xs, outs[-1]
    caches = []  # per attention stage: the last three of its outputs
    for s in attn:
        k = flow_attention.n_outputs(plans[s])
        caches.append(tuple(rest[k - 3:k]))
        rest = rest[k:]
    return ys, xs, outs[-1], caches
