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


def chain_shapes(hidden, q_rows, qkv_rows, inter):
    """Per stage (name, output rows N, K, gated); gate/up's weight is [gate; up] [2N, K].
    o reads q, the first q_rows of qkv's outputs."""
    return (("qkv", qkv_rows, hidden, False), ("o", hidden, q_rows, False),
            ("gate_up", inter, hidden, True), ("down", hidden, inter, False))


SHAPES = chain_shapes(2048, 2048, 6144, 5632)  # the 1.4B model's
Q_ROWS = 2048


def shapes_of(ws, block_n=1, block_k=None):
    """chain_shapes of weights [L, rows, K] or, with block_k, tile_weights' layout."""
    if len(ws) != 4:
        raise ValueError(f"ws must be (qkv, o, gate_up, down) weights, got {len(ws)}")
    dims = []
    for w in ws:
        want = ("[L, rows, K]" if block_k is None else
                "tile_weights' [L, rows / block_n, K / block_k, block_n, block_k]")
        if w.ndim != (3 if block_k is None else 5) or (
                block_k is not None and w.shape[3:] != (block_n, block_k)):
            raise ValueError(f"weights must be {want}, got {w.shape}")
        dims.append((w.shape[1], w.shape[2]) if block_k is None
                    else (w.shape[1] * block_n, w.shape[2] * block_k))
    (n0, h), (h_o, q), (i2, h_gu), (h_d, i) = dims
    if h_o != h or h_gu != h or h_d != h or i2 != 2 * i or q > n0:
        raise ValueError(f"weights do not chain: qkv {dims[0]}, o {dims[1]}, gate_up "
                         f"{dims[2]}, down {dims[3]} (rows, K)")
    return chain_shapes(h, q, n0, i)


def reference_chain(x, ws):
    """The chain in XLA over [L, rows, K] weights: fp32 accumulation, one bf16 rounding per
    output (gemv_reference); returns the last layer's down output."""
    from pallas_kernels.gemv import gemv_reference
    wq, wo, wgu, wd = ws
    h = x
    for l in range(wq.shape[0]):
        y = gemv_reference(h, wq[l])
        y = gemv_reference(y[:, :wo.shape[2]], wo[l])
        y = gemv_reference(y, wgu[l], gated=True)
        h = gemv_reference(y, wd[l])
    return h


