#!/usr/bin/env bash
# Session 4, device call 3 (issue 6): the protocol table with this commit's defaults (Pallas GEMV
# projections for calls of <= 5 rows, decode attention splits down to one key block), and the
# engine's GEMV tilings at 1 and 5 rows against XLA. ~8.5 minutes.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session4_call3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 60 python3 -m benchmarks.gemv --rows 1,5 --variants none \
  --out $OUT/gemv_engine_session4_h200.json 2>&1 | grep -v "^{"
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 300 $D --batch 1,8,32,64 --k 0,4 --temperature 0 --out $OUT/decode_session4_greedy_h200.json 2>&1 | grep -v "^{" | tail -12
timeout 150 $D --batch 1,8,32 --k 0,4 --temperature 0.8 --out $OUT/decode_session4_t08_h200.json 2>&1 | grep -v "^{" | tail -8
rm -f $OUT/*.partial; ls $OUT
