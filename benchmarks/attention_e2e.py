"""End to end, xla vs pallas attention: greedy token match and decode tok/s (issue 5).

    python -m benchmarks.attention_e2e --synthetic 1.4b --batch 64 --prompt-len 2048 \
        --new-tokens 32 --out attention_e2e.json

Both engines share one set of weights and the same prompts; each runs a warm-up call, then a
timed one. Token match is reported per position up to each sequence's first divergence (bf16
kernels round differently from the gather path, so near-tied argmaxes can flip).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax.numpy as jnp
import numpy as np


PAGE = 16  # KV page size (tokens)


def main(argv=None) -> int:
    from benchmarks.decode import save_record, token_match
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.kv_cache import pages_needed
    from ouro_jax.params import random_params
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    ap = argparse.ArgumentParser(prog="python -m benchmarks.attention_e2e", description=__doc__)
    ap.add_argument("--synthetic", default="1.4b")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--speculative-k", type=int, default=0)
    ap.add_argument("--branch-scale", type=float, default=0.003)
    ap.add_argument("--prefill-chunk", type=int, default=64,
                    help="prompt tokens per row per prefill step: the xla path's scores for "
                         "64 rows x 256 tokens x 2k keys need 2.2 GB per buffer beside a "
                         "105 GB KV pool (out of memory on the H200)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    cfg = PRESETS[args.synthetic]
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    params = random_params(cfg, 0, dtype, args.branch_scale, 0.0)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, cfg.vocab_size, args.prompt_len)]
               for _ in range(args.batch)]
    sp = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    spec = SpeculativeConfig(args.speculative_k, 2) if args.speculative_k else None
    rows, outs = [], {}
    for attention in ("xla", "pallas"):
        # An exact pool: at 64 x 2k the default bucket could round 107 GB of K/V up by 25%.
        tokens = args.prompt_len + args.new_tokens + args.speculative_k + 1
        per_seq = pages_needed(tokens, PAGE) * PAGE
        llm = Ouro(cfg, params, None, attention=attention, decode_chunk=args.new_tokens,
                   prefill_chunk=args.prefill_chunk, page_size=PAGE,
                   kv_pool_tokens=args.batch * per_seq)
        llm.generate(prompts, sp, speculative=spec)  # warm-up (compiles)
        res = llm.generate(prompts, sp, speculative=spec)
        outs[attention] = [o.token_ids for o in res.outputs]
        rows.append(dict(attention=attention, decode_tok_s=res.stats.decode_tok_s,
                         prefill_s=res.stats.prefill_s, decode_s=res.stats.decode_s,
                         compile_s=llm.programs.compile_seconds))
        print(json.dumps(rows[-1]), flush=True)
        del llm
    match = token_match(outs["xla"], outs["pallas"])
    print(json.dumps(match))
    save_record("benchmarks.attention_e2e", argv, args.out, rows=rows, token_match=match,
                batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
