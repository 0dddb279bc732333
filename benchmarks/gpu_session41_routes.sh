#!/usr/bin/env bash
# Session 41, routes call: can the batch-invariant mode tile its GEMMs by row count?
#   1. benchmarks.gemm_tiling_bits: every route tile (benchmarks.gemm_tilings.ROUTE_VARIANTS)
#      against the mode's TUNING per weight, bits at 320 / 64 / 5 / 1 rows;
#   2. benchmarks.gemv --fixed-rows: the wide tiles at 64 and 320 rows (the batch-64 native
#      call and its k=4 verification), then the 16-row tiles at 1 and 8 rows, one process
#      per weight and row group (each saves its JSON only at its end).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=420] bash benchmarks/gpu_session41_routes.sh
S=${SESSION:-session41}
CAP=${CAP:-420}
. benchmarks/gpu_call_setup.sh
timeout -s KILL $(left 120) python3 -m benchmarks.gemm_tiling_bits \
  --out $OUT/gemm_tiling_bits_${S}_$G.json 2>&1 | grep -v "^ *$" | tail -50 | cut -c1-200
echo "bits done at ${SECONDS}s"
WIDE1=mm64_n128_k128_w4_s4,mm64_n128_k128_w8_s3,mm128_n64_k128_w4_s4,mm128_n64_k128_w8_s3
WIDE1=$WIDE1,mm128_n128_k128_w4_s4,mm128_n128_k128_w8_s3,mm64_n256_k128_w4_s4,mm64_n256_k128_w8_s3
WIDE1=$WIDE1,mm64_n64_k128_w4_s4
WIDE4=$(echo $WIDE1 | sed 's/\(k128_w[48]_s[34]\)/\1_x4/g')
FEW1=mm16_n32_k128_w4_s4,mm16_n64_k128_w4_s4,mm64_n64_k128_w4_s4
FEW4=$(echo $FEW1 | sed 's/\(k128_w[48]_s[34]\)/\1_x4/g')
G1="python3 -m benchmarks.gemv --fixed-rows --layers 8 --calls 5 --trials 3"
for grp in wide few; do
  for sh in qkv gate_up o down; do
    case $sh in qkv|gate_up) V=$([ $grp = wide ] && echo $WIDE1 || echo $FEW1) ;;
      *) V=$([ $grp = wide ] && echo $WIDE4 || echo $FEW4) ;; esac
    R=$([ $grp = wide ] && echo 64,320 || echo 1,8)
    timeout -s KILL $(left 100) $G1 --shapes $sh --rows $R --variants $V \
      --out $OUT/gemm_route_${grp}_${sh}_${S}_$G.json 2>&1 | grep -v "^ *$" | tail -40 | cut -c1-120
  done
done
echo "sweep done at ${SECONDS}s"
ls $OUT/gemm_route_*_${S}_$G.json 2>/dev/null | paste -sd, > /tmp/sweeps
[ -s /tmp/sweeps ] && [ -f $OUT/gemm_tiling_bits_${S}_$G.json ] && python3 -m benchmarks.gemv \
  --pick-routes $(cat /tmp/sweeps) --bits $OUT/gemm_tiling_bits_${S}_$G.json
echo "elapsed ${SECONDS}s"
