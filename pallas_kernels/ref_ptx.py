"""PTX on the address of a Pallas (Triton) kernel ref: what Pallas cannot express itself.

Pallas refs have no address, and `plt.elementwise_inline_asm` takes values only. This module
adds one primitive, `ref_asm_p`: a whole-array kernel ref plus an int32 element offset, lowered
for Triton to the ref's base pointer plus the offset (`tt.addptr`), which an impure inline-PTX
block receives as `$1` (a 64-bit register); the block writes an int32 to `$0`. Impure: MLIR
and ptxas neither drop it nor hoist it out of a loop. JAX's dead-code elimination of the kernel
jaxpr does drop it when its result is unused, so every caller consumes the result (the L2
prefetch adds its zero into a later index; an acquire load is the value read).

Users: `l2_prefetch` (pallas_kernels/l2_prefetch.py, a bulk prefetch into L2) and
`gpu_load` (below: `ld.relaxed.gpu` / `ld.acquire.gpu`; the grid barrier's spin read in
_common.BARRIER["spin"] = "load"). It uses jax-internal Pallas-Triton lowering helpers
(`register_lowering`, `_add`, `_ensure_ir_value`) that jax 0.10.2 and 0.11.2 both have; tests lower kernels with
it for 'cuda' on the CPU under both. There is no interpret-mode rule: callers emit nothing (or
a plain read) in interpret mode.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import state
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as _lowering

ref_asm_p = jax_core.Primitive("ouro_ref_asm")


def ref_asm(ref, offset, asm: str, *, writes: bool = False):
    """Runs `asm` ($1: the address of element `offset` of `ref`, flat row-major; $0: an int32
    result) in every thread of the program; returns the int32 result. writes: the asm stores
    through the address; it then has a write effect on the ref, which keeps it in the kernel
    even when its result is unused (a read-only one is dropped then)."""
    if "$1" not in asm or "$0" not in asm:
        raise ValueError("ref_asm's PTX must read the address as $1 and write an int32 to $0")
    return ref_asm_p.bind(ref, jnp.asarray(offset, jnp.int32), asm=asm, writes=bool(writes))


@ref_asm_p.def_effectful_abstract_eval
def _abstract_eval(ref_aval, offset_aval, *, asm, writes):
    del offset_aval, asm
    if not isinstance(ref_aval, state.AbstractRef):
        raise ValueError(f"ref_asm takes a kernel ref, got {ref_aval}")
    return jax_core.ShapedArray((), jnp.int32), {
        state.WriteEffect(0) if writes else state.ReadEffect(0)}


@_lowering.register_lowering(ref_asm_p)
def _lower(ctx, ptr, offset, *, asm, writes):
    del writes
    offset = _lowering._ensure_ir_value(offset, ctx.avals_in[1])  # a literal offset too
    if "ptr" not in str(ptr.type) or "tensor" in str(ptr.type):
        raise NotImplementedError(f"ref_asm needs a whole-array ref (a scalar pointer), got "
                                  f"{ptr.type}")
    addr = _lowering._add(ptr, offset)  # tt.addptr: offset in elements
    i32 = ir.IntegerType.get_signless(32)
    return tt_dialect.elementwise_inline_asm([i32], asm, constraints="=r,l", pure=False,
                                             packed_element=1, args=[addr])


LOAD_SEMANTICS = ("relaxed", "acquire")


def gpu_load(ref, offset, *, sem: str = "relaxed"):
    """ld.<sem>.gpu of the int32 at element `offset` of `ref` (GPU only): a GPU-scope load
    that bypasses L1, for spinning on a flag without the read-modify-write of an atomic.
    "acquire" also orders later reads after it, at the cost of an L1 invalidate per load."""
    if jnp.dtype(ref.dtype) != jnp.int32:
        raise ValueError(f"gpu_load reads int32 refs, got {ref.dtype}")
    if sem not in LOAD_SEMANTICS:
        raise ValueError(f"gpu_load sem must be one of {LOAD_SEMANTICS}, got {sem!r}")
    return ref_asm(ref, offset, f"ld.{sem}.gpu.global.b32 $0, [$1];")


def global_timer(ref):
    """The GPU's global timer, low 32 bits (ns), read where it stands in program order (the
    asm is impure, which keeps it there). `ref` is any kernel ref (ref_asm needs one; its
    address is unused). For timelines inside kernels (benchmarks.gemv_timeline)."""
    return ref_asm(ref, 0, "mov.u32 $0, %globaltimer_lo; // $1 (unused)")


def sm_id(ref):
    """The SM this program runs on (%smid); `ref` as in global_timer."""
    return ref_asm(ref, 0, "mov.u32 $0, %smid; // $1 (unused)")


def store_timeline(t_ref, p, start):
    """Row p of a timeline (int32 [programs, 3]): `start` (global_timer at the program's
    start), the timer now (call it after the program's last store) and the SM."""
    t_ref[p, 0] = start
    t_ref[p, 1] = global_timer(t_ref)
    t_ref[p, 2] = sm_id(t_ref)


# A relaxed GPU-scope atomic add: Pallas's atomic_add is acq_rel (a fence before it and an L1
# invalidate after it that waits for its result), which a ticket needs neither of; without
# them the loads that follow it (and do not depend on its value) issue while it is in flight.
relaxed_add_p = jax_core.Primitive("ouro_relaxed_atomic_add")


def relaxed_atomic_add(ref, offset, value):
    """atom.relaxed.gpu add of int32 `value` at element `offset` of `ref` (flat, whole-array
    ref; GPU only, no interpret-mode rule); returns the old value (one thread's atomic, as
    Triton does for a scalar atomic, its result given to every thread)."""
    if jnp.dtype(ref.dtype) != jnp.int32:
        raise ValueError(f"relaxed_atomic_add takes int32 refs, got {ref.dtype}")
    return relaxed_add_p.bind(ref, jnp.asarray(offset, jnp.int32), jnp.asarray(value, jnp.int32))


@relaxed_add_p.def_effectful_abstract_eval
def _relaxed_abstract_eval(ref_aval, offset_aval, value_aval):
    del offset_aval, value_aval
    if not isinstance(ref_aval, state.AbstractRef):
        raise ValueError(f"relaxed_atomic_add takes a kernel ref, got {ref_aval}")
    return jax_core.ShapedArray((), jnp.int32), {state.WriteEffect(0)}


@_lowering.register_lowering(relaxed_add_p)
def _relaxed_lower(ctx, ptr, offset, value):
    if "ptr" not in str(ptr.type) or "tensor" in str(ptr.type):
        raise NotImplementedError(f"relaxed_atomic_add needs a whole-array ref, got {ptr.type}")
    offset = _lowering._ensure_ir_value(offset, ctx.avals_in[1])
    value = _lowering._ensure_ir_value(value, ctx.avals_in[2])
    return _lowering._atomic_rmw(tt_dialect.RMWOp.ADD, _lowering._add(ptr, offset), value,
                                 semantic=tt_dialect.MemSemantic.RELAXED)


# Impure inline PTX on values (Pallas's own elementwise_inline_asm is pure: MLIR may hoist it
# out of a loop or merge two equal ones, which a spin read or a prefetch must not be). For raw
# 64-bit addresses that no XLA buffer of the kernel names (session 33's side-stream
# prefetcher and the progress word its consumers write: pallas_kernels/side_prefetch.py).
value_asm_p = jax_core.Primitive("ouro_value_asm")


def value_asm(asm: str, *args, constraints: str):
    """Runs `asm` elementwise over `args` (arrays of one shape, or scalars; `$0` is an int32
    result, `$1`... the args in order, per `constraints`, e.g. "=r,l,r" for an int64 and an
    int32), impure, in every thread that holds an element; returns the int32 results. The
    caller must use them (JAX drops an unused primitive): add them into a value it keeps."""
    if not constraints.startswith("=r") or len(constraints.split(",")) != len(args) + 1:
        raise ValueError(f"value_asm constraints {constraints!r} must be '=r' and one entry "
                         f"per argument ({len(args)})")
    args = [jnp.asarray(a) for a in args]
    shapes = {a.shape for a in args if a.ndim}
    if len(shapes) > 1:
        raise ValueError(f"value_asm arguments must share one shape, got {sorted(shapes)}")
    return value_asm_p.bind(*args, asm=asm, constraints=constraints)


@value_asm_p.def_abstract_eval
def _value_abstract_eval(*avals, asm, constraints):
    del asm, constraints
    shape = next((a.shape for a in avals if a.shape), ())
    return jax_core.ShapedArray(shape, jnp.int32)


@_lowering.register_lowering(value_asm_p)
def _value_lower(ctx, *args, asm, constraints):
    shape = ctx.avals_out[0].shape
    vals = []
    for a, aval in zip(args, ctx.avals_in):
        v = _lowering._ensure_ir_value(a, aval)
        if shape and not aval.shape:
            v = _lowering._bcast_to(v, shape)
        vals.append(v)
    i32 = ir.IntegerType.get_signless(32)
    out = ir.RankedTensorType.get(shape, i32) if shape else i32
    return tt_dialect.elementwise_inline_asm([out], asm, constraints=constraints, pure=False,
                                             packed_element=1, args=vals)
