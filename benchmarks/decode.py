"""Decode throughput on the reference protocol: native vs speculative, greedy vs sampling.

    python -m benchmarks.decode --synthetic 1.4b --batch 1,8,32,64 --out results.json
    python -m benchmarks.decode --model DIR --batch 8 --k 4 --temperature 0,0.8

Protocol (OURO.md): prompt 128 tokens, 64 new tokens, ignore_eos; decode-only time after every
request's first token (prefill + first token excluded), and end-to-end time with prefill.
Each configuration runs `--warmup` untimed calls (compiles happen there and are reported
apart), then `--repeats` timed calls; the median and the spread are reported. For native
decode the roofline fraction is computed from the bytes one decode step must read (weights
once per loop, the LM head, and every loop's K/V) and the copy bandwidth measured in-run.
"""

from __future__ import annotations

import argparse
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
from benchmarks.tuning import (DECODE_TUNING_KEYS, RAGGED_TUNING_KEYS, add_stream_args,
                               apply_kernel_tuning, check_graph_pdl)


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
              persistent_layers=getattr(args, "persistent_layers", False))
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


def engine_for(args, new_tokens: int, unroll_loops: bool = False):
    """make_engine for add_model_args' options, with the protocol's synthetic recipe."""
    ns = argparse.Namespace(model=args.model, synthetic=args.synthetic, dtype=args.dtype,
                            attention=args.attention, page_size=16, new_tokens=new_tokens,
                            seed=0, branch_scale=0.003, norm_jitter=0.0, no_fuse=False,
                            unroll_loops=unroll_loops, projections=args.projections,
                            kv_write=args.kv_write)
    return make_engine(ns)


def run_config(llm, batch, k, temp, args):
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    rng = np.random.default_rng(batch)
    prompts = [[int(t) for t in rng.integers(1, llm.cfg.vocab_size, args.prompt_len)]
               for _ in range(batch)]
    sps = [SamplingParams(max_tokens=args.new_tokens, temperature=temp, top_p=1.0, seed=i,
                          ignore_eos=True) for i in range(batch)]
    spec = (SpeculativeConfig(k, args.draft_loops, rounds_per_fetch=args.new_tokens)
            if k else None)
    compile_s = 0.0
    for _ in range(args.warmup):
        compile_s += llm.generate(prompts, sps, speculative=spec).stats.compile_s
    runs = [llm.generate(prompts, sps, speculative=spec) for _ in range(args.repeats)]
    dec = [r.stats.decode_tok_s for r in runs]
    e2e = [r.stats.generated_tokens / (r.stats.prefill_s + r.stats.decode_s) for r in runs]
    row = dict(batch=batch, mode="speculative" if k else "native", k=k,
               draft_loops=args.draft_loops if k else None, temperature=temp,
               decode_tok_s=statistics.median(dec), decode_tok_s_min=min(dec),
               decode_tok_s_max=max(dec), e2e_tok_s=statistics.median(e2e),
               prefill_s=statistics.median(r.stats.prefill_s for r in runs),
               decode_s=statistics.median(r.stats.decode_s for r in runs),
               compile_s=compile_s, host_fetches=runs[-1].stats.host_fetches,
               # the tokens' digest: equal across runs of different kernel options means the
               # same output (a race, e.g. with --pdl, would show here or across repeats)
               tokens_sha=token_digest(runs[-1]),
               repeats_identical=len({token_digest(r) for r in runs}) == 1)
    if k:
        s = runs[-1].stats.spec
        row.update(acceptance=s["acceptance"], tokens_per_round=s["tokens_per_round"],
                   rounds=s["rounds"])
    else:
        steps = args.new_tokens - 1
        ctx = args.prompt_len + args.new_tokens / 2
        nbytes = step_bytes(llm.cfg, batch, ctx)
        step_s = row["decode_s"] / steps
        row.update(step_ms=1e3 * step_s, step_bytes=nbytes,
                   roofline_fraction=nbytes / step_s / args.copy_bw)
    return row, runs[-1]