def umax(shapes, block_n, programs):
    """Per stage: the most units (blocks of block_n output rows) one program owns."""
    return [-(-(n // block_n) // programs) for _, n, _, _ in shapes]


def step_tiles(shapes, block_n, programs):
    """The most weight tiles one K step consumes: units x (2 for gate/up)."""
    return max(u * (2 if gated else 1)
               for u, (*_, gated) in zip(umax(shapes, block_n, programs), shapes))


def smem_bytes(shapes, block_n, block_k, stages, interpret=False):
    kmax = max(k for _, _, k, _ in shapes)
    a_tile = AROWS * block_k * 2 if interpret else 0
    return (stages * block_n * block_k * 2 + kmax * 2 + AROWS * block_n * 2 + a_tile
            + 1024)


def tile_weights(ws, block_n, block_k):
    """[L, rows, K] -> [L, rows / block_n, K / block_k, block_n, block_k]: every tile the
    kernel requests is one contiguous block of memory (a layout chosen once, at load)."""
    out = []
    for w in ws:
        n_layers, rows, k = w.shape
        out.append(w.reshape(n_layers, rows // block_n, block_n, k // block_k, block_k)
                   .transpose(0, 1, 3, 2, 4))
    return tuple(out)


def check(x, ws, block_n, block_k, stages, programs, interpret=False):
    """The chain's shapes (chain_shapes), or ValueError naming what is wrong."""
    if block_n % 8 or not 8 <= block_n <= 256 or block_k % 64:
        raise ValueError(f"block_n={block_n} must be a multiple of 8 in 8..256 and "
                         f"block_k={block_k} a multiple of 64")
    shapes = shapes_of(ws, block_n, block_k)
    n_layers = ws[0].shape[0]
    if x.shape != (1, shapes[0][2]) or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [1, {shapes[0][2]}], got {x.dtype} {x.shape}")
    if type(programs) is not int or programs < 1:
        raise ValueError(f"programs must be an int >= 1, got {programs!r}")
    for (name, n, k, gated), w in zip(shapes, ws):
        if k % block_k or n % block_n:
            raise ValueError(f"{name}: block_n={block_n} must divide N={n} and "
                             f"block_k={block_k} K={k}")
        rows = 2 * n if gated else n
        want = (n_layers, rows // block_n, k // block_k, block_n, block_k)
        if w.shape != want or w.dtype != jnp.bfloat16:
            raise ValueError(f"{name} weights must be bf16 {want} (tile_weights of "
                             f"[{n_layers}, {rows}, {k}]), got {w.dtype} {w.shape}")
        if n // block_n < programs:
            raise ValueError(f"{name}: {n // block_n} blocks of {block_n} rows leave some of "
                             f"the {programs} programs without work; lower block_n")
    need = 2 * step_tiles(shapes, block_n, programs)
    if stages < need or stages > 32:  # barrier phases live in one 32-bit mask
        raise ValueError(f"stages={stages} must be in {need}..32 (twice the tiles of one "
                         f"K step, {need // 2} at block_n={block_n}, {programs} programs)")
    smem = smem_bytes(shapes, block_n, block_k, stages, interpret)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{smem} B of shared memory exceeds {SMEM_LIMIT}")
    return shapes


@functools.lru_cache(maxsize=None)
def _build(shapes, n_layers, block_n, block_k, stages, programs, sync=True, diag=None,
           interpret=None):
    dt = jnp.dtype(jnp.bfloat16)
    S, P, BN, BK = stages, programs, block_n, block_k
    SHAPES = shapes  # noqa: N806 - the module constant's name, for this chain's shapes
    kmax = max(k for _, _, k, _ in SHAPES)
    transforms = w_tile_transforms(BK, dt)
    wg = plgpu.Layout.WGMMA.to_mgpu()
    a_layout = plgpu.Layout.TILED(wg.tiling, warp_dims=wg.warp_dims, lane_dims=wg.lane_dims,
                                  vector_dim=wg.vector_dim)
    col_layout = a_layout.reduce(0)
    nk = [k // BK for _, _, k, _ in SHAPES]
    c = [2 if gated else 1 for *_, gated in SHAPES]
    um = umax(SHAPES, BN, P)
    B = step_tiles(SHAPES, BN, P)  # refill distance: a step's tiles are requested B ahead

    def body(x_g, wq, wo, wgu, wd, yq, yo, ygu, yd, ring, bars, x_smem, o_smem, *a_smem):
        ws, ys = (wq, wo, wgu, wd), (yq, yo, ygu, yd)
        # (the CPU interpreter has no global semaphores: one program needs no handover)
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if sync else None
        me = lax.axis_index("p")
        # this program's units and tiles per stage (the same every layer); within a stage
        # the tiles go K step by K step, each step over the program's units (gate, up)
        units = [(n // BN - me + P - 1) // P for _, n, _, _ in SHAPES]
        per_step = [u * c[t] for t, u in enumerate(units)]
        prefix = [0]
        for t in range(4):
            prefix.append(prefix[-1] + per_step[t] * nk[t])
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
                        kb, rem = i // per_step[t], i % per_step[t]
                        unit, j = rem // c[t], rem % c[t]
                        rb = me + unit * P + j * (n // BN)
                        plgpu.copy_gmem_to_smem(ws[t].at[layer, rb, kb], ring.at[g % S],
                                                bars.at[g % S])

        for g0 in range(S - B):  # B slots stay free for the first step's refill
            issue(g0)

        def load_x(src, k):  # the stage's input row into SMEM, fenced for wgmma's readers
            x_smem.at[pl.ds(0, k)][...] = plgpu.load(src)
            plgpu.commit_smem()

        def stage(t, layer, g):
            _, n, k, gated = SHAPES[t]
            if sync:  # the handover: all programs' outputs of the layer * 4 + t stages
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
            nt = per_step[t]

            def scope(*accs):  # accs[u * c + j]: unit u's gate (j=0) / up (j=1) or plain
                def kb_body(kb, g):
                    for u in range(um[t]):
                        @pl.when(u < units[t])
                        def _(u=u):
                            for j in range(c[t]):
                                plgpu.barrier_wait(bars.at[(g + u * c[t] + j) % S])
                    if diag != "nomma":
                        if diag == "nox":
                            a = plgpu.layout_cast(jnp.zeros((AROWS, BK), dt), a_layout)
                        else:  # x's chunk once per K step, for all of the step's tiles
                            h = plgpu.load(x_smem.at[pl.ds(kb * BK, BK)], layout=col_layout,
                                           optimized=False)
                            a = plgpu.layout_cast(lax.broadcast_in_dim(h, (AROWS, BK), (1,)),
                                                  a_layout)
                        if a_smem:  # the interpreter's wgmma takes refs only (jax 0.11.2)
                            a_smem[0][...] = a
                            plgpu.commit_smem()
                            a = a_smem[0]
                        for u in range(um[t]):
                            @pl.when(u < units[t])
                            def _(u=u):
                                for j in range(c[t]):
                                    plgpu.wgmma(accs[u * c[t] + j], a,
                                                ring.at[(g + u * c[t] + j) % S].T)
                    # Tiles < g + S - B are requested and tiles < g done (the last step's
                    # wgmma_wait), so slots (g - B + i) % S are free: refill them while this
                    # step's MMAs run (S >= 2B keeps them off this step's [g, g + nt)).
                    for i in range(um[t] * c[t]):
                        @pl.when(i < nt)
                        def _(i=i):
                            issue(g + S - B + i)
                    if diag != "nomma":
                        plgpu.wgmma_wait(0)
                    return g + nt
                g2 = lax.fori_loop(0, nk[t], kb_body, g)
                return g2, tuple(acc[...] for acc in accs)

            g, vals = pl.run_scoped(
                scope, *([plgpu.ACC((AROWS, BN), jnp.float32)] * (um[t] * c[t])))
            for u in range(um[t]):
                @pl.when(u < units[t])
                def _(u=u):
                    v = vals[u * c[t]:(u + 1) * c[t]]
                    res = _silu_mul(v[0], v[1], dt) if gated else v[0].astype(dt)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # o_smem read out
                    o_smem[...] = res
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[pl.ds(0, 1)],
                        ys[t].at[pl.ds(0, 1), pl.ds((me + u * P) * BN, BN)])
            plgpu.wait_smem_to_gmem(0)  # the stores are done before they are announced
            if sync:
                # pl.semaphore_signal fences *after* its add: the empty signal's fence
                # orders the stores above before the counting add below
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
                       plgpu.SMEM((kmax,), dt), plgpu.SMEM((AROWS, BN), dt)]
        + ([plgpu.SMEM((AROWS, BK), dt, transforms=transforms)] if interpret else []),
        grid=(P,), grid_names=("p",), interpret=interpret)


def gemv_chain_mgpu(x, ws, *, block_n=16, block_k=256, stages=12, programs=None, sync=True,
                    diag=None, interpret=False):
    """The plain chain over ws = tile_weights((qkv [L, 6144, 2048], o [L, 2048, 2048],
    gate_up [L, 11264, 2048], down [L, 2048, 5632]), block_n, block_k), bf16, from x
    [1, 2048]; returns the last layer's four outputs (qkv, o, gate/up, down).
    programs: by default the SM count, or the smallest stage's block count if fewer. Diagnostics (wrong results): sync=False drops the
    handover waits (the stream's own pace); diag="nox" multiplies a zero A operand (no x
    load or broadcast), "nomma" does no math (the ring's pace alone). interpret: the CPU
    simulation, with programs=1 (it has no global semaphores, and one program needs no
    handover), or more with sync=False (each program's own ring; later stages wrong)."""
    if programs is None:  # one per SM, but no more than the smallest stage has blocks
        sms = getattr(jax.devices()[0], "core_count", None) or 132
        fewest = min(n // block_n for _, n, _, _ in shapes_of(ws, block_n, block_k))
        programs = 1 if interpret else min(sms, fewest)
    if diag not in (None, "nox", "nomma"):
        raise ValueError(f"diag must be None, 'nox' or 'nomma', got {diag!r}")
    if interpret and programs != 1 and sync:
        raise ValueError(f"interpret has no handover: programs=1, or sync=False (a "
                         f"diagnostic), got programs={programs}")
    shapes = check(x, ws, block_n, block_k, stages, programs, bool(interpret))
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    return _build(shapes, ws[0].shape[0], block_n, block_k, stages, programs,
                  bool(sync) and not interpret, diag, interpret or None)(x, *ws)


def lower_for_h200(x, ws, **kw):
    """The Pallas -> Mosaic GPU lowering for 'cuda' on any machine (see gemv_mgpu)."""
    from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401
    from pallas_kernels.offline_compile import sm90_device_info
    kw.setdefault("programs", 132)
    with sm90_device_info():
        return jax.jit(functools.partial(gemv_chain_mgpu, **kw)).trace(x, ws).lower(
            lowering_platforms=("cuda",))
