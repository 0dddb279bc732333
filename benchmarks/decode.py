"""Decode throughput on the reference protocol: native vs speculative, greedy vs sampling.

    python -m benchmarks.decode --synthetic 1.4b --batch 1,8,32,64 --out results.json
    python -m benchmarks.decode --model DIR --batch 8 --k 4 --temperature 0,0.8

Protocol (the reference's, in the model notes ../shared/OURO.md): prompt 128 tokens, 64 new
tokens, ignore_eos; decode-only time after every request's first token (prefill + first token
excluded), and end-to-end time with prefill. Each configuration runs `--warmup` untimed calls
(compiles happen there and are reported apart), then `--repeats` timed calls; the median
decode time and the spread are reported. For native decode the roofline fraction is
computed from the bytes one decode step must read (weights once per loop, the LM head, and
every loop's K/V, at the run's dtype) and the copy bandwidth measured first, in-run (an
`a + 1` over 2 GiB on a GPU, 256 MiB elsewhere). The default model is the 1.4B shape with
random bf16 weights (--synthetic); --model DIR runs a checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.record import save_record
from benchmarks.timing import copy_bandwidth
from benchmarks.decode_args import (PROJECTIONS_HELP, build_parser, check_ragged_decode_run,
                                   check_run)
from benchmarks.tuning import apply_kernel_tuning


def step_bytes(cfg, batch: int, context: float, dtype_bytes: int = 2) -> float:
    """Bytes one native decode step must read: the layer stack once per loop, the LM head
    and final norm, and every loop's K/V over the context."""
    per_layer = (cfg.num_params() - 2 * cfg.vocab_size * cfg.hidden_size) / cfg.num_hidden_layers
    weights = cfg.total_ut_steps * cfg.num_hidden_layers * per_layer * dtype_bytes
    head = cfg.vocab_size * cfg.hidden_size * dtype_bytes
    kv = batch * context * 2 * cfg.kv_entries * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes
    return weights + head + kv


def make_engine(args):
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params

    kw = dict(page_size=args.page_size, attention=args.attention,
              decode_chunk=args.new_tokens, prefill_chunk=256,
              fuse_projections=not args.no_fuse, unroll_loops=args.unroll_loops,
              projections=getattr(args, "projections", "auto"),
              fused_kv_write=getattr(args, "kv_write", "fused") == "fused",
              persistent_layers=getattr(args, "persistent_layers", False),
              batch_invariant=getattr(args, "batch_invariant", False))
    if args.model:
        return Ouro.load(args.model, args.dtype, **kw)
    cfg = PRESETS[args.synthetic]
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    params = random_params(cfg, args.seed, dtype, args.branch_scale, args.norm_jitter)
    return Ouro(cfg, params, None, **kw)


def add_model_args(ap, attention: str = "xla") -> None:
    """The model options the profiling scripts share (synthetic 1.4B by default)."""
    ap.add_argument("--synthetic", default="1.4b")
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--attention", default=attention)
    ap.add_argument("--projections", default="auto", help=PROJECTIONS_HELP)
    ap.add_argument("--kv-write", default="fused", choices=["fused", "xla"],
                    help="decode's RoPE and K/V write in the Pallas decode kernel or in XLA")
    ap.add_argument("--batch-invariant", action="store_true",
                    help="the engine's batch-invariant kernels (ouro_jax.invariant)")


def engine_for(args, new_tokens: int, unroll_loops: bool = False):
    """make_engine for add_model_args' options, with the protocol's synthetic recipe."""
    ns = argparse.Namespace(model=args.model, synthetic=args.synthetic, dtype=args.dtype,
                            attention=args.attention, page_size=16, new_tokens=new_tokens,
                            seed=0, branch_scale=0.003, norm_jitter=0.0, no_fuse=False,
                            unroll_loops=unroll_loops, projections=args.projections,
                            kv_write=args.kv_write,
                            batch_invariant=getattr(args, "batch_invariant", False))
    return make_engine(ns)


