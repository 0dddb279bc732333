"""Collect the arms of an interleaved A/B run (one benchmarks.decode JSON per arm and pass) into
one file, and print a line per arm and row: arm, decode tok/s (median, min, max), greedy token
digest, compile seconds.

    python -m benchmarks.ab_arms ARMS_DIR OUT.json [--flags]

The GPU call scripts (benchmarks/gpu_session*_call*.sh) write each arm to ARMS_DIR/NAME.json;
OUT.json maps NAME to that record. --flags adds each record's XLA_FLAGS (first 20 characters)
after the arm's name.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys


def collect(arms_dir: str) -> dict:
    files = sorted(glob.glob(os.path.join(arms_dir, "*.json")))
    if not files:
        raise SystemExit(f"benchmarks.ab_arms: no *.json arms in {arms_dir}")
    return {os.path.basename(f)[:-5]: json.load(open(f)) for f in files}


def lines(arms: dict, flags: bool = False) -> list[str]:
    out = []
    for arm, rec in arms.items():
        for r in rec["rows"]:
            head = [arm] + ([rec.get("xla_flags", "")[:20]] if flags else [])
            out.append(" ".join(str(v) for v in head + [
                round(r["decode_tok_s"], 1), round(r["decode_tok_s_min"], 1),
                round(r["decode_tok_s_max"], 1), r["tokens_sha"], round(r["compile_s"], 1)]))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab_arms", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("arms_dir")
    ap.add_argument("out")
    ap.add_argument("--flags", action="store_true")
    args = ap.parse_args(argv)
    arms = collect(args.arms_dir)
    print("\n".join(lines(arms, args.flags)))
    with open(args.out, "w") as f:
        json.dump(arms, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
