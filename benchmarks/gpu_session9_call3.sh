#!/usr/bin/env bash
# Session 9, device call 3 (~5 min of commands), on the session-9 default tilings:
#   1. The GPU test of the decode kernel that merges its own splits, fixed: it had compiled the
#      test caches in as constants (closed over by the jitted lambdas), and both earlier runs
#      were cut off by their time-outs before it finished.
#   2. One speculative round (k=4, d=2) split into parts, batch 1.
#   3. Kernel trace of a batch-1 native step.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 120 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_pallas_kernels.py \
  -k "merges_splits_itself_gpu" 2>&1 | tail -4
timeout 110 python3 -m benchmarks.profile_round --attention pallas --batch 1 --iters 10 \
  --out $OUT/profile_round_session9_b1_h200.json 2>&1 | grep -vi warning | tail -12
timeout 80 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 10 --out $OUT/kernel_trace_b1_default_session9_h200.json 2>&1 | grep -vi warning \
  | cut -c1-160 | grep -v "^  *top_kinds" | head -24
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
