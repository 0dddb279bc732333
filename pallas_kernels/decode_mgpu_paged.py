"""The engine's decode attention on Mosaic GPU: paged caches, GQA, the new token's RoPE and
K/V write, one program per (row, KV head), no splits and no merge kernel (prototype, jax >=
0.11, session 27; opt-in in the engine, `benchmarks.decode --decode-kernel mgpu=1`).

Why: at batch 1 the engine's Triton decode kernel costs ~4.4 us per layer application and
the XLA kernel that merges its flash-decoding splits 1.3 us more (H200, docs/performance.md),
for ~1.5 MB of K/V: a latency chain, not bandwidth. decode_mgpu.py showed the form (one
program per head requesting all its K/V blocks by TMA up front, wgmma for both products);
this module gives it the engine's interface, that of `decode.paged_decode_attention_qkv`:

- qkv [B, H + 2 KVH, hd] is the new token's fused projection before RoPE; the kernel rotates
  q and the new k (each op rounded to qkv's dtype, as model.apply_rope is under XLA), writes
  k and v into the caches at (entry, page, slot) by TMA, and attends over the kv_len - 1
  cached positions plus the new one. Rows whose page is `trash_page` (the engine's padding)
  write nothing and attend to the cached positions only; no position gives zeros.
- The caches [E, P, page_size, KVH, hd] are updated in place: they enter the kernel as
  mutable refs (`jax.new_ref`), which Pallas turns into aliased operands (donate them).
- entry = base * entry_stride + offset (the engine's (loop, layer)), read by the kernel from
  one-element operands, so no XLA kernel computes the plane.

Per program (b, g): the first `stages` blocks of `block` positions are requested by TMA, one
copy per page of the block (all of a block's copies on one barrier; pages past the cached
positions are predicated off), while the program rotates q and k. A KV head's `group` query
heads are the rows of wgmma's A operand ([64, hd], row r = head min(r, group - 1)); the
scores [64, block] take an online softmax in registers; P, rounded to the cache dtype as the
engine's kernels round it, is the A operand against the V block. The new key and value are
put into the last block's SMEM tiles at their row (the cache slot is written by TMA, never
read back), and the last block's V rows past the length are zeroed, since stale slots may
hold NaN. The sum of p v is divided by the softmax denominator in fp32 and rows 0..group-1
are stored.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.gemv_mgpu import SMEM_LIMIT, w_tile_transforms
from pallas_kernels.gemv_mgpu_areg import AROWS, broadcast_a, register_a_layouts

DEFAULT_BLOCK = 64  # positions per K/V block
DEFAULT_STAGES = 4  # K/V blocks in flight


def smem_bytes(block, head_dim, stages, interpret=False):
    tiles = 2 * stages * block * head_dim * 2
    rows = (2 * head_dim + AROWS * head_dim + 2 * head_dim) * 2  # rotation, q rows, new k/v
    a = (AROWS * head_dim + AROWS * block) * 2 if interpret else 0
    return tiles + rows + AROWS * head_dim * 2 + a + 4096  # + barriers, alignment (~2.1 KB)


def check(qkv, k_cache, v_cache, block_tables, kv_lens, page, slot, rope, block, stages,
          interpret=False):
    """ValueError naming what is wrong with the call, if anything; returns (H, KVH, hd)."""
    name = "paged_decode_attention_mgpu"
    if k_cache.ndim != 5 or v_cache.shape != k_cache.shape:
        raise ValueError(f"{name}: k and v caches must be [E, P, page_size, KVH, hd] alike, "
                         f"got {k_cache.shape}, {v_cache.shape}")
    _, _, ps, kvh, hd = k_cache.shape
    if qkv.ndim != 3 or qkv.shape[2] != hd or (qkv.shape[1] - 2 * kvh) % kvh \
            or qkv.shape[1] <= 2 * kvh:
        raise ValueError(f"{name}: qkv {qkv.shape} does not hold H + 2 KVH heads of {hd} for "
                         f"a cache with KVH = {kvh}")
    bsz, h = qkv.shape[0], qkv.shape[1] - 2 * kvh
    if h // kvh > AROWS:
        raise ValueError(f"{name}: {h // kvh} query heads per KV head exceed {AROWS}")
    if not (qkv.dtype == k_cache.dtype == v_cache.dtype) or qkv.dtype not in (
            jnp.bfloat16, jnp.float16):
        raise ValueError(f"{name}: qkv and the caches must share a 16-bit dtype (wgmma), got "
                         f"{qkv.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if hd not in (64, 128):  # 256 would hold two fp32 [64, 256] arrays per thread
        raise ValueError(f"{name}: head_dim={hd} must be 64 or 128")
    if ps % 8:  # a page lands on whole 8-row tiles of the swizzled SMEM block
        raise ValueError(f"{name}: page_size={ps} must be a multiple of 8")
    if block % 64 or block > 256 or block % ps:
        raise ValueError(f"{name}: block={block} must be a multiple of 64 up to 256 and of "
                         f"page_size={ps}")
    if not 1 <= stages <= 8:
        raise ValueError(f"{name}: stages={stages} must be in 1..8")
    for what, a in (("page", page), ("slot", slot), ("kv_lens", kv_lens)):
        if a.shape != (bsz,):
            raise ValueError(f"{name}: {what} {a.shape} must be [{bsz}]")
    if block_tables.ndim != 2 or block_tables.shape[0] != bsz:
        raise ValueError(f"{name}: block_tables {block_tables.shape} must be [{bsz}, pages]")
    if rope is not None and any(c.shape != (bsz, hd) for c in rope):
        raise ValueError(f"{name}: cos / sin {[c.shape for c in rope]} must be [{bsz}, {hd}]")
    need = smem_bytes(block, hd, stages, interpret)
    if need > SMEM_LIMIT:
        raise ValueError(f"{name}: {need} B of shared memory exceed {SMEM_LIMIT}")
    return h, kvh, hd


@functools.lru_cache(maxsize=None)
def _build(bsz, h, kvh, hd, ps, max_pages, dtype, block, stages, rope, trash_page,
           entry_stride, interpret):
    dt = jnp.dtype(dtype)
    S, group, ppb, cap = stages, h // kvh, block // ps, max_pages * ps
    transforms = w_tile_transforms(hd, dt)
    a_layout, col_layout = register_a_layouts()
    scale = hd ** -0.5
    half = hd // 2

    def body(qkv_g, kc, vc, bt_g, lens_g, page_g, slot_g, base_g, off_g, *refs):
        if rope:
            cos_g, sin_g, refs = refs[0], refs[1], refs[2:]
        (o_g, k_smem, v_smem, kbar, vbar, two, q_smem, new_smem, o_smem, *a_smem) = refs
        b, g = lax.axis_index("b"), lax.axis_index("h")
        entry = base_g[0] * entry_stride + off_g[0]
        kv_len, wpage, wslot = lens_g[b], page_g[b], slot_g[b]
        new = (kv_len > 0) & (wpage != trash_page)  # this row writes and attends a new key
        n_cached = jnp.clip(kv_len - 1, 0, cap)
        length = jnp.minimum(n_cached + new.astype(jnp.int32), cap)
        new = new & (n_cached < cap)
        steps = (length + block - 1) // block

        def issue(j):  # block j's pages into slot j % S (pages past the cache: no copy)
            @pl.when(j < steps)
            def _():
                for i in range(ppb):
                    col = j * ppb + i
                    pid = bt_g[b, jnp.minimum(col, max_pages - 1)]
                    rows = pl.ds(i * ps, ps)
                    # (the CPU interpreter has no predicated copies: it copies them all)
                    fill = None if interpret else col * ps < n_cached
                    plgpu.copy_gmem_to_smem(kc.at[entry, pid, :, g], k_smem.at[j % S, rows],
                                            kbar.at[j % S], predicate=fill)
                    plgpu.copy_gmem_to_smem(vc.at[entry, pid, :, g], v_smem.at[j % S, rows],
                                            vbar.at[j % S], predicate=fill)

        for j0 in range(S):
            issue(j0)

        def rotated(row):  # the row [hd] of qkv, rotated as model.apply_rope rounds it
            x = plgpu.load(qkv_g.at[b, row])
            if not rope:
                return x
            # rotate_half(x) = [-x2, x1] is the middle of [-x, x]: one SMEM round trip
            two[pl.ds(0, hd)] = -x
            two[pl.ds(hd, hd)] = x
            plgpu.commit_smem()
            rot = two[pl.ds(half, hd)]
            f32 = lambda a: a.astype(jnp.float32)
            a = (f32(x) * f32(plgpu.load(cos_g.at[b]))).astype(dt)
            c = (f32(rot) * f32(plgpu.load(sin_g.at[b]))).astype(dt)
            plgpu.commit_smem()  # every thread has read `two` before the next row writes it
            return (f32(a) + f32(c)).astype(dt)

        for gi in range(group):
            q_smem.at[gi][...] = rotated(g * group + gi)
        new_smem.at[0][...] = rotated(h + g)
        new_smem.at[1][...] = plgpu.load(qkv_g.at[b, h + kvh + g])
        plgpu.commit_smem()

        @pl.when(new)
        def _():  # the new key and value into the cache (never read back by this call)
            for r, cache in ((0, kc), (1, vc)):
                plgpu.copy_smem_to_gmem(new_smem.at[pl.ds(r, 1)],
                                        cache.at[entry, wpage, pl.ds(wslot, 1), g])

        def row_a(ref):  # a row [hd] as the [64, hd] register A layout, all rows equal
            return broadcast_a(plgpu.load(ref, layout=col_layout, optimized=False), a_layout)
        qa = row_a(q_smem.at[0])
        if group > 1:  # row r holds query head min(r, group - 1) of this KV head
            heads = plgpu.broadcasted_iota(jnp.int32, (AROWS, hd), 0, layout=a_layout)
            for gi in range(1, group):
                qa = jnp.where(heads >= gi, row_a(q_smem.at[gi]), qa)
        if a_smem:  # the interpreter's wgmma takes its A operand from SMEM only
            a_smem[0][...] = qa
            plgpu.commit_smem()
            qa = a_smem[0]

        def fix_last(j, tile, r):
            """The last block's tile: the new row (new_smem[r]) at n_cached, and for V
            (r = 1) zeros past the length, so that p = 0 times a stale NaN stays 0."""
            t = tile.at[j % S]
            cur = plgpu.load(t, layout=a_layout, optimized=False)
            pos = plgpu.broadcasted_iota(jnp.int32, (block, hd), 0, layout=a_layout) \
                + j * block
            nr = plgpu.layout_cast(lax.broadcast_in_dim(
                plgpu.load(new_smem.at[r], layout=col_layout, optimized=False),
                (block, hd), (1,)), a_layout)
            out = jnp.where(new & (pos == n_cached), nr, cur)
            if r == 1:
                out = jnp.where(pos < length, out, jnp.zeros_like(out))
            t[...] = out
            plgpu.commit_smem()

        wg = plgpu.Layout.WGMMA
        m = plgpu.layout_cast(jnp.full((AROWS,), -jnp.inf, jnp.float32), wg.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((AROWS,), jnp.float32), wg.reduce(1))
        acc = plgpu.layout_cast(jnp.zeros((AROWS, hd), jnp.float32), wg)

        def kv_step(j, carry):
            acc, m, l = carry
            slot = j % S
            last = j == steps - 1
            plgpu.barrier_wait(kbar.at[slot])

            @pl.when(last & new)
            def _():
                fix_last(j, k_smem, 0)

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, qa, k_smem.at[slot].T)
                return acc_ref[...]
            s = pl.run_scoped(scores, plgpu.ACC((AROWS, block), jnp.float32)) * scale
            pos = plgpu.broadcasted_iota(jnp.int32, (AROWS, block), 1, layout=wg) + j * block
            s = jnp.where(pos < length, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            l = l * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dt)
            if a_smem:
                a_smem[1][...] = p16
                plgpu.commit_smem()
                p16 = a_smem[1]
            plgpu.barrier_wait(vbar.at[slot])

            @pl.when(last)
            def _():
                fix_last(j, v_smem, 1)

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

            def pv_from_zero(acc_ref):
                pv(acc_ref)
                return acc_ref[...]
            # Reading the accumulator back waits for the MMAs: the slot is free after it.
            if a_smem:  # the interpreter cannot start an accumulator from a value
                acc = acc + pl.run_scoped(pv_from_zero, plgpu.ACC((AROWS, hd), jnp.float32))
            else:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            issue(j + S)
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, steps, kv_step, (acc, m, l))
        l = jnp.where(l > 0, l, 1.0)  # nothing attended: acc is 0, the output zeros
        o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, group)],
                                o_g.at[b, pl.ds(g * group, group)])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = "paged_decode_attention_mgpu"
    scratch = [plgpu.SMEM((S, block, hd), dt, transforms=transforms),
               plgpu.SMEM((S, block, hd), dt, transforms=transforms),
               plgpu.Barrier(num_arrivals=ppb, num_barriers=S),
               plgpu.Barrier(num_arrivals=ppb, num_barriers=S),
               plgpu.SMEM((2 * hd,), dt), plgpu.SMEM((AROWS, hd), dt),
               plgpu.SMEM((2, hd), dt), plgpu.SMEM((AROWS, hd), dt)]
    if interpret:
        scratch += [plgpu.SMEM((AROWS, hd), dt, transforms=transforms),
                    plgpu.SMEM((AROWS, block), dt, transforms=w_tile_transforms(block, dt))]
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((bsz, h, hd), dt),
                        scratch_types=scratch, grid=(bsz, kvh), grid_names=("b", "h"),
                        interpret=interpret)


def _scalar_operand(x):
    """An entry part (int, numpy or traced int32 scalar) as a one-element int32 operand (a
    reshape, which XLA does without a kernel)."""
    return jnp.reshape(jnp.asarray(x, jnp.int32), (1,))


def paged_decode_attention_mgpu(qkv, k_cache, v_cache, entry, block_tables, kv_lens, page,
                                slot, *, rope=None, trash_page=None, entry_stride: int = 1,
                                block: int = DEFAULT_BLOCK, stages: int = DEFAULT_STAGES,
                                interpret=False):
    """decode.paged_decode_attention_qkv's contract on Mosaic GPU (see the module docstring):
    returns (out [B, H, hd], k_cache, v_cache), the caches updated in place (donate them).
    entry: an int32 plane index, or a pair (base, offset) read as base * entry_stride +
    offset. block: positions per K/V block (a multiple of 64 up to 256 and of the page
    size); stages: blocks in flight. interpret: the CPU simulation."""
    check(qkv, k_cache, v_cache, block_tables, kv_lens, page, slot, rope, block, stages,
          bool(interpret))
    h, kvh, hd = qkv.shape[1] - 2 * k_cache.shape[3], k_cache.shape[3], k_cache.shape[4]
    base, off = entry if isinstance(entry, tuple) else (entry, 0)
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    kernel = _build(qkv.shape[0], h, kvh, hd, k_cache.shape[2], block_tables.shape[1],
                    jnp.dtype(qkv.dtype), block, stages, rope is not None,
                    -1 if trash_page is None else int(trash_page), int(entry_stride),
                    interpret or None)
    extra = () if rope is None else tuple(c.astype(qkv.dtype) for c in rope)
    kr, vr = jax.new_ref(k_cache), jax.new_ref(v_cache)
    i32 = lambda a: a.astype(jnp.int32)
    out = kernel(qkv, kr, vr, i32(block_tables), i32(kv_lens), i32(page), i32(slot),
                 _scalar_operand(base), _scalar_operand(off), *extra)
    return out, jax.freeze(kr), jax.freeze(vr)


def lower_for_h200(qkv, k_cache, v_cache, block_tables, kv_lens, page, slot, rope, **kw):
    """The Pallas -> Mosaic GPU lowering for 'cuda' on any machine (offline_compile)."""
    from pallas_kernels.offline_compile import lower_for_cuda
    return lower_for_cuda(
        lambda *a: paged_decode_attention_mgpu(a[0], a[1], a[2], (a[3], 1), *a[4:8],
                                               rope=(a[8], a[9]), trash_page=0,
                                               entry_stride=2, **kw),
        qkv, k_cache, v_cache, jnp.int32(0), block_tables, kv_lens, page, slot, *rope)
