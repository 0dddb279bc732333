#!/usr/bin/env bash
# Prepared in session 11 for the next session (issue 6), one device call of about 5-7 min,
# best run after gpu_next_session_mgpu.sh shows the plain Mosaic GPU GEMV compiles and
# streams well: pallas_kernels/gemv_mgpu_normed.py, the same kernel with the engine's fused
# RMSNorm / residual-add prologue and gated-SiLU epilogue (the qkv and gate/up projections as
# the engine runs them). Interpret mode on the CPU is bit-identical to the engine's XLA path
# and every tested tiling lowers for 'cuda'; on the GPU this is the first run of its custom
# register layout's store into the swizzled wgmma operand.
#   1. its GPU tests (qkv and gate/up shapes, norm / add_norm, overlap off and on), which
#      print how many output elements differ from XLA;
#   2. us per call at those shapes: XLA, the engine's gemv_stream_normed (its tiling) and the
#      Mosaic tilings, overlap off and on.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session_mgpu_normed.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 250 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -s -W ignore::DeprecationWarning \
  tests/test_gemv_mgpu.py -k normed > $OUT/gpu_tests_gemv_mgpu_normed.txt 2>&1
tail -40 $OUT/gpu_tests_gemv_mgpu_normed.txt | cut -c1-200
timeout 330 python3 -W ignore::DeprecationWarning -m pallas_kernels.gemv_mgpu_normed \
  $OUT/gemv_mgpu_normed_h200.json 2>&1 | tee $OUT/gemv_mgpu_normed_h200.txt | cut -c1-200
