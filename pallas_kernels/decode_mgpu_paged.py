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

from pallas_kernels.attend_head_mgpu import HeadSpec, attend_head, scalar_operand
from pallas_kernels.gemv_mgpu import SMEM_LIMIT
from pallas_kernels.gemv_mgpu_areg import AROWS

DEFAULT_BLOCK = 64  # positions per K/V block
DEFAULT_STAGES = 4  # K/V blocks in flight


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
    need = _spec(qkv, k_cache, block_tables, rope, None, block, stages,
                 interpret).smem_bytes()
    if need > SMEM_LIMIT:
        raise ValueError(f"{name}: {need} B of shared memory exceed {SMEM_LIMIT}")
    return h, kvh, hd


@functools.lru_cache(maxsize=None)
def _build(bsz, spec: HeadSpec, entry_stride):
    def body(qkv_g, kc, vc, bt_g, lens_g, page_g, slot_g, base_g, off_g, *refs):
        rope_g, refs = (refs[:2], refs[2:]) if spec.rope else (None, refs)
        o_g, *scratch = refs
        b, g = lax.axis_index("b"), lax.axis_index("h")
        attend_head(spec, scratch, g=g, qkv_row=lambda i: qkv_g.at[b, i],
                    out_row=lambda head: o_g.at[b, pl.ds(head, 1)],
                    rope_rows=None if rope_g is None else (rope_g[0].at[b], rope_g[1].at[b]),
                    kc=kc, vc=vc, page_of=lambda col: bt_g[b, col],
                    entry=base_g[0] * entry_stride + off_g[0], kv_len=lens_g[b],
                    wpage=page_g[b], wslot=slot_g[b])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = "paged_decode_attention_mgpu"
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((bsz, spec.h, spec.hd),
                                                            jnp.dtype(spec.dtype)),
                        scratch_types=spec.scratch(), grid=(bsz, spec.kvh),
                        grid_names=("b", "h"),
                        interpret=plgpu.InterpretGPUParams() if spec.interpret else None)


def _spec(qkv, k_cache, block_tables, rope, trash_page, block, stages, interpret):
    _, _, ps, kvh, hd = k_cache.shape
    return HeadSpec(h=qkv.shape[1] - 2 * kvh, kvh=kvh, hd=hd, ps=ps,
                    max_pages=block_tables.shape[1], dtype=jnp.dtype(qkv.dtype).name,
                    block=block, stages=stages, rope=rope is not None,
                    trash_page=-1 if trash_page is None else int(trash_page),
                    interpret=bool(interpret))


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
    base, off = entry if isinstance(entry, tuple) else (entry, 0)
    kernel = _build(qkv.shape[0], _spec(qkv, k_cache, block_tables, rope, trash_page, block,
                                        stages, interpret), int(entry_stride))
    extra = () if rope is None else tuple(c.astype(qkv.dtype) for c in rope)
    kr, vr = jax.new_ref(k_cache), jax.new_ref(v_cache)
    i32 = lambda a: a.astype(jnp.int32)
    out = kernel(qkv, kr, vr, i32(block_tables), i32(kv_lens), i32(page), i32(slot),
                 scalar_operand(base), scalar_operand(off), *extra)
    return out, jax.freeze(kr), jax.freeze(vr)


def lower_for_h200(qkv, k_cache, v_cache, block_tables, kv_lens, page, slot, rope, **kw):
    """The Pallas -> Mosaic GPU lowering for 'cuda' on any machine (offline_compile)."""
    from pallas_kernels.offline_compile import lower_for_cuda
    return lower_for_cuda(
        lambda *a: paged_decode_attention_mgpu(a[0], a[1], a[2], (a[3], 1), *a[4:8],
                                               rope=(a[8], a[9]), trash_page=0,
                                               entry_stride=2, **kw),
        qkv, k_cache, v_cache, jnp.int32(0), block_tables, kv_lens, page, slot, *rope)
