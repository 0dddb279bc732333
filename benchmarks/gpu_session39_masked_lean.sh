#!/usr/bin/env bash
# Session 39, the last start's budget: gpu_session39_masked.sh's steps in order of worth.
#   1. the batch-invariant mode at batch 1 with session 38's tiling for o and down
#      (mm64_n16_k256_w4_s4: 71.0 tok/s with the clamped row block on an H100,
#      decode_inv_shipped_session39_h100.json), now masked;
#   2. the mode as shipped since session 39 (o and down at mm16_n64_k128_w4_s4_x4: 105.4
#      clamped, decode_inv_pick_session39_h100.json), now masked, native and k=4 d=2
#      (identical sequences);
#   3. the GEMM's compiled GPU tests (masked rows: bits at 1-320 rows, and the ragged blocks);
#   4. qkv's and gate/up's tilings at 1 and 320 rows, masked.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=250] bash benchmarks/gpu_session39_masked_lean.sh
S=${SESSION:-session39}
CAP=${CAP:-250}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --compile-cache /tmp/cc --batch 1"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|identical|bandwidth"; }
timeout -s KILL $(left 45) $D --batch-invariant --k 0 \
  --invariant-tiling down=mm64_n16_k256_w4_s4,o=mm64_n16_k256_w4_s4 \
  --out $OUT/decode_masked_s38tiling_b1_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 70) $D --batch-invariant --k 0,4 \
  --out $OUT/decode_masked_shipped_b1_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 70) python3 -m pytest -q -p no:cacheprovider tests/test_gemm.py \
  tests/test_invariant.py -k "on_the_gpu or gemm_fixed" 2>&1 | tail -4
V=mm64_n16_k256_w4_s4,mm64_n16_k128_w4_s4_x4,mm64_n32_k128_w4_s4_x4,mm64_n64_k128_w4_s4_x4
V=$V,mm16_n64_k128_w4_s4_x4
for shape in qkv gate_up; do
  timeout -s KILL $(left 45) python3 -m benchmarks.gemv --variants $V --fixed-rows \
    --shapes $shape --rows 1,320 --device-time --out $OUT/gemm_masked_${shape}_${S}_$G.json \
    2>&1 | grep -E "M= ?[0-9]+ "
done
echo "elapsed ${SECONDS}s"
