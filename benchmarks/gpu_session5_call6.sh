#!/usr/bin/env bash
# Session 5, device call 6 (issue 6): the one-loop draft (d=1) with sampling (T=0.8, k=4) at
# batch 1 and 8, and longer drafts at batch 1 (k=3, 6; greedy).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session5_call6.sh (<= 7 files)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --draft-loops 1"
timeout 130 $D --batch 1,8 --k 4 --temperature 0.8 --out $OUT/decode_session5_d1_t08_b1_b8_h200.json \
  2>&1 | grep -E "spec"
timeout 130 $D --batch 1 --k 3,6 --temperature 0 --out $OUT/decode_session5_d1_k3_k6_b1_h200.json \
  2>&1 | grep -E "spec"
rm -f $OUT/*.partial*; ls $OUT
