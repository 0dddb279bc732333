"""Few-row projections (decode GEMVs): y [M, N] = x [M, K] @ W [N, K]^T, W in the HF layout.

At batch 1 a decode step is ~96 matrix-vector products per token over 103 MB of weights per
layer application; XLA's Triton GEMM fusions read them at 1.9-3.0 TB/s (docs/performance.md).
This kernel streams W once with one program per block of `block_n` output rows, so it has no
split-K partials to reduce, and its per-row result does not depend on how many rows are in
the call (every row sees the same tiles in the same order): verification (k+1 rows) and
decode (1 row) compute bit-identical projections.

Two inner products, chosen per call:
  * use_dot=True: tensor-core dots on x padded to 16 rows (clamped row indices; duplicates
    are discarded). Triton software-pipelines the W tile loads that feed dots (cp.async,
    `num_stages` deep), which keeps bytes in flight.
  * use_dot=False: fp32 multiply-adds on the CUDA cores into a [block_n, block_k] accumulator
    per row, reduced once at the end. Triton does not pipeline loads that feed no dot, so a
    program waits a full memory round trip per K chunk; `prefetch=P` software-pipelines by
    hand: the loop carries the next P chunks' raw loads and requests chunk c+P before the
    math on chunk c, so P+1 tiles per program are in flight. The summation order is the
    same for every P (bit-identical results).

`gated=True` takes W = [gate; up] ([2I, K]) and returns silu(gate) * up [M, I], rounding as
the model does (each projection rounded to the activation dtype, silu in fp32 rounded once,
the product rounded once), so the SiLU kernel after the GEMM disappears.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import compiler_params, dot, pl

MAX_ROWS = 16
MAX_FMA_ROWS = 8  # registers: one [block_n, block_k] fp32 accumulator per row
# Defaults when a call gives no tuning; the engine passes its own per-projection tilings
# (ouro_jax.projections.GEMV_TUNING, measured with benchmarks/gemv.py on the H200).
DEFAULTS = dict(use_dot=True, block_n=16, block_k=256, num_warps=4, num_stages=4, prefetch=0)
MAX_PREFETCH = 4  # chunks loaded ahead (registers: one weight tile per chunk per program)


def pow2_divisor(n: int, cap: int, floor: int = 1) -> int:
    """Largest power of two in [floor, cap] dividing n, or 0 when there is none."""
    b = cap
    while b >= floor:
        if n % b == 0:
            return b
        b //= 2
    return 0


def _mul(a, b, dt):
    """a * b in fp32, rounded once to dt (how XLA multiplies two bf16 arrays)."""
    return (a.astype(jnp.float32) * b.astype(jnp.float32)).astype(dt)


def _silu_mul(g, u, dt):
    gf = g.astype(dt).astype(jnp.float32)
    return _mul((gf * jax.nn.sigmoid(gf)).astype(dt), u.astype(dt), dt)


def _rms_scale(xf, k: int, eps: float):
    """rsqrt(mean(x^2) + eps) of a full fp32 row (model.rms_norm's statistic)."""
    return lax.rsqrt(jnp.sum(xf * xf) / k + eps)


def _normed(xf, scale, weight, dt):
    """model.rms_norm's rounding: (x * scale) rounded to dt, times the weight, rounded."""
    return _mul((xf * scale).astype(dt), weight, dt)


def _kernel(*refs, m: int, k: int, block_n: int, block_k: int, use_dot: bool, gated: bool,
            up_offset: int, prologue: str = "", eps: float = 0.0, prefetch: int = 0):
    """prologue "": refs = (x, w, y). "norm": (x, wx, w, y), the GEMV of rms_norm(x, wx).
    "add_norm": (x, b, wb, wx, w, y, x_out): the residual stream x_out = x + rms_norm(b, wb)
    (program 0 stores it) and the GEMV of rms_norm(x_out, wx). The row statistics need the
    whole row, so every program computes them from the full rows (a few KB from L2) and then
    recomputes each block_k chunk of the normed input inside the K loop."""
    if prologue == "add_norm":
        x_ref, b_ref, wb_ref, wx_ref, w_ref, y_ref, xo_ref = refs
    elif prologue == "norm":
        x_ref, wx_ref, w_ref, y_ref = refs
    else:
        x_ref, w_ref, y_ref = refs
    j = pl.program_id(0)
    dt = y_ref.dtype
    nk = k // block_k
    gate_rows = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
    up_rows = pl.ds(pl.multiple_of(up_offset + j * block_n, block_n), block_n)

    def cols(c):
        if isinstance(c, int):  # a prefetched chunk's static index (Triton cannot tag constants)
            return pl.ds(c * block_k, block_k)
        return pl.ds(pl.multiple_of(c * block_k, block_k), block_k)

    if use_dot:
        mp = MAX_ROWS  # one tensor-core tile of rows (m <= MAX_ROWS)
        rows = jnp.minimum(lax.iota(jnp.int32, mp), m - 1)

        def body(c, accs):
            xc = x_ref[rows, cols(c)]  # [mp, bk]
            out = (accs[0] + dot(xc, w_ref[gate_rows, cols(c)], ((1,), (1,))),)
            if gated:
                out += (accs[1] + dot(xc, w_ref[up_rows, cols(c)], ((1,), (1,))),)
            return out

        init = (jnp.zeros((mp, block_n), jnp.float32),) * (2 if gated else 1)
        accs = lax.fori_loop(0, nk, body, init)
        y = _silu_mul(accs[0], accs[1], dt) if gated else accs[0].astype(dt)
        y_ref[rows, gate_rows] = y  # clamped duplicate rows write identical values
        return

    # Raw loads of chunk c (weight tiles, row inputs, norm-weight chunks), apart from the math
    # on them, so that chunks can be loaded `prefetch` iterations ahead of their use.
    def load(c):
        t = dict(wg=w_ref[gate_rows, cols(c)],
                 x=tuple(x_ref[r, cols(c)] for r in range(m)))
        if gated:
            t["wu"] = w_ref[up_rows, cols(c)]
        if prologue == "add_norm":
            t["b"] = tuple(b_ref[r, cols(c)] for r in range(m))
            t["wb"] = wb_ref[cols(c)]
        if prologue:
            t["wx"] = wx_ref[cols(c)]
        return t

    # The first `prefetch` chunks are requested before the prologue's row statistics, so the
    # weight stream is already in flight while they are computed.
    prefetch = min(prefetch, nk)
    ahead = tuple(load(c) for c in range(prefetch))

    # Per-row norm scales (prologue): s_b for the branch, s_x for the (new) residual row.
    scales = []
    for r in range(m):
        if prologue == "add_norm":
            bf = b_ref[r, :].astype(jnp.float32)
            s_b = _rms_scale(bf, k, eps)
            xn = (x_ref[r, :].astype(jnp.float32)
                  + _normed(bf, s_b, wb_ref[:], dt).astype(jnp.float32)).astype(dt)

            @pl.when(j == 0)
            def _():
                xo_ref[r, :] = xn

            scales.append((s_b, _rms_scale(xn.astype(jnp.float32), k, eps)))
        elif prologue == "norm":
            scales.append((None, _rms_scale(x_ref[r, :].astype(jnp.float32), k, eps)))

    def x_chunk(t, r):
        """Row r's GEMV input for the loaded chunk t, in fp32."""
        if not prologue:
            return t["x"][r].astype(jnp.float32)
        s_b, s_x = scales[r]
        xc = t["x"][r]
        if prologue == "add_norm":
            nb = _normed(t["b"][r].astype(jnp.float32), s_b, t["wb"], dt)
            xc = (xc.astype(jnp.float32) + nb.astype(jnp.float32)).astype(dt)
        return _normed(xc.astype(jnp.float32), s_x, t["wx"], dt).astype(jnp.float32)

    def accumulate(t, accs):
        wg = t["wg"].astype(jnp.float32)  # [bn, bk]
        wu = t["wu"].astype(jnp.float32) if gated else None
        out = []
        for r in range(m):
            xr = x_chunk(t, r)[None, :]
            out.append(accs[len(out)] + wg * xr)
            if gated:
                out.append(accs[len(out)] + wu * xr)
        return tuple(out)

    def body(c, carry):
        ahead, accs = carry
        if not prefetch:
            return ahead, accumulate(load(c), accs)
        nxt = load(c + prefetch)  # issued before the math on chunk c, which does not wait on it
        return ahead[1:] + (nxt,), accumulate(ahead[0], accs)

    per_row = 2 if gated else 1
    init = (jnp.zeros((block_n, block_k), jnp.float32),) * (m * per_row)
    ahead, accs = lax.fori_loop(0, nk - prefetch, body, (ahead, init))
    for t in ahead:  # the last `prefetch` chunks, already loaded
        accs = accumulate(t, accs)
    for r in range(m):
        g = jnp.sum(accs[r * per_row], axis=1)
        y = _silu_mul(g, jnp.sum(accs[r * per_row + 1], axis=1), dt) if gated else g.astype(dt)
        y_ref[r, gate_rows] = y


def check_supported(m: int, k: int, n_out: int, *, use_dot: bool, block_n: int, block_k: int,
                    prefetch: int = 0):
    """Raises ValueError naming what the kernel cannot do for this shape and tiling."""
    if type(prefetch) is not int or not 0 <= prefetch <= MAX_PREFETCH:
        raise ValueError(f"gemv prefetch must be an int in 0..{MAX_PREFETCH}, got {prefetch!r}")
    if use_dot and prefetch:
        raise ValueError("gemv prefetch is for the CUDA-core path (use_dot=False); the dot path "
                         "pipelines its loads through num_stages")
    if m < 1 or m > MAX_ROWS:
        raise ValueError(f"gemv takes 1..{MAX_ROWS} rows, got {m}")
    if not use_dot and m > MAX_FMA_ROWS:
        raise ValueError(f"gemv use_dot=False keeps one accumulator tile per row: at most "
                         f"{MAX_FMA_ROWS} rows, got {m}")
    for name, v in (("block_n", block_n), ("block_k", block_k)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"gemv {name} must be a power of two, got {v}")
    if use_dot and (block_n < 16 or block_k < 16):
        raise ValueError(f"gemv use_dot=True needs block_n and block_k >= 16 (a tensor-core "
                         f"tile), got {block_n} and {block_k}")
    if n_out % block_n or k % block_k:
        raise ValueError(f"gemv: block_n={block_n} must divide N={n_out} and block_k={block_k} "
                         f"must divide K={k}")


def check_operands(x, w, gated: bool) -> int:
    """Shape checks shared by every GEMV entry point (this file and gemv_stream.py); returns
    the output width N (I when gated)."""
    if x.ndim != 2 or w.ndim != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"gemv shape mismatch: x {x.shape} (want [M, K]), w {w.shape} (want [N, K])")
    n = w.shape[0]
    if gated and n % 2:
        raise ValueError(f"gated gemv needs w = [gate; up] with an even row count, got {n}")
    return n // 2 if gated else n


