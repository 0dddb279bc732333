"""Decode attention fused with the o projection, split by KV head (opt-in, experimental).

At one row the engine runs a layer's attention as three kernels: the decode kernel (RoPE,
the K/V write, flash-decoding splits), the XLA split combine, and the o projection's
streaming GEMV (~4.4 + 1.3 + 4.0 us of the ~43 us layer application on the H200, plus two
kernel boundaries; docs/performance.md). This kernel does all of it in one launch; by
default no program ever waits for another (split_keys, below, waits among a head's):

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
* `split_keys` (opt-in): instead of every program attending over all keys, program (b, h, r)
  takes key split r (R splits, as the decode kernel's), stores its normalised partial and
  log-sum-exp, and arrives on a counter of (b, h); it then waits (acquire loads) until all R
  have arrived and merges the R partials in split order, with the split combine's math, before
  its projection. One short wait among R programs replaces the unsplit attention's long key
  loop; it needs the whole grid resident at once (refused past resident_programs; a give-up
  count shows a broken wait, see _wait_for_head), and interpret mode runs it as two calls
  of the same kernel.

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

from pallas_kernels._common import (COUNTER_STEP, _counter_barrier, cdiv, compiler_params,
                                    flash_tile, load_kv_block, next_pow2, pl, plane_index,
                                    plane_operands, plt, split_range)
from pallas_kernels.new_token import fold_new_key, new_token_kv, query_tile

# Defaults, unmeasured: 16 programs per KV head (256 at the 1.4B shape, two per SM), 32-key
# blocks as the decode kernel takes at one row (16 with split_keys, so that 16 splits of a
# 192-token context all hold keys). TUNING overrides them process-wide (read at trace time;
# `benchmarks.decode --decode-kernel fuse_o=1,o_block_n=64`); explicit arguments win.
DEFAULTS = dict(block_n=128, block_t=None, num_warps=4, num_stages=2, w_early=True,
                split_keys=False)
TUNING: dict = {}
PHASES = ("both", "attend", "project")
# split_keys: each KV head's handover word and give-up count sit WORD_STRIDE int32s apart
# (128 bytes, an L2 line each), so the 16 heads' spinning programs do not share lines.
WORD_STRIDE = 32
# The head-order sum and the split merge request every partial at once (unrolled): their
# registers grow with the count, so both are capped (the decode kernel's merge went back to
# loops in session 9 when 64 unrolled splits spilled).
MAX_UNROLL = 32


def _kernel(*refs, names: tuple, group: int, group_pad: int, page_size: int, block_t: int,
            block_n: int, scale: float, entry_stride: int, trash_page: int, gpu_sync: bool,
            w_early: bool, split: bool, phase: str, n_splits: int):
    """names: the refs' names in order (decode_attention_o's inputs, then the outputs).
    phase (PHASES): "both" is the kernel; with split_keys interpret mode runs it as "attend"
    then "project" (two calls), because its programs hand over through a spin wait that
    needs them to run at once."""
    ref = dict(zip(names, refs))
    b, kvh, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    q_ref, k_ref = ref["qkv"], ref["k_cache"]
    hd, n_kv = q_ref.shape[-1], k_ref.shape[3]
    rows = pl.ds(pl.multiple_of(r * block_n, block_n), block_n)
    load_w = lambda: [ref["w_o"][rows, pl.ds(pl.multiple_of((kvh * group + g) * hd, hd), hd)]
                      for g in range(group)]
    w_tiles = load_w() if w_early and phase != "attend" else None
    if phase != "project":
        o = _attend(ref, b, kvh, r, group=group, group_pad=group_pad, page_size=page_size,
                    block_t=block_t, scale=scale, entry_stride=entry_stride,
                    trash_page=trash_page, split=split, n_splits=n_splits)
    if split:
        heads = jnp.minimum(lax.iota(jnp.int32, group_pad), group - 1)
        if phase != "project":
            ref["att_o"][b, kvh, r, heads, :] = o[0]
            ref["att_lse"][b, kvh, r, heads] = o[1]
        if phase == "attend":
            return
        if gpu_sync:
            _wait_for_head(ref["counters"], b, kvh, r, n_splits, n_kv)
        # the real heads only (1 row for MHA), not the dot tile's padding to 16
        real = jnp.minimum(lax.iota(jnp.int32, next_pow2(group)), group - 1)
        o = _merge_head(ref["att_o"], ref["att_lse"], b, kvh, real, n_splits)
    if w_tiles is None:
        w_tiles = load_w()
    head_of = lax.broadcasted_iota(jnp.int32, o.shape, 0)
    acc = jnp.zeros((block_n,), jnp.float32)
    y_ref = ref["y"]
    for g in range(group):
        a = jnp.sum(jnp.where(head_of == g, o, 0.0), axis=0)  # row g, exactly
        a = a.astype(y_ref.dtype).astype(jnp.float32)  # the attention output as the model has it
        acc = acc + jnp.sum(w_tiles[g].astype(jnp.float32) * a[None, :], axis=1)
    ref["part"][b, kvh, rows] = acc
    _sum_if_last(ref["part"], y_ref, ref["counters"], b, r, rows, n_kv, gpu_sync)


def _attend(ref, b, kvh, r, *, group, group_pad, page_size, block_t, scale, entry_stride,
            trash_page, split, n_splits):
    """KV head kvh's attention for row b: over every key (returns o [Gp, hd] fp32) or, with
    split, over split r of them (returns (o, lse)). The r = 0 program writes the new token's
    K/V; every program (split: split 0) folds the new key in from registers."""
    q_ref, k_ref, v_ref = ref["qkv"], ref["k_cache"], ref["v_cache"]
    hd = q_ref.shape[-1]
    entry = plane_index(ref["base"], ref["off"], entry_stride)
    kv_len = ref["kv_lens"][b]
    cached = jnp.maximum(kv_len - 1, 0)  # the new key comes from registers, not the cache
    rope = "cos" in ref
    swap = (lax.iota(jnp.int32, hd) + hd // 2) % hd if rope else None
    kout_ref, vout_ref = ref["k_out"], ref["v_out"]
    k_new, v_new, cos, sin = new_token_kv(q_ref, ref.get("cos"), ref.get("sin"), b, kvh,
                                          k_ref.shape[3], kout_ref.dtype, swap)
    page = ref["page"][b]

    @pl.when((r == 0) & (page != trash_page))
    def _():
        slot = ref["slot"][b]
        kout_ref[entry, page, slot, kvh, :] = k_new
        vout_ref[entry, page, slot, kvh, :] = v_new

    qt = query_tile(q_ref, b, kvh, group, group_pad, (swap, cos, sin) if rope else None)
    start, end, n_blocks = (split_range(cached, r, n_splits, block_t) if split
                            else (0, cached, cdiv(cached, block_t)))
    offs = lax.iota(jnp.int32, block_t)

    def block(i):
        t = start + i * block_t + offs
        k, v = load_kv_block(k_ref, v_ref, ref["block_tables"], entry, b, kvh, t, end - 1,
                             page_size)
        return k, v, lambda: (t < end)[None, :]

    def extra(m, l, acc):  # padding rows (trash page) attend to nothing new, as in decode
        use = lambda: (((r == 0) if split else True) & (kv_len > 0) & (page != trash_page))
        return fold_new_key(qt, k_new, v_new, use, scale, m, l, acc)

    o, lse = flash_tile(qt, n_blocks, block, scale, extra)  # [Gp, hd] fp32, [Gp]
    return (o, lse) if split else o


def _wait_for_head(cnt_ref, b, kvh, r, n_splits, n_kv: int):
    """split_keys: wait until all n_splits programs of (b, kvh) have stored their partials:
    a CTA barrier (every warp's partial stores before the arrival, the release), then
    grid_barrier's "counter" spin among them (_common._counter_barrier) on word [b, R + kvh *
    WORD_STRIDE] of the counters (it only grows, by COUNTER_STEP per call). A program that
    re-reads SPIN_LIMIT times without seeing the others arrive adds 1 to word [b, R + (n_kv +
    kvh) * WORD_STRIDE] and goes on (a broken handover shows as a count and wrong results,
    not as a hung GPU). Needs every program of the grid resident at once (resident_programs;
    the 1.4B grid is 256 programs at 168 registers: 3 per SM)."""
    col = n_splits + kvh * WORD_STRIDE
    plt.debug_barrier()
    _counter_barrier(cnt_ref, n_splits, True, r, word=(b, col),
                     give_up=(b, col + n_kv * WORD_STRIDE), flat=b * cnt_ref.shape[1] + col)


def _merge_head(o_ref, lse_ref, b, kvh, heads, n_splits: int):
    """split_keys: the attention of (b, kvh) [len(heads), hd] from its n_splits normalised
    partials, in split order with _common.combine_splits' math. Unrolled: every partial's
    loads are requested at once (one L2 round trip, not n_splits dependent ones)."""
    lses = [lse_ref[b, kvh, s, heads] for s in range(n_splits)]
    parts = [o_ref[b, kvh, s, heads, :] for s in range(n_splits)]
    m = lses[0]
    for lse in lses[1:]:
        m = jnp.maximum(m, lse)
    num = jnp.zeros(parts[0].shape, jnp.float32)
    den = jnp.zeros(lses[0].shape, jnp.float32)
    for lse, part in zip(lses, parts):  # all-empty rows: every w == 1 and every o == 0 -> 0
        w = jnp.exp(lse - m)
        num, den = num + w[:, None] * part, den + w
    return num / den[:, None]


def _sum_if_last(part_ref, y_ref, cnt_ref, b, r, rows, n_kv: int, gpu_sync: bool):
    """The last of the n_kv programs of (b, r) to arrive adds their partials in head order and
    stores y's rows (the loads unrolled, as in _merge_head). Memory ordering as
    split_merge.merge_if_last: a CTA barrier orders every warp's partial stores before one
    thread's acq_rel atomic, a second orders the last program's acquire before its warps'
    loads. Interpret mode runs programs in turn."""
    if gpu_sync:
        plt.debug_barrier()
    old = plt.atomic_add(cnt_ref, (b, r), jnp.int32(1))

    @pl.when(old == n_kv - 1)
    def _():
        if gpu_sync:
            plt.debug_barrier()
        parts = [part_ref[b, j, rows] for j in range(n_kv)]
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        y_ref[b, rows] = total.astype(y_ref.dtype)
        cnt_ref[b, r] = jnp.int32(0)


def config(n_out: int, **tuning) -> dict:
    """The tuning a call runs with: explicit keys, then TUNING, then DEFAULTS; block_n is
    shrunk to a power of two dividing n_out; block_t None: 16 with split_keys, else 32."""
    unknown = set(tuning) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"decode_attention_o: unknown tuning keys {sorted(unknown)}; "
                         f"known: {sorted(DEFAULTS)}")
    cfg = {k: tuning[k] if tuning.get(k) is not None else TUNING.get(k, v)
           for k, v in DEFAULTS.items()}
    cfg["split_keys"] = bool(cfg["split_keys"])
    cfg["w_early"] = bool(cfg["w_early"])
    if cfg["block_t"] is None:
        cfg["block_t"] = 16 if cfg["split_keys"] else 32
    for key in ("block_n", "block_t", "num_warps"):
        v = cfg[key]
        if not isinstance(v, int) or v < 1 or v & (v - 1):
            raise ValueError(f"decode_attention_o: {key} must be a positive power of two, got {v!r}")
    while n_out % cfg["block_n"]:
        cfg["block_n"] //= 2
    return cfg


def counters_for(batch: int, n_out: int, n_kv: int, **tuning) -> jax.Array:
    """The int32 zeros a call with this tuning takes (donate them; one array serves a whole
    forward block): [batch, R] with R = n_out // block_n, the row blocks' arrivals, which every
    call leaves at zero; with split_keys [batch, R + 2 n_kv WORD_STRIDE], then every
    WORD_STRIDE-th word each KV head's handover word (grows by COUNTER_STEP per call) and then
    its give-up count (0 unless a handover broke; see give_ups)."""
    cfg = config(n_out, **tuning)
    r = n_out // cfg["block_n"]
    return jnp.zeros((batch, r + 2 * n_kv * WORD_STRIDE if cfg["split_keys"] else r), jnp.int32)


def give_ups(counters, n_out: int, n_kv: int, **tuning):
    """split_keys: the give-up counts [batch, n_kv] in counters (nonzero: a program of that
    head waited SPIN_LIMIT re-reads and went on with partials it had not seen arrive)."""
    r = n_out // config(n_out, **tuning)["block_n"]
    return counters[:, r + n_kv * WORD_STRIDE::WORD_STRIDE]


def resident_programs(num_warps: int) -> int:
    """How many programs of a split_keys grid are surely resident at once: two per SM at 4
    warps (any register count up to 255 fits twice in the 64K registers), scaled by the warps;
    the SM count from the GPU (132, an H200's, when there is none, e.g. when lowering on a
    CPU)."""
    dev = jax.devices()[0]
    sms = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
    return (sms or 132) * max(1, 8 // num_warps)


def _check(qkv, k_cache, w_o, block_tables, kv_lens, page, slot, counters, rope, cfg):
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
    want = counters_for(bsz, w_o.shape[0], kvh, **cfg).shape
    if counters.shape != want or counters.dtype != jnp.int32:
        raise ValueError(f"decode_attention_o: counters must be int32 {list(want)} (block_n "
                         f"{cfg['block_n']}, split_keys {cfg['split_keys']}; see "
                         f"counters_for), got {counters.dtype} {counters.shape}")
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
    layout); counters: counters_for(B, N, KVH, **tuning) (donate). Returns (y [B, N] in
    qkv's dtype, k_cache, v_cache, counters): the caches hold the new K/V (aliased, updated
    in place) and the counters are as counters_for describes. tuning: DEFAULTS' keys."""
    cfg = config(w_o.shape[0], **tuning)
    bsz, h, kvh, hd = _check(qkv, k_cache, w_o, block_tables, kv_lens, page, slot, counters,
                             rope, cfg)
    n_out, dt = w_o.shape[0], qkv.dtype
    n_r = n_out // cfg["block_n"]
    if kvh > MAX_UNROLL or (cfg["split_keys"] and n_r > MAX_UNROLL):
        raise ValueError(f"decode_attention_o: the head-order sum and the split merge are "
                         f"unrolled, up to {MAX_UNROLL} KV heads / splits; this call has {kvh} "
                         f"KV heads and {n_r} splits (block_n {cfg['block_n']}): use a larger "
                         f"block_n or the decode kernel")
    if cfg["split_keys"] and not interpret:
        limit = resident_programs(cfg["num_warps"])
        if bsz * kvh * n_r > limit or n_r > COUNTER_STEP:
            raise ValueError(
                f"decode_attention_o: split_keys needs every program resident at once (its "
                f"programs wait for each other): {bsz} x {kvh} x {n_r} = {bsz * kvh * n_r} "
                f"programs at {cfg['num_warps']} warps, at most {limit} here (and at most "
                f"{COUNTER_STEP} splits); use fewer rows, a larger block_n or split_keys=False")
    inputs = dict(zip(("base", "off"), plane_operands(entry, entry_stride)))
    inputs.update(block_tables=block_tables.astype(jnp.int32), kv_lens=kv_lens.astype(jnp.int32),
                  qkv=qkv, k_cache=k_cache, v_cache=v_cache)
    if rope is not None:
        inputs.update(cos=rope[0].astype(dt), sin=rope[1].astype(dt))
    inputs.update(page=page.astype(jnp.int32), slot=slot.astype(jnp.int32), w_o=w_o.astype(dt),
                  counters=counters)
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    # split_keys: each split's normalised partial and log-sum-exp per query head (scratch)
    att = dict(att_o=f32(bsz, kvh, n_r, h // kvh, hd), att_lse=f32(bsz, kvh, n_r, h // kvh))
    sd = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)
    caches = dict(k_out=(sd(k_cache), "k_cache"), v_out=(sd(v_cache), "v_cache"))
    project = dict(part=(f32(bsz, kvh, n_out), None),
                   y=(jax.ShapeDtypeStruct((bsz, n_out), dt), None),
                   counters=(sd(counters), "counters"))
    call = functools.partial(_call, cfg=cfg, group=h // kvh, hd=hd, page_size=k_cache.shape[2],
                             entry_stride=entry_stride, interpret=interpret, grid=(bsz, kvh, n_r),
                             trash_page=-1 if trash_page is None else int(trash_page))
    if not (cfg["split_keys"] and interpret):
        outs = dict(caches, **project, **({k: (v, None) for k, v in att.items()}
                                          if cfg["split_keys"] else {}))
        out = call(inputs, outs, "both")
        return out["y"], out["k_out"], out["v_out"], out["counters"]
    # Interpret mode runs programs one after another, so the split-keys handover (a spin
    # wait on the other programs of the head) cannot run: the same kernel as two calls.
    first = call(inputs, dict(caches, **{k: (v, None) for k, v in att.items()}), "attend")
    inputs.update(k_cache=first["k_out"], v_cache=first["v_out"], att_o=first["att_o"],
                  att_lse=first["att_lse"])
    out = call(inputs, project, "project")
    return out["y"], first["k_out"], first["v_out"], out["counters"]


def _call(inputs: dict, outputs: dict, phase: str, *, cfg, group, hd, page_size, entry_stride,
          interpret, grid, trash_page):
    """One pallas_call of _kernel. outputs: name -> (shape dtype, the input it aliases or
    None). Returns the outputs by name."""
    assert phase in PHASES, phase
    names = tuple(inputs) + tuple(outputs)
    in_index = {k: i for i, k in enumerate(inputs)}
    aliases = {in_index[src]: j for j, (_, src) in enumerate(outputs.values()) if src}
    kernel = functools.partial(
        _kernel, names=names, group=group, group_pad=max(16, next_pow2(group)),
        page_size=page_size, block_t=cfg["block_t"], block_n=cfg["block_n"],
        scale=float(hd) ** -0.5, entry_stride=entry_stride, trash_page=trash_page,
        gpu_sync=not interpret, w_early=cfg["w_early"], split=cfg["split_keys"], phase=phase,
        n_splits=grid[2])
    out = pl.pallas_call(
        kernel,
        out_shape=tuple(sd for sd, _ in outputs.values()),
        grid=grid,
        input_output_aliases=aliases,
        compiler_params=compiler_params(cfg["num_warps"], cfg["num_stages"]),
        interpret=interpret,
        name="decode_attention_o" + ("" if phase == "both" else "_" + phase),
    )(*inputs.values())
    return dict(zip(outputs, out))


__all__ = ["decode_attention_o", "counters_for", "give_ups", "resident_programs", "config",
           "DEFAULTS", "TUNING"]
