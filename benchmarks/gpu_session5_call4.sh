#!/usr/bin/env bash
# Session 5, device call 4 (issue 6): other speculative shapes at batch 64 (greedy), to see
# whether any exact configuration reaches 10,000 tok/s: k=1 and k=3 with d=2, and d=1 with k=2
# and k=4 (k=2/4 with d=2 are in the table).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session5_call4.sh (<= 7 files)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 150 $D --batch 64 --k 1,3 --temperature 0 --out $OUT/decode_session5_k1_k3_b64_h200.json \
  2>&1 | grep -E "spec"
timeout 150 $D --batch 64 --k 2,4 --draft-loops 1 --temperature 0 \
  --out $OUT/decode_session5_d1_b64_h200.json 2>&1 | grep -E "spec"
rm -f $OUT/*.partial*; ls $OUT
