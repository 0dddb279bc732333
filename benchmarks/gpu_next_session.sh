#!/usr/bin/env bash
# What session 2 could not run (device time), about 9 minutes on one H200.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
# 1. The rows of the protocol table not yet measured with the Pallas default (issue 6).
timeout 200 $D --batch 1,64 --k 2 --temperature 0 --out $OUT/decode_pallas_k2_h200.json 2>&1 | tail -4
timeout 150 $D --batch 8,32 --k 0,4 --temperature 0.8 --out $OUT/decode_pallas_t08_b8_b32_h200.json \
  2>&1 | tail -6
# 2. Where a batch-64 speculative round spends its time (issue 6).
timeout 120 python3 -m benchmarks.profile_round --attention pallas --batch 64 --iters 5 \
  --out $OUT/profile_round_pallas_h200_b64.json 2>&1 | tail -3
# 3. cuBLAS GEMMs at batch 64 speculative (the run in session 2 timed out there).
XLA_FLAGS=--xla_gpu_enable_triton_gemm=false timeout 90 $D --batch 64 --k 4 --temperature 0 \
  --out $OUT/decode_pallas_cublas_b64_spec_h200.json 2>&1 | tail -2
