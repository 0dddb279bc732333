"""A weight prefetcher for a stream of its own, and the progress word that paces it (session 33,
an experiment: benchmarks.side_prefetch_jax; docs/performance.md, "Not yet done").

Why: at batch 1 DRAM idles through every kernel's gap, ramp, tail and prologue (~18 of the
43 us of a layer application on the H200 are not weight bytes), and every overlap tried from
inside the chain's own kernels paid what it saved. This kernel runs beside the chain, on
another XLA stream (`compute_on("gpu_stream:1")`), and the chain never waits for it: it walks
a table of 64 KB chunks of the weights in the order the GEMVs read them and asks L2 for each
(`cp.async.bulk.prefetch.L2`, one per thread), at most a lead past the end of the kernel the
chain is running: a group of 32 chunks goes once the progress word has reached the group's
`need`, the first GEMV whose end lies within the lead of the group's last byte
(`schedule`, the host side, which benchmarks.l2_side_stream's Triton version shares). Program 0 of each GEMV writes its
index there as it starts (`store_progress`, gemv_stream's `progress=`). Values never change:
a prefetch moves bytes into L2, not into any kernel.

The progress word and the chunks are raw device addresses (two int32 halves each; JAX's
default int is 32-bit): no XLA buffer of either kernel names the word, so XLA orders nothing
on it and inserts no copy between the writer and the reader. The spin is bounded
(`max_spins` reads per group, and no more waiting once a group has given up): a schedule
that ran the streams one after the other would otherwise hang the GPU. The kernel returns
how many groups gave up waiting and the progress it first read, which tell whether the
two streams overlapped.

GPU only (no interpret-mode semantics for a prefetch or a spin on another kernel's store).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels._common import compiler_params, pl
from pallas_kernels.ref_ptx import value_asm

LANES = 32  # chunks per group: one per thread of the prefetcher's one warp

_ADDR = "{\n.reg .b64 %a_pf;\nmov.b64 %a_pf, {$1, $2};\n"
LOAD_ASM = _ADDR + "ld.relaxed.gpu.global.b32 $0, [%a_pf];\n}"
PREFETCH_ASM = _ADDR + "cp.async.bulk.prefetch.L2.global [%a_pf], $3;\n}\nmov.u32 $0, 0;"
STORE_ASM = (_ADDR + ".reg .pred %p_pf;\nsetp.eq.s32 %p_pf, $4, 0;\n"
             "@%p_pf st.relaxed.gpu.global.b32 [%a_pf], $3;\n}\nmov.u32 $0, 0;")


def _halves(addrs) -> tuple[np.ndarray, np.ndarray]:
    """64-bit device addresses as (low, high) int32 bit patterns."""
    a = np.asarray(addrs, np.uint64)
    lo = (a & np.uint64(0xFFFFFFFF)).astype(np.uint32).view(np.int32)
    return lo, (a >> np.uint64(32)).astype(np.uint32).view(np.int32)


def split_address(addr: int) -> tuple[int, int]:
    """A 64-bit device address as (low, high) int32 bit patterns."""
    lo, hi = _halves([addr])
    return int(lo[0]), int(hi[0])


def store_progress(addr_ref, seq_ref, program, offset: int = 0):
    """In a kernel: program 0 stores seq_ref[0] + offset (int32) at the raw address
    addr_ref[0:2] (its halves); returns an int32 zero for the caller to add into a value it
    keeps."""
    return value_asm(STORE_ASM, addr_ref[0], addr_ref[1], seq_ref[0] + offset, program,
                     constraints="=r,r,r,r,r")


def _kernel(lo_ref, hi_ref, need_ref, word_ref, base_ref, acc_ref, gave_ref, *, groups: int,
            chunk: int, max_spins: int):
    p = pl.program_id(0)
    programs = pl.num_programs(0)
    w_lo, w_hi, base = word_ref[0], word_ref[1], base_ref[0]
    read = lambda: value_asm(LOAD_ASM, w_lo, w_hi, constraints="=r,r,r")  # noqa: E731

    def group(i, carry):
        seen, acc, gave = carry
        g = p + i * programs
        need = jnp.max(need_ref[g, :]) + base

        def spin(c):
            return read(), c[1] + 1
        # once one group has given up, none waits again (the streams are not overlapping)
        seen, spins = lax.while_loop(lambda c: (c[0] < need) & (c[1] < max_spins) & (gave == 0),
                                     spin, (seen, jnp.int32(0)))
        acc = acc + value_asm(PREFETCH_ASM, lo_ref[g, :], hi_ref[g, :], jnp.int32(chunk),
                              constraints="=r,r,r,r")
        return seen, acc, gave + (seen < need).astype(jnp.int32)
    n = (groups - p + programs - 1) // programs
    first = read()
    _, acc, gave = lax.fori_loop(0, n, group, (first, jnp.zeros((LANES,), jnp.int32),
                                               jnp.int32(0)))
    acc_ref[p, :] = acc + (first - base)  # the prefetches' zeros plus where the chain was
    gave_ref[p] = gave


def side_prefetch(addr_lo, addr_hi, need, word, base, *, chunk: int, programs: int,
                  max_spins: int = 1 << 16):
    """Prefetches the chunks (addr_lo / addr_hi: int32 [G, LANES], the halves of each chunk's
    address; `chunk` bytes each) into L2, group g once the int32 at the raw address `word`
    (int32 [2], its halves) has reached need[g].max() + base[0] (need int32 [G, LANES], base
    int32 [1]). Returns (per program, in every lane, the progress it first read less base:
    -1 or less if it started before the chain's first kernel, the chain's last index if after
    it; int32 [programs, LANES]) and the groups per program that gave up waiting after
    max_spins reads (after one give-up a program waits no more; int32 [programs])."""
    g = addr_lo.shape[0]
    for name, a in (("addr_lo", addr_lo), ("addr_hi", addr_hi), ("need", need)):
        if a.shape != (g, LANES) or a.dtype != jnp.int32:
            raise ValueError(f"side_prefetch {name} must be int32 [groups, {LANES}], got "
                             f"{a.dtype} {a.shape}")
    if word.shape != (2,) or base.shape != (1,):
        raise ValueError(f"side_prefetch word must be int32 [2] and base int32 [1], got "
                         f"{word.shape} and {base.shape}")
    if chunk <= 0 or chunk % 16 or programs < 1 or max_spins < 1:
        raise ValueError(f"side_prefetch: chunk {chunk} must be a positive multiple of 16 "
                         f"bytes, programs {programs} and max_spins {max_spins} positive")
    kernel = lambda *r: _kernel(*r, groups=g, chunk=chunk, max_spins=max_spins)  # noqa: E731
    return pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((programs, LANES), jnp.int32),
                           jax.ShapeDtypeStruct((programs,), jnp.int32)),
        grid=(programs,), compiler_params=compiler_params(1, 1), name="side_prefetch",
    )(addr_lo, addr_hi, need, word, base)


def schedule(kernel_bytes, lead: int, chunk: int, segments=None):
    """The prefetcher's work list for kernels reading kernel_bytes[i] bytes each, in order:
    per chunk (kernel index, byte offset in that kernel, need), where `need` is the first
    kernel index k such that the chunk's end (counted in the order of the list) lies within
    `lead` bytes past the end of kernel k: while kernel k runs, the prefetcher may run up to
    `lead` bytes into the kernels after it (the first kernel's own bytes and `lead` more go
    once it has started). segments[i] (default 1): kernel i reads that many equal parts side
    by side (gate/up: the gate and up rows of a block together), so its chunks are listed
    part by part in turn, as it reads them."""
    segments = segments or [1] * len(kernel_bytes)
    ends, total = [], 0
    for n, seg in zip(kernel_bytes, segments):
        if n % (chunk * seg):
            raise ValueError(f"kernel bytes {n} are not a multiple of the chunk {chunk} "
                             f"times {seg} part(s)")
        total += n
        ends.append(total)
    out, k, pos = [], 0, 0
    for i, (n, seg) in enumerate(zip(kernel_bytes, segments)):
        part = n // seg
        for c in range(0, part, chunk):
            for s in range(seg):
                pos += chunk
                while ends[k] + lead < pos:
                    k += 1
                out.append((i, s * part + c, min(k, i)))
    return out


def whole_groups(work: list) -> list:
    """schedule's work list padded to whole groups of LANES with its last chunk again (which
    needs nothing new)."""
    return work + work[-1:] * (-len(work) % LANES)


def chunk_tables(arrays, work):
    """Host side: (addr_lo, addr_hi, need) int32 [G, LANES] for `schedule`'s work list
    (array index, byte offset, need) over device arrays `arrays` (their raw addresses),
    padded to whole groups."""
    bases = [a.unsafe_buffer_pointer() for a in arrays]
    work = whole_groups(list(work))
    lo, hi = _halves([bases[i] + off for i, off, _ in work])
    need = np.array([n for *_, n in work], np.int32)
    return tuple(jnp.asarray(v.reshape(-1, LANES)) for v in (lo, hi, need))
