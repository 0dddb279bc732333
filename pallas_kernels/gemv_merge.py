"""The streaming GEMV with the decode attention's split merge as its prologue (opt-in, the
o projection at one row: `--decode-kernel o_merge=1`).

The decode kernel splits each (row, KV head)'s keys over S programs (flash-decoding); each
writes a normalised partial output and its log-sum-exp, and an XLA kernel merges them
(_common.combine_splits; 1.5 us per layer application at batch 1 on the H200, session 31's
trace) before the o projection reads the merged row. Here the o projection's programs merge
the partials themselves while their first weight block is in flight, so the combine kernel
and one kernel boundary go. Every program merges the whole row (S x K fp32 partials plus
S x H log-sum-exps, 32 KB at S = 4 for the 1.4B shape, from L2).

The merge is _common.combine_splits' math in its order (the max of the log-sum-exps, then
w_s = exp(lse_s - max), sum_s w_s o_s / sum_s w_s, splits in order), then rounded to the
activation dtype as the decode kernel's caller rounds the XLA combine's output; after that
the row goes through gemv_stream's K loop unchanged. Whether a GPU's exp and the XLA
reduction's order give the same bits is for the GPU tests to say (in interpret mode both are
XLA's).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels._common import pl
from pallas_kernels.gemv_stream import _call, _config


def merged_rows(parts_ref, lse_ref, *, m: int, nk: int, block_k: int, dt):
    """Per row, nk [1, block_k] fp32 chunks of the merged attention output: parts_ref [M,
    KVH, S, G, hd] fp32 partials, lse_ref [M, KVH, S, G]; chunk c covers KV heads [c * n, (c +
    1) * n), n = block_k / (G * hd), in the projection's column order (KV head, group, dim)."""
    _, _, s, g, hd = parts_ref.shape
    n = block_k // (g * hd)
    rows = []
    for r in range(m):
        chunks = []
        for c in range(nk):
            heads = pl.ds(c * n, n)
            lses = [lse_ref[r, heads, i, :] for i in range(s)]  # [n, G] each
            outs = [parts_ref[r, heads, i, :, :] for i in range(s)]  # [n, G, hd] each
            top = lses[0]
            for v in lses[1:]:
                top = jnp.maximum(top, v)
            ws = [jnp.exp(v - top) for v in lses]  # all-empty rows: every w == 1, o == 0
            num, den = ws[0][..., None] * outs[0], ws[0]
            for w, o in zip(ws[1:], outs[1:]):
                num, den = num + w[..., None] * o, den + w
            x = (num / den[..., None]).reshape(block_k)
            chunks.append(x.astype(dt).astype(jnp.float32)[None, :])
        rows.append(chunks)
    return rows


# gemv_stream options the merged GEMV does not take (the norm prologue's and PDL's)
MERGE_EXCLUDES = ("row2d", "pdl", "x_first", "defer_norm", "fold_sums")


def check_merge_operands(parts: jax.Array, lse: jax.Array, w: jax.Array) -> int:
    """K = KVH * G * hd of the merged row; ValueError naming an operand gemv_stream_merged
    cannot take."""
    if parts.ndim != 5 or lse.shape != parts.shape[:4]:
        raise ValueError(f"gemv_stream_merged: parts must be [M, KVH, S, G, hd] and lse [M, "
                         f"KVH, S, G]; got {parts.shape} and {lse.shape}")
    if parts.dtype != jnp.float32 or lse.dtype != jnp.float32:
        raise ValueError(f"gemv_stream_merged: parts and lse are fp32 (the decode kernel's "
                         f"partials), got {parts.dtype} and {lse.dtype}")
    _, kvh, _, g, hd = parts.shape
    k = kvh * g * hd
    if w.ndim != 2 or w.shape[1] != k:
        raise ValueError(f"gemv_stream_merged: w must be [N, {k}] (K = KVH * G * hd), got "
                         f"{w.shape}")
    return k


def gemv_stream_merged(parts: jax.Array, lse: jax.Array, w: jax.Array, *, dtype,
                       interpret: bool = False, next_w: jax.Array | None = None,
                       next_split: int = 1, **tuning) -> jax.Array:
    """y [M, N] = x @ w^T, x [M, K] = the merged split partials (combine_splits(parts, lse,
    axis=2) reshaped to [M, KVH * G * hd]) rounded to `dtype`; y in `dtype`. tuning:
    gemv_stream's DEFAULTS keys, except row2d, pdl, x_first, defer_norm and fold_sums (the
    norm prologue's and PDL's options); next_w / next_split as in gemv_stream."""
    k = check_merge_operands(parts, lse, w)
    m, kvh, _, g, hd = parts.shape
    cfg = _config(tuning, k)
    if cfg["block_k"] % (g * hd) or kvh % (cfg["block_k"] // (g * hd)):
        raise ValueError(f"gemv_stream_merged: block_k={cfg['block_k']} must hold whole KV "
                         f"heads (a multiple of G * hd = {g * hd} dividing K = {k})")
    for key in MERGE_EXCLUDES:
        if cfg[key]:
            raise ValueError(f"gemv_stream_merged takes no {key} (the merge is its prologue)")
    return _call((parts, lse, w.astype(dtype)), m=m, k=k, n_out=w.shape[0], gated=False,
                 prologue="merge", eps=0.0, interpret=interpret, cfg=cfg, next_w=next_w,
                 next_split=next_split, out_dtype=jnp.dtype(dtype))
