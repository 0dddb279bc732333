"""Decode attention fused with the o projection, split by KV head (opt-in, experimental).

At one row the engine runs a layer's attention as three kernels: the decode kernel (RoPE,
the K/V write, flash-decoding splits), the XLA split combine, and the o projection's
streaming GEMV (~4.4 + 1.3 + 4.0 us of the ~43 us layer application on the H200, plus two
kernel boundaries; docs/performance.md). This kernel does all of it in one launch, and no
program ever waits for another:

* Grid (B, KVH, R). Program (b, h, r) computes KV head h's whole attention for row b, over
  every key (no splits), then multiplies it by the o weight's tile [rows of block r, the
  columns of h's query heads] and stores that fp32 partial sum [block_n]. Every program of
  (b, h) recomputes the same attention: its K/V (2 x kv_len x hd per head) is read R times,
  from L2 after the first, so this pays only at short contexts (the benchmark protocol's
  128-192 keys: ~98 KB per program).
* The o weight's tile is requested at the program's start (`w_early`), so its DRAM latency
  runs under the attention's.
* The last program of (b, r) to finish (an int32 counter per (b, r), the pattern of
  split_merge.merge_if_last) adds the KVH partials up in head order and stores the output
  rows, so the sum's order does not depend on which program is last; it resets the counter.
* Program (b, h, 0) writes the new token's K/V (RoPE applied) into the caches; every program
  folds the new key in from registers, as the decode kernel's split 0 does.

Numerics: the attention output is rounded to the activation dtype before the projection, as
the model rounds it; the projection accumulates in fp32 (per head a sum over hd, then the
heads in order), a different order from the GEMV's, so a result can differ from the three
kernels' by an ulp of the output dtype. Not measured on a GPU yet (docs/kernels.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (cdiv, compiler_params, flash_tile, load_kv_block, next_pow2,
                                    pl, plane_index, plane_operands, plt)
from pallas_kernels.decode import fold_new_key, new_token_kv, query_tile

# Defaults, unmeasured: 16 programs per KV head (256 at the 1.4B shape, two per SM), 32-key
# blocks as the decode kernel takes at one row. TUNING overrides them process-wide (read at
# trace time; `benchmarks.decode --decode-kernel fuse_o=1,o_block_n=64`); explicit
# arguments win.
DEFAULTS = dict(block_n=128, block_t=32, num_warps=4, num_stages=2, w_early=True)
TUNING: dict = {}


def _kernel(*refs, group: int, group_pad: int, page_size: int, block_t: int, block_n: int,
            scale: float, entry_stride: int, rope: bool, trash_page: int, gpu_sync: bool,
            w_early: bool):
    base_ref, off_ref, bt_ref, lens_ref, q_ref, k_ref, v_ref, *rest = refs
    cos_ref, sin_ref = rest[:2] if rope else (None, None)
    wpage_ref, wslot_ref, w_ref, _, part_ref, kout_ref, vout_ref, y_ref, cnt_ref = \
        rest[2:] if rope else rest
    b, kvh, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    hd = q_ref.shape[-1]
    rows = pl.ds(pl.multiple_of(r * block_n, block_n), block_n)
    load_w = lambda: [w_ref[rows, pl.ds(pl.multiple_of((kvh * group + g) * hd, hd), hd)]
                      for g in range(group)]
    w_tiles = load_w() if w_early else None
    entry = plane_index(base_ref, off_ref, entry_stride)
    kv_len = lens_ref[b]
    cached = jnp.maximum(kv_len - 1, 0)  # the new key comes from registers, not the cache
    swap = (lax.iota(jnp.int32, hd) + hd // 2) % hd if rope else None
    k_new, v_new, cos, sin = new_token_kv(q_ref, cos_ref, sin_ref, b, kvh, k_ref.shape[3],
                                          kout_ref.dtype, swap)
    page = wpage_ref[b]

    @pl.when((r == 0) & (page != trash_page))
    def _():
        slot = wslot_ref[b]
        kout_ref[entry, page, slot, kvh, :] = k_new
        vout_ref[entry, page, slot, kvh, :] = v_new

    qt = query_tile(q_ref, b, kvh, group, group_pad, (swap, cos, sin) if rope else None)
    offs = lax.iota(jnp.int32, block_t)

    def block(i):
        t = i * block_t + offs
        k, v = load_kv_block(k_ref, v_ref, bt_ref, entry, b, kvh, t, cached - 1, page_size)
        return k, v, lambda: (t < cached)[None, :]

    def extra(m, l, acc):  # padding rows (trash page) attend to nothing new, as in decode
        return fold_new_key(qt, k_new, v_new, lambda: (kv_len > 0) & (page != trash_page),
                            scale, m, l, acc)

    o, _ = flash_tile(qt, cdiv(cached, block_t), block, scale, extra)  # [Gp, hd] fp32
    if w_tiles is None:
        w_tiles = load_w()
    head_of = lax.broadcasted_iota(jnp.int32, o.shape, 0)
    acc = jnp.zeros((block_n,), jnp.float32)
    for g in range(group):
        a = jnp.sum(jnp.where(head_of == g, o, 0.0), axis=0)  # row g, exactly
        a = a.astype(y_ref.dtype).astype(jnp.float32)  # the attention output as the model has it
        acc = acc + jnp.sum(w_tiles[g].astype(jnp.float32) * a[None, :], axis=1)
    part_ref[b, kvh, rows] = acc
    _sum_if_last(part_ref, y_ref, cnt_ref, b, r, rows, k_ref.shape[3], gpu_sync)


def _sum_if_last(part_ref, y_ref, cnt_ref, b, r, rows, n_kv: int, gpu_sync: bool):
    """The last of the n_kv programs of (b, r) to arrive adds their partials in head order and
    stores y's rows. Memory ordering as split_merge.merge_if_last: a CTA barrier orders every
    warp's partial stores before one thread's acq_rel atomic, a second orders the last
    program's acquire before its warps' loads. Interpret mode runs programs in turn."""
    if gpu_sync:
        plt.debug_barrier()
    old = plt.atomic_add(cnt_ref, (b, r), jnp.int32(1))

    @pl.when(old == n_kv - 1)
    def _():
        if gpu_sync:
            plt.debug_barrier()
        total = lax.fori_loop(1, n_kv, lambda j, s: s + part_ref[b, j, rows],
                              part_ref[b, 0, rows])
        y_ref[b, rows] = total.astype(y_ref.dtype)
        cnt_ref[b, r] = jnp.int32(0)


def config(n_out: int, **tuning) -> dict:
    """The tuning a call runs with: explicit keys, then TUNING, then DEFAULTS; block_n is
    shrunk to a power of two dividing n_out."""
    unknown = set(tuning) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"decode_attention_o: unknown tuning keys {sorted(unknown)}; "
                         f"known: {sorted(DEFAULTS)}")
    cfg = {k: tuning[k] if tuning.get(k) is not None else TUNING.get(k, v)
           for k, v in DEFAULTS.items()}
    for key in ("block_n", "block_t", "num_warps"):
        v = cfg[key]
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"decode_attention_o: {key} must be a positive power of two, got {v!r}")
    while n_out % cfg["block_n"]:
        cfg["block_n"] //= 2
    cfg["w_early"] = bool(cfg["w_early"])
    return cfg


def counters_for(batch: int, n_out: int, **tuning) -> jax.Array:
    """The int32 [batch, n_out // block_n] zeros a call with this tuning takes (donate them;
    every call leaves them at zero, so one array serves a whole forward block)."""
    return jnp.zeros((batch, n_out // config(n_out, **tuning)["block_n"]), jnp.int32)


def _check(qkv, k_cache, w_o, block_tables, kv_lens, page, slot, counters, rope, block_n):
    bsz, rows, hd = qkv.shape
    kvh, hd_c = k_cache.shape[3], k_cache.shape[4]
    h = rows - 2 * kvh
    if hd != hd_c or h < kvh or h % kvh:
        raise ValueError(f"decode_attention_o: qkv {qkv.shape} does not hold H + 2 KVH heads of "
                         f"{hd_c} for a cache with KVH = {kvh}")
    if w_o.ndim != 2 or w_o.shape[1] != h * hd:
        raise ValueError(f"decode_attention_o: w_o {w_o.shape} must be [N, H * hd = {h * hd}]")
    for name, a, shape in (("page", page, (bsz,)), ("slot", slot, (bsz,)),
                           ("kv_lens", kv_lens, (bsz,))):
        if a.shape != shape:
            raise ValueError(f"decode_attention_o: {name} {a.shape} must be {list(shape)}")
    if block_tables.ndim != 2 or block_tables.shape[0] != bsz:
        raise ValueError(f"decode_attention_o: block_tables {block_tables.shape} must be "
                         f"[{bsz}, max_pages]")
    want = (bsz, w_o.shape[0] // block_n)
    if counters.shape != want or counters.dtype != jnp.int32:
        raise ValueError(f"decode_attention_o: counters must be int32 {list(want)} (block_n "
                         f"{block_n}; see counters_for), got {counters.dtype} {counters.shape}")
    if rope is not None and any(c.shape != (bsz, hd) for c in rope):
        raise ValueError(f"decode_attention_o: cos / sin {[c.shape for c in rope]} must be "
                         f"[{bsz}, {hd}]")
    return bsz, h, kvh, hd


def decode_attention_o(qkv, k_cache, v_cache, entry, block_tables, kv_lens, page, slot, w_o,
                       counters, *, rope=None, trash_page=None, interpret: bool = False,
                       entry_stride: int = 1, **tuning):
    """o_proj(decode attention) for a new token, in one kernel (see the module doc).

    qkv, k_cache, v_cache, entry, block_tables, kv_lens, page, slot, rope, trash_page and
    entry_stride as pallas_kernels.decode.paged_decode_attention_qkv; w_o [N, H * hd] (the HF
    layout); counters: counters_for(B, N, **tuning) (donate). Returns (y [B, N] in qkv's
    dtype, k_cache, v_cache, counters): the caches hold the new K/V (aliased, updated in
    place) and the counters are back at zero. tuning: DEFAULTS' keys."""
    cfg = config(w_o.shape[0], **tuning)
    bsz, h, kvh, hd = _check(qkv, k_cache, w_o, block_tables, kv_lens, page, slot, counters,
                             rope, cfg["block_n"])
    group = h // kvh
    n_out, dt = w_o.shape[0], qkv.dtype
    extra = () if rope is None else tuple(c.astype(dt) for c in rope)
    operands = (*plane_operands(entry, entry_stride), block_tables.astype(jnp.int32),
                kv_lens.astype(jnp.int32), qkv, k_cache, v_cache, *extra,
                page.astype(jnp.int32), slot.astype(jnp.int32), w_o.astype(dt), counters)
    kernel = functools.partial(
        _kernel, group=group, group_pad=max(16, next_pow2(group)), page_size=k_cache.shape[2],
        block_t=cfg["block_t"], block_n=cfg["block_n"], scale=float(hd) ** -0.5,
        entry_stride=entry_stride, rope=rope is not None,
        trash_page=-1 if trash_page is None else int(trash_page), gpu_sync=not interpret,
        w_early=cfg["w_early"])
    sd = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    part, kc, vc, y, cnt = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((bsz, kvh, n_out), jnp.float32), sd(k_cache),
                   sd(v_cache), jax.ShapeDtypeStruct((bsz, n_out), dt), sd(counters)),
        grid=(bsz, kvh, n_out // cfg["block_n"]),
        input_output_aliases={5: 1, 6: 2, len(operands) - 1: 4},
        compiler_params=compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="decode_attention_o",
    )(*operands)
    del part  # the per-head partial sums: scratch
    return y, kc, vc, cnt


__all__ = ["decode_attention_o", "counters_for", "config", "DEFAULTS", "TUNING"]
