#!/usr/bin/env bash
# Session 14 (issue 6), fifth call. Calls 1-4 found no per-call gain inside the kernels (L2
# prefetch, the prologue's read order); the cost model says the gap is per call (2.1-4.1 us
# per GEMV). Session 1 measured XLA command buffers with while-loop capture (CUDA graphs of
# the decode loop's body) at 157 tok/s and 18 kernels per layer, with no gain; the engine now
# runs 7 kernels per layer application at 241 tok/s. Batch-1 native greedy, default against
# XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL,
# two passes; then batch 8 once each.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session14_call5.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
A=$OUT/arms; mkdir -p $A
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL"
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --k 0 --temperature 0"
run() { timeout 55 env XLA_FLAGS="$2" $D --compile-cache /tmp/cc_$1 --batch $3 --out $A/$1_b$3_p$pass.json 2>&1 | grep -E "rror" ; }
pass=1; run default "" 1; run cmdbuf "$CB" 1
pass=2; run cmdbuf "$CB" 1; run default "" 1
pass=1; run default "" 8; run cmdbuf "$CB" 8
python3 -m benchmarks.ab_arms $A $OUT/ab_cmdbuf_session14_h200.json --flags
rm -rf $A
