#!/usr/bin/env bash
# Session 3, the protocol table with the code of this commit (issue 6), about 9 minutes.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session3_table.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 290 $D --batch 1,8,32,64 --k 0,4 --temperature 0 --out $OUT/decode_session3_greedy_h200.json 2>&1 | grep -v "^{" | tail -12
timeout 105 $D --batch 1,64 --k 2 --temperature 0 --out $OUT/decode_session3_k2_h200.json 2>&1 | grep -v "^{" | tail -4
timeout 130 $D --batch 8,32 --k 0,4 --temperature 0.8 --out $OUT/decode_session3_t08_h200.json 2>&1 | grep -v "^{" | tail -6
ls $OUT