def check_pdl_run(args) -> None:
    """--pdl and --decode-kernel pdl=1 make kernels let the next one launch early, which is safe
    only where that next kernel is a Pallas kernel that waits (pallas_kernels._common.PDL):
    the engine's GPU defaults (Pallas attention with the fused K/V write, the streaming GEMVs
    with the norm prologues), and for the decode kernel one row."""
    if not args.pdl and "pdl=1" not in args.decode_kernel.replace(" ", ""):
        return
    if (args.attention != "pallas" or args.kv_write != "fused" or args.projections != "auto"
            or args.no_fuse):
        raise SystemExit("--pdl / --decode-kernel pdl=1 need --attention pallas, --kv-write "
                         "fused, --projections auto and fused projections: with other paths "
                         "an XLA kernel can follow the triggering one")
    if "pdl=1" in args.decode_kernel.replace(" ", "") and args.batch.strip() != "1":
        raise SystemExit("--decode-kernel pdl=1 needs --batch 1: with more rows the o "
                         "projection after the decode kernel is an XLA GEMM")


def check_fuse_o_run(args) -> None:
    """--decode-kernel fuse_o=1 changes only one-row decode steps on the Pallas attention with
    the fused K/V write and the fused qkv weight; anywhere else it would silently measure the
    default, so say so instead."""
    if "fuse_o=1" not in args.decode_kernel.replace(" ", ""):
        return
    if args.attention != "pallas" or args.kv_write != "fused" or args.no_fuse:
        raise SystemExit("--decode-kernel fuse_o=1 needs --attention pallas, --kv-write fused "
                         "and fused projections (it replaces the fused-write decode kernel)")
    if "1" not in [b.strip() for b in args.batch.split(",")]:
        raise SystemExit("--decode-kernel fuse_o=1 changes one-row decode only: give --batch 1 "
                         "(other batch sizes run the default kernels)")
    from ouro_jax.attention import FUSE_O_MAX_KEYS
    if ("o_split=1" not in args.decode_kernel.replace(" ", "")
            and args.prompt_len + args.new_tokens + 16 > FUSE_O_MAX_KEYS):
        raise SystemExit(f"--decode-kernel fuse_o=1 runs unsplit only up to {FUSE_O_MAX_KEYS} "
                         f"keys (ouro_jax.attention.FUSE_O_MAX_KEYS); give o_split=1 or a "
                         f"shorter --prompt-len / --new-tokens")


def check_flow_o_run(args) -> None:
    """--decode-kernel flow_o=1 changes only one-row decode steps on the Pallas attention with
    the fused K/V write and the fused qkv weight (as fuse_o=1): say so rather than measure
    the default under its name."""
    if "flow_o=1" not in args.decode_kernel.replace(" ", ""):
        return
    if args.attention != "pallas" or args.kv_write != "fused" or args.no_fuse:
        raise SystemExit("--decode-kernel flow_o=1 needs --attention pallas, --kv-write fused "
                         "and fused projections (its first stage is the fused-write decode "
                         "kernel's body)")
    if "1" not in [b.strip() for b in args.batch.split(",")]:
        raise SystemExit("--decode-kernel flow_o=1 changes one-row decode only: give --batch 1 "
                         "(other batch sizes run the default kernels)")
    from ouro_jax.projection_spec import FLOW_PARTS
    if set(args.projections.split("+")) & set(FLOW_PARTS):
        raise SystemExit("--decode-kernel flow_o=1 runs o with the attention: the '+flow' "
                         "projections (which start with o) would never run; use one")


def check_mgpu_run(args) -> None:
    """--decode-kernel mgpu=1 replaces the fused-write decode kernel (Pallas attention, fused
    K/V write, fused qkv); anywhere else it would silently measure the default."""
    if "mgpu=1" not in args.decode_kernel.replace(" ", ""):
        return
    if args.attention != "pallas" or args.kv_write != "fused" or args.no_fuse:
        raise SystemExit("--decode-kernel mgpu=1 needs --attention pallas, --kv-write fused "
                         "and fused projections (it replaces the fused-write decode kernel)")
    if "flow5" in args.projections.split("+"):
        raise SystemExit("--decode-kernel mgpu=1 has no gemv_flow attention stage, which "
                         "'+flow5' projections run: drop one of them")


