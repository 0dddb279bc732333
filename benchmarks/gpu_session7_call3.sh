#!/usr/bin/env bash
# Session 7, device call 3 (issue 6): the new GPU default projections ('auto' =
# 'gemv+norms+stream') at batch 1: native and speculative d=2 k=2/4, greedy and T=0.8; then
# T=0.8 at batch 64, native and k=4.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session7_call3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 200 $D --batch 1 --k 0,2,4 --temperature 0,0.8 \
  --out $OUT/decode_session7_default_b1_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
timeout 110 $D --batch 64 --k 0,4 --temperature 0.8 \
  --out $OUT/decode_session7_t08_b64_h200.json 2>&1 | grep -E "^ *64 (native|spec)"
rm -f $OUT/*.partial; ls $OUT
