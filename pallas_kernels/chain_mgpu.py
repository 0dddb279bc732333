"""A decoder layer's four one-row GEMVs (qkv -> o -> gate/up -> down), over L layers, as ONE
persistent Mosaic GPU kernel whose weight stream never stops at a stage boundary (prototype,
jax >= 0.11, session 26; not in the engine).

Why: batch-1 decode is ~18 us per layer application above its bytes on the H200
(docs/performance.md), paid per kernel: each GEMV's ramp, tail and first weights. Every
handover tried so far (grid barriers, completion counters, PDL) was written in Triton,
where a program's loads land in registers, so no more than a block or two of the next
stage's weights can be in flight while a program waits for the previous stage. Here each
of the grid's programs (one per SM, all resident) owns a ring of `stages` shared-memory
slots filled by TMA, and walks one flat sequence of weight tiles across every stage and
layer: the tiles of stage s + 1 are requested while stage s is still being computed and
while the program waits at the handover, so the memory system keeps streaming through it.

The chain is the plain projections (no norms, no residuals, no attention: what a whole
layer would need is listed in docs/kernels.md): x -> qkv, q = its first 2048 outputs -> o
-> gate/up (silu(gate) * up, as gemv._silu_mul rounds it) -> down -> the next layer's qkv.
Math per tile as gemv_mgpu_areg: x's chunk broadcast to 64 rows is wgmma's register A
operand, W's [block_n, block_k] tile the transposed B operand, fp32 accumulation over the
whole K in one program (no split-K), one bf16 rounding per output.

Handover: a program that has written its stage-s outputs (TMA stores, completed) adds 1 to
one global counter (a Pallas GPU semaphore, zeroed by Pallas at every call); stage s + 1
starts once the counter reaches (s + 1) * programs, then reads its input row from global
memory. Every output buffer is rewritten four stages after it was read, behind three more
of these waits, so no program can overwrite an input another program has yet to read. All
programs must be resident at once: the grid is the SM count (`programs`) and one program
fits an SM.

Units: stage t's output rows in blocks of block_n, block b to program b % programs; a
program's tiles for one unit are its K blocks in order (gate and up tiles alternating for
gate/up). `stages` tiles are in flight per program.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.gemv import _silu_mul
from pallas_kernels.gemv_mgpu import SMEM_LIMIT, w_tile_transforms

AROWS = 64  # wgmma's M: x broadcast to 64 rows
# name -> (output rows N, K, gated): the 1.4B shapes; gate/up's weight is [gate; up] [2N, K]
SHAPES = (("qkv", 6144, 2048, False), ("o", 2048, 2048, False),
          ("gate_up", 5632, 2048, True), ("down", 2048, 5632, False))
Q_ROWS = 2048  # o reads q, the first 2048 of qkv's outputs


def reference_chain(x, ws):
    """The chain in XLA: fp32 accumulation, one bf16 rounding per output (gemv_reference)."""
    from pallas_kernels.gemv import gemv_reference
    wq, wo, wgu, wd = ws
    h = x
    for l in range(wq.shape[0]):
        y = gemv_reference(h, wq[l])
        y = gemv_reference(y[:, :Q_ROWS], wo[l])
        y = gemv_reference(y, wgu[l], gated=True)
        h = gemv_reference(y, wd[l])
    return h


def smem_bytes(block_n, block_k, stages):
    kmax = max(k for _, _, k, _ in SHAPES)
    return stages * block_n * block_k * 2 + kmax * 2 + AROWS * block_n * 2 + 1024


def check(x, ws, block_n, block_k, stages, programs):
    if len(ws) != 4:
        raise ValueError(f"ws must be (qkv, o, gate_up, down) weights, got {len(ws)}")
    n_layers = ws[0].shape[0]
    if x.shape != (1, SHAPES[0][2]) or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [1, {SHAPES[0][2]}], got {x.dtype} {x.shape}")
    for (name, n, k, gated), w in zip(SHAPES, ws):
        want = (n_layers, 2 * n if gated else n, k)
        if w.shape != want or w.dtype != jnp.bfloat16:
            raise ValueError(f"{name} weights must be bf16 {want}, got {w.dtype} {w.shape}")
        if k % block_k or n % block_n:
            raise ValueError(f"{name}: block_n={block_n} must divide N={n} and "
                             f"block_k={block_k} K={k}")
        if n // block_n < programs:
            raise ValueError(f"{name}: {n // block_n} blocks of {block_n} rows leave some of "
                             f"the {programs} programs without work; lower block_n")
    if block_n % 8 or not 8 <= block_n <= 256 or block_k % 64:
        raise ValueError(f"block_n={block_n} must be a multiple of 8 in 8..256 and "
                         f"block_k={block_k} a multiple of 64")
    if stages < 2 or stages > 32:  # barrier phases live in one 32-bit mask
        raise ValueError(f"stages={stages} must be in 2..32")
    if smem_bytes(block_n, block_k, stages) > SMEM_LIMIT:
        raise ValueError(f"{smem_bytes(block_n, block_k, stages)} B of shared memory "
                         f"exceeds {SMEM_LIMIT}")


@functools.lru_cache(maxsize=None)
def _build(n_layers, block_n, block_k, stages, programs):
    dt = jnp.dtype(jnp.bfloat16)
    S, P, BN, BK = stages, programs, block_n, block_k
    kmax = max(k for _, _, k, _ in SHAPES)
    transforms = w_tile_transforms(BK, dt)
    wg = plgpu.Layout.WGMMA.to_mgpu()
    a_layout = plgpu.Layout.TILED(wg.tiling, warp_dims=wg.warp_dims, lane_dims=wg.lane_dims,
                                  vector_dim=wg.vector_dim)
    col_layout = a_layout.reduce(0)
    nk = [k // BK for _, _, k, _ in SHAPES]
    c = [2 if gated else 1 for *_, gated in SHAPES]

    def body(x_g, wq, wo, wgu, wd, yq, yo, ygu, yd, ring, bars, x_smem, o_smem):
        ws, ys = (wq, wo, wgu, wd), (yq, yo, ygu, yd)
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR)
        me = lax.axis_index("p")
        # this program's units and tiles per stage (the same every layer)
        units = [(n // BN - me + P - 1) // P for _, n, _, _ in SHAPES]
        tiles = [u * nk[t] * c[t] for t, u in enumerate(units)]
        prefix = [0]
        for t in range(4):
            prefix.append(prefix[-1] + tiles[t])
        per_layer = prefix[4]
        total = per_layer * n_layers

        def issue(g):  # request tile g of this program's sequence into slot g % S
            @pl.when(g < total)
            def _():
                layer, r = g // per_layer, g % per_layer
                for t, (_, n, _, _) in enumerate(SHAPES):
                    @pl.when((r >= prefix[t]) & (r < prefix[t + 1]))
                    def _(t=t, n=n):
                        i = r - prefix[t]
                        unit, rem = i // (nk[t] * c[t]), i % (nk[t] * c[t])
                        kb, j = rem // c[t], rem % c[t]
                        row0 = (me + unit * P) * BN + j * n
                        plgpu.copy_gmem_to_smem(
                            ws[t].at[layer, pl.ds(row0, BN), pl.ds(kb * BK, BK)],
                            ring.at[g % S], bars.at[g % S])

        for g0 in range(S):
            issue(g0)

        def load_x(src, k):  # the stage's input row into SMEM, fenced for wgmma's readers
            x_smem.at[pl.ds(0, k)][...] = plgpu.load(src)
            plgpu.commit_smem()

        def stage(t, layer, g):
            _, n, k, gated = SHAPES[t]
            # the handover: every program's stage outputs written (layer * 4 + t stages)
            plgpu.semaphore_wait(sem, (layer * 4 + t) * P, decrement=False,
                                 memory_scope="gpu")
            if t == 0:
                @pl.when(layer == 0)
                def _():
                    load_x(x_g.at[0, pl.ds(0, k)], k)

                @pl.when(layer > 0)
                def _():
                    load_x(yd.at[0, pl.ds(0, k)], k)
            else:
                load_x(ys[t - 1].at[0, pl.ds(0, k)], k)

            def unit_body(u, g_unit):
                row0 = (me + u * P) * BN

                def scope(*accs):
                    def kb_body(kb, g):
                        for j in range(c[t]):
                            plgpu.barrier_wait(bars.at[(g + j) % S])
                        h = plgpu.load(x_smem.at[pl.ds(kb * BK, BK)], layout=col_layout,
                                       optimized=False)
                        a = plgpu.layout_cast(lax.broadcast_in_dim(h, (AROWS, BK), (1,)),
                                              a_layout)
                        for j in range(c[t]):
                            plgpu.wgmma(accs[j], a, ring.at[(g + j) % S].T)
                        plgpu.wgmma_wait(0)  # the slots just read are free again
                        for j in range(c[t]):
                            issue(g + S + j)
                        return g + c[t]
                    g = lax.fori_loop(0, nk[t], kb_body, g_unit)
                    return g, tuple(acc[...] for acc in accs)

                g, vals = pl.run_scoped(scope, *([plgpu.ACC((AROWS, BN), jnp.float32)] * c[t]))
                res = _silu_mul(vals[0], vals[1], dt) if gated else vals[0].astype(dt)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem's last store read
                o_smem[...] = res
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, 1)],
                                        ys[t].at[pl.ds(0, 1), pl.ds(row0, BN)])
                return g

            g = lax.fori_loop(0, units[t], unit_body, g)
            plgpu.wait_smem_to_gmem(0)  # the stores are done before they are announced
            # pl.semaphore_signal fences *after* its add: the empty signal's fence orders
            # the stores above before the counting add below
            pl.semaphore_signal(sem, 0)
            pl.semaphore_signal(sem, 1)
            return g

        def layer_body(layer, g):
            for t in range(4):
                g = stage(t, layer, g)
            return g

        lax.fori_loop(0, n_layers, layer_body, jnp.int32(0))

    body.__name__ = "gemv_chain_mgpu"
    out = [jax.ShapeDtypeStruct((1, n), dt) for _, n, _, _ in SHAPES]
    return plgpu.kernel(
        body, out_type=out,
        scratch_types=[plgpu.SMEM((S, BN, BK), dt, transforms=transforms),
                       plgpu.Barrier(num_arrivals=1, num_barriers=S),
                       plgpu.SMEM((kmax,), dt), plgpu.SMEM((AROWS, BN), dt)],
        grid=(P,), grid_names=("p",))


def gemv_chain_mgpu(x, ws, *, block_n=8, block_k=256, stages=8, programs=None):
    """The plain chain over ws = (qkv [L, 6144, 2048], o [L, 2048, 2048], gate_up
    [L, 11264, 2048], down [L, 2048, 5632]), bf16, from x [1, 2048]; returns the last
    layer's four outputs (qkv, o, gate/up, down). programs: the SM count by default."""
    if programs is None:
        programs = getattr(jax.devices()[0], "core_count", None) or 132
    check(x, ws, block_n, block_k, stages, programs)
    return _build(ws[0].shape[0], block_n, block_k, stages, programs)(x, *ws)


def lower_for_h200(x, ws, **kw):
    """The Pallas -> Mosaic GPU lowering for 'cuda' on any machine (see gemv_mgpu)."""
    from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    from pallas_kernels.offline_compile import sm90_device_info
    kw.setdefault("programs", 132)
    with sm90_device_info():
        return jax.jit(functools.partial(gemv_chain_mgpu, **kw)).trace(x, ws).lower(
            lowering_platforms=("cuda",))
