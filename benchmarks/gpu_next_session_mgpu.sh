#!/usr/bin/env bash
# Prepared in session 11 for the next session (issue 6), one device call of about 3-5 min:
# the Mosaic GPU GEMV prototype (pallas_kernels/gemv_mgpu.py: TMA copies of the weight tiles
# into a 4-deep shared-memory ring, wgmma with x padded to 8 rows). Session 11 found that a
# persistent kernel with a grid barrier cannot pay (2.84 us per barrier against 0.85 us per
# kernel boundary) and that most of the ~18 us per layer application above the bytes is
# inside the kernels: the Triton-lowered GEMVs reach 58-70% of the copy bandwidth. This asks
# whether TMA streaming reaches more. It lowered for 'cuda' on a CPU machine at every tiling
# (the Mosaic GPU MLIR checks), but PTX generation and the wgmma/TMA slot-reuse timing are
# first exercised here.
#   1. its GPU test against the fp32 reference at the 1.4B shapes;
#   2. us per call and TB/s at the four decode projection shapes: jnp.dot, the engine's
#      streaming GEMV (its tiling), and 13 Mosaic tilings (kernel alone, and with the XLA
#      pad/slice/split-K sum around it).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session_mgpu.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -W ignore::DeprecationWarning \
  tests/test_gemv_mgpu.py -k "not normed" > $OUT/gpu_tests_gemv_mgpu.txt 2>&1
tail -15 $OUT/gpu_tests_gemv_mgpu.txt
timeout 400 python3 -W ignore::DeprecationWarning -m pallas_kernels.gemv_mgpu $OUT/gemv_mgpu_h200.json 2>&1 \
  | tee $OUT/gemv_mgpu_h200.txt | grep -v "^ *$" | cut -c1-200
