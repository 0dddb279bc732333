#!/usr/bin/env bash
# Session 15 call 1: the script session 14 prepared (gpu_next_session.sh). About 8 minutes.
# (Session 13's version of this script ran in full in sessions 13 and 14.)
#   1. The persistent o -> gate/up kernel (pallas_kernels/gemv_chain.py) with its rolling L2
#      prefetch: session 14 took it from 32.4 to 25.8 us per layer at 128 programs (l2_ahead
#      1), against 21.7 for the engine's two kernels. Grid sizes 128 and 256, 4 and 8 warps,
#      l2_ahead 0-2 (8 warps: other register layouts, so max_abs_diff may be non-zero).
#      Both barrier spins: session 14 added _common.BARRIER["spin"] = "load" (waiting
#      programs re-read the generation with ld.relaxed.gpu, LDG.E.STRONG.GPU in the SASS,
#      instead of atomic adds of 0 on the line the arrivals update; one atomic re-read after); first the barrier
#      alone against a kernel boundary (session 11: 2.84 us against 0.85).
#   2. The default table at today's code, a subset (batch 1, 8, 64; native and k=4 d=2,
#      greedy), to confirm session 11's figures still hold.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session15_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -W ignore::DeprecationWarning \
  tests/test_grid_barrier.py tests/test_gemv_chain.py 2>&1 | tail -2
timeout 90 python3 -W ignore::DeprecationWarning -m benchmarks.grid_barrier --programs 128,132 \
  --barriers 0,64 --spin atomic,load --out $OUT/grid_barrier_spin_h200.json 2>&1 | cut -c1-400
for spin in atomic load; do
  timeout 120 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_chain --programs 128,256 \
    --num-warps 4,8 --l2-ahead 0,1,2 --separate engine --spin $spin \
    --out $OUT/gemv_chain_sweep_${spin}_h200.json 2>&1 \
    | grep -o '"programs": [0-9]*\|fused_us_per_layer[a-z0-9_]*": [0-9.]*\|separate_engine_us_per_layer": [0-9.]*'
done
timeout 200 python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 \
  --compile-cache /tmp/cc --batch 1,8,64 --k 0,4 --temperature 0 \
  --out $OUT/decode_table_check_h200.json 2>&1 | grep -E "^ *[0-9]+ (native|spec)|rror"
