#!/usr/bin/env bash
# Session 10 (issue 6), last call: the two candidates within 1% of the default
# (--decode-kernel block_t=32: 242.4 vs 240.2; --pdl qkv,o,gate_up --pdl-at end: 240.8 vs
# 238.5) and both together, interleaved twice with the default (ABCD ABCD) so that drift
# over the call hits every arm alike. Batch 1, greedy, native, 3 repeats each.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session10_ab.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
for pass in 1 2; do
  timeout 60 $D --out $OUT/ab2_default_p${pass}_session10_h200.json 2>&1 | grep -E "^ *1 |rror"
  timeout 60 $D --decode-kernel block_t=32 --out $OUT/ab2_block_t32_p${pass}_session10_h200.json 2>&1 | grep -E "^ *1 |rror"
  timeout 60 $D --pdl qkv,o,gate_up --pdl-at end --out $OUT/ab2_pdl_end_p${pass}_session10_h200.json 2>&1 | grep -E "^ *1 |rror"
  timeout 60 $D --decode-kernel block_t=32 --pdl qkv,o,gate_up --pdl-at end --out $OUT/ab2_both_p${pass}_session10_h200.json 2>&1 | grep -E "^ *1 |rror"
done
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/ab2_*_session10_h200.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1][4:-20], round(r["decode_tok_s"], 1), r["decode_tok_s_min"],
              r["decode_tok_s_max"], r["tokens_sha"], r["repeats_identical"])
PY
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
