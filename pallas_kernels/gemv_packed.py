"""Streaming GEMV over 12-bit packed weights (pallas_kernels/packed12.py), lossless.

y [M, N] = x [M, K] @ W [N, K]^T with W stored as a packed12.Packed12: per weight a low byte
and a 4-bit code instead of two bytes, so a call reads ~76-80% of bf16's bytes. A one-row
projection is bound by its bytes, which is why batch-1 decode may gain from this; the
weights are decoded exactly (bit for bit), so the result is the bf16 GEMV's up to the fp32
summation order.

Organised like gemv_stream.py (whose prologues, input handling and block loop this reuses): the
input rows are held in registers (as 8 * K / block_k chunks of block_k / 8 values, the order
packed12 groups each chunk's weights in), each program computes `per_program` blocks of
`block_n` output rows, and each block's loads are requested before the math on the one
before. Per chunk a row's weights arrive as two uint32 tiles of low bytes, one of codes and
the chunk's meta word; packed12.decode_words turns them into eight fp32 tiles with integer
ops. A chunk marked escaped reads its raw bf16 values from the side table instead (a masked
gather: no memory traffic for the chunks that are not escaped). block_k is the packing's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import compiler_params, pl
from pallas_kernels.gemv import _silu_mul, check_norm_operands
from pallas_kernels.gemv_blocks import stream_blocks
from pallas_kernels.gemv_rows import row_inputs, split_refs
from pallas_kernels.gemv_stream import MAX_ROWS, MAX_WARPS
from pallas_kernels.packed12 import Packed12, decode_words

DEFAULTS = dict(block_n=2, per_program=4, num_warps=4)


def _loader(lo_ref, codes_ref, meta_ref, esc_ref, *, block_n, block_k, nk, gated, up_offset,
            escapes):
    """load(j): block j's raw tiles, per chunk (lo plane 0, lo plane 1, codes, meta[, 8 raw
    escape tiles]), for the gate rows then (gated) the up rows."""
    jw = block_k // 8

    def rows_of(j, offset):
        return pl.ds(pl.multiple_of(offset + j * block_n, block_n), block_n)

    def chunk(rows, c):
        meta = meta_ref[rows, pl.ds(c, 1)]  # [block_n, 1]
        t = (lo_ref[rows, pl.ds(c * 2 * jw, jw)], lo_ref[rows, pl.ds(c * 2 * jw + jw, jw)],
             codes_ref[rows, pl.ds(c * jw, jw)], meta)
        if escapes:
            from jax.experimental.pallas import triton as plt
            slot = (meta >> 8) - 1
            mask = jnp.broadcast_to(slot >= 0, (block_n, jw))
            slot = jnp.maximum(slot, 0)  # [block_n, 1] rows x [1, jw] columns: a gather
            col = jax.lax.broadcasted_iota(jnp.int32, (1, jw), 1)
            t += tuple(plt.load(esc_ref.at[slot, col + q * jw], mask=mask, other=0)
                       for q in range(8))
        return t

    def load(j):
        out = tuple(chunk(rows_of(j, 0), c) for c in range(nk))
        if gated:
            out += tuple(chunk(rows_of(j, up_offset), c) for c in range(nk))
        return out
    return load


def _weights(t):
    """A chunk's eight fp32 tiles [block_n, block_k / 8] from its raw tiles, in x's order."""
    lo0, lo1, codes, meta = t[:4]
    base7 = (meta & 0xFF).astype(jnp.uint32)
    ws = decode_words(lo0, codes, base7, 0) + decode_words(lo1, codes, base7, 1)
    if len(t) > 4:  # escapes
        esc = (meta >> 8) > 0
        ws = [jnp.where(esc, r.astype(jnp.float32), w) for r, w in zip(t[4:], ws)]
    return ws


def _store(y_ref, j, tiles, *, xs, block_n, nk, gated):
    def dotrow(r, chunks):
        acc = None
        for c, t in enumerate(chunks):
            for q, w in enumerate(_weights(t)):
                term = w * xs[r][8 * c + q]
                acc = term if acc is None else acc + term
        return jnp.sum(acc, axis=1)
    for r in range(len(xs)):
        g = dotrow(r, tiles[:nk])
        y = _silu_mul(g, dotrow(r, tiles[nk:]), y_ref.dtype) if gated else g.astype(y_ref.dtype)
        y_ref[r, pl.ds(pl.multiple_of(j * block_n, block_n), block_n)] = y


def _kernel(*refs, m, k, block_n, block_k, per_program, gated, up_offset, prologue, eps,
            escapes):
    x_ref, b_ref, wb_ref, wx_ref, (lo, codes, meta, esc), y_ref, xo_ref = \
        split_refs(refs, prologue, 4)
    p, programs = pl.program_id(0), pl.num_programs(0)
    nk = k // block_k
    load = _loader(lo, codes, meta, esc, block_n=block_n, block_k=block_k, nk=nk, gated=gated,
                   up_offset=up_offset, escapes=escapes)
    first = load(p)  # in flight while the prologue runs
    # the rows' inputs in chunks of block_k / 8: chunk 8c + q is plane/byte q of weight chunk c
    xs = row_inputs((x_ref, b_ref, wb_ref, wx_ref, xo_ref), m=m, nk=8 * nk, block_k=block_k // 8,
                    k=k, dt=y_ref.dtype, prologue=prologue, eps=eps, first_program=p == 0,
                    row2d=False)
    store = functools.partial(_store, y_ref, xs=xs, block_n=block_n, nk=nk, gated=gated)
    stream_blocks(load, first, xs, y_ref, p=p, programs=programs, per_program=per_program,
                  block_n=block_n, block_k=block_k, nk=nk, gated=gated, store=store)


def check_supported(m: int, w: Packed12, n_out: int, *, block_n: int, per_program: int,
                    num_warps: int, gated: bool = False):
    """Raises ValueError naming what the kernel cannot do for this shape and tiling."""
    if m < 1 or m > MAX_ROWS:
        raise ValueError(f"gemv_packed takes 1..{MAX_ROWS} rows, got {m}")
    for name, v in (("block_n", block_n), ("num_warps", num_warps)):
        if type(v) is not int or v < 1 or v & (v - 1):
            raise ValueError(f"gemv_packed {name} must be a power of two, got {v!r}")
    if num_warps > MAX_WARPS:
        raise ValueError(f"gemv_packed num_warps must be at most {MAX_WARPS}, got {num_warps}")
    bk = w.block_k
    if bk < 64 or bk & (bk - 1):
        raise ValueError(f"gemv_packed needs a power-of-two packing block_k >= 64, got {bk}: "
                         f"repack with packed12.pack(w, 512)")
    if type(per_program) is not int or per_program < 1:
        raise ValueError(f"gemv_packed per_program must be an int >= 1, got {per_program!r}")
    what = "outputs (gated: half the packed weight's rows)" if gated else "outputs"
    if n_out % block_n:
        raise ValueError(f"gemv_packed: block_n={block_n} must divide the {n_out} {what}")
    if (n_out // block_n) % per_program:
        raise ValueError(f"gemv_packed: per_program={per_program} must divide the "
                         f"{n_out // block_n} output blocks ({n_out} {what} / "
                         f"block_n={block_n})")


def _config(tuning: dict) -> dict:
    unknown = set(tuning) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown gemv_packed tuning keys {sorted(unknown)}; valid: "
                         f"{sorted(DEFAULTS)}")
    return dict(DEFAULTS, **tuning)


def _check(x, w, gated) -> int:
    if not isinstance(w, Packed12):
        raise TypeError(f"gemv_packed takes a packed12.Packed12 weight, got {type(w).__name__}")
    if x.ndim != 2 or x.shape[1] != w.k:
        raise ValueError(f"gemv_packed: x {x.shape} does not match the packed weight "
                         f"[{w.n}, {w.k}]")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"gemv_packed takes floating-point activations, got {x.dtype}")
    if gated and w.n % 2:
        raise ValueError(f"gemv_packed gated needs an even N ([gate; up]), got {w.n}")
    return w.n // 2 if gated else w.n


def _call(front, w: Packed12, *, m, n_out, gated, prologue, eps, interpret, cfg,
          extra_out=()):
    check_supported(m, w, n_out, block_n=cfg["block_n"], per_program=cfg["per_program"],
                    num_warps=cfg["num_warps"], gated=gated)
    programs = n_out // cfg["block_n"] // cfg["per_program"]
    kernel = functools.partial(_kernel, m=m, k=w.k, block_n=cfg["block_n"],
                               block_k=w.block_k, per_program=cfg["per_program"], gated=gated,
                               up_offset=n_out, prologue=prologue, eps=eps,
                               escapes=w.escapes > 0)
    y = jax.ShapeDtypeStruct((m, n_out), front[0].dtype)
    return pl.pallas_call(
        kernel, out_shape=(y, *extra_out) if extra_out else y, grid=(programs,),
        compiler_params=compiler_params(cfg["num_warps"], 1), interpret=interpret,
        name="gemv_packed" + ("_silu" if gated else "") + (f"_{prologue}" if prologue else ""),
    )(*front, w.lo, w.codes, w.meta, w.esc)


def gemv_packed(x: jax.Array, w: Packed12, *, gated: bool = False, interpret: bool = False,
                **tuning) -> jax.Array:
    """x [M, K] @ W^T -> [M, N] in x's dtype (fp32 accumulation), W packed; gated: W = [gate;
    up] -> silu(x @ gate^T) * (x @ up^T) [M, N/2]. tuning: DEFAULTS' keys."""
    n_out = _check(x, w, gated)
    return _call((x,), w, m=x.shape[0], n_out=n_out, gated=gated, prologue="", eps=0.0,
                 interpret=interpret, cfg=_config(tuning))


def gemv_packed_normed(x: jax.Array, norm_w: jax.Array, w: Packed12, *, eps: float,
                       branch: jax.Array | None = None, branch_w: jax.Array | None = None,
                       gated: bool = False, interpret: bool = False, **tuning):
    """gemv_stream.gemv_stream_normed's contract (returns (y, x')) over a packed weight."""
    n_out = _check(x, w, gated)
    check_norm_operands("gemv_packed_normed", x, norm_w, branch, branch_w)
    m, k = x.shape
    dt = x.dtype
    common = dict(m=m, n_out=n_out, gated=gated, eps=float(eps), interpret=interpret,
                  cfg=_config(tuning))
    if branch is None:
        return _call((x, norm_w.astype(dt)), w, prologue="norm", **common), x
    return _call((x, branch.astype(dt), branch_w.astype(dt), norm_w.astype(dt)), w,
                 prologue="add_norm", extra_out=(jax.ShapeDtypeStruct((m, k), dt),), **common)
