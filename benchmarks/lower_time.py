"""Trace and lowering time of the engine's programs: the part of a start that no cache keeps.

    python -m benchmarks.lower_time                         # 1.4B, batch 1, native and k=4
    python -m benchmarks.lower_time --platform cuda         # the H200's programs, on a CPU
    python -m benchmarks.lower_time --compare-sharing --out benchmarks/results/lower_time_cpu.json
    python -m benchmarks.lower_time --compile               # on a GPU: XLA's compile as well

Builds the programs the engine builds for one request (prefill chunk, then the decode chunk
or the speculative chunk) and times, for each, `jit(...).trace` and `.lower` (and, with
--compile, `.compile()`). The persistent compilation cache keys on the lowered program, so
every process pays trace + lower again: on a cached start this is the wait.

--platform cuda lowers the GPU programs (Pallas kernels, streaming GEMVs) on any machine:
JAX lowers Pallas-Triton kernels without a GPU, and the engine is told it runs on one.
--compare-sharing runs every arm twice, with and without ouro_jax.trace_once (each kernel
call traced once per program), each arm in a fresh process, since JAX's caches would favour
whichever ran second. The first program timed in a process (prefill) also carries one-off
costs (imports inside the lowering), as a real start does. With --compile, each row also has
a digest of the compiled program's text with names and metadata taken out
(`compiled_digest`): sharing should leave it unchanged, XLA inlining the shared calls.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from unittest import mock

TRITON_CALL = re.compile(r"stablehlo\.custom_call @__gpu\$xla\.gpu\.triton\([^)]*\)(.*)$")
FUNC = re.compile(r"\s*func\.func (?:public |private )?@([\w$.-]+)\(")


def triton_kernel_calls(text: str) -> Counter:
    """How many times a lowered program (StableHLO text) calls each Triton kernel, counted
    through its function calls from @main; kernels are told apart by everything after the
    custom call's operand names (IR, grid, warps, operand and result types). Loop bodies
    count once."""
    funcs, cur = {}, None
    for line in text.splitlines():
        m = FUNC.match(line)
        if m:
            cur = funcs.setdefault(m.group(1), (Counter(), Counter()))
            continue
        if cur is None:
            continue
        m = TRITON_CALL.search(line)
        if m:
            cur[1][hashlib.sha1(m.group(1).encode()).hexdigest()[:16]] += 1
        else:
            cur[0].update(re.findall(r"\bcall @([\w$.-]+)\(", line))
    memo = {}

    def expand(name):
        if name not in memo:
            calls, kernels = funcs[name]
            total = Counter(kernels)
            for callee, n in calls.items():
                for kernel, m in expand(callee).items():
                    total[kernel] += n * m
            memo[name] = total
        return memo[name]
    return expand("main")


def build(args):
    """(llm, [(name, fn, static, donate, call args)]) for one request of the protocol."""
    import jax.numpy as jnp
    import numpy as np
    from ouro_jax import batch, engine
    from ouro_jax.api import Ouro, SamplingParams
    from ouro_jax.config import PRESETS
    from ouro_jax.model import ExitSpec
    from ouro_jax.params import random_params
    from ouro_jax.projections import GPU_DEFAULT
    from ouro_jax.sampling import SamplingMode
    import jax

    cfg = PRESETS[args.preset]
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    shapes = jax.eval_shape(lambda: random_params(cfg, 0, dtype, 0.003, 0.0))
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)  # values unused
    gpu = args.platform == "cuda" or jax.default_backend() == "gpu"
    llm = Ouro(cfg, params, attention="pallas" if gpu else "xla",
               projections=GPU_DEFAULT if gpu else "xla")
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    ids = [[1] * args.prompt_len] * args.batch
    from ouro_jax import speculative as sm
    sc = (sm.SpeculativeConfig(k=args.k, draft_loops=args.draft_loops,
                               pipelined=args.pipelined).validate(cfg) if args.k else None)
    room = sc.room(cfg) if sc else 0
    planes, bt, state = batch.admit(llm, ids, [sp] * args.batch, [[]] * args.batch, room)
    spec, mode = ExitSpec().validate(cfg), SamplingMode.for_requests([sp])
    chunk = batch.prefill_chunk_len(llm, state.tokens.shape[0], args.prompt_len,
                                    bt.shape[1] * llm.page_size)
    t, bp = cfg.total_ut_steps, state.tokens.shape[0]
    pre = (llm.params, planes, bt, np.zeros((bp, chunk), np.int32), np.int32(0),
           np.zeros((bp,), np.int32), np.zeros((t, bp, cfg.hidden_size), dtype),
           np.zeros((t, bp), dtype))
    out = [("prefill", engine.prefill_chunk, dict(cfg=cfg, backend=llm.backend), (1, 6, 7), pre)]
    if args.k:
        from ouro_jax import pipelined
        name = "pipe" if args.pipelined else "spec"
        carry = (pipelined.init_carry(cfg, sc, mode, state, dtype) if args.pipelined
                 else sm.init_counters(state))
        out.append((f"{name}_k{args.k}_d{args.draft_loops}",
                    pipelined.pipe_chunk if args.pipelined else sm.spec_chunk,
                    sm.chunk_static(llm, sc, spec, mode, False), (1,),
                    (llm.params, planes, bt, state, carry)))
    else:
        static = dict(buffer=llm.decode_chunk, cfg=cfg, spec=spec, mode=mode,
                      want_logprobs=False, backend=llm.backend)
        out.append(("decode", engine.decode_chunk, static, (1,),
                    (llm.params, planes, bt, state, np.int32(llm.decode_chunk))))
    return llm, out


def normalized_digest(hlo_text: str) -> str:
    """A digest of compiled HLO text without its names and metadata (which name the nested
    jits): two programs with the same instructions in the same order share it."""
    lines = []
    for line in hlo_text.splitlines():
        line = re.sub(r", metadata=\{[^{}]*\}", "", line)
        line = re.sub(r"%[\w.\-]+", "%v", line)
        line = re.sub(r"(?<![\w])[A-Za-z_][\w\-]*(\.\d+)+", "N", line).strip()
        if line and not line.startswith("HloModule"):
            lines.append(line)
    return hashlib.sha1("\n".join(lines).encode()).hexdigest()[:16]


def time_program(fn, static, donate, call_args, *, platform, share, compile_):
    import functools
    import jax
    from ouro_jax import trace_once
    jitted = jax.jit(functools.partial(fn, **static), donate_argnums=donate)
    ctx = trace_once.scope() if share else contextlib.nullcontext()
    # OURO_JAX_TRACE_ONCE=0 makes scopes no-ops: the row says what really ran
    row = {"shared": bool(share and trace_once.ENABLED)}
    with ctx:
        t0 = time.perf_counter()
        traced = jitted.trace(*call_args)
        t1 = time.perf_counter()
        lowered = (traced.lower(lowering_platforms=("cuda",)) if platform == "cuda"
                   else traced.lower())
        t2 = time.perf_counter()
    text = lowered.as_text()
    calls = triton_kernel_calls(text)
    # kernels lowered (Triton custom calls in the text) against kernel call sites
    row.update(trace_s=round(t1 - t0, 3), lower_s=round(t2 - t1, 3),
               kernels_lowered=text.count("stablehlo.custom_call @__gpu$xla.gpu.triton"),
               kernel_calls=sum(calls.values()), distinct_kernels=len(calls))
    if compile_:
        t3 = time.perf_counter()
        compiled = lowered.compile()
        row["compile_s"] = round(time.perf_counter() - t3, 3)
        row["compiled_digest"] = normalized_digest(compiled.as_text())
    return row


def one_arm(args) -> dict:
    """Every program of one configuration, in this process."""
    import jax
    patch = (mock.patch.object(jax, "default_backend", lambda: "gpu")
             if args.platform == "cuda" and jax.default_backend() != "gpu"
             else contextlib.nullcontext())
    from pallas_kernels.offline_compile import sm90_device_info
    rows = {}
    with patch, (sm90_device_info() if args.platform == "cuda" else contextlib.nullcontext()):
        llm, programs = build(args)
        for name, fn, static, donate, call_args in programs:
            rows[name] = time_program(fn, static, donate, call_args, platform=args.platform,
                                      share=not args.no_share, compile_=args.compile)
            rows[name]["backend"] = llm.backend
    return rows


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    from ouro_jax.config import PRESETS
    ap.add_argument("--preset", default="1.4b", choices=sorted(PRESETS))
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", default="0,4", help="0: native decode; else speculative k")
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--pipelined", action="store_true",
                    help="speculative programs as pipelined self-speculation (k must be 1)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--platform", choices=("native", "cuda"), default="native",
                    help="cuda: lower the GPU programs (works without a GPU)")
    ap.add_argument("--compile", action="store_true", help="also time XLA's compile")
    ap.add_argument("--compile-cache", metavar="DIR",
                    help="persistent compilation cache (as the CLI's); with --runs 2 the "
                         "second process reads what the first wrote")
    ap.add_argument("--no-share", action="store_true",
                    help="trace every kernel call anew (no ouro_jax.trace_once scope)")
    ap.add_argument("--compare-sharing", action="store_true",
                    help="each arm with and without sharing, in fresh processes")
    ap.add_argument("--runs", type=int, default=1, help="fresh processes per arm")
    ap.add_argument("--out", help="JSON file for the results")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.batch, args.runs, args.prompt_len, args.new_tokens, args.draft_loops) < 1:
        ap.error("--batch, --runs, --prompt-len, --new-tokens and --draft-loops must be "
                 "positive")
    try:
        args.k_list = [int(k) for k in args.k.split(",")]
    except ValueError:
        ap.error(f"--k takes comma-separated integers, got {args.k!r}")
    if any(k < 0 for k in args.k_list):
        ap.error("--k values must be >= 0")
    if args.compile and args.platform == "cuda":
        import jax
        if jax.default_backend() != "gpu":
            ap.error("--compile with --platform cuda needs a GPU (XLA compiles for the "
                     "local device)")
    return args


def run_child(args, k, share) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.lower_time", "--child", "--k", str(k),
           "--preset", args.preset, "--dtype", args.dtype, "--batch", str(args.batch),
           "--draft-loops", str(args.draft_loops), "--prompt-len", str(args.prompt_len),
           "--new-tokens", str(args.new_tokens), "--platform", args.platform]
    cmd += ["--compile"] if args.compile else []
    cmd += ["--pipelined"] if args.pipelined else []
    cmd += ["--compile-cache", args.compile_cache] if args.compile_cache else []
    cmd += [] if share else ["--no-share"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"child failed ({' '.join(cmd)}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        args.k = args.k_list[0]
        if args.compile_cache:
            from ouro_jax.generate import enable_compile_cache
            enable_compile_cache(args.compile_cache)
        print(json.dumps(one_arm(args)))
        return 0
    shares = (True, False) if args.compare_sharing else (not args.no_share,)
    results = []
    for k in args.k_list:
        for share in shares:
            runs = [run_child(args, k, share) for _ in range(args.runs)]
            for name in runs[0]:
                rows = [r[name] for r in runs]
                share = rows[0]["shared"]
                row = dict(program=name, k=k, share=share, runs=rows,
                           **{key: rows[0][key] for key in ("backend", "kernels_lowered",
                                                            "kernel_calls", "distinct_kernels")})
                for key in ("trace_s", "lower_s", "compile_s"):
                    if key in rows[0]:
                        row[key] = statistics.median(r[key] for r in rows)
                results.append(row)
                for i, r in enumerate(rows):
                    print(f"{name:>12} k={k} share={'yes' if share else 'no ':3} run {i + 1}: "
                          f"trace {r['trace_s']:6.2f} s  lower {r['lower_s']:6.2f} s"
                          + (f"  compile {r['compile_s']:6.2f} s" if "compile_s" in r else "")
                          + f"  kernels lowered {row['kernels_lowered']} for "
                          f"{row['kernel_calls']} calls", flush=True)
            if args.out:  # after every arm: a time limit or a failing child keeps the rest
                write_json(args, results)
    return 0


def write_json(args, results):
    import platform

    import jax
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=40"],
                            capture_output=True, text=True)
    doc = dict(command="python -m benchmarks.lower_time " + " ".join(sys.argv[1:]),
               git_commit=commit.stdout.strip(), jax=jax.__version__,
               machine=platform.node(), cpu_count=os.cpu_count(),
               devices=[d.device_kind for d in jax.devices()], results=results)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    sys.exit(main())
