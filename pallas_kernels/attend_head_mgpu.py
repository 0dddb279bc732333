"""One KV head's decode attention for one row, as a piece of a Mosaic GPU kernel body: the new
token's RoPE and K/V write, paged K/V by TMA, wgmma for both products, an online softmax in
registers. decode_mgpu_paged.py runs it as one program per (row, KV head);
chain_mgpu.py's whole-layer form runs it as a stage between qkv and o (session 27).

The math (see decode_mgpu_paged's docstring): the KV head's `group` query heads are the rows
of wgmma's A operand ([64, hd], row r = head min(r, group - 1)); block j of `block` positions
arrives by one TMA copy per page into ring slot j % stages (pages past the cached positions
predicated off on the GPU); the new key and value are put into the last block's SMEM tiles
at their row (the cache slot is written by TMA, never read back), the last block's V rows
past the length zeroed (stale slots may hold NaN); p is rounded to the cache dtype for
P @ V; the sum is divided by the softmax denominator in fp32.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.gemv_mgpu import w_tile_transforms
from pallas_kernels.gemv_mgpu_areg import AROWS, broadcast_a, register_a_layouts


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """The static shape of the attention: H query heads and KVH KV heads of hd, pages of ps
    positions, block tables of max_pages, K/V blocks of `block` positions, `stages` in
    flight; rope: q and k arrive unrotated; trash_page (-1: none) marks padding rows."""
    h: int
    kvh: int
    hd: int
    ps: int
    max_pages: int
    dtype: str
    block: int
    stages: int
    rope: bool
    trash_page: int
    interpret: bool

    @property
    def group(self):
        return self.h // self.kvh

    def scratch(self):
        """The scratch it needs, in the order `attend_head` takes them."""
        dt, hd, S, block = jnp.dtype(self.dtype), self.hd, self.stages, self.block
        tr = w_tile_transforms(hd, dt)
        out = [plgpu.SMEM((S, block, hd), dt, transforms=tr),
               plgpu.SMEM((S, block, hd), dt, transforms=tr),
               plgpu.Barrier(num_arrivals=block // self.ps, num_barriers=S),
               plgpu.Barrier(num_arrivals=block // self.ps, num_barriers=S),
               plgpu.SMEM((2 * hd,), dt), plgpu.SMEM((self.group, hd), dt),
               plgpu.SMEM((2, hd), dt), plgpu.SMEM((AROWS, hd), dt)]
        if self.interpret:  # its wgmma takes A operands from SMEM only
            out += [plgpu.SMEM((AROWS, hd), dt, transforms=tr),
                    plgpu.SMEM((AROWS, block), dt, transforms=w_tile_transforms(block, dt))]
        return out

    def smem_bytes(self):
        hd, block = self.hd, self.block
        tiles = 2 * self.stages * block * hd * 2
        rows = (2 * hd + self.group * hd + 2 * hd + AROWS * hd) * 2
        a = (AROWS * hd + AROWS * block) * 2 if self.interpret else 0
        return tiles + rows + a + 2048  # + barriers, alignment


def scalar_operand(x):
    """An int32 scalar (int, numpy or traced) as the one-element operand the kernels read
    with `ref[0]` (a reshape: XLA runs no kernel for it)."""
    return jnp.reshape(jnp.asarray(x, jnp.int32), (1,))


def scores_step(qa, k_tile, s_block, scale, m, l, acc, pos, length, dt, p_smem=None):
    """One block's scores q K^T (wgmma, fp32, scaled, masked at `pos` >= `length`) and
    online-softmax update: (p rounded to dt as the A operand of P @ V, m, l, acc rescaled).
    p_smem: the interpreter's SMEM A operand (its wgmma takes none from registers)."""
    def scores(acc_ref):
        plgpu.wgmma(acc_ref, qa, k_tile.T)
        return acc_ref[...]
    s = pl.run_scoped(scores, plgpu.ACC((AROWS, s_block), jnp.float32)) * scale
    s = jnp.where(pos < length, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
    l = l * alpha + p.sum(axis=1)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    p16 = p.astype(dt)
    if p_smem is not None:
        p_smem[...] = p16
        plgpu.commit_smem()
        p16 = p_smem
    return p16, m_new, l, acc


def pv_step(acc, p16, v_tile, interpret):
    """acc + P @ V (wgmma). Reading the accumulator back waits for the MMAs, so the V tile's
    slot is free after it. The CPU interpreter cannot start an accumulator from a value:
    there the block's product starts from zero and is added."""
    def pv(acc_ref):
        plgpu.wgmma(acc_ref, p16, v_tile)

    def pv_from_zero(acc_ref):
        pv(acc_ref)
        return acc_ref[...]
    if interpret:
        return acc + pl.run_scoped(pv_from_zero, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(pv)(plgpu.ACC.init(acc))


def _rotated(x, two, rope_rows, dt):
    """Row x [hd] rotated as model.apply_rope rounds it: x*cos + rotate_half(x)*sin, each
    product rounded to dt, then the sum. `two` [2 hd] is SMEM scratch."""
    if rope_rows is None:
        return x
    hd = x.shape[0]
    # rotate_half(x) = [-x2, x1] is the middle of [-x, x]: one SMEM round trip
    two[pl.ds(0, hd)] = -x
    two[pl.ds(hd, hd)] = x
    plgpu.commit_smem()
    rot = two[pl.ds(hd // 2, hd)]
    f32 = lambda a: a.astype(jnp.float32)
    a = (f32(x) * f32(plgpu.load(rope_rows[0]))).astype(dt)
    c = (f32(rot) * f32(plgpu.load(rope_rows[1]))).astype(dt)
    plgpu.commit_smem()  # every thread has read `two` before it is written again
    # a and c through SMEM: the Mosaic GPU lowering folds a bf16 round trip in registers
    # away (gemv_mgpu_normed; the first GPU run's keys differed), and apply_rope rounds both
    two[pl.ds(0, hd)] = a
    two[pl.ds(hd, hd)] = c
    plgpu.commit_smem()
    out = (f32(two[pl.ds(0, hd)]) + f32(two[pl.ds(hd, hd)])).astype(dt)
    plgpu.commit_smem()  # read before the next row writes `two`
    return out


def _query_operand(q_smem, group, hd, a_smem):
    """The KV head's query rows (q_smem [group, hd]) as wgmma's A operand [64, hd]: row r
    is head min(r, group - 1); in registers, or staged in a_smem (the interpreter)."""
    a_layout, col_layout = register_a_layouts()

    def row_a(ref):  # a row [hd] as the [64, hd] register A layout, all rows equal
        return broadcast_a(plgpu.load(ref, layout=col_layout, optimized=False), a_layout)
    qa = row_a(q_smem.at[0])
    if group > 1:
        heads = plgpu.broadcasted_iota(jnp.int32, (AROWS, hd), 0, layout=a_layout)
        for gi in range(1, group):
            qa = jnp.where(heads >= gi, row_a(q_smem.at[gi]), qa)
    if a_smem:
        a_smem[0][...] = qa
        plgpu.commit_smem()
        qa = a_smem[0]
    return qa


def _splice_last(t, new_row, first, n_cached, length, new, zero_past):
    """The last block's SMEM tile t [block, hd] (positions first..): the new row (an SMEM
    ref [hd]) at n_cached where `new`, and with zero_past (V) zeros from `length` on, so
    that p = 0 times a stale NaN stays 0."""
    a_layout, col_layout = register_a_layouts()
    block, hd = t.shape
    cur = plgpu.load(t, layout=a_layout, optimized=False)
    pos = plgpu.broadcasted_iota(jnp.int32, (block, hd), 0, layout=a_layout) + first
    nr = plgpu.layout_cast(lax.broadcast_in_dim(
        plgpu.load(new_row, layout=col_layout, optimized=False), (block, hd), (1,)),
        a_layout)
    out = jnp.where(new & (pos == n_cached), nr, cur)
    if zero_past:
        out = jnp.where(pos < length, out, jnp.zeros_like(out))
    t[...] = out
    plgpu.commit_smem()


def attend_head(spec: HeadSpec, scratch, *, g, qkv_row: Callable, out_row: Callable,
                rope_rows, kc, vc, page_of: Callable, entry, kv_len, wpage, wslot):
    """KV head g (traced) of one row. qkv_row(i): the GMEM ref [hd] of packed-projection row
    i (q heads, then k, then v heads); out_row(head): the GMEM ref [1, hd] its output row
    goes to; rope_rows: (cos, sin) GMEM refs [hd] or None; kc / vc: the caches [E, P, ps,
    KVH, hd] (mutable refs); page_of(col): the row's block-table entry; entry: the plane;
    kv_len / wpage / wslot: the row's length with the new token, and its page and slot."""
    (k_smem, v_smem, kbar, vbar, two, q_smem, new_smem, o_smem, *a_smem) = scratch
    dt = jnp.dtype(spec.dtype)
    S, group, hd, block, ps = spec.stages, spec.group, spec.hd, spec.block, spec.ps
    ppb, cap = block // ps, spec.max_pages * ps
    new = (kv_len > 0) & (wpage != spec.trash_page)  # the row writes and attends a new key
    n_cached = jnp.clip(kv_len - 1, 0, cap)
    length = jnp.minimum(n_cached + new.astype(jnp.int32), cap)
    new = new & (n_cached < cap)
    steps = (length + block - 1) // block

    def issue(j):  # block j's pages into slot j % S (pages past the cache: no copy)
        @pl.when(j < steps)
        def _():
            for i in range(ppb):
                col = j * ppb + i
                pid = page_of(jnp.minimum(col, spec.max_pages - 1))
                rows = pl.ds(i * ps, ps)
                # (the CPU interpreter has no predicated copies: it copies them all)
                fill = None if spec.interpret else col * ps < n_cached
                plgpu.copy_gmem_to_smem(kc.at[entry, pid, :, g], k_smem.at[j % S, rows],
                                        kbar.at[j % S], predicate=fill)
                plgpu.copy_gmem_to_smem(vc.at[entry, pid, :, g], v_smem.at[j % S, rows],
                                        vbar.at[j % S], predicate=fill)

    for j0 in range(S):
        issue(j0)
    # an earlier head's new rows may still be read out by its K/V-write stores
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    for gi in range(group):
        q_smem.at[gi][...] = _rotated(plgpu.load(qkv_row(g * group + gi)), two, rope_rows, dt)
    new_smem.at[0][...] = _rotated(plgpu.load(qkv_row(spec.h + g)), two, rope_rows, dt)
    new_smem.at[1][...] = plgpu.load(qkv_row(spec.h + spec.kvh + g))
    plgpu.commit_smem()

    @pl.when(new)
    def _():  # the new key and value into the cache (never read back by this call)
        for r, cache in ((0, kc), (1, vc)):
            plgpu.copy_smem_to_gmem(new_smem.at[pl.ds(r, 1)],
                                    cache.at[entry, wpage, pl.ds(wslot, 1), g])
    qa = _query_operand(q_smem, group, hd, a_smem)
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
            _splice_last(k_smem.at[slot], new_smem.at[0], j * block, n_cached, length, new,
                         False)
        pos = plgpu.broadcasted_iota(jnp.int32, (AROWS, block), 1, layout=wg) + j * block
        p16, m, l, acc = scores_step(qa, k_smem.at[slot], block, hd ** -0.5, m, l, acc,
                                     pos, length, dt, a_smem[1] if a_smem else None)
        plgpu.barrier_wait(vbar.at[slot])

        @pl.when(last)
        def _():
            _splice_last(v_smem.at[slot], new_smem.at[1], j * block, n_cached, length, new,
                         True)
        acc = pv_step(acc, p16, v_smem.at[slot], bool(a_smem))
        issue(j + S)
        return acc, m, l

    acc, m, l = lax.fori_loop(0, steps, kv_step, (acc, m, l))
    l = jnp.where(l > 0, l, 1.0)  # nothing attended: acc is 0, the output zeros
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # an earlier head's rows are read out
    o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dt)
    plgpu.commit_smem()
    for r in range(group):
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(r, 1)], out_row(g * group + r))