def parse_persistent_tiling(args) -> dict:
    """--persistent-tiling 'stages=14,uniform=1' -> {'stages': 14, 'uniform': True}; it
    needs --persistent-layers (else it would change nothing under its name)."""
    from ouro_jax.persistent import TILING
    out = {}
    for item in filter(None, (x.strip() for x in args.persistent_tiling.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in TILING or not value.isdigit():
            raise SystemExit(f"--persistent-tiling: {item!r} is not KEY=INT with KEY in "
                             f"{sorted(TILING)}")
        out[key] = bool(int(value)) if isinstance(TILING[key], bool) else int(value)
    if out and not args.persistent_layers:
        raise SystemExit("--persistent-tiling tiles the --persistent-layers kernel: give both")
    return out


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
    for scale in [float(x) for x in args.sweep_branch_scale.split(",")]:
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
            f"{'e2e tok/s':>10} {'accept':>7} {'tok/rnd':>7} {'roofline':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        spread = f"{r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f}"
        lines.append(
            f"{r['batch']:>3} {r['mode']:<12} {r['k'] or '-':>2} {r['temperature']:>4} "
            f"{r['decode_tok_s']:>13.1f} {spread:>17} {r['e2e_tok_s']:>10.1f} "
            f"{_fmt(r, 'acceptance', '.1f', 100, '%'):>7} {_fmt(r, 'tokens_per_round', '.2f'):>7} "
            f"{_fmt(r, 'roofline_fraction', '.1f', 100, '%'):>8}")
    return "\n".join(lines)


PROJECTIONS_HELP = ("'auto' (default: 'gemv+norms+stream' on a GPU, else 'xla'), 'xla' "
                    "(einsum GEMMs), 'gemv' "
                    "(one-row calls through the Pallas GEMV), 'gemv@N' (up to N rows; slower beyond "
                    "one), 'gemv[@N]:qkv,o,gate_up,down', '+gemm[@N][:names]' (2..N-row calls "
                    "through the skinny Pallas GEMM), '+norms' (RMSNorms and residual adds in "
                    "the GEMV prologues), '+pfN' (the GEMV loads N K-chunks ahead, 0..4), '+stream' "
                    "(the streaming GEMV kernel), '+mgpu[:names]' (the Mosaic GPU GEMV for "
                    "those projections' one-row calls; jax >= 0.11, slower so far), '+flow' / "
                    "'+flow4' / '+flow5' (with norms and stream: o -> gate/up -> down [-> next "
                    "qkv [-> its attention]] of a one-row layer as one gemv_flow kernel; "
                    "experimental), '+graph' (with gemv+norms+stream: each one-row loop's "
                    "layers as one CUDA graph of our own with PDL edges; a GPU and the triton "
                    "package; experimental)")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="checkpoint folder")
    src.add_argument("--synthetic", default="1.4b", help="preset for random weights on device")
    p.add_argument("--branch-scale", type=float, default=1.0,
                   help="post-branch norm scale of synthetic weights (sets draft acceptance)")
    p.add_argument("--norm-jitter", type=float, default=0.0,
                   help="spread of synthetic norm weights around 1 (0: HF's init)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--attention", default="auto")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--no-fuse", action="store_true", help="separate q/k/v and gate/up GEMMs")
    p.add_argument("--projections", default="auto", help=PROJECTIONS_HELP)
    p.add_argument("--unroll-loops", action="store_true",
                   help="unroll the T loops in the program instead of a fori_loop")
    p.add_argument("--kv-write", default="fused", choices=["fused", "xla"],
                   help="decode's RoPE and K/V write: inside the Pallas decode kernel "
                        "(fused, default) or as XLA kernels (xla: the pre-session-6 path)")
    p.add_argument("--persistent-layers", action="store_true",
                   help="batch-1 decode loops as one persistent Mosaic GPU kernel each "
                        "(ouro_jax.persistent; jax >= 0.11, bf16, --attention pallas)")
    p.add_argument("--persistent-tiling", default="", metavar="K=V,...",
                   help="with --persistent-layers: the kernel's tiling for this run, e.g. "
                        "stages=14,uniform=1,smem_a=1 (keys: block_n, block_k, stages, "
                        "uniform, smem_a)")
    p.add_argument("--batch", default="1,8,32,64")
    p.add_argument("--k", default="0,2,4", help="0 = native decode")
    p.add_argument("--draft-loops", type=int, default=2)
    p.add_argument("--temperature", default="0,0.8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--sweep-branch-scale", default=None,
                   help="synthetic only: try these scales at batch 8, k=4 greedy and keep the "
                        "one whose acceptance is closest to --target-acceptance")
    p.add_argument("--target-acceptance", type=float, default=0.8)
    p.add_argument("--compile-cache", default=os.path.expanduser("~/.cache/ouro_jax/xla"),
                   help="persistent XLA compilation cache ('' disables); compile time is "
                        "reported apart either way")
    p.add_argument("--decode-kernel", default="", metavar="K=V,...",
                   help="override the Pallas decode kernel's tuning defaults for this run, "
                        "e.g. block_t=32,num_warps=2 (keys: %s)" % ",".join(DECODE_TUNING_KEYS))
    p.add_argument("--ragged-kernel", default="", metavar="K=V,...",
                   help="the same for the ragged (verification/prefill) kernel (keys: %s)"
                        % ",".join(RAGGED_TUNING_KEYS))
    p.add_argument("--stream-tiling", default="", metavar="NAME=VARIANT,...",
                   help="override the streaming GEMV's tiling per projection for this run, e.g. "
                        "qkv=st1_k512_p1_w4 (VARIANT: a benchmarks.gemv STREAM_VARIANTS key)")
    p.add_argument("--mgpu-tiling", default="", metavar="NAME=bnN_bkN_ksN_stN[_ov],...",
                   help="override the Mosaic GPU GEMV's tiling (projections '+mgpu') per "
                        "projection for this run, e.g. down=bn64_bk64_ks8_st4 (block_n, "
                        "block_k, k_splits, stages; _ov: prologue overlapped with the first "
                        "weight tiles)")
    p.add_argument("--pdl", default="", metavar="NAME,...",
                   help="streaming projections whose GEMV lets the next kernel launch early "
                        "(programmatic dependent launch), e.g. qkv,o,gate_up; the decode "
                        "kernel's is --decode-kernel last_combine=1,pdl=1")
    p.add_argument("--pdl-at", default="start", choices=["start", "end"],
                   help="where --pdl's GEMVs trigger: at their start, or once their last "
                        "weight block has arrived")
    add_stream_args(p)
    p.add_argument("--out", help="JSON result path")
    args = p.parse_args(argv)
    check_pdl_run(args)
    check_fuse_o_run(args)
    check_flow_o_run(args)
    check_graph_pdl(args)
    check_mgpu_run(args)
    persistent_tiling = parse_persistent_tiling(args)
    if args.mgpu_tiling and "mgpu" not in args.projections:
        raise SystemExit("--mgpu-tiling sets the Mosaic GPU GEMV's tiling: give --projections "
                         "with an 'mgpu' part (e.g. gemv+norms+stream+mgpu:down), or leave it "
                         "out")
    tuning = apply_kernel_tuning(args.decode_kernel, args.ragged_kernel, args.stream_tiling,
                                 args.pdl, args.pdl_at, args.mgpu_tiling, args.l2_prefetch,
                                 args.l2_next, args.l2_next_at, args.stream_set,
                                 args.graph_pdl)
    from ouro_jax import persistent
    shipped = dict(persistent.TILING)
    persistent.TILING.update(persistent_tiling)
    if args.persistent_layers:  # the record names the kernel's tiling
        tuning = dict(tuning, persistent=dict(persistent.TILING))
    try:
        return _run(args, argv, tuning)
    finally:  # the overrides are process-wide: leave none behind for other callers
        apply_kernel_tuning("", "")
        persistent.TILING.clear()
        persistent.TILING.update(shipped)


def _run(args, argv, tuning) -> int:
    if args.compile_cache:
        from ouro_jax.generate import enable_compile_cache
        enable_compile_cache(args.compile_cache)
    args.copy_bw = copy_bandwidth()
    print(f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, copy bandwidth "
          f"{args.copy_bw / 1e12:.2f} TB/s", flush=True)
    sweep = sweep_branch_scale(args) if args.sweep_branch_scale else None
    t0 = time.perf_counter()
    llm = make_engine(args)
    print(f"model ready in {time.perf_counter() - t0:.1f}s", flush=True)
    rows, matches = [], []
    for b in [int(x) for x in args.batch.split(",")]:
        greedy_outs = {}
        for k in [int(x) for x in args.k.split(",")]:
            for temp in [float(x) for x in args.temperature.split(",")]:
                row, res = run_config(llm, b, k, temp, args)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:  # partial results survive a time-out
                    with open(args.out + ".partial", "a") as f:
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
        compiles_total=llm.programs.compiles, branch_scale=args.branch_scale,
        branch_scale_sweep=sweep, greedy_token_match=matches,
        compile_s_total=llm.programs.compile_seconds, kernel_tuning=tuning, rows=rows,
        table=table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
