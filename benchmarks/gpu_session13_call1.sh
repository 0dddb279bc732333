#!/usr/bin/env bash
# Session 13 (issue 6), first call: the Mosaic GPU GEMV (pallas_kernels/gemv_mgpu_normed.py)
# on a GPU for the first time, at the four one-row projections the engine's '+mgpu' part
# sends to it (qkv and gate/up with the add_norm prologue, o and down plain):
#   1. us per call against XLA and the engine's streaming GEMV (STREAM_TUNING), 34 Mosaic
#      tilings, with the bf16 elements that differ from XLA;
#   2. its GPU tests (plain prototype, normed, plain mode), printing the mismatch counts.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session13_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv,noheader
timeout 330 python3 -W ignore::DeprecationWarning -m pallas_kernels.gemv_mgpu_normed \
  $OUT/gemv_mgpu_session13_h200.json 2>&1 | tee $OUT/gemv_mgpu_session13_h200.txt | cut -c1-220
timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=line -s -W ignore::DeprecationWarning \
  tests/test_gemv_mgpu.py > $OUT/gpu_tests_gemv_mgpu_session13.txt 2>&1
grep -E "differ|passed|failed|rror" $OUT/gpu_tests_gemv_mgpu_session13.txt | cut -c1-200 | tail -70
