"""The new token in the fused-write decode kernels (decode.py, attention_o.py): RoPE as
model.apply_rope rounds it, its key and value out of the packed qkv projection, the query
tile of a KV head's group, and one more online-softmax step for the new key, folded in from
registers (the kernels do not read back the slot they write)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import online_softmax_step


def _rope(x, x_swapped, cos, sin):
    """model.apply_rope on rows x [..., hd] given x with its halves swapped, rounding each op
    to x's dtype as XLA does: x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1]."""
    dt = x.dtype
    half = x.shape[-1] // 2
    first = lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1) < half
    f32 = lambda a: a.astype(jnp.float32)
    rot = jnp.where(first, -f32(x_swapped), f32(x_swapped))
    a = (f32(x) * f32(cos)).astype(dt)
    b = (rot * f32(sin)).astype(dt)
    return (f32(a) + f32(b)).astype(dt)


def new_token_kv(q_ref, cos_ref, sin_ref, b, kvh, n_kv: int, cdt, swap):
    """The new token's key (with RoPE when `swap`, the column order with halves swapped, is
    given) and value for KV head kvh, in the cache dtype cdt, from the packed projection
    q_ref [B, H + 2 KVH, hd]; also (cos, sin) of row b (None without RoPE)."""
    n_q = q_ref.shape[1] - 2 * n_kv
    k_row, v_row = n_q + kvh, n_q + n_kv + kvh
    k_new = q_ref[b, k_row, :]
    cos = sin = None
    if swap is not None:
        cos, sin = cos_ref[b, :], sin_ref[b, :]
        k_new = _rope(k_new, q_ref[b, k_row, swap], cos, sin)
    return k_new.astype(cdt), q_ref[b, v_row, :].astype(cdt), cos, sin


def query_tile(q_ref, b, kvh, group: int, group_pad: int, rope):
    """The query tile [group_pad, hd] of KV head kvh (padded rows repeat head group - 1);
    rope = (swap, cos, sin) applies RoPE (see new_token_kv), None does not."""
    heads = kvh * group + jnp.minimum(lax.iota(jnp.int32, group_pad), group - 1)
    qt = q_ref[b, heads, :]  # [Gp, hd]
    if rope is not None:
        swap, cos, sin = rope
        qt = _rope(qt, q_ref[b, heads[:, None], swap[None, :]], cos[None, :], sin[None, :])
    return qt


def fold_new_key(qt, k_new, v_new, use, scale: float, m, l, acc):
    """One more online-softmax step with the new key (a block of one key) where use() (a
    function, traced after the scores: the order the kernel was measured with); the
    rounding matches flash_tile's (q and p in the cache dtype, fp32 products and sums)."""
    cdt = k_new.dtype
    qf = qt.astype(cdt).astype(jnp.float32)
    sc = jnp.sum(qf * k_new.astype(jnp.float32)[None, :], axis=1) * scale  # [Gp]
    valid = use()
    m, alpha, p, l = online_softmax_step(m, l, sc[:, None], valid)  # p [Gp, 1]
    pv = p.astype(cdt).astype(jnp.float32) * v_new.astype(jnp.float32)[None, :]
    return m, l, acc * alpha[:, None] + pv
