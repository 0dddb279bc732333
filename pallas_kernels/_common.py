"""Helpers shared by the Pallas (Triton-lowering) paged-attention kernels."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NEG_INF = -1e30  # finite: empty splits/rows stay NaN-free through the combine
TARGET_PROGRAMS = 512  # ~4 programs per SM on a 132-SM H200


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a, b):
    return (a + b - 1) // b


def choose_num_splits(work_items: int, max_tokens: int, block_t: int,
                      min_blocks_per_split: int = 2) -> int:
    """Flash-decoding split count: enough programs to fill the GPU, at least
    `min_blocks_per_split` key blocks (of the table's capacity) per split."""
    want = cdiv(TARGET_PROGRAMS, max(1, work_items))
    cap = max(1, max_tokens // (min_blocks_per_split * block_t))
    return int(max(1, min(want, cap)))


def _col(x):
    """x[..., None] for arrays; scalars broadcast as they are."""
    return x[..., None] if x.ndim else x


# Programmatic dependent launch (PDL, sm_90+). XLA (xla_gpu_enable_pdl, on by default in
# jaxlib 0.10-0.11) already launches every Triton kernel, Pallas ones included, with the PDL
# attribute and a griddepcontrol.wait at its start; a kernel may then let the next one launch
# early with griddepcontrol.launch_dependents, and the next one's wait holds it until this one
# has completed and its memory is visible. Opt-in per call (gemv_stream's `pdl`, decode
# TUNING["pdl"]), off by default: a trigger is only safe when the next kernel reads this one's
# output after a wait; XLA's own fusions may read through non-coherent loads that the compiler
# can move above their wait (openxla/xla#43894), so a call whose next kernel may be an XLA
# fusion must not trigger. Interpret mode (CPU) emits nothing. PDL["on"] = False turns every
# trigger and wait off whatever the calls ask (a kill switch for A/B runs); like the kernels'
# TUNING dicts it is read at trace time, so programs already compiled keep what they had.
PDL = {"on": True}


def _asm_i32(asm: str, arg):
    [out] = plt.elementwise_inline_asm(
        asm, args=[arg], constraints="=r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return out


def pdl_trigger(anchor, *, interpret: bool):
    """griddepcontrol.launch_dependents; returns a token for pdl_wait (None, and no asm, in
    interpret mode or with PDL off). The asm is pure to the compiler: its result feeding
    pdl_wait keeps it alive and ahead of the wait."""
    if interpret or not PDL["on"]:
        return None
    return _asm_i32("griddepcontrol.launch_dependents;\n\tmov.u32 $0, 0;",
                    jnp.full((1,), anchor, jnp.int32))


def pdl_token(*, interpret: bool):
    """A token for pdl_wait when no trigger precedes the wait (a late trigger follows it):
    an int32[1] zero, or None (no asm) in interpret mode or with PDL off."""
    return None if interpret or not PDL["on"] else jnp.zeros((1,), jnp.int32)


def pdl_wait(token):
    """griddepcontrol.wait; returns int32 0 that the caller adds to the index of every read
    that must follow the wait. The data dependency is what orders those reads after it: the
    asm is pure to the compiler, which may otherwise move loads across it (ptxas keeps loads
    after the wait). XLA's own wait at the kernel's start makes this one redundant today; it
    keeps the ordering if that ever moves. token None: a plain 0, no asm."""
    if token is None:
        return jnp.int32(0)
    return jnp.sum(_asm_i32("griddepcontrol.wait;\n\tmov.u32 $0, $1;", token))


def pdl_trigger_on(tile, *, interpret: bool):
    """griddepcontrol.launch_dependents once `tile` (a 16-bit array, e.g. a loaded weight
    tile) has arrived: the asm passes the tile through, so it runs when its operand is ready
    and before whatever uses the result. The late trigger: the next kernel may launch while
    this one does its last math and stores, not from its start. No asm in interpret mode or
    with PDL off."""
    if jnp.dtype(tile.dtype).itemsize != 2:
        raise ValueError(f"pdl_trigger_on takes a 16-bit tile (two per 32-bit register), got "
                         f"{tile.dtype}")
    if interpret or not PDL["on"]:
        return tile
    [out] = plt.elementwise_inline_asm(
        "griddepcontrol.launch_dependents;\n\tmov.b32 $0, $1;", args=[tile],
        constraints="=r,r", pack=2, result_shape_dtypes=[jax.ShapeDtypeStruct(tile.shape,
                                                                              tile.dtype)])
    return out


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


def compiler_params(num_warps: int, num_stages: int):
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def plane_operands(entry, entry_stride: int):
    """The kernels' plane index as two int32[1] operands (base, offset), plane = base *
    entry_stride + offset, computed inside the kernel. The engine passes (loop, layer) with
    entry_stride = num_layers: the loop counter reshapes for free and the layer is a constant,
    so no XLA kernel computes the index before every attention call. A plain scalar `entry`
    means (entry, 0) with stride 1."""
    if entry_stride < 1:
        raise ValueError(f"entry_stride must be >= 1, got {entry_stride}")
    if not isinstance(entry, tuple) and entry_stride != 1:
        raise ValueError("entry_stride applies to entry=(base, offset); a plain entry is the "
                         f"plane itself (got entry_stride={entry_stride})")
    base, offset = entry if isinstance(entry, tuple) else (entry, 0)
    as1 = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (1,))
    return as1(base), as1(offset)


def plane_index(base_ref, off_ref, entry_stride: int, at=0):
    """The plane; `at` is 0 (pdl_wait's zero, to order the reads after the wait)."""
    return base_ref[at] * entry_stride + off_ref[at]


def split_range(kv_end, split, num_splits: int, block_t: int):
    """Keys [start, end) of split `split` when [0, kv_end) is cut into num_splits block-aligned parts."""
    per = cdiv(cdiv(kv_end, num_splits), block_t) * block_t
    start = split * per
    end = jnp.minimum(start + per, kv_end)
    n_blocks = cdiv(jnp.maximum(end - start, 0), block_t)
    return start, end, n_blocks


def load_kv_block(k_ref, v_ref, bt_ref, entry, seq, kvh, t, last, page_size: int):
    """K, V rows for token positions t [block_t] (clamped to <= last, so every read is in bounds:
    the clamped duplicates hit cache lines already being read). Pointer gather through the
    block table, straight from plane `entry` of the full cache."""
    tc = jnp.minimum(t, last)
    # A padded prefill chunk can reach past the block table (kv_len = chunk end): clamp the
    # logical page so the table read stays in bounds; those keys only serve padding queries.
    logical = jnp.minimum(lax.div(tc, page_size), bt_ref.shape[1] - 1)
    pages = bt_ref[seq, logical]
    slots = lax.rem(tc, page_size)
    k = k_ref[entry, pages, slots, kvh, :]
    v = v_ref[entry, pages, slots, kvh, :]
    return k, v


def online_softmax_step(m, l, sc, mask):
    """One flash step on scores sc [..., T] (fp32) with validity mask; returns (m_new, alpha, p, l_new)."""
    sc = jnp.where(mask, sc, NEG_INF)
    m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
    alpha = jnp.exp(m - m_new)
    p = jnp.where(mask, jnp.exp(sc - _col(m_new)), 0.0)
    l_new = l * alpha + jnp.sum(p, axis=-1)
    return m_new, alpha, p, l_new


def dot(a, b, contract):
    """fp32-accumulating dot for the kernels; fp32 operands get IEEE fp32 (Precision.HIGHEST:
    the Triton lowering's default for fp32 is TF32, ~3e-4 relative error)."""
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision,
                           preferred_element_type=jnp.float32)


QK = ((1,), (1,))  # [M, d] x [T, d] -> [M, T]
PV = ((1,), (0,))  # [M, T] x [T, d] -> [M, d]


def flash_tile(qt, n_blocks, block, scale: float, extra=None):
    """Online-softmax attention of a query tile qt [M, hd] over key blocks 0..n_blocks-1 on
    the tensor cores. block(i) -> (k [T, hd], v [T, hd], mask()), where mask() gives the
    validity mask broadcastable to [M, T]; it is called after the score dot, the order the
    kernels had when they were measured on the H200. `extra(m, l, acc)` may fold more keys
    into the softmax state after the loop (decode's new token). Returns the normalised output
    [M, hd] (fp32) and its log-sum-exp [M] (see finish)."""
    rows, hd = qt.shape

    def body(i, carry):
        m, l, acc = carry
        k, v, mask = block(i)
        sc = dot(qt.astype(k.dtype), k, QK) * scale
        m, alpha, p, l = online_softmax_step(m, l, sc, mask())
        pv = dot(p.astype(v.dtype), v, PV)
        return m, l, acc * alpha[:, None] + pv

    init = (jnp.full((rows,), NEG_INF, jnp.float32), jnp.zeros((rows,), jnp.float32),
            jnp.zeros((rows, hd), jnp.float32))
    m, l, acc = lax.fori_loop(0, n_blocks, body, init)
    if extra is not None:
        m, l, acc = extra(m, l, acc)
    return finish(acc, m, l)


def finish(acc, m, l):
    """Normalised partial output and its log-sum-exp (NEG_INF where the split saw no key)."""
    o = acc / _col(jnp.where(l > 0, l, 1.0))
    lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), NEG_INF)
    return o, lse


