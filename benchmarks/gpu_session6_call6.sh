#!/usr/bin/env bash
# Session 6, device call 6 (issue 6): the final fused decode kernel (padding rows attend to
# nothing new, trash_page passed explicitly): its GPU tests and batch-1 native greedy.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session6_call6.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pallas_kernels.py -k fused \
  2>&1 | tail -2
timeout 60 python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 \
  --compile-cache /tmp/cc --temperature 0 --batch 1 --k 0 \
  --out $OUT/decode_session6_final_b1_h200.json 2>&1 | grep -E "^ *1 native"
