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

The chain: x -> qkv, q = its first q_rows outputs -> o -> gate/up (silu(gate) * up, as
gemv._silu_mul rounds it) -> down -> the next layer's qkv. With `norms`, qkv and gate/up
take the engine's add_norm prologues (x' = x + rms_norm(branch), input rms_norm(x'), rounded
as model.rms_norm; the branch is down's or o's output), computed by every program from the
whole rows; without, the plain projections. No attention: o reads q directly (what a whole
layer still needs is listed in docs/kernels.md).

Math per tile as gemv_mgpu_areg: x's chunk broadcast to 64 rows is wgmma's register A
operand, W's [block_n, block_k] tile the transposed B operand, fp32 accumulation over the
whole K in one program (no split-K), one bf16 rounding per output.

Handover: a program that has written its stage-s outputs (TMA stores, completed) adds 1 to
one global counter (a Pallas GPU semaphore, zeroed by Pallas at every call); stage s + 1
starts once the counter reaches (s + 1) * programs, then reads its input row from global
memory. Every buffer (the stage outputs, and the residual rows hq / hg, which program 0
writes) is rewritten only behind at least one more of these waits than the stage that
reads it starts behind, so no program can overwrite a row another program has yet to read.
All programs must be resident at once: the grid is at most the SM count (`programs`) and
one program fits an SM.

