#!/usr/bin/env bash
# Session 5, device call 1 (issue 6): the skinny Pallas GEMM for batched decode.
#   1. GPU tests: attention kernels, GEMV, and the new GEMM.
#   2. GEMM tilings vs XLA on the four 1.4B projection shapes at 64 and 8 rows.
#   3. End-to-end A/B at batch 8/32/64 native greedy: projections 'gemv' (the default) vs
#      'gemv+gemm' (first-guess tilings).
#   4. Batch-1 kernel trace with the GEMV projections (the profile after session 4).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session5_call1.sh (<= 7 files)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pallas_kernels.py \
  tests/test_gemv.py tests/test_gemm.py > $OUT/gpu_tests_session5_h200.log 2>&1
tail -4 $OUT/gpu_tests_session5_h200.log
timeout 240 python3 -m benchmarks.gemv --rows 64,8 --variants gemm \
  --out $OUT/gemm_session5_h200.json 2>&1 | grep -v "^{" > $OUT/gemm_session5_h200.log
cat $OUT/gemm_session5_h200.log
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
for P in gemv gemv+gemm; do
  timeout 150 $D --batch 8,32,64 --k 0 --temperature 0 --projections $P \
    --out $OUT/ab_proj_${P/+/_}_b8_64_h200.json 2>&1 | grep -E "native"
done
timeout 80 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 20 --out $OUT/kernel_trace_gemv_b1_h200.json 2>&1 | grep -v Memcpy | tail -40
rm -f $OUT/*.partial*; ls $OUT
