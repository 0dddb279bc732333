"""The attention stage of the persistent chain (pallas_kernels/chain_mgpu.py, session 27): a
whole decoder layer per stage group, qkv -> attention -> o -> gate/up -> down, for one row
(batch-1 decode), over L layers of one loop. What the stage needs besides the chain's
inputs, its checks, and the XLA reference of the whole layers.

The attention is attend_head_mgpu's (the engine's decode contract: RoPE on q and the new k,
the new K/V written into plane loop * L + layer of the paged caches at (page, slot), the
cached positions plus the new one attended); the chain's KV heads go to programs me, me + P,
...; the others go straight on to the handover, their rings already requesting o's tiles.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.attend_head_mgpu import HeadSpec, scalar_operand


class ChainAttention(NamedTuple):
    """The decode row's attention inputs: caches [E, P, page_size, KVH, hd] (E = loops x
    layers planes), its block table [1, max_pages], kv_len (positions with the new token),
    the new token's page and slot, the loop (its planes are loop * L + layer; may be
    traced), RoPE's cos and sin [1, hd]; K/V blocks of `block` positions, `stages` deep;
    trash_page: a page that marks a padding row (None: none)."""
    k_cache: jax.Array
    v_cache: jax.Array
    block_table: jax.Array
    kv_len: jax.Array
    page: jax.Array
    slot: jax.Array
    loop: jax.Array
    cos: jax.Array
    sin: jax.Array
    block: int = 64
    stages: int = 2
    trash_page: int | None = None


def spec_of(att: ChainAttention, shapes, interpret: bool) -> HeadSpec:
    """HeadSpec of the stage; ValueError naming what does not fit the chain's shapes."""
    kc, vc = att.k_cache, att.v_cache
    if kc.ndim != 5 or vc.shape != kc.shape:
        raise ValueError(f"attention: k and v caches must be [E, P, page_size, KVH, hd] "
                         f"alike, got {kc.shape}, {vc.shape}")
    _, _, ps, kvh, hd = kc.shape
    q_rows, qkv_rows = shapes[1][2], shapes[0][1]
    h = q_rows // hd
    if q_rows % hd or h % kvh or qkv_rows != (h + 2 * kvh) * hd:
        raise ValueError(f"attention: qkv's {qkv_rows} rows and o's K = {q_rows} are not "
                         f"H + 2 KVH and H heads of {hd} with KVH = {kvh}")
    if kc.dtype != jnp.bfloat16 or vc.dtype != jnp.bfloat16:
        raise ValueError(f"attention: the caches must be bf16, got {kc.dtype}")
    if hd not in (64, 128) or ps % 8 or att.block % 64 or att.block > 256 \
            or att.block % ps or not 1 <= att.stages <= 8:
        raise ValueError(f"attention: head_dim={hd} must be 64 or 128, page_size={ps} a "
                         f"multiple of 8, block={att.block} a multiple of 64 up to 256 and "
                         f"of the page size, stages={att.stages} in 1..8")
    bt = att.block_table
    if bt.ndim != 2 or bt.shape[0] != 1:
        raise ValueError(f"attention: block_table must be [1, pages], got {bt.shape}")
    for name, a in (("cos", att.cos), ("sin", att.sin)):
        if a.shape != (1, hd):
            raise ValueError(f"attention: {name} must be [1, {hd}], got {a.shape}")
    return HeadSpec(h=h, kvh=kvh, hd=hd, ps=ps, max_pages=bt.shape[1], dtype="bfloat16",
                    block=att.block, stages=att.stages, rope=True,
                    trash_page=-1 if att.trash_page is None else int(att.trash_page),
                    interpret=bool(interpret))


def operands(att: ChainAttention):
    """The kernel's attention operands (the caches as mutable refs, updated in place) and
    the two refs, to freeze after the call."""
    kr, vr = jax.new_ref(att.k_cache), jax.new_ref(att.v_cache)
    one = scalar_operand
    ops = (kr, vr, att.block_table.astype(jnp.int32), one(att.kv_len), one(att.page),
           one(att.slot), one(att.loop), att.cos.astype(jnp.bfloat16),
           att.sin.astype(jnp.bfloat16))
    return ops, (kr, vr)


def reference_layers(x, ws, norms, branch, att: ChainAttention, eps=1e-6):
    """XLA: the L layers with the engine's math (add_norm prologues, model.apply_rope, the
    K/V write, paged attention over the written cache, gemv_reference's one rounding per
    output). Returns (down output, residual after qkv's prologue, after gate/up's, the
    attention's output row, k cache, v cache) of the last layer."""
    from ouro_jax.model import apply_rope, rms_norm
    from pallas_kernels.gemv import gemv_reference
    from pallas_kernels.reference import paged_decode_attention_reference
    wq, wo, wgu, wd = ws
    kc, vc = att.k_cache, att.v_cache
    kvh, hd = kc.shape[3], kc.shape[4]
    n_layers, h = wq.shape[0], wo.shape[2] // hd
    d = jnp.zeros_like(x) if branch is None else branch
    new = att.trash_page is None or int(att.page) != att.trash_page
    for layer in range(n_layers):
        hq = x + rms_norm(d, norms[0][layer], eps)
        y = gemv_reference(rms_norm(hq, norms[1][layer], eps), wq[layer])
        qkv = y.reshape(1, 1, h + 2 * kvh, hd)
        rot = apply_rope(qkv[:, :, :h + kvh], att.cos[:, None], att.sin[:, None])
        plane = att.loop * n_layers + layer
        if new:
            kc = kc.at[plane, att.page, att.slot].set(rot[0, 0, h:])
            vc = vc.at[plane, att.page, att.slot].set(qkv[0, 0, h + kvh:])
        lens = jnp.reshape(att.kv_len - (0 if new else 1), (1,)).astype(jnp.int32)
        a = paged_decode_attention_reference(rot[:, 0, :h], kc, vc, plane, att.block_table,
                                             lens)
        a = a.reshape(1, h * hd)
        o = gemv_reference(a, wo[layer])
        x = hq + rms_norm(o, norms[2][layer], eps)
        y = gemv_reference(rms_norm(x, norms[3][layer], eps), wgu[layer], gated=True)
        d = gemv_reference(y, wd[layer])
    return d, hq, x, a, kc, vc
