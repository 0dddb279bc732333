"""L2 prefetch from a Pallas (Triton) kernel: `cp.async.bulk.prefetch.L2` of a byte range.

Why: at batch 1 every projection is a weight stream, and each GEMV program requests its next
weight block only one block ahead (pallas_kernels/gemv_stream.py), after a norm prologue whose
latency chain leaves DRAM idle at the kernel's start (~1.3-1.8 us per call, session 13). A
bulk prefetch asks the memory system for a whole contiguous range with one instruction and
holds no registers, so a program can request all of its later blocks (or a later kernel's
weights) before the prologue; the loads that follow then hit L2. The results do not change:
a prefetch moves bytes into L2, never into the program.

Pallas has no prefetch primitive and no way to take a ref's address: the PTX goes through
pallas_kernels/ref_ptx.py's `ref_asm` (the ref's base pointer plus an element offset), and
thread 0 of the program issues the sm_90 bulk prefetch (its size a multiple of 16 bytes). It
returns an int32 zero that the caller must add into an index: JAX's dead-code elimination
drops an unused result's primitive. In interpret mode (CPU) nothing is emitted: a prefetch
has no semantics to interpret. tests/test_l2_prefetch.py lowers kernels with it for 'cuda'
under jax 0.10.2 and 0.11.2, and its GPU test checks that results are bit-identical with
and without it.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.ref_ptx import ref_asm

MAX_BYTES = 1 << 20  # a sanity bound per instruction; the engine's ranges are 4-128 KB

_ASM = ("{\n\t.reg .pred %%p_pf;\n\t.reg .u32 %%t_pf;\n\tmov.u32 %%t_pf, %%tid.x;\n\t"
        "setp.eq.u32 %%p_pf, %%t_pf, 0;\n\t"
        "@%%p_pf cp.async.bulk.prefetch.L2.global [$1], %d;\n\tmov.u32 $0, 0;\n\t}")


def check_nbytes(nbytes: int) -> int:
    if type(nbytes) is not int or nbytes <= 0 or nbytes % 16 or nbytes > MAX_BYTES:
        raise ValueError(f"l2_prefetch size must be a positive multiple of 16 bytes up to "
                         f"{MAX_BYTES}, got {nbytes!r}")
    return nbytes


def l2_prefetch(ref, offset, nbytes: int, *, interpret: bool, keep: bool = False):
    """Prefetch `nbytes` of `ref` (a whole-array kernel ref, no BlockSpec) from element
    `offset` (int32, flat row-major) into L2. Returns an int32 zero for the caller to add into
    a later index (that keeps the call alive); a plain 0 in interpret mode. keep: the asm is
    kept by a write effect instead (ref_asm's writes=), so the caller need not use the zero:
    an asm zero in the offsets of aligned loads hides their alignment from the compiler."""
    check_nbytes(nbytes)
    if interpret:
        return jnp.int32(0)
    return ref_asm(ref, offset, _ASM % nbytes, writes=keep)


# The streaming GEMV's uses (pallas_kernels/gemv_stream.py; gemv_chain's rolling prefetch):
# which byte ranges of a weight a program asks for.

def prefetch_block(w_ref, p, programs, i, *, k, block_n, gated, up_offset, interpret,
                   keep=False):
    """L2 prefetch of the program's i-th block, p + i * programs, of w_ref (its block_n rows
    of K are contiguous; gated: and its up rows); returns the prefetch's int32 zero (keep:
    as l2_prefetch's)."""
    nbytes = block_n * k * w_ref.dtype.itemsize
    row = (p + i * programs) * block_n
    zero = jnp.int32(0)
    for off in (0, up_offset) if gated else (0,):
        zero = zero + l2_prefetch(w_ref, (off + row) * k, nbytes, interpret=interpret,
                                  **({"keep": True} if keep else {}))
    return zero


def prefetch_blocks(w_ref, p, programs, count, **kw):
    """prefetch_block of the program's blocks 1..count; returns their int32 zero."""
    zero = jnp.int32(0)
    for i in range(1, count + 1):
        zero = zero + prefetch_block(w_ref, p, programs, i, **kw)
    return zero


def prefetch_next(next_ref, p, rows: int, split: int, *, interpret):
    """L2 prefetches of rows [p * rows, (p + 1) * rows) of each of next_ref's `split` equal
    row segments; returns their int32 zero."""
    seg, kn = next_ref.shape[0] // split, next_ref.shape[1]
    nbytes = rows * kn * next_ref.dtype.itemsize
    zero = jnp.int32(0)
    for s in range(split):
        zero = zero + l2_prefetch(next_ref, (s * seg + p * rows) * kn, nbytes,
                                  interpret=interpret)
    return zero


def next_rows_for(next_w, next_split: int, rows: int, programs: int, dtype) -> int:
    """Rows per program of next_w to prefetch: `rows`, lowered so that every program's range
    lies inside its segment (small test models) and one instruction's size limit holds; 0
    when next_w is not in the activation dtype (its kernel will read a cast copy)."""
    if next_w is None or rows == 0:
        return 0
    if next_w.dtype != dtype:  # the later kernel reads a converted copy, not next_w
        return 0
    if next_w.ndim != 2 or type(next_split) is not int or next_split < 1 \
            or next_w.shape[0] % next_split:
        raise ValueError(f"gemv_stream next_w must be 2-D with rows divisible by next_split="
                         f"{next_split!r}, got {next_w.shape}")
    row_bytes = next_w.shape[1] * jnp.dtype(next_w.dtype).itemsize
    if row_bytes % 16:
        raise ValueError(f"gemv_stream next_w rows must be multiples of 16 bytes for the bulk "
                         f"prefetch, got {row_bytes}")
    return min(rows, next_w.shape[0] // next_split // programs, MAX_BYTES // row_bytes)
