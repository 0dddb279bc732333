"""Streaming GEMV: the input row held in registers, the K loop unrolled, blocks per program.

y [M, N] = x [M, K] @ W [N, K]^T for one to a few rows, like pallas_kernels/gemv.py's
CUDA-core path, organised differently:

* The input rows are loaded (and, with a prologue, normalised) once per program and stay in
  registers as `K / block_k` fp32 chunks for every block the program computes. In gemv.py
  every K chunk of every program reloads x and moves it through shared memory into the
  layout the multiply needs, and the prologue's normed chunk is recomputed inside the loop.
* The K loop is unrolled: a block's whole [block_n, K] weight slab is requested with
  independent loads.
* Each program owns `per_program` output blocks of `block_n` rows (blocks p, p + P, ...,
  P = grid size); the loop over them carries the next block's raw loads, requested before
  the math on the current one. On the H200 one or two blocks per program did best (the
  engine's tilings give grids of 512-1,536 programs, like gemv.py's): what pays is the
  resident input and the unrolled K loop, not a persistent grid.
* A norm prologue (`prologue="norm"` / `"add_norm"`, the sandwich layer's RMSNorms and
  residual add, as in gemv.gemv_normed) costs once per program.

The summation order is a [block_n, block_k] fp32 accumulator over the chunks in order, then
a sum over the chunk columns, whose tree follows the register layout (set by block_n and
num_warps). Every row of a call goes through the same code and layout, so a row's result
should not depend on the call's row count (interpret-mode tests check it; the GPU test
exists but its session-7 result did not come back, which is one reason the engine sends
only one-row calls here: projections.STREAM_MAX_ROWS).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import (compiler_params, pdl_token, pdl_trigger, pdl_trigger_on,
                                    pdl_wait, pl)
from pallas_kernels.l2_prefetch import next_rows_for, prefetch_blocks, prefetch_next
from pallas_kernels.gemv import check_norm_operands, check_operands, pow2_divisor
from pallas_kernels.gemv_blocks import block_loader, stream_blocks
from pallas_kernels.gemv_rows import raw_rows, row_inputs, split_refs
from pallas_kernels.side_prefetch import store_progress

MAX_ROWS = 4  # registers: every row's K-long input lives in registers for the whole program
MAX_WARPS = 16
# block_k defaults to the largest power of two up to 512 dividing K (as gemv.py does)
# row2d: load x (and the norm weights) as [1, block_k] tiles, which take the weight tile's
# register layout directly, instead of [block_k] vectors that are re-laid-out through shared
# memory (with barriers) once per chunk in the prologue; same math. On the H200 end to end:
# 229.3 tok/s against 231.2 without it (session 8), so the engine does not use it.
# pdl: "start" emits _common.pdl_trigger at the start (the next kernel may launch early; only
# for a call whose next kernel is one that waits, see _common.PDL), "end" once the last
# weight block has arrived (_common.pdl_trigger_on); either orders the reads of x and the
# branch after _common.pdl_wait, with the first weight block requested before it. False: none.
PDL_MODES = (False, "start", "end")
# l2_prefetch: how many of the program's later blocks (p + P, p + 2P, ...) it asks the memory
# system for at its start with one bulk L2 prefetch each (pallas_kernels/l2_prefetch.py),
# before the prologue; the loop's own loads stay one block ahead and then hit L2. 0: none.
# next_rows / next_at: with a `next_w` operand (the weight a later kernel reads, e.g. gate/up
# after o), each program also prefetches next_rows rows of every segment of next_w into L2
# (segments: next_w split in next_split equal parts, e.g. gate and up), program p rows
# [p * next_rows, (p + 1) * next_rows), at its start or once its last block's loads are out
# ("end"); the later kernel's first blocks then come from L2. Without next_w: nothing.
# x_first: the reads of x and the branch are issued before the first weight block's (same
# math; see raw_rows).
# defer_norm (with a prologue): the row's RMS scale leaves the prologue's chain. The GEMV
# runs on x' * norm_w in fp32 and multiplies each output by rsqrt(mean(x'^2) + eps) before
# its rounding, W (s x' w) = s (W (x' w)); the scale's block-wide reduction runs after the
# first block's multiply-adds instead of before them. Same math, another rounding: the
# normed input is not rounded to the dtype before the multiply (model.rms_norm rounds it
# twice), so the bits differ from the default's at that level. Opt-in: on an H100 batch-1
# native greedy ran 1.3-1.6% faster (session 24), but the engine's verification (XLA GEMMs)
# rounds as the reference, so greedy speculative output no longer equals native output bit
# for bit and acceptance drops (k=4: 247.7 against 263.4 tok/s).
# fold_sums (with a prologue): each row statistic through one block-wide reduction instead of
# one per K chunk (_sum_sq): the same terms summed in another order, so a scale can differ in
# its last fp32 bits and, through the normed input's rounding, an output in its last bit.
# Opt-in until measured on a GPU (session 30: ncu found the norm-prologue kernels stalled on
# shared memory and barriers more than on DRAM; the engine's qkv and gate/up take 8
# reductions per call at K = 2048, block_k = 512).
# evict_first: the weight loads carry L2's evict-first policy (gemv_blocks.block_loader), so
# a decode step's 10 GB of weights, each byte read once per loop, stop pushing out of L2 what
# every layer reads again (block tables, activations). Same math, same bits. Off here; the
# engine's tilings turn it on (projection_tuning.STREAM_TUNING; +0.9-1.3% on H100s, session 34).
# depth: how many of the program's blocks have their loads in flight ahead of the math: 1
# (the next block's, as requested before the math on the current one) or 2 (the second block
# also requested before the prologue, and each iteration requesting the block two ahead;
# gemv_blocks._stream_two_ahead). Same loads, same math, same bits; more registers. Why: the
# H200 reads at 81-92% of XLA's rate through these kernels where an H100 reads at 95-103%
# (gemv_scaling, sessions 14 and 35), which is what too few bytes in flight would do on the
# card with the larger bandwidth-delay product. Blocks per program must be >= 2 for depth 2.
# On an H100 depth 2 is 17% slower end to end (session 35: its registers cost a program per
# SM); not yet measured on an H200.
NEXT_AT = ("start", "end")
DEFAULTS = dict(block_n=2, block_k=512, per_program=4, num_warps=4, row2d=False, pdl=False,
                l2_prefetch=0, next_rows=0, next_at="end", x_first=False, defer_norm=False,
                fold_sums=False, evict_first=False, depth=1)
DEPTHS = (1, 2)


def _kernel(*refs, m, k, block_n, block_k, per_program, gated, up_offset, prologue, eps,
            row2d, interpret, pdl, l2_prefetch, next_rows, next_split, next_at, x_first,
            defer_norm=False, fold_sums=False, evict_first=False, progress=None, depth=1):
    refs = list(refs)
    if progress is not None:  # the last two inputs, before the outputs (y[, x'])
        at = len(refs) - (2 if prologue == "add_norm" else 1) - 2
        word_ref, seq_ref = refs.pop(at), refs.pop(at)
    next_ref = refs.pop(-3 if prologue == "add_norm" else -2) if next_rows else None
    x_ref, b_ref, wb_ref, wx_ref, (w_ref,), y_ref, xo_ref = split_refs(refs, prologue, 1)
    p = pl.program_id(0)
    nxt = functools.partial(prefetch_next, next_ref, p, next_rows, next_split,
                            interpret=interpret) if next_rows else None
    nk = k // block_k
    load = block_loader(w_ref, block_n=block_n, block_k=block_k, nk=nk, gated=gated,
                        up_offset=up_offset, evict_first=evict_first and not interpret)
    pdl_off = interpret or not pdl
    token = (pdl_trigger(p, interpret=pdl_off) if pdl == "start"
             else pdl_token(interpret=pdl_off))
    raw = None
    if x_first:  # x (and the branch) requested before the weights; PDL's wait comes first
        after0 = pdl_wait(token)
        raw = raw_rows((x_ref, b_ref), range(m), nk, block_k, prologue, row2d, after0)
    first = load(p)  # in flight while the prologue runs (and, with PDL, the previous kernel)
    second = load(p + pl.num_programs(0)) if depth == 2 else None  # (the same, depth 2)
    ahead = prefetch_blocks(w_ref, p, pl.num_programs(0), min(l2_prefetch, per_program - 1),
                            k=k, block_n=block_n, gated=gated, up_offset=up_offset,
                            interpret=interpret)
    if nxt is not None and next_at == "start":
        ahead = ahead + nxt()
    after = (after0 if x_first else pdl_wait(token)) + ahead
    if progress is not None:  # program 0 tells the side-stream prefetcher it has started
        stored = store_progress(word_ref, seq_ref, p, offset=progress)
        after, ahead = after + stored, ahead + stored
    defer = defer_norm and bool(prologue)
    if prologue == "merge":  # x_ref / b_ref: the attention's split partials / log-sum-exps
        from pallas_kernels.gemv_merge import merged_rows
        xs = merged_rows(x_ref, b_ref, m=m, nk=nk, block_k=block_k, dt=y_ref.dtype)
    else:
        xs = row_inputs((x_ref, b_ref, wb_ref, wx_ref, xo_ref), m=m, nk=nk, block_k=block_k,
                        k=k, dt=y_ref.dtype, prologue=prologue, eps=eps, first_program=p == 0,
                        row2d=row2d, after=after, raw=raw, defer=defer, fold=fold_sums)
    xs, scales = xs if defer else (xs, None)
    late = [nxt] if nxt is not None and next_at == "end" else []
    if x_first or prologue == "merge":  # no x read takes `after`: keep the prefetches alive
        late.append(lambda: ahead)
    tail = (lambda: sum(f() for f in late)) if late else None
    hook = None
    if pdl == "end":  # once the last block's first tile has arrived
        hook = lambda last: (pdl_trigger_on(last[0], interpret=pdl_off), *last[1:])
    stream_blocks(load, first, xs, y_ref, p=p, programs=pl.num_programs(0),
                  per_program=per_program, block_n=block_n, block_k=block_k, nk=nk,
                  gated=gated, last_hook=hook, tail=tail, scales=scales, second=second)


def check_supported(m: int, k: int, n_out: int, *, block_n: int, block_k: int,
                    per_program: int, num_warps: int, row2d: bool = False, depth: int = 1):
    """Raises ValueError naming what the kernel cannot do for this shape and tiling."""
    if not isinstance(row2d, bool):  # (pdl is checked by _config)
        raise ValueError(f"gemv_stream row2d must be a bool, got {row2d!r}")
    if m < 1 or m > MAX_ROWS:
        raise ValueError(f"gemv_stream takes 1..{MAX_ROWS} rows (each row's input stays in "
                         f"registers), got {m}")
    for name, v in (("block_n", block_n), ("block_k", block_k), ("num_warps", num_warps)):
        if type(v) is not int or v < 1 or v & (v - 1):
            raise ValueError(f"gemv_stream {name} must be a power of two, got {v!r}")
    if num_warps > MAX_WARPS:
        raise ValueError(f"gemv_stream num_warps must be at most {MAX_WARPS}, got {num_warps}")
    if type(per_program) is not int or per_program < 1:
        raise ValueError(f"gemv_stream per_program must be an int >= 1, got {per_program!r}")
    if n_out % block_n or k % block_k:
        raise ValueError(f"gemv_stream: block_n={block_n} must divide N={n_out} and "
                         f"block_k={block_k} must divide K={k}")
    if (n_out // block_n) % per_program:
        raise ValueError(f"gemv_stream: per_program={per_program} must divide the "
                         f"{n_out // block_n} output blocks (N={n_out} / block_n={block_n})")
    if depth not in DEPTHS or type(depth) is not int:
        raise ValueError(f"gemv_stream depth must be one of {DEPTHS}, got {depth!r}")
    if depth > per_program:
        raise ValueError(f"gemv_stream depth={depth} needs at least that many blocks per "
                         f"program, got per_program={per_program}")


def _config(tuning: dict, k: int) -> dict:
    unknown = set(tuning) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown gemv_stream tuning keys {sorted(unknown)}; valid: "
                         f"{sorted(DEFAULTS)}")
    cfg = dict(DEFAULTS, **tuning)
    for key in ("x_first", "defer_norm", "fold_sums", "evict_first"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"gemv_stream {key} must be a bool, got {cfg[key]!r}")
    if cfg["x_first"] and cfg.get("pdl"):
        raise ValueError("gemv_stream x_first with pdl would put PDL's wait ahead of the first "
                         "weight block's request (which pdl requests before it): use one")
    if type(cfg["l2_prefetch"]) is not int or cfg["l2_prefetch"] < 0:
        raise ValueError(f"gemv_stream l2_prefetch must be an int >= 0 (blocks), got "
                         f"{cfg['l2_prefetch']!r}")
    if type(cfg["next_rows"]) is not int or cfg["next_rows"] < 0:
        raise ValueError(f"gemv_stream next_rows must be an int >= 0 (rows per program), got "
                         f"{cfg['next_rows']!r}")
    if cfg["next_at"] not in NEXT_AT:
        raise ValueError(f"gemv_stream next_at must be one of {NEXT_AT}, got "
                         f"{cfg['next_at']!r}")
    if cfg["depth"] == 2 and (cfg["defer_norm"] or cfg["l2_prefetch"]):
        raise ValueError("gemv_stream depth=2 takes neither defer_norm nor l2_prefetch (both "
                         "reorder the blocks' loads themselves)")
    if cfg["pdl"] not in PDL_MODES:
        raise ValueError(f"gemv_stream pdl must be one of {PDL_MODES}, got {cfg['pdl']!r}")
    if "block_k" not in tuning:
        cfg["block_k"] = pow2_divisor(k, DEFAULTS["block_k"]) or DEFAULTS["block_k"]
    return cfg


def _call(operands, *, m, k, n_out, gated, prologue, eps, interpret, cfg, extra_out=(),
          next_w=None, next_split=1, out_dtype=None, progress=None):
    check_supported(m, k, n_out, block_n=cfg["block_n"], block_k=cfg["block_k"],
                    per_program=cfg["per_program"], num_warps=cfg["num_warps"],
                    row2d=cfg["row2d"], depth=cfg["depth"])
    programs = n_out // cfg["block_n"] // cfg["per_program"]
    next_rows = next_rows_for(next_w, next_split, cfg["next_rows"], programs,
                              out_dtype or operands[0].dtype)  # (merge: operand 0 is fp32)
    if next_rows:
        operands = (*operands, next_w)
    progress_offset = None
    if progress is not None:
        refs, progress_offset = check_progress(progress, interpret, cfg["row2d"])
        operands = (*operands, *refs)
    kernel = functools.partial(_kernel, m=m, k=k, block_n=cfg["block_n"],
                               block_k=cfg["block_k"], per_program=cfg["per_program"],
                               gated=gated, up_offset=n_out, prologue=prologue, eps=eps,
                               row2d=cfg["row2d"], interpret=interpret, pdl=cfg["pdl"],
                               l2_prefetch=cfg["l2_prefetch"], next_rows=next_rows,
                               next_split=next_split, next_at=cfg["next_at"],
                               x_first=cfg["x_first"], defer_norm=cfg["defer_norm"],
                               fold_sums=cfg["fold_sums"], evict_first=cfg["evict_first"],
                               progress=progress_offset, depth=cfg["depth"])
    if cfg["row2d"]:  # the norm weights as [1, K] rows
        operands = tuple(o.reshape(1, -1) if o.ndim == 1 else o for o in operands)
    y = jax.ShapeDtypeStruct((m, n_out), out_dtype or operands[0].dtype)
    return pl.pallas_call(
        kernel, out_shape=(y, *extra_out) if extra_out else y,
        grid=(programs,),
        compiler_params=compiler_params(cfg["num_warps"], 1), interpret=interpret,
        name="gemv_stream" + ("_silu" if gated else "") + (f"_{prologue}" if prologue else ""),
    )(*operands)


def _check_xw(x, w, gated):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"gemv_stream takes floating-point activations, got {x.dtype}")
    return check_operands(x, w, gated)


def check_progress(progress, interpret: bool, row2d: bool = False):
    """progress = (word, seq[, offset]): the raw address of the side-stream prefetcher's
    progress word (int32 [2], its halves; pallas_kernels/side_prefetch.py), an int32 [1] and
    a static int (default 0); program 0 stores seq[0] + offset there as the kernel starts.
    Returns ((word, seq), offset). GPU only."""
    if interpret:
        raise ValueError("gemv_stream progress= stores to a raw device address: GPU only")
    if row2d:  # the [1, K] reshape of the norm weights would take the progress operands too
        raise ValueError("gemv_stream progress= is not supported with row2d")
    if not (isinstance(progress, tuple) and len(progress) in (2, 3)):
        raise ValueError("gemv_stream progress must be (word int32 [2], seq int32 [1][, "
                         "offset int])")
    word, seq, offset = (*progress, 0) if len(progress) == 2 else progress
    if word.shape != (2,) or seq.shape != (1,) or word.dtype != jnp.int32 \
            or seq.dtype != jnp.int32 or type(offset) is not int:
        raise ValueError(f"gemv_stream progress must be (word int32 [2], seq int32 [1][, "
                         f"offset int]), got {word.dtype} {word.shape}, {seq.dtype} "
                         f"{seq.shape}, {offset!r}")
    return (word, seq), offset


def gemv_stream(x: jax.Array, w: jax.Array, *, gated: bool = False, interpret: bool = False,
                next_w: jax.Array | None = None, next_split: int = 1, progress=None,
                **tuning) -> jax.Array:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (fp32 accumulation); gated: w = [gate; up]
    [2I, K] -> silu(x @ gate^T) * (x @ up^T) [M, I], rounded as the model rounds it.
    tuning: DEFAULTS' keys. next_w: a weight a later kernel reads, prefetched into L2 per
    next_rows / next_split / next_at (DEFAULTS); it does not change the result. progress:
    see check_progress (does not change the result either)."""
    n_out = _check_xw(x, w, gated)
    m, k = x.shape
    cfg = _config(tuning, k)
    return _call((x, w.astype(x.dtype)), m=m, k=k, n_out=n_out, gated=gated, prologue="",
                 eps=0.0, interpret=interpret, cfg=cfg, next_w=next_w, next_split=next_split,
                 progress=progress)


