#!/usr/bin/env bash
# Session 15 call 4: after review. The counter barrier now arrives with weights (program 0
# adds COUNTER_STEP - P + 1, the others 1) and takes its target from its own arrival (no read
# at the kernel's start; exact across the int32 wrap and for any grid size); the PDL chain
# test draws a new input per repetition and runs the PDL chain first.
#   1. GPU tests: barrier ordering for every mode (counter also from 3 barriers short of the
#      int32 wrap), the chain on the counter barrier, the Mosaic PDL chain.
#   2. benchmarks.grid_barrier atomic vs counter; benchmarks.gemv_chain on the counter barrier.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session15_call4.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -W ignore::DeprecationWarning \
  tests/test_grid_barrier.py tests/test_gemv_chain.py tests/test_gemv_mgpu_areg.py -k "barrier or chain or pdl" \
  2>&1 | tail -4 | tee $OUT/gpu_tests_counter_barrier_b_session15.txt
timeout 90 python3 -W ignore::DeprecationWarning -m benchmarks.grid_barrier --programs 128,132 \
  --barriers 0,64 --spin atomic,counter --out $OUT/grid_barrier_counter_b_session15_h200.json 2>&1 | cut -c1-400
timeout 150 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_chain --programs 128,256 \
  --num-warps 4 --l2-ahead 0,1 --separate engine --spin counter \
  --out $OUT/gemv_chain_counter_b_session15_h200.json 2>&1 \
  | grep -o '"programs": [0-9]*\|fused_us_per_layer[a-z0-9_]*": [0-9.]*\|separate_engine_us_per_layer": [0-9.]*\|barrier_state[a-z0-9_]*": \[[0-9, -]*\]'
