#!/usr/bin/env bash
# Prepared at the end of session 4 for the next session (issue 6), one device call, ~8 minutes.
# Writes at most 7 files (the device returns 8 per call; .partial files are removed).
#   1. GPU kernel tests, including the new GEMV test (not run since session 2 / never).
#   2. The split-rule question: batch-8 native with one decode split vs the default (3),
#      to pair with session 4's speculative A/B (1,643.5 one split vs 1,561.5 default).
#   3. T=0.8 at batch 64 with the current code (session-2 figures in the table).
#   4. Batch-1 kernel trace with the GEMV projections (the profile after session 4's changes).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pallas_kernels.py \
  tests/test_gemv.py > $OUT/pallas_gpu_tests_next.log 2>&1; tail -3 $OUT/pallas_gpu_tests_next.log
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 60 $D --batch 8 --k 0 --temperature 0 --decode-kernel num_splits=1 \
  --out $OUT/ab_splits1_b8_native_h200.json 2>&1 | grep -E "^ *8 native"
timeout 60 $D --batch 8 --k 0 --temperature 0 --out $OUT/ab_default_b8_native_h200.json 2>&1 | grep -E "^ *8 native"
timeout 110 $D --batch 64 --k 0,4 --temperature 0.8 --out $OUT/decode_t08_b64_h200.json 2>&1 | grep -v "^{" | tail -3
timeout 80 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 16 --out $OUT/kernel_trace_gemv_b1_h200.json 2>&1 | grep -v Memcpy | tail -36
rm -f $OUT/*.partial; ls $OUT
