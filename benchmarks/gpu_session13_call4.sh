#!/usr/bin/env bash
# Session 13 (issue 6), fourth call. Call 3: the add_norm fix holds on the GPU (x' and, at one
# split, y bit-identical to XLA); in batch-1 decode 'gemv+norms+stream+mgpu:down' ran 220.0
# and 219.8 tok/s against 239.8 and 241.1 for 'auto', and every projection on the Mosaic
# kernel 177.7 (same tokens as 'auto'). The engine trace put the streaming down GEMV at 7.7
# us and the Mosaic one at 9.9 us + 1.1 us of split-K sum, where the microbenchmark's wall
# clock had said 18-20 us against 17: the wall clock is host-bound. So:
#   1. the four-projection sweep again with device times from a profiler trace;
#   2. a kernel trace of batch-1 decode with every projection on the Mosaic kernel (each
#      projection's time in the engine).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session13_call4.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 330 python3 -W ignore::DeprecationWarning -m pallas_kernels.gemv_mgpu_normed \
  $OUT/gemv_mgpu_device_session13_h200.json qkv o gate_up down --device-time 2>&1 \
  | grep -E "^[a-z_]+:|device" | cut -c1-150
timeout 80 python3 -W ignore::DeprecationWarning -m benchmarks.kernel_trace --attention pallas \
  --projections gemv+norms+mgpu --batch 1 --k 0 --top 12 \
  --out $OUT/kernel_trace_b1_mgpu_all_session13_h200.json 2>&1 | grep -vE "^\s*$" | cut -c1-170 | head -16
