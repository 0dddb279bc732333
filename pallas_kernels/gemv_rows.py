"""The streaming GEMV's row inputs (pallas_kernels/gemv_stream.py's kernel and the kernels
built on it: gemv_flow, gemv_chain, gemv_queue, gemv_packed): each row's x (and the branch)
as loaded, the norm prologues (the sandwich layer's RMSNorms and residual add) that turn them
into the GEMV's fp32 input chunks held in registers, and the split of a kernel's refs."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import pl
from pallas_kernels.gemv import _normed


def raw_rows(refs, rows, nk, block_k, prologue, row2d, after, f32=False):
    """Rows `rows`' raw x (and, for add_norm, branch) chunks as loaded, no math. after:
    _common.pdl_wait's zero, added to the offsets of these reads (an earlier kernel's
    output) so that they follow the wait; the norm weights need not. With x_first they are
    issued ahead of the first weight block, so as not to queue behind the weight stream, and
    kept raw (a conversion here would wait for them); f32: each converted as it is loaded."""
    x_ref, b_ref = refs[0], refs[1]
    late = [pl.ds(pl.multiple_of(after + c * block_k, block_k), block_k) for c in range(nk)]
    out = []
    for r in rows:
        row = pl.ds(r, 1) if row2d else r
        cvt = (lambda v: v.astype(jnp.float32)) if f32 else (lambda v: v)
        xs = [cvt(x_ref[row, late[c]]) for c in range(nk)]
        bs = [cvt(b_ref[row, late[c]]) for c in range(nk)] if prologue == "add_norm" else None
        out.append((xs, bs))
    return out


def _sum_sq(vs, fold: bool):
    """The sum of squares of the chunks vs (fp32). fold=False: one block-wide reduction per
    chunk, then their sum; fold=True: the chunks' squares added element by element in chunk
    order, then one block-wide reduction. The same terms in another order, so the scale can
    differ in its last bits; fold takes K / block_k - 1 reductions (each a shared-memory round
    trip behind a barrier) out of the prologue's chain."""
    if fold:
        acc = vs[0] * vs[0]
        for v in vs[1:]:
            acc = acc + v * v
        return jnp.sum(acc)
    return sum(jnp.sum(v * v) for v in vs)


def _row_chunks(refs, r, nk, block_k, k, dt, prologue, eps, first_program, row2d, raw,
                defer=False, fold=False):
    """Row r's GEMV input as nk fp32 chunks ([1, block_k] with row2d, else [block_k]), after
    the prologue (stores x' for add_norm), from raw_rows' loads `raw` = (x chunks, branch
    chunks). The row statistics are summed chunk by chunk, or with fold in one reduction
    (gemv._rms_scale sums the whole row at once); otherwise the rounding is gemv.py's, through the same helpers. With row2d
    the norm weights arrive as [1, K] arrays. defer (DEFAULTS' defer_norm, with a prologue):
    returns (x' * norm_w chunks, a thunk for the row's RMS scale) instead. fold (DEFAULTS'
    fold_sums): each statistic through one block-wide reduction (_sum_sq)."""
    _, _, wb_ref, wx_ref, xo_ref = refs
    cols = [pl.ds(c * block_k, block_k) for c in range(nk)]
    row = pl.ds(r, 1) if row2d else r
    vec = (lambda ref, c: ref[pl.ds(0, 1), cols[c]]) if row2d else (lambda ref, c: ref[cols[c]])
    raw_x, raw_b = raw
    xs = [raw_x[c].astype(jnp.float32) for c in range(nk)]
    if not prologue:
        return xs
    if prologue == "add_norm":
        bs = [raw_b[c].astype(jnp.float32) for c in range(nk)]
        s_b = lax.rsqrt(_sum_sq(bs, fold) / k + eps)
        xs = [(xs[c] + _normed(bs[c], s_b, vec(wb_ref, c), dt).astype(jnp.float32)).astype(dt)
              .astype(jnp.float32) for c in range(nk)]

        @pl.when(first_program)
        def _():
            for c in range(nk):
                xo_ref[row, cols[c]] = xs[c].astype(dt)

    scale = lambda: lax.rsqrt(_sum_sq(xs, fold) / k + eps)
    if defer:
        return [xs[c] * vec(wx_ref, c).astype(jnp.float32) for c in range(nk)], scale
    s_x = scale()
    return [_normed(xs[c], s_x, vec(wx_ref, c), dt).astype(jnp.float32) for c in range(nk)]


def row_inputs(refs, *, m, nk, block_k, k, dt, prologue, eps, first_program, row2d, after=None,
               raw=None, defer=False, fold=False):
    """Every row's GEMV input chunks (_row_chunks), as [1, block_k] arrays. after: pdl_wait's
    zero (default: an int32 0, which the Triton lowering's multiple_of hint needs as a value).
    raw: raw_rows' loads, when they were issued earlier (else they are issued here). defer
    (with a prologue): returns (chunks, per row its scale thunk), see _row_chunks."""
    after = jnp.int32(0) if after is None else after
    load = lambda r: raw[r] if raw is not None else \
        raw_rows(refs, [r], nk, block_k, prologue, row2d, after, f32=True)[0]  # row by row
    xs = [_row_chunks(refs, r, nk, block_k, k, dt, prologue, eps, first_program, row2d, load(r),
                      defer=defer, fold=fold) for r in range(m)]
    scales = None
    if defer and prologue:
        xs, scales = [x for x, _ in xs], [f for _, f in xs]
    xs = xs if row2d else [[xc[None, :] for xc in xr] for xr in xs]
    return (xs, scales) if defer else xs


def split_refs(refs, prologue: str, n_weights: int):
    """(x, branch, branch norm weight, norm weight, the n_weights weight refs, y, x') from a
    kernel's refs, ordered x[, branch, branch_w][, norm_w], weights..., y[, x'] by
    prologue ("add_norm", "norm" or ""); None for what the prologue does not take. "merge"
    (gemv_merge): x is the split partials and `branch` their log-sum-exps."""
    refs = list(refs)
    x_ref = refs.pop(0)
    b_ref, wb_ref = ((refs.pop(0), refs.pop(0)) if prologue == "add_norm" else
                     (refs.pop(0), None) if prologue == "merge" else (None, None))
    wx_ref = refs.pop(0) if prologue in ("norm", "add_norm") else None
    ws = tuple(refs[:n_weights])
    y_ref, *rest = refs[n_weights:]
    return x_ref, b_ref, wb_ref, wx_ref, ws, y_ref, (rest[0] if rest else None)
