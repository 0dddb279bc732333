"""One-row GEMV y [1, N] = x [1, K] @ W [N, K]^T on Mosaic GPU with x as wgmma's A operand in
registers (prototype, jax >= 0.11; session 13).

Why: gemv_mgpu / gemv_mgpu_normed make W the A operand, whose M is a multiple of 64, so a
program owns >= 64 output rows: qkv runs 96 programs and gate/up 88 on the H200's 132 SMs
at one split, and split-K adds an XLA sum and wave tails. On the H200 that kernel was slower
than the Triton streaming GEMV at every projection (docs/performance.md, session 13). Here
the roles swap: W's tile [block_n, block_k] is the transposed B operand, whose N may be any
multiple of 8 up to 256, and the A operand is x's chunk broadcast to 64 rows in registers
(wgmma takes A from registers in the WGMMA layout). All 64 rows of the [64, block_n]
accumulator are then equal; row 0 is the answer. block_n can drop to 8-32, so the grid can
fill the SMs without splitting K.

Per program: x's K-part is copied once into SMEM (generic loads and stores, then a
warpgroup barrier); the pipeline streams W tiles by TMA into a `stages`-deep ring; each
step loads its x chunk from SMEM in the column layout of WGMMA (every thread the columns
its A fragment needs), broadcasts it to [64, block_k] in registers and issues the wgmma.
The epilogue runs on the whole accumulator in registers; the result goes to SMEM and its row 0
to GMEM by TMA. gated: W = [gate; up], two
accumulators, silu(gate) * up rounded as gemv._silu_mul (k_splits == 1).

pdl_step (opt-in, session 15; None: off): programmatic dependent launch placed by the kernel
itself, which the Triton path cannot do (XLA puts its wait at every Triton kernel's start).
The pipeline's first `stages` weight tiles are requested before `griddepcontrol.wait`
(weights do not depend on the previous kernel), x is read after it, in step 0; at step
min(pdl_step, steps - 1) the kernel lets the next one launch
(`griddepcontrol.launch_dependents`), so that kernel's own weight requests can run under
this one's tail. The result is the same as without PDL (tested bit for bit on the GPU).
The weights are read before the wait, so they must not come from the kernel just before
(a cast or copy of W in the same program would race): pass weights that exist before it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.gemv import _silu_mul
from pallas_kernels.gemv_mgpu import SMEM_LIMIT, check_row_operands, w_tile_transforms

AROWS = 64  # wgmma's M: x broadcast to 64 rows


def register_a_layouts():
    """(a_layout, col_layout): WGMMA's register layout spelled as a TILED layout, for a
    [64, k] A operand held in registers, and its .reduce(0), the columns each thread's A
    fragment needs (replicated over rows), the layout a row chunk is loaded in. Spelled
    out because Layout.WGMMA.reduce(0) trips Mosaic's layout inference (jax 0.11.2)."""
    wg = plgpu.Layout.WGMMA.to_mgpu()
    a_layout = plgpu.Layout.TILED(wg.tiling, warp_dims=wg.warp_dims, lane_dims=wg.lane_dims,
                                  vector_dim=wg.vector_dim)
    return a_layout, a_layout.reduce(0)


def broadcast_a(h, a_layout):
    """A row chunk h [k] (col_layout) as the [64, k] register A operand: all rows h."""
    return plgpu.layout_cast(lax.broadcast_in_dim(h, (AROWS, h.shape[0]), (1,)), a_layout)


