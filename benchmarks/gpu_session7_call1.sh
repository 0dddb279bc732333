#!/usr/bin/env bash
# Session 7, device call 1 (issue 6): GPU tests of the final (post-clean-up) fused decode
# kernel and of the new streaming GEMV, then the one-row GEMV microbenchmark of the streaming
# tilings against XLA and the engine's GEMV.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session7_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pallas_kernels.py -k fused \
  2>&1 | tail -2
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv_stream.py \
  > $OUT/gpu_tests_gemv_stream_session7_h200.log 2>&1; tail -3 $OUT/gpu_tests_gemv_stream_session7_h200.log
timeout 300 python3 -m benchmarks.gemv --rows 1 --variants stream \
  --out $OUT/gemv_stream_session7_h200.json 2>&1 | grep -v Warning
ls $OUT