Units: stage t's output rows in blocks of block_n, block b to program b % programs. A
program's tiles go stage by stage, K step by K step, each step over its units (gate and up
tiles alternating for gate/up); its ring of `stages` slots runs `stages - B` tiles ahead,
B being the most tiles one step takes (docs/kernels.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.chain_layout import (AROWS, Q_ROWS, SHAPES, chain_shapes, check,
                                         program_tiles, reference_chain, shapes_of,
                                         shapes_of_config,
                                         smem_bytes, stage_bases, step_tiles, table_len,
                                         tile_table, tile_weights, umax)
from pallas_kernels.attend_head_mgpu import attend_head
from pallas_kernels.chain_attention import operands, spec_of
from pallas_kernels.gemv import _normed, _silu_mul
from pallas_kernels.gemv_mgpu import w_tile_transforms
from pallas_kernels.gemv_mgpu_areg import broadcast_a, register_a_layouts

__all__ = ["AROWS", "Q_ROWS", "SHAPES", "chain_shapes", "check", "gemv_chain_mgpu",
           "lower_for_h200", "program_tiles", "reference_chain", "shapes_of",
           "shapes_of_config", "smem_bytes",
           "stage_bases", "step_tiles", "table_len", "tile_table", "tile_weights", "umax"]


@functools.lru_cache(maxsize=None)
def _build(shapes, n_layers, block_n, block_k, stages, programs, sync=True, diag=None,
           interpret=None, eps=None, attn=None, uniform=False, smem_a=False):
    dt = jnp.dtype(jnp.bfloat16)
    S, P, BN, BK = stages, programs, block_n, block_k
    kmax = max(k for _, _, k, _ in shapes)
    transforms = w_tile_transforms(BK, dt)
    a_layout, col_layout = register_a_layouts()
    nk = [k // BK for _, _, k, _ in shapes]
    c = [2 if gated else 1 for *_, gated in shapes]
    um = umax(shapes, BN, P)
    B = step_tiles(shapes, BN, P)  # refill distance: a step's tiles are requested B ahead
    normed = eps is not None
    hidden = shapes[0][2]
    n_st = 4 if attn is None else 5  # handovers per layer (the attention is a stage)
    at = (0, 2, 3, 4) if attn else (0, 1, 2, 3)  # projection stage t's place in the layer

    def body(*refs):
        x_g, refs = refs[0], refs[1:]
        if normed:  # the first layer's branch, then per layer [L, H]: qkv's branch and
            # input norm weights, gate/up's
            d0, nbq, nnq, nbg, nng, refs = *refs[:5], refs[5:]
        if attn:  # the caches, then the row's block table, length, page, slot, the loop
            # (the plane is loop * n_layers + layer), RoPE's cos and sin
            att_in, refs = refs[:9], refs[9:]
        w_g, tbl_g, ys, refs = refs[0], refs[1], refs[2:6], refs[6:]
        yd = ys[3]
        if normed:  # the residual stream after qkv's and gate/up's add_norm
            hq, hg, refs = *refs[:2], refs[2:]
        if attn:  # the attention's output row [1, H * hd], o's input
            att_g, refs = refs[0], refs[1:]
        ring, bars, x_smem, o_smem, tbl, *refs = refs
        a_smem = refs[:1] if interpret or smem_a else []
        att_scratch = refs[len(a_smem):]
        # (the CPU interpreter has no global semaphores: one program needs no handover)
        sem = pl.get_global(plgpu.SemaphoreType.REGULAR) if sync else None
        me = lax.axis_index("p")
        # this program's units and tiles per stage (the same every layer); within a stage
        # the tiles go K step by K step, each step over the program's units (gate, up)
        real = [(n // BN - me + P - 1) // P for _, n, _, _ in shapes]  # units it stores
        units = list(um) if uniform else real  # units it computes (uniform: um everywhere)
        per_step = [u * c[t] for t, u in enumerate(units)]
        per_layer = sum(per_step[t] * nk[t] for t in range(4))
        total = per_layer * n_layers
        # which tile of the layer's run each of its requests reads (chain_layout.tile_table)
        tbl[...] = plgpu.load(tbl_g.at[me])
        plgpu.commit_smem()

        def issue(g, layer):
            """Request tile g of this program's sequence into slot g % S; `layer` is the
            requester's layer (g is at most one layer ahead of it: chain_layout.check)."""
            g = jnp.asarray(g, jnp.int32)  # (uniform: per_layer and the first g are ints)
            r = g - layer * per_layer
            ahead = r >= per_layer
            r = jnp.where(ahead, r - per_layer, r)

            @pl.when(g < total)
            def _():
                plgpu.copy_gmem_to_smem(w_g.at[layer + ahead.astype(jnp.int32), tbl[r]],
                                        ring.at[g % S], bars.at[g % S])

        for g0 in range(S - B):  # B slots stay free for the first step's refill
            issue(g0, 0)

        def load_x(src, k):  # the stage's input row into SMEM, fenced for wgmma's readers
            x_smem.at[pl.ds(0, k)][...] = plgpu.load(src)
            plgpu.commit_smem()

        def add_norm_x(x_src, b_src, bw, nw, h_out):
            """The engine's add_norm prologue (gemv_mgpu_normed's statistics, rounded as
            model.rms_norm): x' = x + rms_norm(branch, bw), into h_out (program 0); the
            stage's input rms_norm(x', nw) into x_smem. Every program computes it from the
            whole rows (a few KB from L2)."""
            xf = plgpu.load(x_src).astype(jnp.float32)
            bf = plgpu.load(b_src).astype(jnp.float32)
            nb = _normed(bf, lax.rsqrt(jnp.sum(bf * bf) / hidden + eps), plgpu.load(bw), dt)
            row = x_smem.at[pl.ds(0, hidden)]
            row[...] = nb  # through SMEM: keeps the rounding to bf16 before the add (the
            nb = row[...]  # Mosaic lowering dropped it otherwise; gemv_mgpu_normed)
            xn = (xf + nb.astype(jnp.float32)).astype(dt)

            @pl.when(me == 0)
            def _():
                h_out[0] = xn
            xf = xn.astype(jnp.float32)
            row[...] = _normed(xf, lax.rsqrt(jnp.sum(xf * xf) / hidden + eps),
                               plgpu.load(nw), dt)
            plgpu.commit_smem()

        def stage_input(t, layer, k):
            if normed and t == 0:
                @pl.when(layer == 0)
                def _():
                    add_norm_x(x_g.at[0], d0.at[0], nbq.at[layer], nnq.at[layer], hq)

                @pl.when(layer > 0)
                def _():
                    add_norm_x(hg.at[0], yd.at[0], nbq.at[layer], nnq.at[layer], hq)
            elif normed and t == 2:
                add_norm_x(hq.at[0], ys[1].at[0], nbg.at[layer], nng.at[layer], hg)
            elif t == 0:
                @pl.when(layer == 0)
                def _():
                    load_x(x_g.at[0, pl.ds(0, k)], k)

                @pl.when(layer > 0)
                def _():
                    load_x(yd.at[0, pl.ds(0, k)], k)
            else:  # o reads the attention's output, or (without it) q
                load_x((att_g if attn and t == 1 else ys[t - 1]).at[0, pl.ds(0, k)], k)

        def run(f):  # an unconditional "pl.when"
            f()

        def computes(u, t):  # uniform: every program computes umax units, no condition
            return run if uniform else pl.when(u < units[t])

        def handover(idx):  # all programs' outputs of the first idx stages are stored
            if sync:
                plgpu.semaphore_wait(sem, idx * P, decrement=False, memory_scope="gpu")

        def attention(layer):
            """The attention stage: KV heads me, me + P, ... (attend_head_mgpu), on qkv's
            output row, into att_g."""
            handover(layer * n_st + 1)
            kc, vc, bt_g, len_g, page_g, slot_g, base_g, cos_g, sin_g = att_in
            hd = attn.hd
            for i in range(-(-attn.kvh // P)):
                @pl.when(me + i * P < attn.kvh)
                def _(i=i):
                    attend_head(attn, att_scratch, g=me + i * P,
                                qkv_row=lambda r: ys[0].at[0, pl.ds(r * hd, hd)],
                                out_row=lambda head: att_g.at[pl.ds(0, 1),
                                                              pl.ds(head * hd, hd)],
                                rope_rows=(cos_g.at[0], sin_g.at[0]), kc=kc, vc=vc,
                                page_of=lambda col: bt_g[0, col],
                                entry=base_g[0] * n_layers + layer, kv_len=len_g[0],
                                wpage=page_g[0], wslot=slot_g[0])
            plgpu.wait_smem_to_gmem(0)
            if sync:
                plgpu.semaphore_signal(sem, 1, memory_scope="gpu")

        def stage(t, layer, g):
            _, n, k, gated = shapes[t]
            handover(layer * n_st + at[t])
            stage_input(t, layer, k)
            nt = per_step[t]

            def scope(*accs):  # accs[u * c + j]: unit u's gate (j=0) / up (j=1) or plain
                def kb_body(kb, g):
                    for u in range(um[t]):
                        @computes(u, t)
                        def _(u=u):
                            for j in range(c[t]):
                                plgpu.barrier_wait(bars.at[(g + u * c[t] + j) % S])
                    if diag != "nomma":
                        if diag == "nox":
                            a = plgpu.layout_cast(jnp.zeros((AROWS, BK), dt), a_layout)
                        else:  # x's chunk once per K step, for all of the step's tiles
                            h = plgpu.load(x_smem.at[pl.ds(kb * BK, BK)], layout=col_layout,
                                           optimized=False)
                            a = broadcast_a(h, a_layout)
                        if a_smem:  # the interpreter's wgmma takes refs only (jax 0.11.2);
                            # smem_a: on the GPU too, 64 registers fewer than the A fragment
                            a_smem[0][...] = a
                            plgpu.commit_smem()
                            a = a_smem[0]
                        for u in range(um[t]):
                            @computes(u, t)
                            def _(u=u):
                                for j in range(c[t]):
                                    plgpu.wgmma(accs[u * c[t] + j], a,
                                                ring.at[(g + u * c[t] + j) % S].T)
                    # Tiles < g + S - B are requested and tiles < g done (the last step's
                    # wgmma_wait), so slots (g - B + i) % S are free: refill them while this
                    # step's MMAs run (S >= 2B keeps them off this step's [g, g + nt)).
                    for i in range(um[t] * c[t]):
                        @(run if uniform else pl.when(i < nt))
                        def _(i=i):
                            issue(g + S - B + i, layer)
                    if diag != "nomma":
                        plgpu.wgmma_wait(0)
                    return g + nt
                g2 = lax.fori_loop(0, nk[t], kb_body, g)
                return g2, tuple(acc[...] for acc in accs)

            g, vals = pl.run_scoped(
                scope, *([plgpu.ACC((AROWS, BN), jnp.float32)] * (um[t] * c[t])))
            for u in range(um[t]):
                @pl.when(u < real[t])
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
            if sync:  # a release add (red.release.gpu): the stores above come first
                plgpu.semaphore_signal(sem, 1, memory_scope="gpu")
            return g

        def layer_body(layer, g):
            for t in range(4):
                g = stage(t, layer, g)
                if attn and t == 0:
                    attention(layer)
            return g

        lax.fori_loop(0, n_layers, layer_body, jnp.int32(0))

    body.__name__ = "gemv_chain_mgpu" + ("_add_norm" if normed else "")
    out = [jax.ShapeDtypeStruct((1, n), dt) for _, n, _, _ in shapes]
    if normed:
        out += [jax.ShapeDtypeStruct((1, hidden), dt)] * 2
    if attn:
        out += [jax.ShapeDtypeStruct((1, attn.h * attn.hd), dt)]
    return plgpu.kernel(
        body, out_type=out,
        scratch_types=[plgpu.SMEM((S, BN, BK), dt, transforms=transforms),
                       plgpu.Barrier(num_arrivals=1, num_barriers=S),
                       plgpu.SMEM((kmax,), dt), plgpu.SMEM((AROWS, BN), dt),
                       plgpu.SMEM((table_len(shapes, BN, BK, P),), jnp.int32)]
        + ([plgpu.SMEM((AROWS, BK), dt, transforms=transforms)] if interpret or smem_a
           else [])
        + (attn.scratch() if attn else []),
        grid=(P,), grid_names=("p",), interpret=interpret)


def gemv_chain_mgpu(x, w, shapes=SHAPES, *, norms=None, branch=None, eps=1e-6, block_n=16,
                    block_k=256, stages=16, programs=None, sync=True, diag=None,
                    attention=None, uniform=False, smem_a=False, interpret=False):
    """The chain over w = tile_weights((qkv, o, gate_up, down), block_n, block_k), the four
    stages' [L, rows, K] bf16 weights of the given chain_shapes (the 1.4B model's by
    default: [L, 6144, 2048], [L, 2048, 2048], [L, 11264, 2048], [L, 2048, 5632]), from x
    [1, hidden]; returns the last layer's four outputs (qkv, o, gate/up, down).
    norms = (qkv's branch norm, qkv's input norm, gate/up's branch norm, gate/up's input
    norm), each [L, hidden] bf16: the engine's add_norm prologues on qkv and gate/up
    (x' = x + rms_norm(branch, ...), input rms_norm(x', ...); the branch is the previous
    down output, or `branch` (default zeros) for the first layer, then o's output), and two
    more outputs: the residual stream after the last layer's qkv and gate/up prologues.
    programs: by default the SM count, or the smallest stage's block count if fewer.
    Diagnostics (wrong results): sync=False drops the handover waits (the stream's own
    pace); diag="nox" multiplies a zero A operand (no x load or broadcast), "nomma" does no
    math (the ring's pace alone). interpret: the CPU simulation, with programs=1 (it has no
    global semaphores, and one program needs no handover), or more with sync=False (each
    program's own ring; later stages wrong).
    smem_a: x's broadcast chunk goes to wgmma from SMEM, not registers (64 registers fewer
    per thread: ptxas serialised the register form's MMAs for want of registers). Lowers
    for sm_90; not yet run on a GPU (session 27 ran out of device time).
    uniform: every program computes as many units per stage as the busiest (its last
    real unit again, not stored): no per-program condition around the MMAs, which
    otherwise make ptxas serialise them (session 27); a little more weight traffic where a
    stage's blocks do not divide among the programs.
    attention: a chain_attention.ChainAttention (with norms): whole decoder layers, the
    decode attention as a stage between qkv and o (o then reads its output, not q); returns
    the six outputs, the attention's output row [1, H * hd], and the k and v caches, updated
    in place (donate them)."""
    shapes = tuple(tuple(s) for s in shapes)
    if programs is None:  # one per SM, but no more than the smallest stage has blocks
        sms = getattr(jax.devices()[0], "core_count", None) or 132
        fewest = min(n // block_n for _, n, _, _ in shapes)
        programs = 1 if interpret else min(sms, fewest)
    if diag not in (None, "nox", "nomma"):
        raise ValueError(f"diag must be None, 'nox' or 'nomma', got {diag!r}")
    if interpret and programs != 1 and sync:
        raise ValueError(f"interpret has no handover: programs=1, or sync=False (a "
                         f"diagnostic), got programs={programs}")
    spec = None
    if attention is not None:
        if norms is None:
            raise ValueError("attention runs whole decoder layers: it needs norms")
        spec = spec_of(attention, tuple(tuple(s) for s in shapes), bool(interpret))
    check(x, w, shapes, block_n, block_k, stages, programs,
          bool(interpret) or bool(smem_a),  # (the SMEM A tile counts either way)
          norms is not None, extra_smem=spec.smem_bytes() if spec else 0)
    n_layers, hidden = w.shape[0], shapes[0][2]
    extra = ()
    if norms is not None:
        if len(norms) != 4 or any(v.shape != (n_layers, hidden) or v.dtype != jnp.bfloat16
                                  for v in norms):
            raise ValueError(f"norms must be four bf16 [{n_layers}, {hidden}] weights, got "
                             f"{[(v.dtype, v.shape) for v in norms]}")
        branch = jnp.zeros_like(x) if branch is None else branch
        if branch.shape != x.shape or branch.dtype != x.dtype:
            raise ValueError(f"branch must be like x, {x.dtype} {x.shape}, got "
                             f"{branch.dtype} {branch.shape}")
        extra = (branch, *norms)
    elif branch is not None:
        raise ValueError("branch is the first layer's add_norm input: it needs norms")
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    table = jnp.asarray(tile_table(shapes, block_n, block_k, programs, bool(uniform)))
    att_ops, refs = operands(attention) if spec else ((), ())
    outs = _build(shapes, n_layers, block_n, block_k, stages, programs,
                  bool(sync) and not interpret, diag, interpret or None,
                  None if norms is None else float(eps), spec, bool(uniform),
                  bool(smem_a))(
                      x, *extra, *att_ops, w, table)
    return (*outs, *(jax.freeze(r) for r in refs)) if spec else outs


def lower_for_h200(x, w, norms=None, shapes=SHAPES, **kw):
    """The Pallas -> Mosaic GPU lowering for 'cuda' on any machine (see gemv_mgpu)."""
    from pallas_kernels.offline_compile import lower_for_cuda
    kw.setdefault("programs", 128)
    return lower_for_cuda(lambda x, w, norms: gemv_chain_mgpu(x, w, shapes, norms=norms, **kw),
                          x, w, norms)


def lower_layers_for_h200(x, w, norms, attention, shapes=SHAPES, **kw):
    """lower_for_h200 with the attention stage; attention: a ChainAttention whose arrays may
    be ShapeDtypeStructs."""
    from pallas_kernels.chain_attention import ChainAttention
    from pallas_kernels.offline_compile import lower_for_cuda
    kw.setdefault("programs", 128)
    arrays, settings = tuple(attention[:9]), tuple(attention[9:])
    return lower_for_cuda(
        lambda x, w, norms, arrays: gemv_chain_mgpu(
            x, w, shapes, norms=norms, attention=ChainAttention(*arrays, *settings), **kw),
        x, w, norms, arrays)
