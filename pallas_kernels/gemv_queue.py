"""Streaming GEMV with blocks handed out at run time (a work queue), one row (prototype,
session 15; not in the engine).

Why: inside a chain of the engine's streaming GEMVs (benchmarks.gemv_timeline), programs
start together (ramp 0.2 us) but end apart: the last program ends 0.5-1.4 us after the
median one, and the grids put 2 or 3 (3 or 4) programs on an SM, so some SMs carry half as
much again as others. Here the grid is a fixed number of programs (e.g. 2 or 3 per SM) and
each takes its next output block from an atomic counter, so a program on a busy SM simply
takes fewer blocks.

Each program holds x in registers (gemv_rows.row_inputs) and keeps two block indices
ahead: the loads of the next block are requested before the atomic that fetches the index
after it, and the math on the current block runs after both. A load past the last block is
masked off (no traffic). Results are those of gemv_stream with the same block_n / block_k
(the same per-block math, gemv_blocks.store_block): only which program computes a block
changes.

The counter: an int32 [slots] array threaded from call to call (donate it). A call takes
its blocks from counters[use] and program 0 zeroes counters[zero], the slot the kernel before
it used (complete by then: XLA's PDL wait at every kernel's start, or plain stream order).
So consecutive calls must alternate slots, e.g. a chain of four projections uses slots 0-3
with zero = the previous call's slot; every slot starts at 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import compiler_params, pl
from pallas_kernels.gemv_blocks import block_loader, store_block
from pallas_kernels.gemv_rows import row_inputs
from pallas_kernels.gemv_stream import _check_xw, _config, check_supported


def _kernel(x_ref, w_ref, cnt_in_ref, y_ref, cnt_ref, *rest, k, block_n, block_k, nblocks,
            gated, up_offset, use, zero, timeline, interpret):
    from jax.experimental.pallas import triton as plt
    del cnt_in_ref  # aliased with cnt_ref
    p = pl.program_id(0)
    t_ref = rest[0] if timeline else None
    if timeline:
        from pallas_kernels.ref_ptx import global_timer, store_timeline
        start = global_timer(t_ref)
    nk = k // block_k
    load = block_loader(w_ref, block_n=block_n, block_k=block_k, nk=nk, gated=gated,
                        up_offset=up_offset, nblocks=nblocks)  # masked past the last block

    @pl.when(p == 0)
    def _():
        cnt_ref[zero] = jnp.int32(0)

    def grab():  # the next block index
        if interpret:  # programs run one after another there, and atomics in a loop do not
            j = cnt_ref[use]  # discharge: a read and a write do the same
            cnt_ref[use] = j + 1
            return j
        return plt.atomic_add(cnt_ref, (jnp.int32(use),), jnp.int32(1))
    j0 = grab()
    first = load(j0)
    j1 = grab()
    xs = row_inputs((x_ref, None, None, None, None), m=1, nk=nk, block_k=block_k, k=k,
                    dt=y_ref.dtype, prologue="", eps=0.0, first_program=p == 0, row2d=False)

    def body(c):
        j, nxt, tiles = c
        nxt_tiles = load(nxt)  # requested before the atomic below and the math on block j
        after = grab()
        store_block(y_ref, j, tiles, xs=xs, block_n=block_n, block_k=block_k, nk=nk,
                    gated=gated)
        return nxt, after, nxt_tiles

    lax.while_loop(lambda c: c[0] < nblocks, body, (j0, j1, first))
    if timeline:
        store_timeline(t_ref, p, start)


def gemv_queue(x, w, counters, *, programs: int, use: int, zero: int, gated: bool = False,
               interpret: bool = False, timeline: bool = False, **tuning):
    """x [1, K] (or wider: the first K values are read) @ w [N, K]^T -> ([1, N] (gated:
    [1, N/2]), counters[, timeline int32 [programs, 3]]), with `programs` programs taking
    gemv_stream blocks (block_n / block_k from tuning) from counters[use]; program 0 zeroes
    counters[zero] (see the module docstring). Donate `counters`."""
    if x.ndim != 2 or x.shape[0] != 1:
        raise ValueError(f"gemv_queue takes one row [1, K], got x {x.shape}")
    k = w.shape[1]
    if x.shape[1] < k:
        raise ValueError(f"gemv_queue: x has {x.shape[1]} values, w needs K = {k}")
    n_out = _check_xw(jax.ShapeDtypeStruct((1, k), x.dtype), w, gated)
    unknown = set(tuning) - {"block_n", "block_k", "num_warps"}
    if unknown:
        raise ValueError(f"gemv_queue takes block_n, block_k and num_warps, not "
                         f"{sorted(unknown)}")
    cfg = _config(dict(tuning, per_program=1), k)
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    check_supported(1, k, n_out, block_n=block_n, block_k=block_k, per_program=1,
                    num_warps=cfg["num_warps"])
    if counters.ndim != 1 or counters.dtype != jnp.int32 or not (
            0 <= use < counters.shape[0] and 0 <= zero < counters.shape[0]) or use == zero:
        raise ValueError(f"gemv_queue: counters must be int32 [slots] with use != zero both "
                         f"slots, got {counters.dtype} {counters.shape}, use={use}, zero={zero}")
    if timeline and interpret:
        raise ValueError("gemv_queue timeline reads the GPU's timer: not in interpret mode")
    if type(programs) is not int or programs < 1:
        raise ValueError(f"gemv_queue programs must be an int >= 1, got {programs!r}")
    kernel = functools.partial(_kernel, k=k, block_n=block_n, block_k=block_k,
                               nblocks=n_out // block_n, gated=gated, up_offset=n_out, use=use,
                               zero=zero, timeline=timeline, interpret=bool(interpret))
    sd = jax.ShapeDtypeStruct
    outs = (sd((1, n_out), x.dtype), sd(counters.shape, jnp.int32))
    if timeline:
        outs += (sd((programs, 3), jnp.int32),)
    return pl.pallas_call(
        kernel, grid=(programs,), out_shape=outs, input_output_aliases={2: 1},
        compiler_params=compiler_params(cfg["num_warps"], 1), interpret=interpret,
        name="gemv_queue" + ("_silu" if gated else ""),
    )(x, w.astype(x.dtype), counters)
