"""L2 prefetch from a Pallas (Triton) kernel: `cp.async.bulk.prefetch.L2` of a byte range.

Why: at batch 1 every projection is a weight stream, and each GEMV program requests its next
weight block only one block ahead (pallas_kernels/gemv_stream.py), after a norm prologue whose
latency chain leaves DRAM idle at the kernel's start (~1.3-1.8 us per call, session 13). A
bulk prefetch asks the memory system for a whole contiguous range with one instruction and
holds no registers, so a program can request all of its later blocks (or a later kernel's
weights) before the prologue; the loads that follow then hit L2. The results do not change:
a prefetch moves bytes into L2, never into the program.

Pallas has no prefetch primitive and no way to take a ref's address, so this module adds one
(`l2_prefetch_p`) with a Triton lowering only: the ref's base pointer plus an element offset,
fed to inline PTX that thread 0 of the program executes (the sm_90 bulk prefetch, whose size
must be a multiple of 16 bytes). The asm is impure, so neither MLIR nor ptxas drops it; it
returns an int32 zero that the caller adds into an index, so JAX's dead-code elimination of
the kernel jaxpr keeps it too. In interpret mode (CPU) nothing is emitted: a prefetch has no
semantics to interpret.

It uses jax-internal Pallas-Triton lowering helpers (`register_lowering`, `_add`), which jax
0.10.2 and 0.11.2 both have; tests/test_l2_prefetch.py lowers a kernel with it for 'cuda' on
both, and the GPU test checks that results are bit-identical with and without it.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import state
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as _lowering

MAX_BYTES = 1 << 20  # a sanity bound per instruction; the engine's ranges are 4-128 KB

l2_prefetch_p = jax_core.Primitive("ouro_l2_prefetch")

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
    return l2_prefetch_p.bind(ref, jnp.asarray(offset, jnp.int32), nbytes=nbytes)


@l2_prefetch_p.def_effectful_abstract_eval
def _abstract_eval(ref_aval, offset_aval, *, nbytes):
    del offset_aval, nbytes
    if not isinstance(ref_aval, state.AbstractRef):
        raise ValueError(f"l2_prefetch takes a kernel ref, got {ref_aval}")
    return jax_core.ShapedArray((), jnp.int32), {state.ReadEffect(0)}


@_lowering.register_lowering(l2_prefetch_p)
def _lower(ctx, ptr, offset, *, nbytes):
    del ctx
    if not isinstance(ptr.type, ir.Type) or "ptr" not in str(ptr.type) or \
            "tensor" in str(ptr.type):
        raise NotImplementedError(f"l2_prefetch needs a whole-array ref (a scalar pointer), "
                                  f"got {ptr.type}")
    addr = _lowering._add(ptr, offset)  # tt.addptr: offset in elements
    i32 = ir.IntegerType.get_signless(32)
    return tt_dialect.elementwise_inline_asm([i32], _ASM % nbytes, constraints="=r,l",
                                             pure=False, packed_element=1, args=[addr])
