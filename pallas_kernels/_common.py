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


# The grid barrier and the counter handover live in grid_sync.py; re-exported here, where the
# kernels, tests and benchmarks have always found them (BARRIER is the same dict object).
from pallas_kernels.grid_sync import (BARRIER, COUNTER_STEP, GEN_MASK, SPIN_LIMIT,  # noqa: E402,F401
                                      SPIN_MODES, _counter_barrier, counter_target, grid_barrier)


def compiler_params(num_warps: int, num_stages: int):
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def plane_operands(entry, entry_stride: int, rows: int | None = None):
    """The kernels' plane index as two int32 operands (base, offset), plane = base *
    entry_stride + offset, computed inside the kernel. The engine passes (loop, layer) with
    entry_stride = num_layers: the loop counter reshapes for free and the layer is a constant,
    so no XLA kernel computes the index before every attention call. A plain scalar `entry`
    means (entry, 0) with stride 1.

    rows: the kernel's row count, given by a kernel that reads a per-row base (the decode
    kernel, `plane_index(..., row=)`): then base may be an int32 [rows] array, one loop per
    row (ouro_jax.pipelined runs rows of one call at different loops). A kernel that does
    not pass rows refuses such a base rather than read row 0's plane for every row."""
    if entry_stride < 1:
        raise ValueError(f"entry_stride must be >= 1, got {entry_stride}")
    if not isinstance(entry, tuple) and entry_stride != 1:
        raise ValueError("entry_stride applies to entry=(base, offset); a plain entry is the "
                         f"plane itself (got entry_stride={entry_stride})")
    base, offset = entry if isinstance(entry, tuple) else (entry, 0)
    base = jnp.asarray(base, jnp.int32)
    if base.size != 1 and (rows is None or base.shape != (rows,)):
        raise ValueError(
            f"a per-row plane base of shape {base.shape} needs a kernel that reads one per "
            f"row with that many rows ({rows if rows is not None else 'this kernel reads one'})")
    as1 = lambda x: jnp.reshape(jnp.asarray(x, jnp.int32), (-1,))
    return as1(base), as1(offset)


def plane_index(base_ref, off_ref, entry_stride: int, at=0, row=None):
    """The plane; `at` is 0 (pdl_wait's zero, to order the reads after the wait). row: this
    program's row, for a base with one entry per row (plane_operands' rows)."""
    base = base_ref[row] if row is not None and base_ref.shape[0] > 1 else base_ref[at]
    return base * entry_stride + off_ref[at]


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
                        out_dtype=jnp.float32, updated=(), counters_index=None,
                        defer_merge=False):
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
    then returns (output, *updated arrays, counters). defer_merge (no counters): with
    several splits the function returns ((partials, log-sum-exps), *updated arrays) as the
    kernel wrote them, [rows, KVH, S, m, hd] and [rows, KVH, S, m], for a later kernel to
    merge (pallas_kernels.gemv_merge)."""
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
        out = (o, lse) if defer_merge and num_splits > 1 else combine_splits(o, lse, axis=2)
        return (out, *rest) if updated else out
    return run


__all__ = ["pl", "plt", "NEG_INF", "PDL", "pdl_trigger", "pdl_token", "pdl_wait",
           "pdl_trigger_on", "grid_barrier", "next_pow2", "cdiv", "choose_num_splits",
           "compiler_params", "plane_operands", "plane_index", "split_range", "load_kv_block",
           "dot", "QK", "PV", "online_softmax_step", "finish", "combine_splits",
           "split_partials_call", "flash_tile"]
