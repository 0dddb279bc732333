#!/usr/bin/env bash
# Prepared in session 38, extended in 39 (split-K): the batch-invariant mode's GEMM tilings
# (ouro_jax.invariant; 2.9x slower than the default at batch 1 on an H100, 0.81x at 64).
#   1. each 1.4B projection through the mode's own tiling ('invariant'), XLA, and eight
#      few-row tilings with more programs (smaller tiles, split-K summed in a fixed order),
#      row block fixed, at 1 row (batch-1 decode and draft) and 320 (batch-64 k=4
#      verification), device time;
#   2. the pick per weight (benchmarks.gemv --pick-invariant: best summed relative time
#      over both row counts; the head takes qkv's);
#   3. benchmarks.decode --batch-invariant with the pick (--invariant-tiling) at batch 1 and
#      64, native and k=4 d=2 (greedy_token_match: identical sequences), then the shipped
#      tiling's native rows as this card's baseline.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=540] bash benchmarks/gpu_session39_invariant_sweep.sh
S=${SESSION:-session39}
CAP=${CAP:-540}
. benchmarks/gpu_call_setup.sh
V=mm16_n16_k256_w4_s4,mm16_n16_k256_w4_s4_x2,mm16_n16_k128_w4_s4_x4,mm16_n32_k128_w4_s4_x4
V=$V,mm16_n64_k128_w4_s4_x4,mm32_n16_k128_w4_s4_x4,mm64_n16_k128_w4_s4_x4,mm16_n32_k256_w4_s4_x2
for shape in qkv gate_up down o; do
  timeout -s KILL $(left 80) python3 -m benchmarks.gemv --variants $V --fixed-rows \
    --shapes $shape --rows 1,320 --device-time --out $OUT/gemm_inv_${shape}_${S}_$G.json \
    2>&1 | grep -E "M= ?[0-9]+ " | sort -k5 -n | head -12
done
PICK=$(python3 -m benchmarks.gemv --pick-invariant $(ls $OUT/gemm_inv_*_${S}_$G.json | paste -sd,))
echo "pick: $PICK"
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --compile-cache /tmp/cc"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|identical|bandwidth"; }
timeout -s KILL $(left 240) $D --batch-invariant --invariant-tiling "$PICK" --batch 1,64 --k 0,4 \
  --out $OUT/decode_inv_pick_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 120) $D --batch-invariant --batch 1,64 --k 0 \
  --out $OUT/decode_inv_shipped_${S}_$G.json 2>&1 | show
echo "elapsed ${SECONDS}s"