def run_config(llm, batch, k, temp, args):
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    rng = np.random.default_rng(batch)
    prompts = [[int(t) for t in rng.integers(1, llm.cfg.vocab_size, args.prompt_len)]
               for _ in range(batch)]
    sps = [SamplingParams(max_tokens=args.new_tokens, temperature=temp, top_p=1.0, seed=i,
                          ignore_eos=True) for i in range(batch)]
    spec = (SpeculativeConfig(k, args.draft_loops, rounds_per_fetch=args.new_tokens,
                              pipelined=args.pipelined)
            if k else None)
    if spec is not None and spec.pipelined:  # (one fetch per call, as for rounds)
        from ouro_jax.pipelined import ticks_for
        spec = dataclasses.replace(spec, rounds_per_fetch=ticks_for(args.new_tokens, spec,
                                                                    llm.cfg))
    compile_s = 0.0
    for _ in range(args.warmup):
        compile_s += llm.generate(prompts, sps, speculative=spec).stats.compile_s
    runs = [llm.generate(prompts, sps, speculative=spec) for _ in range(args.repeats)]
    # a compile inside a timed run would be timed: recorded, and said out loud
    timed_compile_s = sum(r.stats.compile_s for r in runs)
    if timed_compile_s:
        print(f"warning: batch {batch} k {k} T {temp}: {timed_compile_s:.2f}s of compiles fell "
              f"in the timed runs", file=sys.stderr, flush=True)
    dec = [r.stats.decode_tok_s for r in runs]
    e2e = [r.stats.generated_tokens / (r.stats.prefill_s + r.stats.decode_s) for r in runs]
    # tok/s from the median decode time, so that tok/s, decode_s and the roofline agree (the
    # median of the rates is not the rate of the median time for even repeats); every run
    # decodes the same number of tokens (ignore_eos)
    decode_s = statistics.median(r.stats.decode_s for r in runs)
    decode_tokens = runs[0].stats.decode_tokens
    if any(r.stats.decode_tokens != decode_tokens for r in runs):
        raise RuntimeError(f"batch {batch} k {k}: the timed runs decoded different token counts")
    row = dict(batch=batch, mode=("pipelined" if args.pipelined else "speculative") if k
               else "native", k=k,
               draft_loops=args.draft_loops if k else None, temperature=temp,
               decode_tok_s=decode_tokens / decode_s, decode_tok_s_min=min(dec),
               decode_tok_s_max=max(dec), e2e_tok_s=statistics.median(e2e),
               prefill_s=statistics.median(r.stats.prefill_s for r in runs),
               decode_s=decode_s, decode_tokens=decode_tokens,
               compile_s=compile_s, timed_compile_s=timed_compile_s,
               host_fetches=runs[-1].stats.host_fetches,
               # the tokens' digest: equal across runs of different kernel options means the
               # same output (a race, e.g. with --pdl, would show here or across repeats)
               tokens_sha=token_digest(runs[-1]),
               repeats_identical=len({token_digest(r) for r in runs}) == 1)
    if k:
        s = runs[-1].stats.spec
        row.update(acceptance=s["acceptance"], tokens_per_round=s["tokens_per_round"],
                   rounds=s["rounds"], rounds_run=s["rounds_run"],
                   active_row_fraction=s["active_row_fraction"])
    else:
        steps = args.new_tokens - 1
        ctx = args.prompt_len + args.new_tokens / 2
        nbytes = step_bytes(llm.cfg, batch, ctx, jnp.dtype(llm.params.dtype).itemsize)
        step_s = row["decode_s"] / steps
        row.update(step_ms=1e3 * step_s, step_bytes=nbytes,
                   roofline_fraction=nbytes / step_s / args.copy_bw)
    return row, runs[-1]


def token_digest(result) -> str:
    """sha256 (16 hex digits) of every output's token ids, in order."""
    h = hashlib.sha256()
    for o in result.outputs:
        h.update(np.asarray(o.token_ids, np.int64).tobytes() + b"|")
    return h.hexdigest()[:16]


def token_match(native, spec) -> dict:
    """Greedy speculative vs native tokens: identical sequences, and per-position agreement
    up to each sequence's first divergence (bf16 rounding can flip near-ties)."""
    same = sum(a == b for a, b in zip(native, spec))
    agree = total = 0
    for a, b in zip(native, spec):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agree += n
        total += len(a)
    return dict(identical_sequences=same, sequences=len(native),
                prefix_match_rate=agree / total if total else 1.0)


def sweep_branch_scale(args) -> list:
    """Measures acceptance (batch 8, k=4, greedy) per branch scale; sets args.branch_scale."""
    out, programs = [], None
    for scale in args.sweep_scales:
        args.branch_scale = scale
        llm = make_engine(args)
        if programs is not None:
            llm.programs = programs  # same shapes: reuse the compiled programs
        programs = llm.programs
        saved = (args.warmup, args.repeats)
        args.warmup, args.repeats = 1, 1
        row, _ = run_config(llm, 8, 4, 0.0, args)
        args.warmup, args.repeats = saved
        out.append(dict(branch_scale=scale, acceptance=row["acceptance"],
                        decode_tok_s=row["decode_tok_s"]))
        print(json.dumps(out[-1]), flush=True)
        del llm
    best = min(out, key=lambda r: abs(r["acceptance"] - args.target_acceptance))
    args.branch_scale = best["branch_scale"]
    return out


