#!/usr/bin/env bash
# Session 8, device call 3 (~6 min): profiles of the current default at batch 1, and d=1.
#   1. Kernel trace of a native step and a speculative round (k=4, d=2) at batch 1.
#   2. One speculative round split into parts (profile_round), batch 1.
#   3. Batch-1 one-loop draft (d=1) k=2,4 greedy with the current default.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
# (The first run of this script passed --branch-scale to the two profilers, which do not take it;
# its decode part ran. The rerun skips the decode part: `false &&`.)
OUT=${OUT:-benchmarks/results}
timeout 170 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0,4 --attention pallas \
  --top 14 --out $OUT/kernel_trace_session8_b1_h200.json 2>&1 | grep -vi warning \
  | cut -c1-160 | grep -v "^  *top_kinds" | head -40
timeout 120 python3 -m benchmarks.profile_round --attention pallas --batch 1 --iters 10 \
  --out $OUT/profile_round_session8_b1_h200.json 2>&1 | grep -vi warning | tail -12
false && timeout 150 python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 \
  --compile-cache /tmp/cc --batch 1 --k 2,4 --draft-loops 1 --temperature 0 \
  --out $OUT/decode_session8_d1_b1_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
