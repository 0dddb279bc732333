#!/usr/bin/env bash
# Session 41, the batch-invariant mode's row-count routes in one call (prepared; device starts
# were scarce): the route tiles' bits (benchmarks.gemm_tiling_bits), a --fixed-rows sweep of
# the wide tiles at 64 and 320 rows and the 16-row tiles at 1 and 8 (benchmarks.gemv, one
# process per weight and group), the pick (--pick-routes), then the mode end to end with
# the picked routes (benchmarks.decode --invariant-tiling) and without routes (session 40's
# tiling; batch 64 only, with what time is left: session 40's files are the other
# comparison), on the same card. Budget: probe 90 s, sweep 8 x 40 s, each arm 150 s.
# For a short budget: WIDE_ROWS=320 FEW_ROWS=1 E2E=0 (the probe, one row count per group, the
# pick); ROUTE_GROUPS=wide (session 42) sweeps and probes only the wide tiles (the batch-64
# verification's case) and E2E_BATCH=64 runs the arms at batch 64 only.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=585] [WIDE_ROWS=64,320] [FEW_ROWS=1,8]
#   [ROUTE_GROUPS="wide few"] [E2E=1] [E2E_BATCH=1,64] bash benchmarks/gpu_session41_combined.sh
S=${SESSION:-session41}
CAP=${CAP:-585}
. benchmarks/gpu_call_setup.sh
WIDE1=mm64_n128_k128_w4_s4,mm64_n128_k128_w8_s3,mm128_n64_k128_w8_s3,mm128_n128_k128_w8_s3
WIDE1=$WIDE1,mm64_n256_k128_w8_s3,mm64_n64_k128_w4_s4
WIDE4=$(echo $WIDE1 | sed 's/\(k128_w[48]_s[34]\)/\1_x4/g')
FEW1=mm16_n32_k128_w4_s4,mm16_n64_k128_w4_s4
FEW4=$(echo $FEW1 | sed 's/\(k128_w[48]_s[34]\)/\1_x4/g')
# the probe: the swept tiles only (a tile of the other K split is an error row, not compiled);
# it saves after each weight, so a time-out keeps the weights done
PROBED=$WIDE1,$WIDE4; case "${ROUTE_GROUPS:-wide few}" in *few*) PROBED=$PROBED,$FEW1,$FEW4 ;; esac
timeout -s KILL $(left 90) python3 -m benchmarks.gemm_tiling_bits --variants $PROBED --out $OUT/gemm_tiling_bits_${S}_$G.json 2>&1 \
  | grep -v "^ *$" | grep -v "other K steps" | tail -40 | cut -c1-200
echo "bits done at ${SECONDS}s"
G1="python3 -m benchmarks.gemv --fixed-rows --layers 8 --calls 5 --trials 3"
for grp in ${ROUTE_GROUPS:-wide few}; do
  for sh in qkv gate_up o down; do
    case $sh in qkv|gate_up) V=$([ $grp = wide ] && echo $WIDE1 || echo $FEW1) ;;
      *) V=$([ $grp = wide ] && echo $WIDE4 || echo $FEW4) ;; esac
    R=$([ $grp = wide ] && echo ${WIDE_ROWS:-64,320} || echo ${FEW_ROWS:-1,8})
    timeout -s KILL $(left 40) $G1 --shapes $sh --rows $R --variants $V \
      --out $OUT/gemm_route_${grp}_${sh}_${S}_$G.json 2>&1 | grep -v "^ *$" | tail -40 | cut -c1-100
  done
done
echo "sweep done at ${SECONDS}s"
SPEC=$(python3 -m benchmarks.gemv --pick-routes $(ls $OUT/gemm_route_*_${S}_$G.json | paste -sd,) \
  --bits $OUT/gemm_tiling_bits_${S}_$G.json 2>&1 | tail -1)
echo "pick: $SPEC"
[ "${E2E:-1}" = 0 ] && { echo "elapsed ${SECONDS}s"; exit; }
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --batch-invariant"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth" | cut -c1-170; }
case "$SPEC" in *=*)
  timeout -s KILL $(left 150) $D --batch ${E2E_BATCH:-1,64} --k 0,4 --invariant-tiling "$SPEC" \
    --out $OUT/decode_inv_routes_${S}_$G.json 2>&1 | show ;; esac
S40=qkv=mm64_n64_k128_w4_s4,o=mm64_n64_k128_w4_s4_x4,gate_up=mm64_n64_k128_w8_s4
S40=$S40,down=mm64_n64_k128_w4_s4_x4
timeout -s KILL $(left 150) $D --batch 64 --k 0,4 --invariant-tiling $S40 \
  --out $OUT/decode_inv_noroutes_${S}_$G.json 2>&1 | show
echo "elapsed ${SECONDS}s"