def _fmt(r: dict, key: str, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    return format(scale * r[key], spec) + suffix if key in r else "-"


def table(rows) -> str:
    head = (f"{'B':>3} {'mode':<12} {'k':>2} {'T':>4} {'decode tok/s':>13} {'spread':>17} "
            f"{'e2e tok/s':>10} {'accept':>7} {'tok/rnd':>7} {'roofline':>8} {'active':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = f"{r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f}"
        lines.append(
            f"{r['batch']:>3} {r['mode']:<12} {r['k'] or '-':>2} {r['temperature']:>4} "
            f"{r['decode_tok_s']:>13.1f} {spread:>17} {r['e2e_tok_s']:>10.1f} "
            f"{_fmt(r, 'acceptance', '.1f', 100, '%'):>7} {_fmt(r, 'tokens_per_round', '.2f'):>7} "
            f"{_fmt(r, 'roofline_fraction', '.1f', 100, '%'):>8} "
            # speculative: the share of the batch's row-rounds whose row was not yet done
            f"{_fmt(r, 'active_row_fraction', '.1f', 100, '%'):>7}")
    return "\n".join(lines)


def _recorded_tuning(args, tuning: dict) -> dict:
    """The record's tuning: the run's overrides, plus what the decode attention and the
    batch-invariant kernels ran with where they ran, defaults included."""
    from ouro_jax.attention import ragged_from, skip_done
    from ouro_jax.projections import parse
    tuning = dict(tuning, ragged_from=ragged_from(), skip_done=int(skip_done()))
    if args.batch_invariant or getattr(parse(args.projections), "inv_rows", ()):
        # the mode's whole tiling ('+inv' runs it too), not only the run's overrides
        from ouro_jax import invariant
        tuning = dict(tuning, invariant={k: dict(v) for k, v in invariant.TUNING.items()},
                      invariant_routes={k: [list(r) for r in v]
                                        for k, v in invariant.ROUTES.items() if v})
    return tuning


def main(argv=None) -> int:
    args = build_parser(__doc__).parse_args(argv)
    persistent_tiling = check_run(args)
    tuning = apply_kernel_tuning(args.decode_kernel, args.ragged_kernel, args.stream_tiling,
                                 args.pdl, args.pdl_at, args.mgpu_tiling, args.l2_prefetch,
                                 args.l2_next, args.l2_next_at, args.stream_set,
                                 args.graph_pdl, args.invariant_tiling)
    from ouro_jax import persistent
    shipped = dict(persistent.TILING)
    persistent.TILING.update(persistent_tiling)
    if args.persistent_layers:  # the record names the kernel's tiling
        tuning = dict(tuning, persistent=dict(persistent.TILING))
    try:
        check_ragged_decode_run(args, tuning["decode"])
        return _run(args, argv, _recorded_tuning(args, tuning))
    finally:  # the overrides are process-wide: leave none behind for other callers
        apply_kernel_tuning("", "")
        persistent.TILING.clear()
        persistent.TILING.update(shipped)


def _run(args, argv, tuning) -> int:
    if args.compile_cache:
        from ouro_jax.generate import enable_compile_cache
        enable_compile_cache(args.compile_cache)
    partial = args.out + ".partial" if args.out else None
    if partial:  # rows go here as they finish (a time-out keeps them); a rerun starts afresh
        os.makedirs(os.path.dirname(os.path.abspath(partial)), exist_ok=True)
        open(partial, "w").close()
    args.copy_bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth "
          f"{args.copy_bw / 1e9:.1f} GB/s", flush=True)
    sweep = sweep_branch_scale(args) if args.sweep_branch_scale else None
    t0 = time.perf_counter()
    try:
        llm = make_engine(args)
    except (ValueError, OSError) as e:  # a checkpoint that does not load, named in one line
        raise SystemExit(f"error: {e}") from None
    print(f"model ready in {time.perf_counter() - t0:.1f}s", flush=True)
    rows, matches = [], []
    for b in args.batches:
        greedy_outs = {}
        for k in args.ks:
            for temp in args.temps:
                row, res = run_config(llm, b, k, temp, args)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if partial:
                    with open(partial, "a") as f:
                        f.write(json.dumps(row) + "\n")
                if temp == 0:
                    greedy_outs[k] = [o.token_ids for o in res.outputs]
        for k, outs in greedy_outs.items():
            if k and 0 in greedy_outs:
                matches.append(dict(batch=b, k=k, **token_match(greedy_outs[0], outs)))
                print(json.dumps(matches[-1]), flush=True)
    print(table(rows))
    save_record(
        "benchmarks.decode", argv, args.out, copy_bandwidth_Bps=args.copy_bw,
        model=args.model or f"synthetic {args.synthetic} (branch_scale {args.branch_scale})",
        dtype=args.dtype, attention=llm.backend.split("+")[0], backend=llm.backend,
        fused_projections=not args.no_fuse,
        prompt_len=args.prompt_len, new_tokens=args.new_tokens, repeats=args.repeats,
        compiles_total=llm.programs.compiles,
        # (a checkpoint's weights have no branch scale: synthetic runs only)
        **({} if args.model else dict(branch_scale=args.branch_scale)),
        branch_scale_sweep=sweep, greedy_token_match=matches,
        compile_s_total=llm.programs.compile_seconds, kernel_tuning=tuning, rows=rows,
        table=table(rows))
    if partial:  # the record holds every row now
        os.remove(partial)
    return 0


if __name__ == "__main__":
    sys.exit(main())
