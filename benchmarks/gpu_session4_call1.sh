#!/usr/bin/env bash
# Session 4, device call 1 (issue 6): Pallas GEMV vs XLA on the decode projection shapes, the
# batch-1 kernel trace with Pallas attention, and split-K off at batch 1/64. ~8 minutes.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session4_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 200 python3 -m benchmarks.gemv --rows 1,8 --out $OUT/gemv_session4_h200.json 2>&1 | grep -v "^{"
timeout 110 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 25 --out $OUT/kernel_trace_pallas_b1_h200.json 2>&1 | tail -28
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
XLA_FLAGS=--xla_gpu_enable_split_k_autotuning=false timeout 120 $D --batch 1,64 --k 0 \
  --temperature 0 --out $OUT/ab_no_splitk_h200.json 2>&1 | tail -3
ls $OUT
