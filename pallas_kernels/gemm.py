"""Skinny projections for batched decode: y [M, N] = x [M, K] @ W [N, K]^T, M of 8-512 rows.

At batch 64 a decode step's four GEMMs read 103 MB of weights per layer application; XLA's
Triton GEMM fusions read them at ~2.4 TB/s with split-K and fp32 partials (a separate reduce
kernel per GEMM, ~20 MB of partial traffic per layer; docs/performance.md, batch-64 profile).
By default this kernel has no split-K: one program per (block_n output columns, block_m rows)
streams its W columns over the whole K on the tensor cores (Triton pipelines the W tile
loads, `num_stages` deep) and writes the activation dtype directly, so there is no partial
buffer and no reduce kernel. `k_splits=S` opts into a split-K whose partials are added in a
fixed order (for few-row calls that would leave SMs idle, ouro_jax.invariant). `gated=True`
takes W = [gate; up] and returns silu(gate) * up, rounded as the model rounds (see
pallas_kernels.gemv), so the SiLU kernel disappears as well.

Rows: M need not divide block_m; the last row block masks the rows past M (loaded as zeros,
not stored), so no pad or slice kernel is needed on a GPU. A row's result does not depend
on the other rows in the call.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plt

from pallas_kernels._common import cdiv, compiler_params, dot, pl
from pallas_kernels.gemv import _silu_mul

DEFAULTS = dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4, k_splits=1)
TRANS_B = ((1,), (1,))  # [bm, bk] x [bn, bk] -> [bm, bn]


def _kernel(x_ref, w_ref, y_ref, *, m: int, k: int, block_m: int, block_n: int,
            block_k: int, gated: bool, up_offset: int, k_splits: int):
    # Row blocks vary fastest, so the programs sharing a W tile run together and the tile
    # comes from HBM once (L2 serves the others).
    i, j, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    chunks = k // block_k // k_splits  # this program's K blocks: [s * chunks, (s+1) * chunks)
    rows = pl.ds(pl.multiple_of(i * block_m, block_m), block_m)
    # A ragged last row block masks its missing rows: they load as zeros and are not stored.
    # (Until session 39 their indices were clamped to row M-1, so a one-row call at
    # block_m=64 loaded 64 copies of x per K step, as many bytes from L2 as its weight tile
    # or more. Masked, qkv's one-row call went from 24.96 to 11.21 us on an H100:
    # gemm_masked_qkv_session40_h100.json.) A row's dot products do not see the other rows
    # of its tile: no bit changes.
    # (Pallas' interpreter pads a block that runs past the array, so the CPU runs this too.)
    live = None if m % block_m == 0 else (i * block_m + lax.iota(jnp.int32, block_m)) < m

    def ks(c):
        return pl.ds(pl.multiple_of((s * chunks + c) * block_k, block_k), block_k)

    def cols(offset):
        return pl.ds(pl.multiple_of(offset + j * block_n, block_n), block_n)

    def body(c, accs):
        if live is None:
            xc = x_ref[rows, ks(c)]
        else:
            xc = plt.load(x_ref.at[rows, ks(c)], mask=live[:, None], other=0)
        out = (accs[0] + dot(xc, w_ref[cols(0), ks(c)], TRANS_B),)
        if gated:
            out += (accs[1] + dot(xc, w_ref[cols(up_offset), ks(c)], TRANS_B),)
        return out

    def store(col, y):
        if live is None:
            y_ref[rows, col] = y
        else:
            plt.store(y_ref.at[rows, col], y, mask=live[:, None])

    init = (jnp.zeros((block_m, block_n), jnp.float32),) * (2 if gated else 1)
    accs = lax.fori_loop(0, chunks, body, init)
    if k_splits > 1:  # fp32 partials, split s in columns [s * width, (s+1) * width)
        width = up_offset * (2 if gated else 1)
        store(cols(s * width), accs[0])
        if gated:
            store(cols(s * width + up_offset), accs[1])
        return
    dt = y_ref.dtype
    store(cols(0), _silu_mul(accs[0], accs[1], dt) if gated else accs[0].astype(dt))


def check_supported(m: int, k: int, n_out: int, *, block_m: int, block_n: int, block_k: int,
                    k_splits: int = 1):
    """Raises ValueError naming what the kernel cannot do for this shape and tiling."""
    if isinstance(k_splits, bool) or not isinstance(k_splits, (int, np.integer)) \
            or k_splits < 1:
        raise ValueError(f"gemm k_splits must be an integer >= 1, got {k_splits!r}")
    if m < 1:
        raise ValueError(f"gemm needs at least one row, got {m}")
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"gemm {name} must be a power of two >= 16 (a tensor-core tile), "
                             f"got {v}")
    if n_out % block_n or k % block_k:
        raise ValueError(f"gemm: block_n={block_n} must divide N={n_out} and block_k={block_k} "
                         f"must divide K={k}")
    if (k // block_k) % k_splits:
        raise ValueError(f"gemm: k_splits={k_splits} must divide K / block_k = {k // block_k} "
                         f"(K={k}, block_k={block_k})")


def sum_splits(parts: jax.Array, k_splits: int) -> jax.Array:
    """[M, S * W] fp32 partials -> [M, W], added left to right (p0 + p1, then + p2, ...):
    elementwise adds, which XLA does not reassociate, so every row and every M sums the
    same way, unlike a reduction whose tree the compiler picks by shape."""
    if parts.shape[1] % k_splits:
        raise ValueError(f"sum_splits: {parts.shape[1]} partial columns are not {k_splits} "
                         f"equal splits")
    width = parts.shape[1] // k_splits
    acc = parts[:, :width]
    for s in range(1, k_splits):
        acc = acc + parts[:, s * width:(s + 1) * width]
    return acc


def gemm(x: jax.Array, w: jax.Array, *, gated: bool = False, interpret: bool = False,
         fixed_rows: bool = False, partials: bool = False, **tuning) -> jax.Array:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (fp32 accumulation); gated: w = [gate; up]
    [2I, K] -> silu(x @ gate^T) * (x @ up^T) [M, I]. tuning: DEFAULTS' keys; block_m is cut
    to the next power of two >= M (at least 16) so few-row calls do not compute empty rows.
    fixed_rows: keep block_m whatever M is. The tile shapes, and so every row's arithmetic,
    are then the same for any M (a shorter tile may lower to other tensor-core instructions
    on a GPU): ouro_jax.invariant relies on it.
    k_splits: S > 1 splits K over S times the programs (few-row calls of a narrow weight
    otherwise leave SMs idle); each writes fp32 partials and XLA adds them in a fixed order
    (sum_splits), then rounds (and for gated applies the SiLU) as the one-split kernel does.
    partials: with k_splits > 1 (not gated), return the fp32 partials [M, S*N] unsummed, for a
    later kernel to add in the same order (pallas_kernels.add_norm)."""
    unknown = set(tuning) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown gemm tuning keys {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    if x.ndim != 2 or w.ndim != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"gemm shape mismatch: x {x.shape} (want [M, K]), w {w.shape} (want [N, K])")
    m, k = x.shape
    n = w.shape[0]
    if gated and n % 2:
        raise ValueError(f"gated gemm needs w = [gate; up] with an even row count, got {n}")
    n_out = n // 2 if gated else n
    if partials and gated:
        raise ValueError("gemm: partials=True is for plain projections, not gated ones")
    cfg = dict(DEFAULTS, **tuning)
    if not fixed_rows:
        cfg["block_m"] = min(cfg["block_m"], max(16, 1 << (m - 1).bit_length()))
    check_supported(m, k, n_out, block_m=cfg["block_m"], block_n=cfg["block_n"],
                    block_k=cfg["block_k"], k_splits=cfg["k_splits"])
    splits = int(cfg["k_splits"])
    kernel = functools.partial(_kernel, m=m, k=k, block_m=cfg["block_m"],
                               block_n=cfg["block_n"], block_k=cfg["block_k"], gated=gated,
                               up_offset=n_out, k_splits=splits)
    width = n_out * (2 if gated and splits > 1 else 1)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, splits * width),
                                       jnp.float32 if splits > 1 else x.dtype),
        grid=(cdiv(m, cfg["block_m"]), n_out // cfg["block_n"], splits),
        compiler_params=compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="gemm_silu" if gated else "gemm",
    )(x, w.astype(x.dtype))
    if splits == 1 or partials:
        return y
    acc = sum_splits(y, splits)
    if gated:
        return _silu_mul(acc[:, :n_out], acc[:, n_out:], x.dtype)
    return acc.astype(x.dtype)
