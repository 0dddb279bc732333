"""Row-wise residual add and RMSNorm, one row per program: the batch-invariant mode's norms.

    h = x + rms_norm(branch, branch_w)    the sandwich layer's residual add (h = x without one)
    y = rms_norm(h, norm_w)               the next projection's input (none without norm_w)

`branch` may hold split-K partials (pallas_kernels.gemm(..., partials=True)): fp32 [M, S*K],
split s in columns [s*K, (s+1)*K). They are added left to right and rounded, as
gemm.sum_splits and gemm's rounding do, so the branch has the bits gemm would return.

Why a kernel: a row's sum of squares in XLA is a reduction whose tree the compiler may choose
by shape, so ouro_jax.invariant summed it in a fixed order with elementwise halvings
(invariant.row_sum). XLA ran those, the split-K sums, the adds and the scalings as small
kernels: with RoPE's and the K/V write's, about 18 per layer application at one row, ~24 us
of its ~78 (session 40's trace, kernel_trace_inv_b1_session40_h100.json). Here each program
reads one row, so a row's sums run the same instructions whatever the row count: the same
guarantee in one kernel per norm pair (two per layer application: they replaced ~10). The
roundings are model.rms_norm's, through the GEMV prologue's helpers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import compiler_params, next_pow2, pl
from pallas_kernels.gemv import _normed, _rms_scale


def _kernel(*refs, k: int, eps: float, splits: int, branch: bool, norm: bool):
    """refs: x, [b, wb], [wx], [h_out], [y_out]; blocks of one row, K padded to a power of
    two with zeros (which add nothing to the sums; the means divide by the true k)."""
    refs = list(refs)
    x_ref = refs.pop(0)
    b_ref, wb_ref = (refs.pop(0), refs.pop(0)) if branch else (None, None)
    wx_ref = refs.pop(0) if norm else None
    h_ref = refs.pop(0) if branch else None
    y_ref = refs.pop(0) if norm else None
    dt = x_ref.dtype
    xf = x_ref[...].astype(jnp.float32)  # [1, Kp]
    if branch:
        kp = x_ref.shape[1]
        bf = b_ref[:, 0:kp]
        for s in range(1, splits):  # left to right, as gemm.sum_splits
            bf = bf + b_ref[:, s * kp:(s + 1) * kp]
        bf = bf.astype(dt).astype(jnp.float32)  # the branch as gemm rounds it
        nb = _normed(bf, _rms_scale(bf, k, eps), wb_ref[...], dt)
        xn = (xf + nb.astype(jnp.float32)).astype(dt)
        h_ref[...] = xn
        xf = xn.astype(jnp.float32)
    if norm:
        y_ref[...] = _normed(xf, _rms_scale(xf, k, eps), wx_ref[...], dt)


def check_operands(x, norm_w, branch, branch_w):
    if x.ndim != 2:
        raise ValueError(f"add_norm: x must be [M, K], got {x.shape}")
    m, k = x.shape
    if norm_w is None and branch is None:
        raise ValueError("add_norm: give norm_w, or branch and branch_w (or both)")
    if norm_w is not None and norm_w.shape != (k,):
        raise ValueError(f"add_norm: norm weight shape {norm_w.shape}, want ({k},)")
    if (branch is None) != (branch_w is None):
        raise ValueError("add_norm: give branch and branch_w together")
    if branch is None:
        return 1
    if branch_w.shape != (k,):
        raise ValueError(f"add_norm: branch weight shape {branch_w.shape}, want ({k},)")
    if branch.ndim != 2 or branch.shape[0] != m or branch.shape[1] % k:
        raise ValueError(f"add_norm: branch {branch.shape} is neither [M, K] nor split-K "
                         f"partials [M, S*K] for x {x.shape}")
    splits = branch.shape[1] // k
    if splits > 1 and branch.dtype != jnp.float32:
        raise ValueError(f"add_norm: split-K partials must be float32, got {branch.dtype}")
    return splits


def add_norm(x: jax.Array, norm_w: jax.Array | None, *, eps: float,
             branch: jax.Array | None = None, branch_w: jax.Array | None = None,
             interpret: bool = False, num_warps: int = 4):
    """(h, y): h = x + rms_norm(branch, branch_w) (x itself without a branch), y =
    rms_norm(h, norm_w) (None without norm_w); both [M, K] in x's dtype. branch: [M, K],
    or fp32 split-K partials [M, S*K] (see the module docstring)."""
    splits = check_operands(x, norm_w, branch, branch_w)
    m, k = x.shape
    kp = next_pow2(k)
    dt = x.dtype

    def padded(a, width):  # the kernel's blocks are powers of two (tiny test models only)
        if kp == k:
            return a
        if a.ndim == 1:
            return jnp.pad(a, (0, kp - k))
        return jnp.pad(a.reshape(m, width // k, k), ((0, 0), (0, 0), (0, kp - k))).reshape(
            m, width // k * kp)

    row = pl.BlockSpec((1, kp), lambda i: (i, 0))
    vec = pl.BlockSpec((kp,), lambda i: (0,))
    args, specs, outs, out_specs = [padded(x, k)], [row], [], []
    if branch is not None:
        bt = branch if splits > 1 else branch.astype(dt)
        args += [padded(bt, branch.shape[1]), padded(branch_w.astype(dt), k)]
        specs += [pl.BlockSpec((1, splits * kp), lambda i: (i, 0)), vec]
        outs.append(jax.ShapeDtypeStruct((m, kp), dt))
        out_specs.append(row)
    if norm_w is not None:
        args.append(padded(norm_w.astype(dt), k))
        specs.append(vec)
        outs.append(jax.ShapeDtypeStruct((m, kp), dt))
        out_specs.append(row)
    kernel = functools.partial(_kernel, k=k, eps=float(eps), splits=splits,
                               branch=branch is not None, norm=norm_w is not None)
    res = pl.pallas_call(kernel, out_shape=tuple(outs), grid=(m,), in_specs=specs,
                         out_specs=tuple(out_specs),
                         compiler_params=compiler_params(num_warps, 1), interpret=interpret,
                         name="add_norm" if branch is not None else "norm")(*args)
    res = [r[:, :k] for r in res]
    h = res.pop(0) if branch is not None else x
    return h, (res.pop(0) if norm_w is not None else None)


def reference(x, norm_w, *, eps, branch=None, branch_w=None):
    """The same in XLA (model.rms_norm; partials summed by gemm.sum_splits): the tests' oracle."""
    from ouro_jax.model import rms_norm
    from pallas_kernels.gemm import sum_splits
    h = x
    if branch is not None:
        splits = branch.shape[1] // x.shape[1]
        b = sum_splits(branch, splits).astype(x.dtype) if splits > 1 else branch.astype(x.dtype)
        h = x + rms_norm(b, branch_w, eps)
    return h, (None if norm_w is None else rms_norm(h, norm_w, eps))
