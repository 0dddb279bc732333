"""KV-plane-sized copies in the compiled programs: where buffer donation does not hold.

    python -m benchmarks.hlo_copies [--model DIR] [--dtype bf16] [--pool-tokens N]

Runs one native and one speculative generate (k=2, d=2) on the model (the embedded demo model
by default), then lists, for every program the engine compiled, the `copy` instructions in
its optimized HLO that produce a KV plane's shape (`copy`, or an async `copy-start` whose
result tuple holds one). With the planes donated there should be none: a copy of a plane
costs a read and a write of the pool every time the program runs (a 0.1 GB plane at batch
1 on the 1.4B shape, 6.5 GB at batch 64 x 2k tokens). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import sys


def plane_copies(llm) -> list[dict]:
    shape = ",".join(str(s) for s in llm._planes[0].shape)
    # "%c = bf16[E,P,S,H,D]{...} copy(", or "%c = (bf16[E,P,S,H,D]{...}, ...) copy-start("
    pat = re.compile(r"= \(?[^=]*\[" + re.escape(shape) + r"\][^=]* copy(?:-start)?\(")
    rows = []
    for key, prog in llm.programs._programs.items():
        lines = [ln.strip()[:200] for ln in prog.as_text().splitlines() if pat.search(ln)]
        rows.append({"program": key[0].__name__, "donate": list(key[2]),
                     "plane_copies": len(lines), "first": lines[:3]})
    return rows


def main(argv=None) -> int:
    from ouro_jax.api import Ouro, SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    ap = argparse.ArgumentParser(prog="python -m benchmarks.hlo_copies", description=__doc__)
    ap.add_argument("--model", default="ouro_jax/demo_model")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--pool-tokens", type=int, default=None)
    args = ap.parse_args(argv)
    llm = Ouro.load(args.model, dtype=args.dtype, kv_pool_tokens=args.pool_tokens)
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = [[1, 2, 3, 4, 5, 6, 7] * 10]
    llm.generate(prompt, sp)
    llm.generate(prompt, sp, speculative=SpeculativeConfig(k=2, draft_loops=2))
    rows = plane_copies(llm)
    print(json.dumps({"device": str(llm._planes[0].devices()), "backend": llm.backend,
                      "plane_shape": list(llm._planes[0].shape), "programs": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
