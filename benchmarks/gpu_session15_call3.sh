#!/usr/bin/env bash
# Session 15 call 3: the "counter" grid barrier (_common.BARRIER["spin"] = "counter": one
# arrival atomic per program, acquire loads until the never-reset arrivals word reaches the
# program's target; no generation read, no reset by the last arrival).
#   1. GPU tests: every barrier mode's ordering test; the persistent o -> gate/up kernel on
#      the counter barrier against the two kernels, bit for bit.
#   2. benchmarks.grid_barrier: atomic vs counter against a kernel boundary.
#   3. benchmarks.gemv_chain on the counter barrier (128 and 256 programs, l2_ahead 0 and 1).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session15_call3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -W ignore::DeprecationWarning \
  tests/test_grid_barrier.py tests/test_gemv_chain.py 2>&1 | tail -4 | tee $OUT/gpu_tests_counter_barrier_session15.txt
timeout 90 python3 -W ignore::DeprecationWarning -m benchmarks.grid_barrier --programs 128,132 \
  --barriers 0,64 --spin atomic,counter --out $OUT/grid_barrier_counter_session15_h200.json 2>&1 | cut -c1-400
timeout 150 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_chain --programs 128,256 \
  --num-warps 4 --l2-ahead 0,1 --separate engine --spin counter \
  --out $OUT/gemv_chain_counter_session15_h200.json 2>&1 \
  | grep -o '"programs": [0-9]*\|fused_us_per_layer[a-z0-9_]*": [0-9.]*\|separate_engine_us_per_layer": [0-9.]*\|barrier_state[a-z0-9_]*": \[[0-9, ]*\]'
