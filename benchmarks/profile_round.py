"""Where the time goes: one native decode step and one speculative round, split into parts.

    python -m benchmarks.profile_round --synthetic 1.4b --batch 1,8,64 --out prof.json

Each part (native step; draft of k+1 offsets; verification of loops d..D-1; acceptance and
commit) is compiled as its own program over the same state and timed (median of --iters, after
a warm-up), and the kernels of each compiled program are counted from its optimized HLO
(fusions, GEMM/custom calls, copies). The sum of the parts is compared with the fused round.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import jax
import numpy as np

from benchmarks.timing import median_time


def kernel_counts(compiled_text: str) -> dict:
    """Instructions that launch work on a GPU, counted in the optimized HLO (loop bodies are
    counted once, whatever their trip count)."""
    text = re.sub(r"metadata=\{[^}]*\}", "", compiled_text)
    return {
        "fusions": len(re.findall(r" fusion\(", text)),
        "custom_calls": len(re.findall(r" custom-call\(", text)),
        "copies": len(re.findall(r" copy\(", text)),
        "while_loops": len(re.findall(r" while\(", text)),
        "gemm_targets": sorted(set(re.findall(r'custom_call_target="([^"]+)"', text))),
    }


def profile(llm, batch, k, d, prompt_len, iters):
    from ouro_jax import engine, speculative as sm
    from ouro_jax.batch import admit, prefill
    from ouro_jax.model import ExitSpec
    from ouro_jax.sampling import SamplingMode, SamplingParams

    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, llm.cfg.vocab_size, prompt_len)]
               for _ in range(batch)]
    sps = [SamplingParams(max_tokens=64, ignore_eos=True)] * batch
    sc = sm.SpeculativeConfig(k, d)
    planes, bt, state = admit(llm, prompts, sps, [[0]] * batch, k + 1)
    llm._planes = None
    mode, spec = SamplingMode(), ExitSpec()
    planes, state, _ = prefill(llm, planes, bt, state, prompts, spec, mode, False)
    p, cfg, be = llm.params, llm.cfg, llm.backend
    kw = dict(cfg=cfg, spec=spec, mode=mode, want_logprobs=False, backend=be)
    # Weights and block tables are arguments, never closed over (closed-over arrays become
    # program constants: 2.9 GB of them for the 1.4B shape). No donation: each part is
    # re-run on the same inputs.
    native = jax.jit(lambda p, pl, st: engine.decode_step(p, pl, bt, st, **kw))
    draft = jax.jit(lambda p, pl, st: sm._draft(p, pl, bt, st, cfg=cfg, sc=sc, mode=mode,
                                                backend=be))
    pl2, hs, gs, cands, qlp = draft(p, planes, state)
    verify = jax.jit(lambda p, pl, st, hs, gs: sm._verify(p, pl, bt, st, hs, gs, cfg=cfg, sc=sc,
                                                          spec=spec, backend=be))
    _, logits, steps = verify(p, pl2, state, hs, gs)
    ctr = sm.init_counters(state)

    def accept_commit(logits, cands, qlp, st, ctr, steps):
        a, out = sm._accept(logits, cands, qlp, st, sc=sc, mode=mode)
        return sm._commit(st, ctr, a, out, logits, steps, sc=sc, want_logprobs=False,
                          backend=be)
    accept = jax.jit(accept_commit)
    rnd = jax.jit(lambda p, pl, st, c: sm.spec_round(p, pl, bt, st, c, sc=sc, **kw))
    parts = {
        "native_step": (median_time(native, p, planes, state, runs=iters),
                        native.lower(p, planes, state).compile().as_text()),
        "draft": (median_time(draft, p, planes, state, runs=iters),
                  draft.lower(p, planes, state).compile().as_text()),
        "verify": (median_time(verify, p, pl2, state, hs, gs, runs=iters),
                   verify.lower(p, pl2, state, hs, gs).compile().as_text()),
        "accept_commit": (median_time(accept, logits, cands, qlp, state, ctr, steps, runs=iters),
                          accept.lower(logits, cands, qlp, state, ctr, steps).compile().as_text()),
        "round": (median_time(rnd, p, planes, state, ctr, runs=iters),
                  rnd.lower(p, planes, state, ctr).compile().as_text()),
    }
    row = {"batch": batch, "k": k, "draft_loops": d, "prompt_len": prompt_len}
    for name, (sec, text) in parts.items():
        row[name + "_ms"] = 1e3 * sec
        row[name + "_kernels"] = kernel_counts(text)
    row["parts_sum_ms"] = sum(row[n + "_ms"] for n in ("draft", "verify", "accept_commit"))
    row["round_vs_native_steps"] = row["round_ms"] / row["native_step_ms"]
    return row


def main(argv=None) -> int:
    from benchmarks.decode import add_model_args, engine_for, save_record

    ap = argparse.ArgumentParser(prog="python -m benchmarks.profile_round", description=__doc__)
    add_model_args(ap)
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--draft-loops", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    llm = engine_for(args, 64)
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        row = profile(llm, b, args.k, args.draft_loops, args.prompt_len, args.iters)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_kernels")}), flush=True)
        print("  kernels:", {n: row[n + "_kernels"]["fusions"] + row[n + "_kernels"]["custom_calls"]
                             for n in ("native_step", "draft", "verify", "accept_commit", "round")},
              flush=True)
    save_record("benchmarks.profile_round", argv, args.out, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
