#!/usr/bin/env bash
# Session 39, second call: the GEMM's ragged row block masked instead of clamped (the
# clamped rows loaded a whole block_m x block_k x tile per step for one live row).
#   1. the GEMM's GPU tests (tests/test_gemm.py -m gpu; test_invariant's compiled row-bit
#      test with its control);
#   2. the mode's tilings at 1 and 320 rows, fixed row block, device time: its shipped tiling
#      ('invariant': since session 39 o and down at mm16_n64_k128_w4_s4_x4), the
#      block_m=64 ones with split-K, and session 38's for o and down (mm64_n16_k256_w4_s4);
#   3. the pick (benchmarks.gemv --pick-invariant) end to end: batch 1 native and k=4 d=2,
#      the shipped tiling's batch-1 native row beside it, then the pick's batch 64 native.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=540] bash benchmarks/gpu_session39_masked.sh
S=${SESSION:-session39}
CAP=${CAP:-540}
. benchmarks/gpu_call_setup.sh
timeout -s KILL $(left 80) python3 -m pytest -q -p no:cacheprovider tests/test_gemm.py \
  tests/test_invariant.py -k "on_the_gpu or gemm_fixed" 2>&1 | tail -4
V=mm64_n16_k256_w4_s4,mm64_n16_k128_w4_s4_x4,mm64_n32_k128_w4_s4_x4,mm64_n64_k128_w4_s4_x4
V=$V,mm16_n64_k128_w4_s4_x4,mm32_n32_k128_w4_s4
for shape in qkv gate_up down o; do
  timeout -s KILL $(left 50) python3 -m benchmarks.gemv --variants $V --fixed-rows \
    --shapes $shape --rows 1,320 --device-time --out $OUT/gemm_masked_${shape}_${S}_$G.json \
    2>&1 | grep -E "M= ?[0-9]+ "
done
PICK=$(python3 -m benchmarks.gemv --pick-invariant $(ls $OUT/gemm_masked_*_${S}_$G.json | paste -sd,))
echo "pick: $PICK"
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --compile-cache /tmp/cc"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|identical|bandwidth"; }
timeout -s KILL $(left 90) $D --batch-invariant --invariant-tiling "$PICK" --batch 1 --k 0,4 \
  --out $OUT/decode_masked_pick_b1_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 45) $D --batch-invariant --batch 1 --k 0 \
  --out $OUT/decode_masked_shipped_b1_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 90) $D --batch-invariant --invariant-tiling "$PICK" --batch 64 --k 0 \
  --out $OUT/decode_masked_pick_b64_${S}_$G.json 2>&1 | show
echo "elapsed ${SECONDS}s"
