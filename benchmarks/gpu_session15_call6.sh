#!/usr/bin/env bash
# Session 15 call 6 (call 5 was one command on the warm machine): the persistent o -> gate/up
# kernel on the counter barrier at finer blocks and larger grids. At 256 programs it was
# 0.35 us per layer behind the two kernels on its own grid and 1.85 behind the engine's
# (512 and 352 programs): does a 512-program persistent grid close that? (Offline, the
# kernel takes 79 registers at o=2,gate_up=1: 4 programs fit an SM.)
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session15_call6.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
pick='"programs": [0-9]*\|fused_us_per_layer[a-z0-9_]*": [0-9.]*\|separate_[a-z]*_us_per_layer": [0-9.]*\|barrier_state_after[a-z0-9_]*": \[[0-9, -]*\]\|max_abs_diff[a-z0-9_]*": [0-9.e-]*'
timeout 200 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_chain --programs 256,512 \
  --block-n o=2,gate_up=1 --num-warps 4 --l2-ahead 0,1 --separate engine,grid --spin counter \
  --out $OUT/gemv_chain_counter_fine_session15_h200.json 2>&1 | grep -o "$pick"
timeout 150 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_chain --programs 512 \
  --block-n o=1,gate_up=1 --num-warps 4 --l2-ahead 0 --separate engine,grid --spin counter \
  --out $OUT/gemv_chain_counter_fine1_session15_h200.json 2>&1 | grep -o "$pick"
