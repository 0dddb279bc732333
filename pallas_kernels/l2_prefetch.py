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


def l2_prefetch(ref, offset, nbytes: int, *, interpret: bool):
    """Prefetch `nbytes` of `ref` (a whole-array kernel ref, no BlockSpec) from element
    `offset` (int32, flat row-major) into L2. Returns an int32 zero for the caller to add into
    a later index (that keeps the call alive); a plain 0 in interpret mode."""
    check_nbytes(nbytes)
    if interpret:
        return jnp.int32(0)
    return ref_asm(ref, offset, _ASM % nbytes)
