"""The Mosaic GPU GEMV (gemv_mgpu.py) with the engine's fused RMSNorm prologue and SiLU epilogue:
gemv_mgpu_normed has gemv_stream.gemv_stream_normed's contract (prototype).

  norm:      h = rms_norm(x, norm_w);                               y = h @ W^T
  add_norm:  x' = x + rms_norm(branch, branch_w); h = rms_norm(x', norm_w); y = h @ W^T
             (x' is returned too; program (0, 0) writes it)
  gated:     W = [gate; up] [2I, K];  y = silu(h @ gate^T) * (h @ up^T)  [1, I]

Rounding is gemv.py's contract (gemv._normed / gemv._silu_mul, i.e. model.rms_norm and
model.silu): row statistics in fp32 over the whole row, x * scale rounded to the model dtype,
times the weight rounded, the residual add rounded, fp32 accumulation, each projection
rounded before the SiLU, silu rounded once, the product rounded once.

Per program (Lane semantics: the body is one warpgroup, arrays are warpgroup-wide):
1. The row statistics: the whole row [K] is loaded from GMEM straight into registers in the
   WG_STRIDED layout (plgpu.load works on GMEM refs), squared and summed (a full reduction of
   a strided array: per thread, then across the warpgroup through a small SMEM scratch).
   add_norm: x' is computed in that layout, kept in a plain SMEM row for step 2, and
   program (0, 0) stores it to GMEM with an ordinary register store.
2. h, block_k columns at a time, in a TiledLayout made for this (_h_layout below): the
   layout of [8, block_k] whose 8 rows are split over the 4 warps (2 rows each) and whose
   columns go 2 per lane. Its 1-D reduction over the rows (.reduce(0): every warp
   holds all columns, replicated) is the layout the chunk is loaded and normalised in;
   lax.broadcast_in_dim to [8, block_k] (plgpu.layout_cast names the target layout: the
   broadcast rule takes the cast as its hint) is then free in registers, and the [8, block_k]
   array is stored into h_smem[c], a buffer with the wgmma B-operand transforms
   (TilingTransform((8, 64)) + 128-byte SwizzleTransform): Pallas' store of a TiledLayout
   array into a tiled, swizzled ref. All 8 rows hold h (MMA columns are independent, so
   nothing needs zeroing). commit_smem() fences these generic-proxy writes for wgmma.
3. The pipeline of gemv_mgpu.py streams only W tiles (gate and up tiles when gated, two
   accumulators); step s multiplies by h_smem[s]^T. overlap=True runs steps 1-2 inside the
   pipeline's first step (under pl.when), so the first `stages` W tiles are already in
   flight during the prologue, as gemv_stream requests its first block before its prologue.

SMEM: h takes 8 x (K / k_splits) x 2 bytes (32 KB at K = 2048), x' K x 2 more (add_norm).
gated with k_splits > 1 writes fp32 partials of gate and up ([k_splits, 2I, 8]); XLA sums
them and applies the SiLU (gemv._silu_mul) afterwards. K must be a multiple of 256.

Status: interpret mode (CPU) is bit-identical to the engine's XLA path in bf16 (tests), and
every tiling in the tests lowers for 'cuda' (Mosaic GPU MLIR, layouts, wgmma operands); it has
not yet run on a GPU. There, the fp32 row statistic (sum order, rsqrt) may differ from XLA's
in the last bit, as for gemv_stream. `python -m pallas_kernels.gemv_mgpu_normed out.json`
times it against XLA and the engine's gemv_stream_normed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

# gemv's rounding helpers, used in the kernel as they are: (x * scale) rounded to the model
# dtype, times the weight, rounded; silu(g) * u rounded as model.silu and the product.
from pallas_kernels.gemv import _normed, _silu_mul, check_norm_operands
from pallas_kernels.gemv_mgpu import SMEM_LIMIT, XROWS, _check, w_tile_transforms

H_TILE = 64  # columns per (8, 64) tile: one 128-byte swizzle atom of bf16 per row


def _h_layout():
    """[8, n] (n % 64 == 0) in 8 x 64 tiles: warp w holds rows 2w and 2w + 1, lane l
    columns 2l and 2l + 1 of each tile (4 elements per thread per tile)."""
    from jax.experimental.mosaic.gpu.fragmented_array import Tiling
    return plgpu.Layout.TILED(Tiling(((XROWS, H_TILE), (XROWS, 2), (2, 2))),
                              warp_dims=(-4,), lane_dims=(-5,), vector_dim=-1)


def smem_bytes(k, block_n, block_k, k_splits, stages, gated, add_norm, out_itemsize=4):
    w_ring = stages * block_n * block_k * 2 * (2 if gated else 1)
    out_tiles = 2 if gated and k_splits > 1 else 1
    return (w_ring + XROWS * (k // k_splits) * 2 + (k * 2 if add_norm else 0)
            + out_tiles * block_n * out_itemsize + 1024)  # + reduction scratch etc.


@functools.lru_cache(maxsize=None)
def _build(n_out, k, dtype, eps, add_norm, gated, block_n, block_k, k_splits, stages,
           overlap, interpret, norm=True):
    dt = jnp.dtype(dtype)
    k_part = k // k_splits
    nk = k_part // block_k
    out_dtype = jnp.float32 if k_splits > 1 else dt
    transforms = w_tile_transforms(block_k, dt)
    h_layout = _h_layout()
    col_layout = h_layout.reduce(0)

    def body(*refs):
        if add_norm:
            x_g, b_g, wb_g, wx_g, w_g, o_g, xo_g, o_smem, h_smem, xn_smem = refs
        elif norm:
            x_g, wx_g, w_g, o_g, o_smem, h_smem = refs
        else:  # no norm: x itself, loaded in the kernel, is the B operand (no XLA pad kernel)
            x_g, w_g, o_g, o_smem, h_smem = refs
        ni = lax.axis_index("n")
        ki = lax.axis_index("k")

        def statistics():
            """1. The row statistics (WG_STRIDED registers, the whole row): x's scale (after
            the residual add with add_norm, x' then kept in SMEM for step 2)."""
            xf = plgpu.load(x_g.at[0]).astype(jnp.float32)
            if add_norm:
                bf = plgpu.load(b_g.at[0]).astype(jnp.float32)
                s_b = lax.rsqrt(jnp.sum(bf * bf) / k + eps)
                nb = _normed(bf, s_b, plgpu.load(wb_g), dt)
                # The normed branch is rounded to bf16 before the add (model.rms_norm's
                # output dtype). On the H200 the Mosaic GPU lowering dropped that rounding
                # when nb went straight into the fp32 add (574 of 2048 elements of x' then
                # differed from XLA and the host's exact rounding,
                # benchmarks/results/mgpu_add_norm_probe_session13_h200.json); a store to
                # and load from SMEM makes it physical.
                xn_smem[...] = nb
                nb = xn_smem[...]
                xn = (xf + nb.astype(jnp.float32)).astype(dt)
                xn_smem[...] = xn

                @pl.when(jnp.logical_and(ni == 0, ki == 0))
                def _():
                    xo_g[0] = xn

                xf = xn.astype(jnp.float32)
            return lax.rsqrt(jnp.sum(xf * xf) / k + eps)

        def prologue():
            s_x = statistics() if norm else None
            # 2. h, block_k columns at a time, broadcast to 8 rows into the B-operand buffer.
            # (Loads from GMEM in a TiledLayout need optimized=False.)
            src = xn_smem if add_norm else x_g.at[0]
            for c in range(nk):
                cols = pl.ds(ki * k_part + c * block_k, block_k)
                h = plgpu.load(src.at[cols], layout=col_layout, optimized=False)
                if norm:
                    wx = plgpu.load(wx_g.at[cols], layout=col_layout, optimized=False)
                    h = _normed(h.astype(jnp.float32), s_x, wx, dt)
                h_smem[c] = plgpu.layout_cast(
                    lax.broadcast_in_dim(h, (XROWS, block_k), (1,)), h_layout)
            plgpu.commit_smem()  # fence the generic-proxy SMEM writes for wgmma (+ barrier)

        if not overlap:
            prologue()

        # 3. The W stream.
        def acc_scope(*accs):
            def step(idx, *w_tiles):
                if overlap:  # the first `stages` W tiles are in flight already
                    pl.when(idx[0] == 0)(prologue)
                hb = h_smem.at[idx[0]]
                for acc, w_tile in zip(accs, w_tiles):
                    plgpu.wgmma(acc, w_tile, hb.T)
                plgpu.wgmma_wait(1)  # as in gemv_mgpu: delay_release=1 covers the last one

            spec = functools.partial(plgpu.BlockSpec, (block_n, block_k),
                                     index_map=lambda s: (0, s), transforms=transforms,
                                     delay_release=1)
            rows = [pl.ds(ni * block_n, block_n)]
            if gated:
                rows.append(pl.ds(n_out + ni * block_n, block_n))
            plgpu.emit_pipeline(
                step, grid=(nk,), in_specs=[spec() for _ in rows],
                max_concurrent_steps=stages,
            )(*[w_g.at[r, pl.ds(ki * k_part, k_part)] for r in rows])
            plgpu.wgmma_wait(0)
            return tuple(acc[...] for acc in accs)

        acc_t = plgpu.ACC((block_n, XROWS), jnp.float32)
        accs = pl.run_scoped(acc_scope, *([acc_t] * (2 if gated else 1)))
        # All 8 columns of an accumulator are equal (every row of h holds h), so their max is
        # column 0 exactly: a row reduction in registers (WGMMA_ROW layout) leaves the [N]
        # result the engine wants, where an [N, 8] output would need an XLA slice kernel
        # before a Pallas consumer.
        accs = tuple(jnp.max(acc, axis=1) for acc in accs)
        if gated and k_splits == 1:
            accs = (_silu_mul(accs[0], accs[1], dt),)
        # Registers -> SMEM -> TMA store (gated split-K: gate and up partials, rows 0 and I).
        for i, acc in enumerate(accs):
            o_smem[i] = acc.astype(out_dtype)
        plgpu.commit_smem()
        for i in range(len(accs)):
            rows = pl.ds(i * n_out + ni * block_n, block_n)
            plgpu.copy_smem_to_gmem(o_smem.at[i], o_g.at[ki, rows])
        plgpu.wait_smem_to_gmem(0)

    # The kernel's name in traces and profiles, as gemv_stream's: gemv_mgpu[_silu][_add_norm]
    body.__name__ = ("gemv_mgpu" + ("_silu" if gated else "")
                     + ("_add_norm" if add_norm else "_norm" if norm else ""))
    split_gated = gated and k_splits > 1
    out_type = [jax.ShapeDtypeStruct((k_splits, n_out * (2 if split_gated else 1)), out_dtype)]
    scratch = [plgpu.SMEM((2 if split_gated else 1, block_n), out_dtype),
               plgpu.SMEM((nk, XROWS, block_k), dt, transforms=transforms)]
    if add_norm:
        out_type.append(jax.ShapeDtypeStruct((1, k), dt))
        scratch.append(plgpu.SMEM((k,), dt))
    return plgpu.kernel(
        body, out_type=tuple(out_type), scratch_types=scratch,
        grid=(n_out // block_n, k_splits), grid_names=("n", "k"), interpret=interpret)


def check_tiling(x, w_out, block_n, block_k, k_splits, stages, gated, add_norm, norm):
    """The kernel's rules for a tiling, on x [1, K] and the [n_out, K] weight rows one
    accumulator streams (arrays or ShapeDtypeStructs): gemv_mgpu's shape and tiling rules,
    K % 256 with the norm prologue, and the shared-memory budget."""
    _check(x, w_out, block_n, block_k, k_splits, stages)
    k = x.shape[1]
    if norm and k % 256:  # the statistics' whole-row WG_STRIDED loads: 128 threads x >= 2
        raise ValueError(f"K={k} must be a multiple of 256 (the norm prologue)")
    need = smem_bytes(k, block_n, block_k, k_splits, stages, gated, add_norm)
    if need > SMEM_LIMIT:
        raise ValueError(f"{need} B of shared memory exceeds {SMEM_LIMIT}")


def gemv_mgpu_normed(x, norm_w, w, *, eps, branch=None, branch_w=None, gated=False,
                     block_n=64, block_k=256, k_splits=1, stages=4, overlap=False,
                     interpret=False):
    """gemv_stream.gemv_stream_normed's contract on Mosaic GPU: returns (y, x'), y [1, N]
    (or [1, I] gated) the projection of rms_norm(x', norm_w), x' = x or
    x + rms_norm(branch, branch_w) (x itself without a branch). norm_w=None: no prologue
    math, y the projection of x itself (no branch then): the plain GEMV without
    gemv_mgpu's XLA pad and slice around it. overlap: run the prologue inside the pipeline's
    first step, after the first `stages` W tiles have been requested (else before the
    pipeline starts)."""
    norm = norm_w is not None
    if norm:
        check_norm_operands("gemv_mgpu_normed", x, norm_w, branch, branch_w)
    elif branch is not None or branch_w is not None:
        raise ValueError("gemv_mgpu_normed: a branch (the residual add) needs norm_w")
    if gated and w.shape[0] % 2:
        raise ValueError(f"gated needs w = [gate; up] with an even row count, got {w.shape}")
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    add_norm = branch is not None
    check_tiling(x, w[:n_out], block_n, block_k, k_splits, stages, gated, add_norm, norm)
    k = x.shape[1]
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    dt = x.dtype
    call = _build(n_out, k, jnp.dtype(dt), float(eps), add_norm, gated, block_n, block_k,
                  k_splits, stages, bool(overlap), interpret or None, norm)
    if add_norm:
        vecs = (x, branch.astype(dt), branch_w.astype(dt), norm_w.astype(dt))
    else:
        vecs = (x, norm_w.astype(dt)) if norm else (x,)
    outs = call(*vecs, w)
    raw = outs[0]
    if k_splits == 1:
        y = raw  # [1, N]: no XLA op between this kernel and the next
    elif gated:  # the fp32 partials of gate and up, summed, then gemv._silu_mul's rounding
        gu = raw.sum(0)
        y = _silu_mul(gu[:n_out], gu[n_out:], dt)[None]
    else:
        y = raw.sum(0).astype(dt)[None]
    return y, (outs[1] if add_norm else x)


def gemv_mgpu_plain(x, w, *, gated=False, **tiling):
    """y [1, N] = x @ w^T (gated: silu(x @ gate^T) * (x @ up^T) [1, I]) on the kernel above
    with no norm prologue: x is loaded into the wgmma operand in the kernel and y is written
    as [1, N], so no XLA op runs before or after it (k_splits == 1)."""
    return gemv_mgpu_normed(x, None, w, eps=0.0, gated=gated, **tiling)[0]


def lower_for_h200(x, norm_w, w, branch=None, branch_w=None, **kw):
    """gemv_mgpu.lower_for_h200 for gemv_mgpu_normed (arguments may be ShapeDtypeStructs)."""
    from pallas_kernels.offline_compile import lower_for_cuda
    return lower_for_cuda(
        lambda x, nw, w, b, bw: gemv_mgpu_normed(x, nw, w, branch=b, branch_w=bw, **kw),
        x, norm_w, w, branch, branch_w)


def reference(x, norm_w, w, *, eps, branch=None, branch_w=None, gated=False):
    """The engine's XLA path (model.rms_norm, model.linear, model.silu): (y, x'); norm_w
    None: the plain projection of x."""
    from ouro_jax.model import rms_norm
    from pallas_kernels.gemv import gemv_reference
    if norm_w is None:
        return gemv_reference(x, w, gated=gated), x
    if branch is not None:
        x = x + rms_norm(branch, branch_w, eps)
    return gemv_reference(rms_norm(x, norm_w, eps), w, gated=gated), x


if __name__ == "__main__":
    # On the H200:  PYTHONPATH=. python -m pallas_kernels.gemv_mgpu_normed [out.json [NAME...]
    #               [--device-time]]   (the sweep lives in pallas_kernels.gemv_mgpu_sweep)
    import sys
    from pallas_kernels.gemv_mgpu_sweep import main
    main(sys.argv[1:], prog="pallas_kernels.gemv_mgpu_normed")
