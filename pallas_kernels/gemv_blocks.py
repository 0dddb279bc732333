"""The streaming GEMV's per-block machinery (pallas_kernels/gemv_stream.py's kernel and the
kernels built on it: gemv_flow, gemv_chain, gemv_queue, gemv_packed): a block's weight loads,
the loop over a program's blocks with the next block's loads requested before the math on the
current one, and a block's dot products, epilogue and store."""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import pl
from pallas_kernels.gemv import _silu_mul


def block_loader(w_ref, *, block_n: int, block_k: int, nk: int, gated: bool, up_offset: int,
                 nblocks=None, evict_first: bool = False):
    """load(j): block j's raw weight slab, nk gate chunks (then nk up chunks when gated).
    nblocks (gemv_queue): j may run past the last block; those loads are masked off (no
    memory traffic) and read as zeros. evict_first (GPU only; the interpreter has no cache):
    the weight loads carry Triton's evict_first policy, so the streamed weights, read once per
    loop, are the first lines L2 gives up and the small data read every layer (the K/V block
    tables, the activations) can stay."""
    cols = [pl.ds(c * block_k, block_k) for c in range(nk)]

    def load(j):
        if nblocks is None and evict_first:
            from jax.experimental.pallas import triton as plt
            read = lambda rows, c: plt.load(w_ref.at[rows, c], eviction_policy="evict_first")
        elif nblocks is None:
            read = lambda rows, c: w_ref[rows, c]
        else:
            from jax.experimental.pallas import triton as plt
            mask = jnp.full((block_n, block_k), j < nblocks)
            j = jnp.minimum(j, nblocks - 1)
            read = lambda rows, c: plt.load(w_ref.at[rows, c], mask=mask, other=0)
        tiles = tuple(read(_rows(j, block_n), cols[c]) for c in range(nk))
        if gated:
            tiles += tuple(read(_rows(j, block_n, up_offset), cols[c]) for c in range(nk))
        return tiles
    return load


def _rows(j, block_n, offset=0):
    return pl.ds(pl.multiple_of(offset + j * block_n, block_n), block_n)


def stream_blocks(load, first, xs, y_ref, *, p, programs, per_program: int, block_n: int,
                  block_k: int, nk: int, gated: bool, last_hook=None, tail=None,
                  ahead=None, store=None, scales=None, second=None):
    """Blocks p, p + programs, ... (per_program of them) of y = x @ W^T into y_ref, each
    block's loads requested before the math on the one before; `first` holds block p's
    (requested by the caller, ahead of its prologue). xs: per row, nk [1, block_k] fp32
    chunks. last_hook(tiles) -> tiles runs on the last block's loads (the late PDL trigger);
    tail() -> int32 zero runs once they are requested (the late L2 prefetch of next_w);
    ahead(i) -> int32 zero runs in iteration i, before block i + 1's loads (a rolling L2
    prefetch of a later block, gemv_chain's). store(j, tiles): computes and stores block j
    from its loads (default store_block; gemv_packed passes its own). scales (defer_norm):
    per row a thunk for the factor every output is multiplied by; its reduction is traced
    after the first block's multiply-adds (block p peeled off the loop), and the second
    block's loads between those multiply-adds and the reduction (the order that was
    measured, session 24). second (gemv_stream's depth=2): block p + programs's loads,
    requested by the caller right after `first`; the loop then keeps two blocks' loads in
    flight ahead of the math instead of one (same math, same bits)."""
    if second is not None:
        if scales is not None or ahead is not None or store is not None or per_program < 2:
            raise ValueError("stream_blocks: `second` (depth 2) takes no scales, ahead or "
                             "store, and at least two blocks per program")
        _stream_two_ahead(load, first, second, p=p, programs=programs,
                          per_program=per_program, last_hook=last_hook, tail=tail,
                          compute_store=functools.partial(
                              store_block, y_ref, xs=xs, block_n=block_n, block_k=block_k,
                              nk=nk, gated=gated))
        return
    if scales is not None:
        if store is not None or ahead is not None:
            raise ValueError("stream_blocks: scales go with the default store and no `ahead`")
        dots = functools.partial(block_dots, xs=xs, block_n=block_n, nk=nk, gated=gated)
        if per_program == 1:  # the first block is the last: its hook and tail apply
            first = first if last_hook is None else last_hook(first)
            d0 = dots(first)
            j = p if tail is None else p + tail()
            finish_block(y_ref, j, d0, [f() for f in scales], block_n=block_n)
            return
        d0 = dots(first)
        first = load(p + programs)  # requested before the scale's reduction
        factors = [f() for f in scales]
        finish_block(y_ref, p, d0, factors, block_n=block_n)
        compute_store = lambda j, tiles: finish_block(y_ref, j, dots(tiles), factors,
                                                      block_n=block_n)
        p, per_program = p + programs, per_program - 1
    else:
        compute_store = store or functools.partial(store_block, y_ref, xs=xs,
                                                   block_n=block_n, block_k=block_k, nk=nk,
                                                   gated=gated)

    def body(i, cur):
        j = p + i * programs
        if ahead is not None:
            j = j + ahead(i)
        nxt = load(j + programs)  # requested before the math on block j
        compute_store(j, cur)
        return nxt

    last = lax.fori_loop(0, per_program - 1, body, first)
    if last_hook is not None:
        last = last_hook(last)
    j = p + (per_program - 1) * programs
    compute_store(j if tail is None else j + tail(), last)


