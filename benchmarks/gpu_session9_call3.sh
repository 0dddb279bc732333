#!/usr/bin/env bash
# Session 9, device call 3 (~3.5 min of commands; the session's device time left allows no more), on the session-9 default tilings:
#   1. The GPU test of the decode kernel that merges its own splits, fixed: it had compiled the
#      test caches in as constants (closed over by the jitted lambdas), and both earlier runs
#      were cut off by their time-outs before it finished.
#   2. One speculative round (k=4, d=2) split into parts, batch 1.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 100 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_pallas_kernels.py \
  -k "merges_splits_itself_gpu" 2>&1 | tail -4
timeout 100 python3 -m benchmarks.profile_round --attention pallas --batch 1 --iters 10 \
  --out $OUT/profile_round_session9_b1_h200.json 2>&1 | grep -vi warning | tail -12
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