def combine_splits(o, lse, axis: int):
    """Merge flash-decoding partials: o [..., S, M, hd] fp32 normalised, lse [..., S, M]."""
    if o.shape[axis] == 1:
        return jnp.squeeze(o, axis)
    m = jnp.max(lse, axis=axis, keepdims=True)
    w = jnp.exp(lse - m)  # all-empty rows: every w == 1 and every o == 0 -> 0
    num = jnp.sum(w[..., None] * o, axis=axis)
    den = jnp.sum(w, axis=axis)
    return num / den[..., None]


def split_partials_call(kernel, *, rows: int, kvh: int, num_splits: int, m: int, hd: int,
                        name: str, num_warps: int, num_stages: int, interpret: bool,
                        out_dtype=jnp.float32, updated=(), counters_index=None):
    """pallas_call over grid (rows, KVH, splits) whose kernel writes a normalised partial
    output [.., m, hd] and its log-sum-exp per (row, KV head, split); returns a function of
    the kernel's inputs giving the merged [rows, KVH, m, hd] output. With one split there is
    nothing to merge, so the kernel writes `out_dtype` itself (no separate convert kernel);
    with several, partials stay fp32 for the combine. `updated`: (input index, shape dtype)
    pairs of inputs the kernel updates in place (aliased outputs after o and lse); the
    function then returns (output, *updated arrays). counters_index: the input index of an
    int32 [rows, KVH] array of zeros; the kernel merges the partials itself (the last split
    program of each row and head, see split_merge.merge_if_last), writing the output [rows, KVH,
    m, hd] and leaving the counters at zero again (aliased, updated in place); the function
    then returns (output, *updated arrays, counters)."""
    o_dtype = out_dtype if num_splits == 1 else jnp.float32
    aliases = {i: 2 + j for j, (i, _) in enumerate(updated)}
    merged = ()
    if counters_index is not None:
        merged = (jax.ShapeDtypeStruct((rows, kvh, m, hd), out_dtype),
                  jax.ShapeDtypeStruct((rows, kvh), jnp.int32))
        aliases[counters_index] = 2 + len(updated) + 1
    call = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((rows, kvh, num_splits, m, hd), o_dtype),
                   jax.ShapeDtypeStruct((rows, kvh, num_splits, m), jnp.float32),
                   *(sd for _, sd in updated), *merged),
        grid=(rows, kvh, num_splits),
        input_output_aliases=aliases,
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name=name,
    )

    def run(*args):
        o, lse, *rest = call(*args)
        if counters_index is not None:
            *rest, out, counters = rest
            return (out, *rest, counters)
        out = combine_splits(o, lse, axis=2)
        return (out, *rest) if updated else out
    return run


__all__ = ["pl", "plt", "NEG_INF", "PDL", "pdl_trigger", "pdl_token", "pdl_wait",
           "pdl_trigger_on", "grid_barrier", "next_pow2", "cdiv", "choose_num_splits",
           "compiler_params", "plane_operands", "plane_index", "split_range", "load_kv_block",
           "dot", "QK", "PV", "online_softmax_step", "finish", "combine_splits",
           "split_partials_call", "flash_tile"]
