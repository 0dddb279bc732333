"""gemv_flow's attention stage (experimental): the decode kernel's body, run by the flow's
programs on the previous stage's qkv output, so that a layer's qkv -> attention -> o -> ...
hand over through completion counters in one kernel instead of crossing a kernel boundary.

The body is pallas_kernels/decode.py's fused-write kernel itself (RoPE, the new token's K/V
written into the paged cache, the cached keys read through the block table, the new key
folded in from registers), with its split merge done by the last split program of each
(row, KV head) (split_merge.merge_if_last, the engine's opt-in last_combine): the stage's
programs are (row, KV head, split) in that order, M * KVH * splits of them, and the next
stage waits until all have counted themselves done, the merging ones after their merge. So
the output has the bits of paged_decode_attention_qkv(..., counters=) at the same block_t and
splits. The stage reads the packed projection [M, (H + 2 KVH) * hd] and writes [M, H * hd]
(the o projection's input) through FlatView, which lets the decode kernel's [row, head, col]
indexing address those flat rows.

Why (docs/kernels.md): at batch 1 attention is latency-bound (4.4 us per layer application
with the XLA split combine after it, session 11) while the o and gate/up programs that follow
could already be streaming their weights; in the flow the o stage's programs request their
first weight blocks before they wait for the attention stage. Measured (session 23, H100,
benchmarks.flow_layer): exact, and slower: 59.3 us per layer application in one kernel
against 51.9 for the separate kernels; opt-in only ('+flow5').
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import plane_operands
from pallas_kernels.decode import _decode_kernel, key_tiling


class AttnStage(NamedTuple):
    """Decode attention as a gemv_flow stage, on the previous stage's output (the packed
    q/k/v projection of the new token, [M, (H + 2 KVH) * hd]): paged_decode_attention_qkv's
    arguments. counters: int32 [M, KVH] zeros, the split merge's (returned at zero)."""
    k_cache: jax.Array  # [E, P, page_size, KVH, hd], updated in place (donate)
    v_cache: jax.Array
    entry: object  # the plane: an int32 scalar or (base, offset) with entry_stride
    block_tables: jax.Array  # [M, max_pages] int32
    kv_lens: jax.Array  # [M] int32, the new token included
    page: jax.Array  # [M] int32: where the new token's K/V go
    slot: jax.Array  # [M] int32
    counters: jax.Array  # [M, KVH] int32 zeros
    rope: tuple | None = None  # (cos, sin) [M, hd]
    trash_page: int | None = None
    block_t: int | None = None
    num_splits: int | None = None
    entry_stride: int = 1
    name: str = "attention"

    add_norm = False  # read by gemv_flow's generic code, as for a Stage
    gated = False


class AttnPlan(NamedTuple):
    """The attention stage's static layout (hashable: a kernel parameter)."""
    n_out: int  # H * hd
    k: int  # (H + 2 KVH) * hd, the input's width
    kvh: int
    group: int
    group_pad: int
    hd: int
    page_size: int
    block_t: int
    splits: int
    rope: bool
    trash_page: int
    entry_stride: int
    programs: int
    start: int
    add_norm: bool = False
    gated: bool = False


def plan(st: AttnStage, m: int, width: int, start: int, label: str) -> AttnPlan:
    """The stage's plan; ValueError names the first operand that does not fit."""
    kc, vc = st.k_cache, st.v_cache
    if kc.ndim != 5 or vc.shape != kc.shape or vc.dtype != kc.dtype:
        raise ValueError(f"{label}: k_cache and v_cache must be one [E, P, page_size, KVH, hd] "
                         f"shape and dtype, got {kc.dtype} {kc.shape} / {vc.dtype} {vc.shape}")
    _, _, page_size, kvh, hd = kc.shape
    heads = width // hd
    h = heads - 2 * kvh
    if width % hd or h < kvh or h % kvh:
        raise ValueError(f"{label}: the previous stage gives [{m}, {width}], which is not "
                         f"H + 2 KVH heads of {hd} with H a multiple of KVH = {kvh}")
    for name, a, shape in (("kv_lens", st.kv_lens, (m,)), ("page", st.page, (m,)),
                           ("slot", st.slot, (m,)), ("counters", st.counters, (m, kvh))):
        if a.shape != shape or a.dtype != jnp.int32:
            raise ValueError(f"{label}: {name} must be int32 {list(shape)}, got {a.dtype} "
                             f"{a.shape}")
    if st.block_tables.ndim != 2 or st.block_tables.shape[0] != m:
        raise ValueError(f"{label}: block_tables must be [{m}, max_pages], got "
                         f"{st.block_tables.shape}")
    if st.rope is not None and any(r.shape != (m, hd) for r in st.rope):
        raise ValueError(f"{label}: rope's cos and sin must be [{m}, {hd}], got "
                         f"{[r.shape for r in st.rope]}")
    block_t, splits, group_pad = key_tiling(
        m, kvh, h // kvh, kc.dtype, st.block_tables.shape[1] * page_size, True,
        block_t=st.block_t, num_splits=st.num_splits)
    return AttnPlan(h * hd, width, kvh, h // kvh, group_pad, hd, page_size, block_t, splits,
                    st.rope is not None, -1 if st.trash_page is None else int(st.trash_page),
                    st.entry_stride, m * kvh * splits, start)