def check_norm_operands(who: str, x, norm_w, branch, branch_w):
    """The norm prologue's operands (gemv_normed and gemv_stream_normed)."""
    k = x.shape[1]
    if norm_w.shape != (k,):
        raise ValueError(f"{who}: norm weight shape {norm_w.shape}, want ({k},)")
    if (branch is None) != (branch_w is None):
        raise ValueError(f"{who}: give branch and branch_w together")
    if branch is not None and (branch.shape != x.shape or branch_w.shape != (k,)):
        raise ValueError(f"{who}: branch {branch.shape} / branch_w {branch_w.shape} do not "
                         f"match x {x.shape}")


def gemv(x: jax.Array, w: jax.Array, *, gated: bool = False, interpret: bool = False,
         **tuning) -> jax.Array:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (fp32 accumulation); gated: w = [gate; up]
    [2I, K] -> silu(x @ gate^T) * (x @ up^T) [M, I]. tuning: DEFAULTS' keys; block_k defaults
    to the largest power of two in 16..256 dividing K (256 when none does, which K then
    fails to divide: an error)."""
    unknown = set(tuning) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown gemv tuning keys {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    n_out = check_operands(x, w, gated)
    m, k = x.shape
    cfg = dict(DEFAULTS, **tuning)
    if "block_k" not in tuning:
        cfg["block_k"] = pow2_divisor(k, cfg["block_k"], floor=16) or cfg["block_k"]
    check_supported(m, k, n_out, use_dot=cfg["use_dot"], block_n=cfg["block_n"],
                    block_k=cfg["block_k"], prefetch=cfg["prefetch"])
    kernel = functools.partial(_kernel, m=m, k=k, block_n=cfg["block_n"],
                               block_k=cfg["block_k"], use_dot=cfg["use_dot"], gated=gated,
                               up_offset=n_out, prefetch=cfg["prefetch"])
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n_out), x.dtype),
        grid=(n_out // cfg["block_n"],),
        compiler_params=compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="gemv_silu" if gated else "gemv",
    )(x, w.astype(x.dtype))


def gemv_normed(x: jax.Array, norm_w: jax.Array, w: jax.Array, *, eps: float,
                branch: jax.Array | None = None, branch_w: jax.Array | None = None,
                gated: bool = False, interpret: bool = False, **tuning):
    """The projection of rms_norm(x', norm_w) with the RMSNorm done in the kernel's prologue,
    where x' = x, or with `branch` x' = x + rms_norm(branch, branch_w) (the sandwich layer's
    residual add). Returns (y, x'): x' is the residual stream the layer goes on with (x
    itself without a branch). Only the CUDA-core path (use_dot=False) has the prologue."""
    unknown = set(tuning) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown gemv tuning keys {sorted(unknown)}; valid: {sorted(DEFAULTS)}")
    cfg = dict(DEFAULTS, **tuning)
    if cfg["use_dot"]:
        raise ValueError("gemv_normed: the norm prologue needs use_dot=False")
    n_out = check_operands(x, w, gated)
    m, k = x.shape
    check_norm_operands("gemv_normed", x, norm_w, branch, branch_w)
    check_supported(m, k, n_out, use_dot=False, block_n=cfg["block_n"], block_k=cfg["block_k"],
                    prefetch=cfg["prefetch"])
    prologue = "norm" if branch is None else "add_norm"
    kernel = functools.partial(_kernel, m=m, k=k, block_n=cfg["block_n"],
                               block_k=cfg["block_k"], use_dot=False, gated=gated,
                               up_offset=n_out, prologue=prologue, eps=float(eps),
                               prefetch=cfg["prefetch"])
    dt = x.dtype
    y_shape = jax.ShapeDtypeStruct((m, n_out), dt)
    call = functools.partial(
        pl.pallas_call, kernel, grid=(n_out // cfg["block_n"],),
        compiler_params=compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret, name=("gemv_silu" if gated else "gemv") + "_" + prologue)
    if branch is None:
        y = call(out_shape=y_shape)(x, norm_w.astype(dt), w.astype(dt))
        return y, x
    y, x_new = call(out_shape=(y_shape, jax.ShapeDtypeStruct((m, k), dt)))(
        x, branch.astype(dt), branch_w.astype(dt), norm_w.astype(dt), w.astype(dt))
    return y, x_new


def gemv_reference(x, w, *, gated: bool = False):
    """The engine's XLA projections (model.linear, model.silu): the oracle for tests."""
    from ouro_jax.projections import XLA

    return XLA().gated(x, w) if gated else XLA().project("", x, w)
