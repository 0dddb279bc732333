#!/usr/bin/env bash
# Session 11 (issue 6), first call (prepared at the end of session 10 as gpu_next_session.sh; at most ~9 min: the time-outs add up to 520 s).
#   1. The grid barrier (pallas_kernels._common.grid_barrier) on the GPU: its ordering test
#      (one program per SM and 8 programs, 16 phases, neighbour reads), then what one
#      barrier costs against one kernel boundary (benchmarks.grid_barrier). A persistent
#      per-layer kernel, the one lever left for batch-1 native decode, pays only if a barrier
#      is much cheaper than a boundary (~1.9 us of fixed cost per projection kernel now).
#      Then the first such kernel (pallas_kernels/gemv_chain.py: o -> gate/up, 128
#      persistent programs): its GPU test against the two kernels, and us per layer against
#      them (benchmarks.gemv_chain).
#   2. The new decode block default (32-key blocks up to 8 rows, session 10's interleaved
#      A/B ran it as an override only): batch 1 and 8, native and k=4 d=2, greedy.
#   3. A prefill-only trace (--new-tokens 1: batch-1 prefill reads ~10 ms against ~3 ms of
#      weight reads and math) and a trace of batch-1 speculative rounds (verification takes
#      3.61 ms for two loops over 5 tokens).
# A .partial file is deleted only when its finished JSON exists; at most 8 files come back.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session11_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
# A barrier that never passes gives up after ~4 s per barrier (SPIN_LIMIT) and counts it in
# its state, so these fail rather than hang; the benchmarks run only if the tests passed.
timeout -k 10 60 python3 -m pytest -q -x -m gpu -p no:cacheprovider -rfE --tb=short -s \
  tests/test_grid_barrier.py tests/test_gemv_chain.py > $OUT/gpu_tests_barrier_chain.txt 2>&1 \
  && timeout 60 python3 -m benchmarks.grid_barrier --programs 132,264 --barriers 0,64 \
    --out $OUT/grid_barrier_h200.json 2>&1 | tail -3 \
  && timeout 90 python3 -m benchmarks.gemv_chain --layers 8 --programs 128,256 \
    --out $OUT/gemv_chain_h200.json 2>&1 | tail -3
tail -5 $OUT/gpu_tests_barrier_chain.txt
timeout 170 python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 \
  --compile-cache /tmp/cc --batch 1,8 --k 0,4 --temperature 0 \
  --out $OUT/decode_b1_b8_block_default_h200.json 2>&1 | grep -E "^ *(1|8) |rror|identical"
timeout 60 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --new-tokens 1 \
  --attention pallas --top 15 --out $OUT/kernel_trace_prefill_b1_h200.json 2>&1 | cut -c1-200 | head -40
timeout 80 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 4 \
  --attention pallas --top 20 --out $OUT/kernel_trace_spec_b1_h200.json 2>&1 | cut -c1-200 | head -40
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
