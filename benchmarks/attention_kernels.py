"""Microbenchmark: Pallas paged-attention kernels vs the XLA gather path (pallas_kernels.reference).

    PYTHONPATH=. python benchmarks/attention_kernels.py --out $OUT/attention_kernels.json

Ouro-1.4B attention shapes: 16 query heads, 16 KV heads, head_dim 128, bf16. Decode at batch
{1, 8, 64} x context {512, 2048, 8192}; verification with 5 queries per sequence at batch
{8, 64} (same contexts). Context = kv_len, the new tokens included; every sequence has it.

Timing: R calls unrolled in one jit (each reads a different cache plane `entry`, so small
problems are not served from L2), outputs reduced into one scalar; median of several runs,
minus the median time of the same jit doing no attention (dispatch + sync), divided by R.
`--device-time` instead times up to R unrolled calls, one per plane (two on one plane could
be merged by XLA's CSE), that return every output (no reductions), by their GPU kernels' own
durations from a profiler trace (benchmarks.timing.device_seconds), the split combine
included: the figure to trust at small points, where the wall clock less the empty program's
is suspect (session 45 read batch 1 at 2048 keys above the DRAM peak).
K/V bandwidth = B * context * KVH * head_dim * 2 B * 2 (K and V) / time: the fewest bytes any
implementation must read. Copy bandwidth (read + write bytes of a 2 GiB x+1) is measured in
the same run. `--smoke` runs tiny shapes in interpret mode on CPU to check the script.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_time, pipelined_rate
from pallas_kernels._common import next_pow2
from pallas_kernels import (paged_decode_attention, paged_decode_attention_reference,
                            ragged_paged_attention, ragged_paged_attention_reference)

HEADS, KV_HEADS, HEAD_DIM, DTYPE = 16, 16, 128, jnp.bfloat16
L2_DEFEAT_BYTES = 256 << 20  # K/V touched across the R unrolled calls: >> the 50 MB L2


def copy_bandwidth(smoke: bool):
    """Best (read + write bytes) / time of x + 1 over 2 GiB (bf16 and fp32), and the read-only
    rate of a full reduction, as measured through XLA in this process."""
    nbytes = (2 << 20) if smoke else (2 << 30)
    rates = {}
    for dt in (jnp.bfloat16, jnp.float32):
        x = jnp.ones((nbytes // jnp.dtype(dt).itemsize,), dt)
        copy = pipelined_rate(jax.jit(lambda a: a + 1), x, 2 * nbytes, calls=20)
        rates[f"copy_{jnp.dtype(dt).name}"] = copy
        if dt == jnp.float32:
            rates["read_sum_float32"] = pipelined_rate(jax.jit(jnp.sum), x, nbytes, calls=20)
        del x
    return max(rates["copy_bfloat16"], rates["copy_float32"]), rates


def make_problem(batch, ctx, n_q_per_seq, page_size, seed=0, smoke=False):
    pages_per_seq = -(-ctx // page_size)
    n_pages = batch * pages_per_seq + 1
    plane_bytes = batch * ctx * KV_HEADS * HEAD_DIM * 2 * 2
    planes = int(min(64, max(2, math.ceil(L2_DEFEAT_BYTES / plane_bytes))))
    if smoke:
        planes = 2
    key = jax.random.PRNGKey(seed)
    kk, kv, kq = jax.random.split(key, 3)
    shape = (planes, n_pages, page_size, KV_HEADS, HEAD_DIM)
    k_cache = jax.random.normal(kk, shape, DTYPE)
    v_cache = jax.random.normal(kv, shape, DTYPE)
    rng = np.random.default_rng(seed)
    tables = jnp.asarray(rng.permutation(np.arange(1, n_pages)).reshape(batch, pages_per_seq),
                         jnp.int32)
    kv_lens = jnp.full((batch,), ctx, jnp.int32)
    q = jax.random.normal(kq, (batch * n_q_per_seq, HEADS, HEAD_DIM), DTYPE)
    cu = jnp.arange(batch + 1, dtype=jnp.int32) * n_q_per_seq
    return dict(q=q, k=k_cache, v=v_cache, bt=tables, lens=kv_lens, cu=cu, planes=planes,
                kv_bytes=plane_bytes)


def unrolled(fn, reps, ragged):
    """jit of `reps` calls on planes entries[i]; returns the sum of all outputs (fp32)."""
    def run(q, k, v, bt, lens, cu, entries):
        acc = jnp.zeros((), jnp.float32)
        for i in range(reps):
            args = (q, k, v, entries[i], bt, lens) + ((cu,) if ragged else ())
            acc = acc + jnp.sum(fn(*args).astype(jnp.float32))
        return acc
    return jax.jit(run)


def unrolled_outputs(fn, reps, ragged, planes):
    """jit of `reps` calls, call i on plane i % planes (a constant), returning every output:
    no reductions and no index kernels, so a device trace of it holds the attention's own
    kernels alone (a split combine included): what --device-time sums."""
    def run(q, k, v, bt, lens, cu):
        return tuple(fn(*((q, k, v, np.int32(i % planes), bt, lens) + ((cu,) if ragged else ())))
                     for i in range(reps))
    return jax.jit(run)


def empty(q, k, v, bt, lens, cu, entries):
    return jnp.sum(q[:1].astype(jnp.float32)) + entries[0]


def timed_calls(reps, planes, device_time):
    """Calls per timed program: by device time at most one per plane, as two calls on one
    plane (a constant) have identical operands, which XLA's CSE may merge into one; the
    wall-clock path passes traced entries instead, so all `reps`."""
    return min(reps, planes) if device_time else reps


def time_impl(fn, p, ragged, reps, overhead, device_time=False):
    """Seconds per call: by the wall clock of `reps` unrolled calls less the empty program's
    (`overhead`), or with device_time the GPU kernels' own durations (NaN without a GPU).
    Why both: at small points (a few MB of K/V) the wall clock's overhead subtraction is
    noisy enough to read above the copy rate (session 45, batch 1 at 2048 keys)."""
    if device_time:
        from benchmarks.timing import device_seconds
        n = timed_calls(reps, p["planes"], True)
        f = unrolled_outputs(fn, n, ragged, p["planes"])
        return device_seconds(f, p["q"], p["k"], p["v"], p["bt"], p["lens"], p["cu"],
                              calls=4, units=n)[0]
    entries = jnp.arange(reps, dtype=jnp.int32) % p["planes"]
    f = unrolled(fn, reps, ragged)
    t = median_time(f, p["q"], p["k"], p["v"], p["bt"], p["lens"], p["cu"], entries)
    return max(t - overhead, 1e-9) / reps


def rel_err(a, b):
    a = np.asarray(a.astype(jnp.float32), np.float64)
    b = np.asarray(b.astype(jnp.float32), np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _pallas_impl(kern, ragged, nq, smoke, kw):
    """The kernel as the engine calls it: ragged with q_len (every sequence has nq rows, so
    the kernel needs no XLA tile map and, with one split, no gather; session 42), unless the
    variant passes cu=1 (the cu_q_lens form, any row counts). A decode variant with
    ragged_decode=1 times the ragged kernel on the decode rows instead (q_len=1), as the
    engine runs decode of ouro_jax.attention.RAGGED_FROM sequences or more."""
    kw = dict(kw)
    if kw.pop("ragged_decode", False):  # decode rows through the ragged kernel, q_len=1
        return lambda q, k, v, e, bt, lens: ragged_paged_attention(
            q, k, v, e, bt, lens, interpret=smoke, q_len=1, **kw)
    if not ragged or kw.pop("cu", False):
        return functools.partial(kern, interpret=smoke, **kw)
    return lambda q, k, v, e, bt, lens, cu: kern(q, k, v, e, bt, lens, interpret=smoke,
                                                 q_len=nq, **kw)


def bench_point(kind, batch, ctx, page_size, copy_bw, smoke, variants, device_time=False):
    nq = 1 if kind == "decode" else 5
    p = make_problem(batch, ctx, nq, page_size, smoke=smoke)
    ragged = kind != "decode"
    if ragged:
        ref = functools.partial(ragged_paged_attention_reference, max_q_len=nq)
        kern = ragged_paged_attention
    else:
        ref, kern = paged_decode_attention_reference, paged_decode_attention
    # R so that each timed jit runs for >= ~1.5 ms of K/V traffic at ~4 TB/s
    est = p["kv_bytes"] / 4e12 + 5e-6
    reps = int(min(16, max(4, math.ceil(1.5e-3 / est))))
    if smoke:
        reps = 2
    overhead = 0.0 if device_time else median_time(  # (the wall clock's baseline only)
        jax.jit(empty), p["q"], p["k"], p["v"], p["bt"], p["lens"], p["cu"],
        jnp.arange(reps, dtype=jnp.int32))
    base_args = (p["q"], p["k"], p["v"], jnp.int32(1), p["bt"], p["lens"]) + \
        ((p["cu"],) if ragged else ())
    want = jax.jit(ref)(*base_args)
    rows = []
    impls = [("xla", ref)] + [(f"pallas{name}", _pallas_impl(kern, ragged, nq, smoke, kw))
                              for name, kw in variants]
    t_xla = None
    for name, fn in impls:
        rec = dict(kernel=kind, batch=batch, context=ctx, q_per_seq=nq, impl=name,
                   page_size=page_size, planes=p["planes"],
                   reps=timed_calls(reps, p["planes"], device_time),
                   timing="device" if device_time else "wall")
        try:
            err = 0.0 if name == "xla" else rel_err(jax.jit(fn)(*base_args), want)
            t = time_impl(fn, p, ragged, reps, overhead, device_time)
        except Exception as e:  # keep the table going; the failure is recorded
            rec.update(error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(rec)
            print(f"  {name}: FAILED {rec['error']}", flush=True)
            continue
        bw = p["kv_bytes"] / t
        if name == "xla":
            t_xla = t
        rec.update(time_us=t * 1e6, kv_bytes=p["kv_bytes"], kv_GBps=bw / 1e9,
                   frac_copy_bw=bw / copy_bw, rel_err_vs_xla=err,
                   speedup_vs_xla=(t_xla / t) if t_xla else None)
        rows.append(rec)
    del p
    return rows


def fmt_table(rows, copy_bw):
    lines = [f"copy bandwidth (read+write): {copy_bw / 1e9:.0f} GB/s",
             f"{'kernel':8} {'B':>3} {'ctx':>5} {'impl':24} {'time us':>9} {'KV GB/s':>8} "
             f"{'%copy':>6} {'vs xla':>7} {'relerr':>8}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['kernel']:8} {r['batch']:>3} {r['context']:>5} {r['impl']:24} "
                         f"FAILED {r['error'][:60]}")
            continue
        sp = f"{r['speedup_vs_xla']:.2f}x" if r.get("speedup_vs_xla") else "-"
        lines.append(f"{r['kernel']:8} {r['batch']:>3} {r['context']:>5} {r['impl']:24} "
                     f"{r['time_us']:9.1f} {r['kv_GBps']:8.0f} {100 * r['frac_copy_bw']:5.1f}% "
                     f"{sp:>7} {r['rel_err_vs_xla']:8.1e}")
    return "\n".join(lines)


# The engine's ragged decode route (ouro_jax.attention.RAGGED_FROM): one split, a query tile
# of 16 rows of (sequence, padded head group) as ouro_jax.invariant.ragged_tuning gives
RAGGED_DECODE = ("[ragged q_len=1]", dict(ragged_decode=True, num_splits=1,
                                          block_q=max(1, 16 // next_pow2(HEADS // KV_HEADS))))
# Tuning variants tried at a few decode points (name suffix, kwargs).
DECODE_SWEEP = [
    RAGGED_DECODE,
    ("[cuda-core]", dict(use_dot=False)),
    ("[cuda-core,rowwise]", dict(use_dot=False, rowwise=True)),
    ("[stages3]", dict(num_stages=3)),
    ("[stages1]", dict(num_stages=1)),
    ("[bt32]", dict(block_t=32)),
    ("[splits x2]", None),  # filled per point: twice the default split count
]
RAGGED_SWEEP = [("[stages1]", dict(num_stages=1)), ("[stages3]", dict(num_stages=3)),
                ("[cu_q_lens]", dict(cu=True))]
# Short contexts at large batch (the protocol's 128-token prompts): many programs of few key
# blocks each, where per-program overheads and wave quantisation matter more than pipelining.
SHORT_DECODE_SWEEP = [
    RAGGED_DECODE,
    ("[bt32]", dict(block_t=32)), ("[bt128]", dict(block_t=128)),
    ("[stages1]", dict(num_stages=1)), ("[stages3]", dict(num_stages=3)),
    ("[warps2]", dict(num_warps=2)), ("[warps8]", dict(num_warps=8)),
    ("[bt32,warps2]", dict(block_t=32, num_warps=2)),
    # the default before session 45 from 2 rows up (since then bt32,warps2 there: at more
    # than one row the three variants above equal the default)
    ("[bt64,warps4]", dict(block_t=64, num_warps=4)),
    ("[splits2]", dict(num_splits=2)), ("[splits4]", dict(num_splits=4)),
    ("[cuda-core]", dict(use_dot=False)),
]
SHORT_RAGGED_SWEEP = [
    ("[cu_q_lens]", dict(cu=True)),
    ("[bt32]", dict(block_t=32)), ("[bt128]", dict(block_t=128)),
    ("[stages1]", dict(num_stages=1)), ("[stages3]", dict(num_stages=3)),
    ("[warps2]", dict(num_warps=2)), ("[splits2]", dict(num_splits=2)),
    ("[bq8]", dict(block_q=8)),
]

# Second round: combinations of the short-context winners, also at longer contexts so a new
# default can be checked for regressions there.
COMBO_DECODE_SWEEP = [
    ("[bt32,warps2]", dict(block_t=32, num_warps=2)),
    ("[bt32,warps2,stages3]", dict(block_t=32, num_warps=2, num_stages=3)),
    ("[bt32,warps2,splits2]", dict(block_t=32, num_warps=2, num_splits=2)),
    ("[warps2,splits2]", dict(num_warps=2, num_splits=2)),
    ("[warps2,splits4]", dict(num_warps=2, num_splits=4)),
    ("[bt32,splits2]", dict(block_t=32, num_splits=2)),
    ("[warps2]", dict(num_warps=2)),
]
COMBO_RAGGED_SWEEP = [
    ("[warps2]", dict(num_warps=2)), ("[warps2,bt32]", dict(num_warps=2, block_t=32)),
    ("[warps2,stages1]", dict(num_warps=2, num_stages=1)), ("[bt128]", dict(block_t=128)),
    ("[warps2,splits2]", dict(num_warps=2, num_splits=2)),
]
VARIANT_SETS = {"short": (SHORT_DECODE_SWEEP, SHORT_RAGGED_SWEEP),
                "combo": (COMBO_DECODE_SWEEP, COMBO_RAGGED_SWEEP)}


def parse_points(spec: str):
    """'decode:64:160,verify:64:160' -> [('decode', 64, 160), ('verify', 64, 160)]."""
    out = []
    for item in spec.split(","):
        kind, b, c = item.split(":")
        if kind not in ("decode", "verify"):
            raise SystemExit(f"--points: kind must be decode or verify, got {kind!r}")
        out.append((kind, int(b), int(c)))
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                  "attention_kernels.json"))
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="skip the verification table")
    ap.add_argument("--quick-sweep", action="store_true",
                    help="sweep 3 decode variants at 64x8k and 1x8k only, no ragged sweep")
    ap.add_argument("--points", default=None,
                    help="only these points, e.g. decode:64:160,verify:64:160, each with the "
                         "tuning variants of --variant-set")
    ap.add_argument("--variant-set", default="short", choices=sorted(VARIANT_SETS))
    ap.add_argument("--device-time", action="store_true",
                    help="time each call by its GPU kernels' durations from a profiler trace "
                         "(the split combine included) instead of the wall clock")
    return ap.parse_args(argv)


def run_tables(args, point, fmt, rows, save):
    """Decode at every batch x context, then verification (5 queries per sequence)."""
    batches = (1, 8, 64) if not args.smoke else (1, 2)
    contexts = (512, 2048, 8192) if not args.smoke else (16, 40)
    verify_batches = () if args.decode_only else (8, 64) if not args.smoke else (2,)
    for kind, kind_batches in (("decode", batches), ("verify", verify_batches)):
        for b in kind_batches:
            for c in contexts:
                rows += point(kind, b, c, [("", {})])
                print("\n".join(fmt(rows[-2:]).splitlines()[-2:]), flush=True)
                save()


SWEEP_POINTS = [(64, 8192), (64, 2048), (8, 2048), (1, 8192)]  # (batch, context)
SMOKE_SWEEP_POINTS = [(2, 40)]


def run_sweep(args, point, sweep, save):
    """The decode kernel's DECODE_SWEEP variants at a few points, then RAGGED_SWEEP."""
    points = SWEEP_POINTS if not args.smoke else SMOKE_SWEEP_POINTS
    decode_sweep = DECODE_SWEEP
    if args.quick_sweep:
        points = [(64, 8192), (1, 8192)]
        decode_sweep = [v for v in DECODE_SWEEP if v[0] in ("[cuda-core]", "[stages3]",
                                                             "[splits x2]")]
    from pallas_kernels.decode import key_tiling
    for b, c in points:  # (the default's split count, as the kernel computes it)
        base = key_tiling(b, KV_HEADS, HEADS // KV_HEADS, DTYPE,
                          -(-c // args.page_size) * args.page_size, True)[1]
        variants = [(n, kw if kw is not None else dict(num_splits=2 * base))
                    for n, kw in decode_sweep]
        sweep += point("decode", b, c, variants)
        save()
    for b, c in ([] if args.quick_sweep else [(8, 2048)] if not args.smoke else [(2, 40)]):
        sweep += point("verify", b, c, RAGGED_SWEEP)
        save()


def main(argv=None):
    args = parse_args(argv)
    global HEADS, KV_HEADS, HEAD_DIM
    if args.smoke:
        HEADS, KV_HEADS, HEAD_DIM = 2, 2, 16
    copy_bw, bw_detail = copy_bandwidth(args.smoke)
    rows, sweep = [], []

    def point(kind, b, c, variants):
        return bench_point(kind, b, c, args.page_size, copy_bw, args.smoke, variants,
                           args.device_time)

    def fmt(rows_):
        return fmt_table(rows_, copy_bw)

    def save():  # after every point, so a run cut short still leaves its numbers
        result = dict(jax_version=jax.__version__, device=str(jax.devices()[0].device_kind),
                      python=platform.python_version(), command=" ".join(sys.argv),
                      shapes=dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                  dtype="bfloat16", page_size=args.page_size),
                      copy_bandwidth_GBps=copy_bw / 1e9,
                      bandwidth_detail_GBps={k: v / 1e9 for k, v in bw_detail.items()},
                      timing="device" if args.device_time else "wall",
                      results=rows, decode_sweep=sweep)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    print(f"jax {jax.__version__}  device {jax.devices()[0].device_kind}  "
          f"copy {copy_bw / 1e9:.0f} GB/s {[f'{k} {v / 1e9:.0f}' for k, v in bw_detail.items()]}  "
          f"page_size {args.page_size}", flush=True)
    if args.points:
        for kind, b, c in parse_points(args.points):
            dec, rag = VARIANT_SETS[args.variant_set]
            variants = [("", {})] + (dec if kind == "decode" else rag)
            sweep += point(kind, b, c, variants)
            print(fmt(sweep[-len(variants) - 1:]), flush=True)
            save()
        print(f"wrote {args.out}")
        return
    run_tables(args, point, fmt, rows, save)
    if not args.no_sweep:
        run_sweep(args, point, sweep, save)
        print("\ntuning sweep:\n" + fmt(sweep), flush=True)
    print("\n" + fmt(rows))
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
