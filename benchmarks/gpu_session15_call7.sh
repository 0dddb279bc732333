#!/usr/bin/env bash
# Session 15 call 7: where a streaming GEMV's per-call time goes, from the GPU's timer inside
# the kernels (benchmarks.gemv_timeline): per kernel of a 24-layer chain of the four plain
# projections, the gap after the previous kernel, the ramp (late-starting programs), the
# median program's duration and the tail; programs per SM.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session15_call7.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 200 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_timeline --layers 24 --reps 5 \
  --out $OUT/gemv_timeline_session15_h200.json 2>&1 | cut -c1-600
