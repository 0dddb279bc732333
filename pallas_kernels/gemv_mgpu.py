"""One-row GEMV y [1, N] = x [1, K] @ W [N, K]^T on the Pallas Mosaic GPU backend (prototype).

Why: the Triton-lowered GEMVs (pallas_kernels/gemv.py) reach 58-70% of the H200's copy
bandwidth. Here each program streams its [block_n, K / k_splits] slab of W through a
`stages`-deep ring of shared-memory buffers filled by TMA (plgpu.emit_pipeline), so up to
stages - 1 weight tiles per program are in flight while the tensor cores consume one.

The math runs on wgmma, which wastes MMA work but the kernel is memory bound: wgmma's M must
be a multiple of 64 and its N may be as small as 8, so W is the A operand and x, padded to
8 rows, is the transposed B operand:  acc^T [block_n, 8] += W_tile [block_n, bk] @ X^T [bk, 8].
Column 0 of acc is the answer (columns 1-7 come from the zero padding rows and are dropped).
MMA columns are independent, so garbage in the padding rows could never reach column 0.

k_splits > 1 splits K over more programs (N / block_n programs alone is only 32-176 for the
1.4B shapes, against 132 SMs); each split writes fp32 partials that XLA sums afterwards.
The kernel writes [k_splits, N, 8] (TMA stores need rows of >= 16 bytes, so 8 columns are
stored rather than one); gemv_mgpu slices column 0.

Interpret mode (CPU, interpret=True): plgpu.kernel(..., interpret=plgpu.InterpretGPUParams())
simulates SMEM, TMA and barriers; it runs wgmma synchronously, so it cannot check the
wgmma_wait(1) / delay_release=1 pairing below (the GPU test does). After an exception inside an interpreted kernel, call
jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call.reset_gpu_interpret_mode_state().
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

XROWS = 8  # x padded to wgmma's smallest N
SMEM_LIMIT = 227 * 1024  # H100/H200 dynamic shared memory per block


def gemv_reference(x, w):
    """x [1, K] @ w [N, K]^T with fp32 accumulation, rounded once to x.dtype."""
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32).T).astype(x.dtype)


def smem_bytes(block_n, block_k, stages, out_itemsize=4):
    """Shared memory per program: the W and x rings plus the output staging tile."""
    return stages * (block_n + XROWS) * block_k * 2 + block_n * XROWS * out_itemsize


def check_row_operands(x, w):
    """x one bf16/fp16 row [1, K], w [N, K] of the same dtype (every Mosaic GEMV here)."""
    if x.ndim != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be one row [1, K], got {x.shape}")
    if w.ndim != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"w must be [N, K] with K = {x.shape[1]}, got {w.shape}")
    if x.dtype != w.dtype or x.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"x and w must both be bf16 or fp16, got {x.dtype}, {w.dtype}")


def w_tile_transforms(block_k, dtype):
    """SMEM transforms of a [rows, block_k] weight tile for wgmma: 8-row tiles of one swizzle
    atom, the widest swizzle (128 bytes) a row of the tile allows: bank-conflict-free reads."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(block_k * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _check(x, w, block_n, block_k, k_splits, stages):
    check_row_operands(x, w)
    n, k = w.shape
    if block_n % 64 or n % block_n:  # wgmma M: multiples of 64 per warpgroup
        raise ValueError(f"block_n={block_n} must be a multiple of 64 dividing N={n}")
    if k_splits < 1 or k % k_splits or (k // k_splits) % block_k:
        raise ValueError(f"K={k} must split into k_splits={k_splits} parts divisible by "
                         f"block_k={block_k}")
    if block_k % 64:  # one 128-byte swizzle atom of bf16 per row
        raise ValueError(f"block_k={block_k} must be a multiple of 64")
    if stages < 2:  # delay_release=1 below needs max_concurrent_steps > 1
        raise ValueError(f"stages={stages} must be >= 2")
    if smem_bytes(block_n, block_k, stages) > SMEM_LIMIT:
        raise ValueError(f"{smem_bytes(block_n, block_k, stages)} B of shared memory "
                         f"(block_n={block_n}, block_k={block_k}, stages={stages}) exceeds "
                         f"{SMEM_LIMIT}")


@functools.lru_cache(maxsize=None)
def _build(n, k, dtype, block_n, block_k, k_splits, stages, interpret):
    k_part = k // k_splits
    out_dtype = jnp.float32 if k_splits > 1 else dtype  # partials stay fp32 until summed
    transforms = w_tile_transforms(block_k, dtype)

    def body(x_gmem, w_gmem, o_gmem, o_smem):
        ni = lax.axis_index("n")
        ki = lax.axis_index("k")

        def acc_scope(acc_ref):
            def step(_, w_smem, x_smem):
                plgpu.wgmma(acc_ref, w_smem, x_smem.T)
                # Keep one wgmma in flight: it may still read this step's slot, which is
                # why the specs set delay_release=1 (the slot is refilled one step later).
                plgpu.wgmma_wait(1)

            spec = functools.partial(plgpu.BlockSpec, index_map=lambda s: (0, s),
                                     transforms=transforms, delay_release=1)
            plgpu.emit_pipeline(
                step, grid=(k_part // block_k,),
                in_specs=[spec((block_n, block_k)), spec((XROWS, block_k))],
                max_concurrent_steps=stages,
            )(w_gmem.at[pl.ds(ni * block_n, block_n), pl.ds(ki * k_part, k_part)],
              x_gmem.at[:, pl.ds(ki * k_part, k_part)])
            plgpu.wgmma_wait(0)
            return acc_ref[...]

        acc = pl.run_scoped(acc_scope, plgpu.ACC((block_n, XROWS), jnp.float32))
        # Registers -> SMEM -> TMA store; commit_smem fences the SMEM writes for the TMA unit.
        o_smem[...] = acc.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[ki, pl.ds(ni * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((k_splits, n, XROWS), out_dtype),
        scratch_types=[plgpu.SMEM((block_n, XROWS), out_dtype)],
        grid=(n // block_n, k_splits), grid_names=("n", "k"),
        interpret=interpret)


def pad_x(x):
    """x [1, K] -> [8, K], zero rows below (in a model this pad fuses into x's producer)."""
    return jnp.pad(x, ((0, XROWS - 1), (0, 0)))


def gemv_mgpu_raw(xp, w, *, block_n=64, block_k=256, k_splits=1, stages=4, interpret=False):
    """The kernel alone: xp [8, K] (pad_x) -> [k_splits, N, 8] (fp32 if k_splits > 1)."""
    _check(xp[:1], w, block_n, block_k, k_splits, stages)
    if xp.shape[0] != XROWS:
        raise ValueError(f"xp must have {XROWS} rows, got {xp.shape}")
    n, k = w.shape
    # interpret: False (compile for the GPU), True (CPU simulation) or an InterpretGPUParams
    # (e.g. detect_races=True); params are a frozen dataclass, hence hashable for the cache.
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    call = _build(n, k, jnp.dtype(w.dtype), block_n, block_k, k_splits, stages,
                  interpret or None)
    return call(xp, w)


def gemv_mgpu(x, w, *, block_n=64, block_k=256, k_splits=1, stages=4, interpret=False):
    """y [1, N] = x [1, K] @ w [N, K]^T (fp32 accumulation, x.dtype out) on Mosaic GPU."""
    _check(x, w, block_n, block_k, k_splits, stages)
    out = gemv_mgpu_raw(pad_x(x), w, block_n=block_n, block_k=block_k, k_splits=k_splits,
                        stages=stages, interpret=interpret)
    return out[:, :, 0].sum(0).astype(x.dtype)[None] if k_splits > 1 else out[0, :, 0][None]


def lower_for_h200(x, w, **tiling):
    """Lower gemv_mgpu for the 'cuda' platform on any machine (a CPU one included): runs the
    Pallas -> Mosaic GPU lowering (layouts, transforms, wgmma operand checks) without a GPU.
    PTX generation happens later, in the CUDA plugin, and is not exercised here."""
    from pallas_kernels.offline_compile import lower_for_cuda
    return lower_for_cuda(functools.partial(gemv_mgpu, **tiling), x, w)


# The 1.4B decode projections (N, K), and tilings for the GPU sweep (block_n, block_k,
# k_splits, stages): 37-205 KB of SMEM each, so 1 to 6 programs fit on an SM.
SHAPES = [(6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]
ENGINE_NAMES = {(6144, 2048): "qkv", (2048, 2048): "o", (11264, 2048): "gate_up",
                (2048, 5632): "down"}  # the baseline: the engine's kernel for that shape
SWEEP = [(64, 256, 1, 4), (64, 128, 1, 4), (64, 128, 1, 6), (128, 256, 1, 3),
         (128, 128, 1, 4), (64, 256, 2, 4), (64, 128, 2, 4), (64, 128, 4, 4),
         (64, 256, 4, 3), (128, 128, 2, 4), (128, 256, 2, 3), (64, 64, 2, 8),
         (64, 64, 8, 4)]


def _bench(fn, ws, reps):
    """us per call: fn applied to each weight copy in one jitted program (no dispatch gaps,
    and the copies together exceed the 50 MB L2, so weights come from HBM), `reps` times."""
    import time
    run = jax.jit(lambda ws: [fn(w) for w in ws])
    jax.block_until_ready(run(ws))
    t = time.perf_counter()
    for _ in range(reps):
        out = run(ws)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / (reps * len(ws)) * 1e6


def _device_us(fn, ws, reps=4):
    """(kernel us, span us) per call of fn over the weight copies, from the GPU's clock
    (benchmarks.timing.device_seconds): the figures to rank tilings by."""
    from benchmarks.timing import device_seconds
    run = jax.jit(lambda ws: [fn(w) for w in ws])
    kernel, span = device_seconds(run, ws, calls=reps, units=len(ws))
    return kernel * 1e6, span * 1e6


def benchmark(shapes=SHAPES, sweep=SWEEP, interpret=False, min_bytes=200_000_000, calls=200):
    """Print us per call and TB/s of jnp.dot, of the engine's kernel and of every tiling in
    `sweep` at `shapes`; return the figures as rows (dicts)."""
    import numpy as np
    rows = []
    for n, k in shapes:
        kx, kw = jax.random.split(jax.random.PRNGKey(n + k))
        x = jax.random.normal(kx, (1, k), jnp.float32).astype(jnp.bfloat16)
        nbytes = n * k * 2
        copies = max(2, -(-min_bytes // nbytes))
        ws = [(jax.random.normal(jax.random.fold_in(kw, i), (n, k), jnp.float32)
               * k ** -0.5).astype(jnp.bfloat16) for i in range(copies)]
        reps = max(1, calls // copies)
        ref = np.asarray(gemv_reference(x, ws[0]), np.float32)
        us = _bench(lambda w: jnp.dot(x, w.T), ws, reps)
        print(f"N={n} K={k} {nbytes / 1e6:.1f} MB x{copies}  jnp.dot: {us:.2f} us "
              f"{nbytes / us / 1e6:.2f} TB/s", flush=True)
        rows.append(dict(n=n, k=k, kernel="jnp.dot", us=us))
        name = ENGINE_NAMES.get((n, k))
        if name and not interpret:  # the engine's Triton streaming GEMV on its own tiling
            from ouro_jax.projections import STREAM_TUNING
            from pallas_kernels.gemv_stream import gemv_stream
            kw = dict(STREAM_TUNING[name], gated=name == "gate_up")
            us = _bench(lambda w: gemv_stream(x, w, **kw), ws, reps)
            print(f"  engine gemv_stream ({name}): {us:.2f} us {nbytes / us / 1e6:.2f} TB/s",
                  flush=True)
            rows.append(dict(n=n, k=k, kernel=f"gemv_stream {name}", us=us))
        xp = pad_x(x)
        for bn, bk, ks, st in sweep:
            tiling = dict(block_n=bn, block_k=bk, k_splits=ks, stages=st, interpret=interpret)
            tag = f"  bn={bn:3d} bk={bk:3d} ks={ks} st={st} progs={n // bn * ks:4d}"
            try:
                err = np.abs(np.asarray(gemv_mgpu(x, ws[0], **tiling), np.float32) - ref).max()
                us_k = _bench(lambda w: gemv_mgpu_raw(xp, w, **tiling), ws, reps)
                us_f = _bench(lambda w: gemv_mgpu(x, w, **tiling), ws, reps)
            except Exception as e:  # noqa: BLE001 - report the tiling and go on
                print(f"{tag}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                rows.append(dict(n=n, k=k, kernel="gemv_mgpu", tiling=[bn, bk, ks, st],
                                 error=f"{type(e).__name__}: {str(e)[:300]}"))
                continue
            print(f"{tag}: kernel {us_k:7.2f} us {nbytes / us_k / 1e6:.2f} TB/s | with "
                  f"pad/slice/sum {us_f:7.2f} us | max err {err:.3g}", flush=True)
            rows.append(dict(n=n, k=k, kernel="gemv_mgpu", tiling=[bn, bk, ks, st], us=us_k,
                             us_with_glue=us_f, max_err=float(err)))
    return rows


if __name__ == "__main__":
    # On the H200:  PYTHONPATH=. python -m pallas_kernels.gemv_mgpu [out.json]
    import json
    import sys
    result = dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
                  command="python -m pallas_kernels.gemv_mgpu", rows=benchmark())
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
