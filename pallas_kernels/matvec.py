"""Fused residual + RMSNorm + projection for few-row (decode) GEMMs: one kernel instead of four.

At batch 1 a decoder layer's projections are matrix-vector products of 8-46 MB each, a few
microseconds apiece on the H200, and XLA surrounds each with its own small kernels (norm
statistics, normalisation, residual add, the SiLU gate). Launch and drain of those small
kernels cost about as much as the weight reads. This kernel folds them into the projection:

    h = x + rms_norm(d) * w_res          (optional: the pending residual branch)
    y = rms_norm(h) * w_in  @  W^T        W [N, K] (HF layout), or
    y = silu(g) * u  with [g; u] = ...    (gated: W = [gate; up], [2I, K])

and returns (h, y). Every program recomputes the row statistics of its [M, K] inputs (a few
KB, L2-resident) and streams its own BN rows of W; rounding follows model.rms_norm / silu
exactly (fp32 statistics, one rounding to the activation dtype per op), so only the
accumulation order of the dot differs from XLA's.

Rows are padded to >= 16 with clamped indices (tensor-core dots need 16 rows; the duplicate
rows write identical values). Meant for M <= 16 rows; larger batches read the row inputs once
per program and are better served by XLA's GEMMs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import compiler_params, dot, next_pow2, pl

MAX_ROWS = 16


def _pick_block(n: int, cap: int) -> int:
    """Largest power of two <= cap dividing n, or 0 when below 16 (no tensor-core tile)."""
    b = cap
    while b >= 16:
        if n % b == 0:
            return b
        b //= 2
    return 0


def supported(m: int, k: int, n: int) -> bool:
    return m <= MAX_ROWS and _pick_block(k, 256) > 0 and _pick_block(n, 32) > 0


def _mul(a, b, dt):
    """bf16 * bf16 as XLA does it: exact product in fp32, one rounding."""
    return (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(dt)


def _kernel(x_ref, d_ref, wres_ref, win_ref, w_ref, rh_ref, y_ref, h_ref, *, m: int, mp: int,
            k: int, bk: int, bn: int, up_offset: int, eps: float, has_res: bool, gated: bool,
            given_stats: bool):
    j = pl.program_id(0)
    dt = x_ref.dtype
    rows = jnp.minimum(lax.iota(jnp.int32, mp), m - 1)
    nk = k // bk

    def cols(c):
        return pl.ds(pl.multiple_of(c * bk, bk), bk)

    if given_stats:  # h and its 1/rms come in (computed by XLA); no prologue loops
        has_res = False
    if has_res:
        def ssq_d(c, acc):
            dc = d_ref[rows, cols(c)].astype(jnp.float32)
            return acc + jnp.sum(dc * dc, axis=1)
        rd = lax.rsqrt(lax.fori_loop(0, nk, ssq_d, jnp.zeros((mp,), jnp.float32)) / k + eps)

    def h_chunk(c):
        xc = x_ref[rows, cols(c)]
        if not has_res:
            return xc
        dn = (d_ref[rows, cols(c)].astype(jnp.float32) * rd[:, None]).astype(dt)
        dn = _mul(dn, wres_ref[cols(c)][None, :], dt)
        return (xc.astype(jnp.float32) + dn.astype(jnp.float32)).astype(dt)

    def ssq_h(c, acc):
        hc = h_chunk(c).astype(jnp.float32)
        return acc + jnp.sum(hc * hc, axis=1)
    if given_stats:
        rh = rh_ref[rows]
    else:
        rh = lax.rsqrt(lax.fori_loop(0, nk, ssq_h, jnp.zeros((mp,), jnp.float32)) / k + eps)

    out_rows = pl.ds(pl.multiple_of(j * bn, bn), bn)
    up_rows = pl.ds(pl.multiple_of(up_offset + j * bn, bn), bn)

    def body(c, accs):
        hc = h_chunk(c)
        if has_res:
            @pl.when(j == 0)
            def _():
                h_ref[rows, cols(c)] = hc
        hn = (hc.astype(jnp.float32) * rh[:, None]).astype(dt)
        hn = _mul(hn, win_ref[cols(c)][None, :], dt)
        acc = accs[0] + dot(hn, w_ref[out_rows, cols(c)], ((1,), (1,)))
        if not gated:
            return (acc,)
        return acc, accs[1] + dot(hn, w_ref[up_rows, cols(c)], ((1,), (1,)))

    init = (jnp.zeros((mp, bn), jnp.float32),) * (2 if gated else 1)
    accs = lax.fori_loop(0, nk, body, init)
    if gated:
        g, u = accs[0].astype(dt), accs[1].astype(dt)
        gf = g.astype(jnp.float32)
        y = _mul((gf * jax.nn.sigmoid(gf)).astype(dt), u, dt)
    else:
        y = accs[0].astype(dt)
    y_ref[rows, out_rows] = y


def fused_norm_matvec(x, w_in, w, *, eps: float, d=None, w_res=None, gated: bool = False,
                      interpret: bool = False, num_warps: int = 4, num_stages: int = 3,
                      block_n=None, block_k=None, stats: str = "kernel"):
    """(h, y) for x [M, K]; see the module doc. `d`/`w_res` given: h = x + rms_norm(d)*w_res,
    else h = x. w [N, K]; gated: w = [gate; up] with N = 2I, y [M, I]; else y [M, N].
    stats="kernel": every program computes the row statistics itself; stats="xla": h and
    1/rms(h) are computed by XLA first (one small fusion) and the kernel only streams W."""
    m, k = x.shape
    n_rows = w.shape[0]
    n_out = n_rows // 2 if gated else n_rows
    if w.shape[1] != k or w_in.shape != (k,) or (gated and n_rows % 2):
        raise ValueError(f"shape mismatch: x {x.shape}, w_in {w_in.shape}, w {w.shape}")
    if not supported(m, k, n_out):
        raise ValueError(f"fused_norm_matvec does not support M={m}, K={k}, N={n_out} "
                         f"(needs M <= {MAX_ROWS} and K, N divisible by 16)")
    has_res = d is not None
    if has_res and (d.shape != x.shape or w_res is None or w_res.shape != (k,)):
        raise ValueError(f"residual branch d {None if d is None else d.shape} / w_res must "
                         f"match x {x.shape}")
    bk = block_k or _pick_block(k, 256)
    bn = block_n or _pick_block(n_out, 32)
    mp = max(16, next_pow2(m))
    dt = x.dtype
    if stats not in ("kernel", "xla"):
        raise ValueError(f"stats must be 'kernel' or 'xla', got {stats!r}")
    given = stats == "xla"
    rh = jnp.zeros((m,), jnp.float32)
    if given:
        from ouro_jax.model import rms_norm

        if has_res:
            x = x + rms_norm(d, w_res, eps)
        xf = x.astype(jnp.float32)
        rh = lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)
    if not has_res or given:  # placeholders, never read
        d, w_res = x, w_in
    kernel = functools.partial(_kernel, m=m, mp=mp, k=k, bk=bk, bn=bn, up_offset=n_out,
                               eps=float(eps), has_res=has_res, gated=gated, given_stats=given)
    y, h = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m, n_out), dt), jax.ShapeDtypeStruct((m, k), dt)),
        grid=(n_out // bn,),
        compiler_params=compiler_params(num_warps, num_stages),
        interpret=interpret,
        name="fused_norm_matvec_gated" if gated else "fused_norm_matvec",
    )(x, d, w_res.astype(dt), w_in.astype(dt), w.astype(dt), rh)
    return (h if has_res and not given else x), y


def fused_norm_matvec_reference(x, w_in, w, *, eps: float, d=None, w_res=None,
                                gated: bool = False):
    """Plain-JAX oracle with the model's own ops (model.rms_norm, model.silu)."""
    from ouro_jax.model import linear, rms_norm, silu

    h = x if d is None else x + rms_norm(d, w_res, eps)
    y = linear(rms_norm(h, w_in, eps), w)
    if gated:
        i = w.shape[0] // 2
        y = silu(y[:, :i]) * y[:, i:]
    return h, y