def smem_bytes(k, block_n, block_k, k_splits, stages, gated):
    ntiles = 2 if gated else 1
    return (stages * block_n * block_k * 2 * ntiles + (k // k_splits) * 2
            + AROWS * block_n * 4 + 1024)


def check(x, w, block_n, block_k, k_splits, stages, gated):
    check_row_operands(x, w)
    if gated and w.shape[0] % 2:
        raise ValueError(f"gated needs w = [gate; up] with an even row count, got {w.shape}")
    n = w.shape[0] // 2 if gated else w.shape[0]
    k = x.shape[1]
    if block_n % 8 or not 8 <= block_n <= 256 or n % block_n:
        raise ValueError(f"block_n={block_n} must be a multiple of 8 in 8..256 dividing N={n}")
    if block_k < 64 or block_k % 64 or k_splits < 1 or k % k_splits or (k // k_splits) % block_k:
        raise ValueError(f"K={k} must split into k_splits={k_splits} parts divisible by "
                         f"block_k={block_k}, a multiple of 64")
    if (k // k_splits) % 128:  # x's part is loaded in one warpgroup-strided load
        raise ValueError(f"K={k} / k_splits={k_splits} = {k // k_splits} must be a multiple "
                         f"of 128")
    if gated and k_splits > 1:
        raise ValueError("gated takes k_splits=1 (the SiLU needs whole sums)")
    if stages < 2:
        raise ValueError(f"stages={stages} must be >= 2")
    need = smem_bytes(k, block_n, block_k, k_splits, stages, gated)
    if need > SMEM_LIMIT:
        raise ValueError(f"{need} B of shared memory exceeds {SMEM_LIMIT}")
    return n


@functools.lru_cache(maxsize=None)
def _build(n, k, dtype, gated, block_n, block_k, k_splits, stages, interpret, pdl_step=None):
    dt = jnp.dtype(dtype)
    k_part = k // k_splits
    nk = k_part // block_k
    out_dtype = jnp.float32 if k_splits > 1 else dt
    transforms = w_tile_transforms(block_k, dt)
    a_layout, col_layout = register_a_layouts()
    ntiles = 2 if gated else 1

    def body(x_g, w_g, o_g, x_smem, o_smem, *a_smem):
        ni = lax.axis_index("n")
        ki = lax.axis_index("k")

        def load_x():  # x's K-part into SMEM once (a row of a few KB), fenced for all threads
            x_smem[...] = plgpu.load(x_g.at[0, pl.ds(ki * k_part, k_part)])
            plgpu.commit_smem()
        if pdl_step is None:
            load_x()

        def acc_scope(*accs):
            def step(idx, *w_tiles):
                if pdl_step is not None:
                    @pl.when(idx[0] == 0)
                    def _():  # the first tiles are in flight: now wait, then read x
                        _pdl_wait(interpret)
                        load_x()

                    @pl.when(idx[0] == min(pdl_step, nk - 1))
                    def _():
                        _pdl_launch(interpret)
                h = plgpu.load(x_smem.at[pl.ds(idx[0] * block_k, block_k)],
                               layout=col_layout, optimized=False)
                a = broadcast_a(h, a_layout)
                if a_smem:  # interpret mode: its wgmma takes refs only (see gemv_mgpu_areg)
                    a_smem[0][...] = a
                    plgpu.commit_smem()
                    a = a_smem[0]
                for acc, w_tile in zip(accs, w_tiles):
                    plgpu.wgmma(acc, a, w_tile.T)
                plgpu.wgmma_wait(1)

            spec = functools.partial(plgpu.BlockSpec, (block_n, block_k),
                                     index_map=lambda s: (0, s), transforms=transforms,
                                     delay_release=1)
            rows = [pl.ds(ni * block_n, block_n)]
            if gated:
                rows.append(pl.ds(n + ni * block_n, block_n))
            plgpu.emit_pipeline(step, grid=(nk,), in_specs=[spec() for _ in rows],
                                max_concurrent_steps=stages,
                                )(*[w_g.at[r, pl.ds(ki * k_part, k_part)] for r in rows])
            plgpu.wgmma_wait(0)
            return tuple(acc[...] for acc in accs)

        acc_t = plgpu.ACC((AROWS, block_n), jnp.float32)
        accs = pl.run_scoped(acc_scope, *([acc_t] * ntiles))
        # All 64 rows are equal: the epilogue runs on all of them in registers, the result
        # goes to SMEM and its row 0 to the output by TMA.
        res = _silu_mul(accs[0], accs[1], dt) if gated else accs[0].astype(out_dtype)
        o_smem[...] = res
        plgpu.commit_smem()
        # Row 0 as a [1, block_n] slice (a 1-D one trips Mosaic's transform inference).
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, 1)],
                                o_g.at[pl.ds(ki, 1), pl.ds(ni * block_n, block_n)])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = "gemv_mgpu_areg" + ("_silu" if gated else "")
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((k_splits, n), out_dtype),
        scratch_types=[plgpu.SMEM((k_part,), dt), plgpu.SMEM((AROWS, block_n), out_dtype)]
        + ([plgpu.SMEM((AROWS, block_k), dt, transforms=transforms)] if interpret else []),
        grid=(n // block_n, k_splits), grid_names=("n", "k"), interpret=interpret)


def _pdl_wait(interpret):
    if not interpret:  # (the CPU simulation has no grids to wait for)
        plgpu.griddepcontrol_wait()


def _pdl_launch(interpret):
    if not interpret:
        plgpu.griddepcontrol_launch_dependents()


def gemv_mgpu_areg(x, w, *, gated=False, block_n=32, block_k=128, k_splits=1, stages=4,
                   interpret=False, pdl_step=None):
    """y [1, N] = x @ w^T (gated: silu(x @ gate^T) * (x @ up^T), [1, I]) with x as the
    register A operand; fp32 accumulation, x.dtype out (k_splits > 1: XLA sums the fp32
    partials). interpret: the CPU simulation, whose wgmma takes its A operand from shared
    memory only (jax 0.11.2), so there the broadcast x chunk is stored to an SMEM tile first;
    the register path itself is checked by the lowering for 'cuda' and on the GPU."""
    n = check(x, w, block_n, block_k, k_splits, stages, gated)
    if pdl_step is not None and (type(pdl_step) is not int or pdl_step < 0):
        raise ValueError(f"pdl_step must be None or an int >= 0, got {pdl_step!r}")
    if pdl_step is not None and k_splits > 1:
        raise ValueError("pdl_step needs k_splits=1 (with splits the next kernel is XLA's "
                         "sum of the partials, which gains nothing from an early launch)")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    call = _build(n, x.shape[1], jnp.dtype(x.dtype), bool(gated), block_n, block_k, k_splits,
                  stages, interpret or None, pdl_step)
    out = call(x, w)
    return out if k_splits == 1 else out.sum(0).astype(x.dtype)[None]


def lower_for_h200(x, w, **kw):
    """The Pallas -> Mosaic GPU lowering for 'cuda' on any machine (see gemv_mgpu)."""
    from pallas_kernels.offline_compile import lower_for_cuda
    return lower_for_cuda(functools.partial(gemv_mgpu_areg, **kw), x, w)


# The 1.4B one-row projections as plain GEMVs: name -> (W rows, K, gated), and the first
# sweep (block_n, block_k, k_splits, stages): 128-384 programs without splitting K.
SHAPES = {"qkv": (6144, 2048, False), "o": (2048, 2048, False),
          "gate_up": (11264, 2048, True), "down": (2048, 5632, False)}
SWEEP = {
    "qkv": [(16, 256, 1, 4), (32, 128, 1, 4), (32, 256, 1, 4), (64, 128, 1, 4), (16, 128, 1, 8)],
    "o": [(8, 256, 1, 4), (16, 256, 1, 4), (16, 128, 1, 6), (8, 128, 2, 4), (16, 128, 2, 4)],
    "gate_up": [(16, 256, 1, 3), (16, 128, 1, 4), (32, 128, 1, 4), (8, 256, 1, 4)],
    "down": [(8, 256, 1, 4), (16, 256, 1, 4), (16, 512, 1, 3), (16, 256, 2, 4), (8, 512, 1, 3)],
}


def benchmark(names=tuple(SHAPES), sweep=SWEEP, min_bytes=200_000_000, calls=200):
    """Device time per call (profiler trace; pallas_kernels.gemv_mgpu._device_us) of XLA,
    the engine's streaming GEMV on STREAM_TUNING (plain, no prologue) and each tiling here,
    with the bf16 elements that differ from XLA; wall-clock us as well (host-bound)."""
    import numpy as np
    from ouro_jax.projections import STREAM_TUNING
    from pallas_kernels.gemv import gemv_reference
    from pallas_kernels.gemv_mgpu import _bench, _device_us
    from pallas_kernels.gemv_mgpu_sweep import _bench_inputs
    from pallas_kernels.gemv_stream import gemv_stream
    rows = []
    for name in names:
        n, k, gated = SHAPES[name]
        nbytes = n * k * 2
        x, _, _, _, ws = _bench_inputs(n, k, min_bytes)
        copies = len(ws)
        reps = max(1, calls // copies)
        ref = np.asarray(jax.jit(lambda w: gemv_reference(x, w, gated=gated))(ws[0]), np.float32)
        print(f"{name}: N={n} K={k} gated={gated} {nbytes / 1e6:.1f} MB x{copies}", flush=True)

        def record(kernel, fn, **extra):
            try:
                y = np.asarray(jax.jit(fn)(ws[0]), np.float32)
                us = _bench(fn, ws, reps)
                dev, span = _device_us(fn, ws)
            except Exception as e:  # noqa: BLE001 - report it and go on
                msg = f"{type(e).__name__}: {str(e)[:300]}"
                print(f"  {kernel} {extra}: FAILED {msg}", flush=True)
                rows.append(dict(name=name, kernel=kernel, error=msg, **extra))
                return
            row = dict(name=name, n=n, k=k, kernel=kernel, us=us, device_us=dev, span_us=span,
                       mismatches=int((y != ref).sum()),
                       max_err=float(np.abs(y - ref).max()), **extra)
            print(f"  {kernel} {extra}: device {dev:6.2f} us ({nbytes / dev / 1e6:.2f} TB/s), "
                  f"wall {us:6.2f} | {row['mismatches']} of {y.size} differ from XLA",
                  flush=True)
            rows.append(row)

        record("xla", lambda w: gemv_reference(x, w, gated=gated))
        t = STREAM_TUNING[name]
        record("gemv_stream", lambda w: gemv_stream(x, w, gated=gated, **t), tiling=t)
        for bn, bk, ks, st in sweep[name]:
            tiling = dict(block_n=bn, block_k=bk, k_splits=ks, stages=st)
            record("gemv_mgpu_areg", lambda w, t=tiling: gemv_mgpu_areg(x, w, gated=gated, **t),
                   tiling=[bn, bk, ks, st])
    return rows


if __name__ == "__main__":
    # On the H200:  PYTHONPATH=. python -m pallas_kernels.gemv_mgpu_areg [out.json [NAME...]]
    import json
    import sys
    names = tuple(sys.argv[2:]) or tuple(SHAPES)
    bad = sorted(set(names) - set(SHAPES))
    if bad:
        raise SystemExit(f"unknown projection(s) {bad}; choose from {tuple(SHAPES)}")
    result = dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
                  command="python -m " + " ".join(["pallas_kernels.gemv_mgpu_areg"]
                                                  + sys.argv[1:]),
                  rows=benchmark(names))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)