def gemv_stream_normed(x: jax.Array, norm_w: jax.Array, w: jax.Array, *, eps: float,
                       branch: jax.Array | None = None, branch_w: jax.Array | None = None,
                       gated: bool = False, interpret: bool = False,
                       next_w: jax.Array | None = None, next_split: int = 1,
                       progress=None, **tuning):
    """gemv.gemv_normed's contract (the projection of rms_norm(x', norm_w), x' = x or
    x + rms_norm(branch, branch_w); returns (y, x')) with the streaming kernel; next_w,
    next_split and progress as in gemv_stream."""
    n_out = _check_xw(x, w, gated)
    m, k = x.shape
    cfg = _config(tuning, k)
    check_norm_operands("gemv_stream_normed", x, norm_w, branch, branch_w)
    dt = x.dtype
    common = dict(m=m, k=k, n_out=n_out, gated=gated, eps=float(eps), interpret=interpret,
                  cfg=cfg, next_w=next_w, next_split=next_split, progress=progress)
    if branch is None:
        y = _call((x, norm_w.astype(dt), w.astype(dt)), prologue="norm", **common)
        return y, x
    return _call((x, branch.astype(dt), branch_w.astype(dt), norm_w.astype(dt), w.astype(dt)),
                 prologue="add_norm", extra_out=(jax.ShapeDtypeStruct((m, k), dt),), **common)
