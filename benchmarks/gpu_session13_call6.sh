#!/usr/bin/env bash
# Session 13 (issue 6), sixth call, on the last ~4 device minutes: the first GPU run of
# pallas_kernels/gemv_mgpu_areg.py (x as wgmma's register A operand, W as the B operand, so
# block_n can be 8-32 and the grid fills the SMs without split-K). Device time per call at
# the four projections (plain GEMVs) against XLA and the streaming GEMV, then its GPU tests.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session13_call6.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 120 python3 -W ignore::DeprecationWarning -m pallas_kernels.gemv_mgpu_areg \
  $OUT/gemv_mgpu_areg_session13_h200.json 2>&1 | tee $OUT/gemv_mgpu_areg_session13_h200.txt | cut -c1-150
timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=line -s -W ignore::DeprecationWarning \
  tests/test_gemv_mgpu_areg.py 2>&1 | grep -E "differ|passed|failed|rror" | cut -c1-150 | tail -25
