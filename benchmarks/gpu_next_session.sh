#!/usr/bin/env bash
# Prepared for the next session (issue 6). Two device calls:
#   1. OUT=dir bash benchmarks/gpu_session3_table.sh   (~9 min) the whole protocol table with
#      the current code: session 3 ended with only batch 64 rerun after the K/V scatter change.
#   2. OUT=dir bash benchmarks/gpu_next_session.sh     (~9.5 min, this file) the A/B runs below.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
# 1. End-to-end A/B of the short-context decode-kernel variants the microbenchmarks could not
#    settle (docs/performance.md): same protocol, default vs block_t=32,num_warps=2 vs 2 warps.
timeout 100 $D --batch 1,64 --k 0 --temperature 0 --out $OUT/ab_default_h200.json 2>&1 | tail -3
timeout 100 $D --batch 1,64 --k 0 --temperature 0 --decode-kernel block_t=32,num_warps=2 \
  --out $OUT/ab_bt32_w2_h200.json 2>&1 | tail -3
timeout 100 $D --batch 1,64 --k 0 --temperature 0 --decode-kernel num_warps=2 \
  --out $OUT/ab_w2_h200.json 2>&1 | tail -3
# 2. Verification kernel with 2 warps, speculative k=4 at batch 64 (the 0.98x row).
timeout 90 $D --batch 64 --k 4 --temperature 0 --ragged-kernel num_warps=2 \
  --out $OUT/ab_ragged_w2_b64_h200.json 2>&1 | tail -2
# 3. XLA's split-K GEMMs write fp32 partials (~20 MB per layer at batch 64) that the next
#    fusions reduce (docs/performance.md, batch-64 table): the same rows without split-K.
XLA_FLAGS=--xla_gpu_enable_split_k_autotuning=false timeout 100 $D --batch 1,64 --k 0 \
  --temperature 0 --out $OUT/ab_no_splitk_h200.json 2>&1 | tail -3
# 4. Batch-1 kernel trace with Pallas attention (session 2 traced batch 1 with xla attention).
timeout 110 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0,4 --attention pallas \
  --top 30 --out $OUT/kernel_trace_pallas_b1_h200.json 2>&1 | tail -60
