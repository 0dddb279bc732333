#!/usr/bin/env bash
# Session 11 (issue 6), third call, on the decode block default set back to 64 keys above one
# row (SMALL_BATCH_ROWS=1): today's figures for the table's older cells.
#   1. batch 1: native and k=2/4 d=2 at T=0 and 0.8 (the table's batch-1 row is session 9's);
#   2. batch 1, d=1 k=4 (session 9's 359.3);
#   3. batch 8 and 32, native and k=4 d=2 at T=0.8 (the table has session 4's figures).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session11_call3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 230 $D --batch 1 --k 0,2,4 --temperature 0,0.8 --out $OUT/decode_b1_session11_h200.json 2>&1 | grep -E "^ *1 |rror"
timeout 70 $D --batch 1 --k 4 --draft-loops 1 --temperature 0 --out $OUT/decode_b1_d1_k4_session11_h200.json 2>&1 | grep -E "^ *1 |rror"
timeout 200 $D --batch 8,32 --k 0,4 --temperature 0.8 --out $OUT/decode_b8_b32_t08_session11_h200.json 2>&1 | grep -E "^ *(8|32) |rror"
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
