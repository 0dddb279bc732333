"""Where a CLI start's seconds go: one process, phase by phase, as `python -m ouro_jax.generate`
runs them (same defaults), then the same request again in that process.

    python -m benchmarks.start_time --model DIR --dtype bf16 --speculative-k 0
    python -m benchmarks.start_time --model DIR --dtype bf16 --compile-cache /tmp/cc --out r.json

Phases, wall seconds:
- import_s: importing jax and ouro_jax;
- backend_s: the first `jax.devices()` (on a GPU: the CUDA context and XLA's client);
- load_s: `Ouro.load` (checkpoint to device, tokenizer, KV pool), split in load_phases
  (Ouro.load_phases: convert.load.LoadedCheckpoint's phases, then tokenizer and engine);
- first: the first `generate` (prompt of --prompt-len ids, --max-tokens new, ignore_eos) with
  its own stats (compile_s, prefill_s, decode_s: decode_s carries the first run of each program,
  e.g. loading its kernels onto the GPU);
- again: the same request once more in the same process (nothing left to compile or load).

Run it twice with one --compile-cache folder to see a cached start (the second process compiles
nothing: its compile_s is the persistent cache's read plus tracing and lowering).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

T0 = time.perf_counter()


def _request(llm, args, spec):
    from ouro_jax.sampling import SamplingParams

    ids = [1 + i % 1000 for i in range(args.prompt_len)]
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)]
    t = time.perf_counter()
    res = llm.generate([ids], params, speculative=spec)
    wall = time.perf_counter() - t
    return dict(res.stats.to_json(), wall_s=wall), res.outputs[0].token_ids


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.start_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF Ouro checkpoint folder (default: the embedded demo model)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--speculative-k", type=int, default=0)
    p.add_argument("--draft-loops", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--compile-cache", default=None,
                   help="persistent XLA cache folder (default: none, every compile is a first)")
    p.add_argument("--out", default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    if args.prompt_len < 1 or args.max_tokens < 1:
        p.error("--prompt-len and --max-tokens must be positive")

    phases = {}
    t = time.perf_counter()
    import jax

    from benchmarks.record import save_record
    from ouro_jax.api import Ouro
    from ouro_jax.generate import enable_compile_cache
    from ouro_jax.speculative import SpeculativeConfig
    phases["import_s"] = time.perf_counter() - t
    if args.compile_cache:
        enable_compile_cache(args.compile_cache)
    t = time.perf_counter()
    device = jax.devices()[0]
    phases["backend_s"] = time.perf_counter() - t
    t = time.perf_counter()
    llm = Ouro.load(args.model, args.dtype)
    jax.block_until_ready(llm.params)
    phases["load_s"] = time.perf_counter() - t
    spec = (SpeculativeConfig(args.speculative_k, args.draft_loops)
            if args.speculative_k else None)
    first, toks1 = _request(llm, args, spec)
    again, toks2 = _request(llm, args, spec)
    if toks1 != toks2:  # greedy and the same request: a difference is a bug, not noise
        raise SystemExit("benchmarks.start_time: the repeated request gave other tokens")
    record = save_record("benchmarks.start_time", argv, args.out, what=__doc__.split("\n")[0],
                         model=args.model or "embedded demo model", dtype=args.dtype,
                         speculative_k=args.speculative_k, compile_cache=args.compile_cache,
                         device_kind=device.device_kind, phases=phases,
                         load_phases=llm.load_phases, first=first,
                         again=again, process_s=time.perf_counter() - T0)
    print(json.dumps({k: record[k] for k in ("phases", "first", "again", "process_s")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