def _stream_two_ahead(load, first, second, *, p, programs, per_program, last_hook, tail,
                      compute_store):
    """stream_blocks with two blocks' loads in flight ahead of the math: iteration i
    requests block i + 2's loads, then computes block i (its loads requested two iterations
    back). The H200 needs more bytes in flight per SM than the H100 to reach its read rate
    (gemv_scaling: the GEMVs stream at XLA's read rate on an H100, 81-92% of it on an
    H200); this doubles a program's bytes in flight without more programs per SM, at the
    price of registers (on an H100 a program per SM fewer: 17% slower end to end, session
    35; the H200 run is prepared)."""
    def body(i, carry):
        cur, nxt = carry
        j = p + i * programs
        after = load(j + 2 * programs)  # requested before the math on block j
        compute_store(j, cur)
        return nxt, after

    cur, last = lax.fori_loop(0, per_program - 2, body, (first, second))
    compute_store(p + (per_program - 2) * programs, cur)
    if last_hook is not None:
        last = last_hook(last)
    j = p + (per_program - 1) * programs
    compute_store(j if tail is None else j + tail(), last)


def block_dots(tiles, *, xs, block_n, nk, gated):
    """Per row, (gate or plain, up or None) fp32 dot products of one block's weight tiles
    with the rows' input chunks: store_block's sums, before the epilogue."""
    wf = [t.astype(jnp.float32) for t in tiles]
    out = []
    for r in range(len(xs)):
        def dotrow(ws):
            acc = jnp.zeros((block_n, ws[0].shape[1]), jnp.float32)
            for c in range(nk):
                acc = acc + ws[c] * xs[r][c]
            return jnp.sum(acc, axis=1)
        out.append((dotrow(wf[:nk]), dotrow(wf[nk:]) if gated else None))
    return out


def finish_block(y_ref, j, dots, factors=None, *, block_n):
    """Stores block j from block_dots' sums, each row's multiplied by its factor first when
    factors are given (gated: both halves, then silu(gate) * up as the model rounds it)."""
    for r, (g, u) in enumerate(dots):
        if factors is not None:
            g, u = g * factors[r], None if u is None else u * factors[r]
        y = g.astype(y_ref.dtype) if u is None else _silu_mul(g, u, y_ref.dtype)
        y_ref[r, _rows(j, block_n)] = y


def store_block(y_ref, j, tiles, *, xs, block_n, block_k, nk, gated):
    """y's block j (block_n outputs per row) from its weight tiles (block_loader's) and the
    rows' input chunks xs (block_k: the chunks' width, which the tiles carry)."""
    del block_k
    finish_block(y_ref, j, block_dots(tiles, xs=xs, block_n=block_n, nk=nk, gated=gated),
                 block_n=block_n)
