#!/usr/bin/env bash
# Session 9, device call 2 (~9.5 min of commands), on the new qkv and gate/up streaming tilings
# (projections.STREAM_TUNING: qkv st4_k512_p4_w4, gate/up st2_k512_p8_w4, picked in call 1):
#   1. The GPU test of the decode kernel that merges its own splits (call 1's test run was cut
#      off by its time-out before this test finished).
#   2. Gate/up alone back on the session-8 tiling (st1_k512_p4_w4): is the gain qkv's alone?
#   3. The batch-1 table with the new default: native and k=2,4 (d=2), greedy and T=0.8.
#   4. Batch-1 one-loop drafts (d=1), k=2,4, greedy.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 100 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_pallas_kernels.py \
  -k "merges_splits_itself_gpu" 2>&1 | tail -4
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1"
timeout 50 $D --k 0 --temperature 0 --stream-tiling gate_up=st1_k512_p4_w4 \
  --out $OUT/ab_b1_gate_up_s8_tiling_session9_h200.json 2>&1 | grep -E "^ *1 native|rror"
timeout 250 $D --k 0,2,4 --temperature 0,0.8 --out $OUT/decode_session9_b1_h200.json 2>&1 \
  | grep -E "^ *1 (native|spec)|rror|match"
timeout 160 $D --k 2,4 --draft-loops 1 --temperature 0 --out $OUT/decode_session9_d1_b1_h200.json \
  2>&1 | grep -E "^ *1 (native|spec)|rror|match"
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
