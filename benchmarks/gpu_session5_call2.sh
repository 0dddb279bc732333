#!/usr/bin/env bash
# Session 5, device call 2 (issue 6): the table cells still missing, with the current defaults
# (projections 'gemv': one-row calls only, so batch >= 8 runs as in session 4).
#   1. Batch-8 native with one decode split vs the default (the split-rule question).
#   2. Speculative k=2 greedy at batch 8 and 32.
#   3. T=0.8 at batch 64 (native, k=4) and k=2 with T=0.8 at batch 8 and 64.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session5_call2.sh (<= 7 files)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 60 $D --batch 8 --k 0 --temperature 0 --decode-kernel num_splits=1 \
  --out $OUT/ab_splits1_b8_native_session5_h200.json 2>&1 | grep -E "^ *8 native"
timeout 60 $D --batch 8 --k 0 --temperature 0 --out $OUT/ab_default_b8_native_session5_h200.json \
  2>&1 | grep -E "^ *8 native"
timeout 130 $D --batch 8,32 --k 2 --temperature 0 --out $OUT/decode_session5_k2_b8_b32_h200.json \
  2>&1 | grep -E "spec"
timeout 150 $D --batch 64 --k 0,4 --temperature 0.8 --out $OUT/decode_session5_t08_b64_h200.json \
  2>&1 | grep -E "native|spec"
timeout 130 $D --batch 8,64 --k 2 --temperature 0.8 --out $OUT/decode_session5_k2_t08_h200.json \
  2>&1 | grep -E "spec"
rm -f $OUT/*.partial*; ls $OUT