def operands(st: AttnStage, dt) -> list:
    """The stage's inputs in the kernel's order (decode._decode_kernel's, its q apart)."""
    base, off = plane_operands(st.entry, st.entry_stride)
    rope = [r.astype(dt) for r in st.rope] if st.rope is not None else []
    return [base, off, st.block_tables.astype(jnp.int32), st.kv_lens, st.k_cache, st.v_cache,
            *rope, st.page, st.slot, st.counters]


def outputs(p: AttnPlan, st: AttnStage, m: int) -> list:
    """The stage's extra outputs: the partials (o: with one split the flat output itself
    takes them, so none) and log-sum-exps, the caches, the counters (the last three aliased
    to their inputs; `aliased` says which)."""
    sd = jax.ShapeDtypeStruct
    part = [sd((m, p.kvh, p.splits, p.group, p.hd), jnp.float32)] if p.splits > 1 else []
    return part + [sd((m, p.kvh, p.splits, p.group), jnp.float32),
                   sd(st.k_cache.shape, st.k_cache.dtype), sd(st.v_cache.shape, st.v_cache.dtype),
                   sd(st.counters.shape, jnp.int32)]


def n_inputs(p: AttnPlan) -> int:
    """len(operands()): base, offset, tables, lens, caches, [cos, sin], page, slot, counters."""
    return 11 if p.rope else 9


def n_outputs(p: AttnPlan) -> int:
    """len(outputs())."""
    return 5 if p.splits > 1 else 4


def aliased(p: AttnPlan) -> list:
    """(input index, output index) pairs within the stage's operands() / outputs(): the
    caches (inputs 4, 5) and the counters (last), the last three outputs."""
    outs = n_outputs(p)
    return [(4, outs - 3), (5, outs - 2), (n_inputs(p) - 1, outs - 1)]


def run(q, p: AttnPlan, ins: list, outs: list, x_ref, y_ref, *, gpu_sync: bool):
    """Program q of the stage: decode._decode_kernel for (row, KV head, split) = q's place,
    reading x_ref [M, (H + 2 KVH) * hd] and writing y_ref [M, H * hd] (merged by the last
    split when there are several)."""
    b = q // (p.kvh * p.splits)
    kvh = lax.rem(q // p.splits, p.kvh)
    sp = lax.rem(q, p.splits)
    qkv = FlatView(x_ref, (p.k // p.hd, p.hd))
    flat_out = FlatView(y_ref, (p.kvh, p.group, p.hd))
    base, off, bt, lens, kc, vc, *rest = ins
    write = rest[:-1]  # [cos, sin,] page, slot
    if p.splits > 1:
        o_ref, lse_ref, kout, vout, cnt = outs
        tail = (rest[-1], o_ref, lse_ref, kout, vout, flat_out, cnt)
    else:  # nothing to merge: the normalised output goes straight to y
        lse_ref, kout, vout, _ = outs
        tail = (FlatView(y_ref, (p.kvh, 1, p.group, p.hd)), lse_ref, kout, vout)
    _decode_kernel(base, off, bt, lens, qkv, kc, vc, *write, *tail, group=p.group,
                   group_pad=p.group_pad, use_dot=True, page_size=p.page_size,
                   block_t=p.block_t, num_splits=p.splits, scale=float(p.hd) ** -0.5,
                   rowwise=False, entry_stride=p.entry_stride, write_new=True, rope=p.rope,
                   trash_page=p.trash_page, last_combine=p.splits > 1, gpu_sync=gpu_sync,
                   pdl=False, ids=(b, kvh, sp))


class FlatView:
    """A ref [M, N] seen as [M, *inner] (prod(inner) == N), for the decode kernel's indexing:
    view[row, i_1, .., i_n] with ints and int arrays (broadcast together), then any number of
    full slices (`:`, each a trailing axis of the result, in order), reads and writes one
    gathered / scattered tile of the flat row."""

    def __init__(self, ref, inner):
        self.ref, self.inner = ref, tuple(inner)
        assert ref.shape[1] == math.prod(self.inner), (ref.shape, self.inner)

    @property
    def shape(self):
        return (self.ref.shape[0], *self.inner)

    @property
    def dtype(self):
        return self.ref.dtype

    def _flat(self, key):
        row, *idx = key
        assert len(idx) == len(self.inner), (key, self.inner)
        strides = [math.prod(self.inner[j + 1:]) for j in range(len(self.inner))]
        n_sl = 0
        while n_sl < len(idx) and isinstance(idx[-1 - n_sl], slice):
            assert idx[-1 - n_sl] == slice(None), "only full slices"
            n_sl += 1
        head = idx[:len(idx) - n_sl]
        flat = jnp.int32(0)
        for i, s in zip(head, strides):
            flat = flat + jnp.asarray(i, jnp.int32) * s
        for j in range(len(idx) - n_sl, len(idx)):  # each slice a new trailing axis
            axis = lax.iota(jnp.int32, self.inner[j]) * strides[j]
            flat = flat[..., None] + axis.reshape((1,) * flat.ndim + axis.shape)
        return row, flat

    def __getitem__(self, key):
        return self.ref[self._flat(key)]

    def __setitem__(self, key, value):
        self.ref[self._flat(key)] = value
