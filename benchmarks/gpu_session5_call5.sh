#!/usr/bin/env bash
# Session 5, device call 5 (issue 6): a one-loop draft (d=1) at batch 1/8/32 (greedy, k=2/4),
# and at batch 64 k=3 greedy and k=2 T=0.8 (call 4: batch 64 d=1 k=2 greedy 10,371.6 tok/s).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session5_call5.sh (<= 7 files)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --draft-loops 1"
timeout 250 $D --batch 1,8,32 --k 2,4 --temperature 0 --out $OUT/decode_session5_d1_b1_b32_h200.json \
  2>&1 | grep -E "spec"
timeout 100 $D --batch 64 --k 3 --temperature 0 --out $OUT/decode_session5_d1_k3_b64_h200.json \
  2>&1 | grep -E "spec"
timeout 100 $D --batch 64 --k 2 --temperature 0.8 --out $OUT/decode_session5_d1_t08_b64_h200.json \
  2>&1 | grep -E "spec"
rm -f $OUT/*.partial*; ls $OUT
