"""RoPE and the K/V write for packed query rows, one token per program: the batch-invariant
mode's attention input (ouro_jax.invariant).

qkv [N, H + 2 KVH, hd] is the fused projection of N tokens before RoPE. Each program takes
one token: it returns its queries with RoPE, [N, H, hd], and writes its key (with RoPE) and
value into plane `entry` of the paged caches at (page, slot), in place (the caches are
aliased). A token aimed at the trash page (padding rows, positions past a row's table) writes
nothing, as kv_cache.write_kv drops it. RoPE rounds as model.apply_rope
(pallas_kernels.new_token._rope), and it is elementwise, so a token's bits never depend on
the others.

Why: in XLA the slices, RoPE's rotate-half and products, and the two scatters were ~5 small
kernels per layer application at one row; this one 3.0 us kernel took busy time per layer
application from 69.0 to 65.8 us (session 40's traces,
kernel_trace_inv_{add_norm,rope_kv}_b1_session40_h100.json). The default engine does this inside its
decode kernel, which the mode does not run (its decode goes through the ragged kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (compiler_params, next_pow2, pl, plane_index,
                                    plane_operands)
from pallas_kernels.new_token import _rope


def _kernel(base_ref, off_ref, page_ref, slot_ref, qkv_ref, cos_ref, sin_ref, kc_in, vc_in,
            q_ref, kc_ref, vc_ref, *, n_q: int, n_kv: int, trash_page: int,
            entry_stride: int):
    del kc_in, vc_in  # aliased to kc_ref, vc_ref
    i = pl.program_id(0)
    hd = qkv_ref.shape[-1]
    swap = (lax.iota(jnp.int32, hd) + hd // 2) % hd  # column order, halves swapped
    cos, sin = cos_ref[i, :][None, :], sin_ref[i, :][None, :]

    def heads(first, count):  # row indices padded to a power of two (repeats of the last)
        return first + jnp.minimum(lax.iota(jnp.int32, next_pow2(count)), count - 1)

    def rotated(rows):
        return _rope(qkv_ref[i, rows, :], qkv_ref[i, rows[:, None], swap[None, :]], cos, sin)

    qh = heads(0, n_q)
    q_ref[i, qh, :] = rotated(qh)  # (padded rows write the same values again)
    page = page_ref[i]

    @pl.when(page != trash_page)
    def _():
        entry = plane_index(base_ref, off_ref, entry_stride, row=i)  # (a base per token)
        slot = slot_ref[i]
        kv = jnp.minimum(lax.iota(jnp.int32, next_pow2(n_kv)), n_kv - 1)
        kc_ref[entry, page, slot, kv, :] = rotated(heads(n_q, n_kv)).astype(kc_ref.dtype)
        vc_ref[entry, page, slot, kv, :] = qkv_ref[i, heads(n_q + n_kv, n_kv), :].astype(
            vc_ref.dtype)


def rope_kv_write(qkv, cos, sin, k_cache, v_cache, entry, page, slot, *, n_kv: int,
                  trash_page: int = 0, entry_stride: int = 1, interpret: bool = False,
                  num_warps: int = 4):
    """(q [N, H, hd] with RoPE, k_cache, v_cache with the N tokens' K/V written).

    qkv [N, H + 2 n_kv, hd]; cos, sin [N, hd]; caches [E, P, page_size, n_kv, hd]; entry as
    the attention kernels take it (a plane, or (base, offset) with entry_stride); page,
    slot [N] int32 (page == trash_page: no write). The base may be an int32 [N], one loop
    per token (ouro_jax.pipelined)."""
    n, rows, hd = qkv.shape
    n_q = rows - 2 * n_kv
    if hd & (hd - 1):  # (on the CPU too: the interpreter would accept what Triton refuses)
        raise ValueError(f"rope_kv_write: head_dim {hd} is not a power of two (Triton blocks)")
    if n_kv < 1 or n_q < 1:
        raise ValueError(f"rope_kv_write: qkv {qkv.shape} does not hold H query heads and "
                         f"2 x {n_kv} K/V heads")
    if k_cache.shape != v_cache.shape or k_cache.ndim != 5 or k_cache.shape[3:] != (n_kv, hd):
        raise ValueError(f"rope_kv_write: caches {k_cache.shape} / {v_cache.shape}, want "
                         f"[E, P, page_size, {n_kv}, {hd}] each")
    if cos.shape != (n, hd) or sin.shape != (n, hd) or page.shape != (n,) or \
            slot.shape != (n,):
        raise ValueError(f"rope_kv_write: cos {cos.shape}, sin {sin.shape}, page {page.shape}, "
                         f"slot {slot.shape}; want [{n}, {hd}] and [{n}]")
    kernel = functools.partial(_kernel, n_q=n_q, n_kv=n_kv, trash_page=int(trash_page),
                               entry_stride=entry_stride)
    sd = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    q, kc, vc = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((n, n_q, hd), qkv.dtype), sd(k_cache), sd(v_cache)),
        grid=(n,),
        input_output_aliases={7: 1, 8: 2},
        compiler_params=compiler_params(num_warps, 1),
        interpret=interpret,
        name="rope_kv_write",
    )(*plane_operands(entry, entry_stride, rows=n), page.astype(jnp.int32),
      slot.astype(jnp.int32),
      qkv, cos.astype(qkv.dtype), sin.astype(qkv.dtype), k_cache, v_cache)
    return q, kc, vc


def reference(qkv, cos, sin, k_cache, v_cache, entry, page, slot, *, n_kv: int,
              trash_page: int = 0):
    """The XLA path (model.apply_rope, kv_cache.write_kv): the tests' oracle; entry a plane."""
    from ouro_jax.kv_cache import write_kv
    from ouro_jax.model import apply_rope
    n_q = qkv.shape[1] - 2 * n_kv
    q, k, v = qkv[:, :n_q], qkv[:, n_q:n_q + n_kv], qkv[:, n_q + n_kv:]
    c, s = cos.astype(qkv.dtype), sin.astype(qkv.dtype)
    q, k = apply_rope(q, c, s), apply_rope(k, c, s)
    page = jnp.where(page == trash_page, 0, page)  # write_kv drops the trash page (0)
    kc, vc = write_kv((k_cache, v_cache), entry, page[:, None], slot[:, None], k[:, None],
                      v[:, None])
    return q, kc, vc
