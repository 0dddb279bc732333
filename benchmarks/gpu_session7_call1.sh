#!/usr/bin/env bash
# Session 7, device call 1 (issue 6): GPU tests of the final (post-clean-up) fused decode
# kernel, then the full greedy table on it: batch 1/8/32/64 x native, speculative d=2 k=2/4.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session7_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pallas_kernels.py -k fused \
  2>&1 | tail -2
timeout 450 python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 \
  --compile-cache /tmp/cc --temperature 0 --batch 1,8,32,64 --k 0,2,4 \
  --out $OUT/decode_session7_greedy_h200.json 2>&1 | grep -E "^ *[0-9]+ (native|spec)"
ls $OUT
