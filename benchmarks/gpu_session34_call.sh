#!/usr/bin/env bash
# Session 34's call: benchmarks.gemv_l2_hot (each one-row projection with its weights cold
# in DRAM, hot in L2, and after another kernel's L2 prefetch with a 30 us and a 5 us wait:
# the ceiling of every L2 prefetch route and whether the prefetch lands; any card, ~1 minute),
# benchmarks.l2_side_stream with the GEMVs' weight loads evict-first (+ev: their own lines
# read once no longer push out what the prefetcher fetched; any card, ~20 s),
# benchmarks.side_prefetch_jax's ffi arms (the prefetcher launched by pdl_launch.side_call on a
# stream of our own, in a fori_loop of 4 steps, as the engine would) and the side launch's
# GPU test; then on an H200 only session 33's PART 2 with the ev arm (evict_first weight loads, +0.9%
# on an H100 in session 34's first call) beside default and omk.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=560] [SKIP_PART2=1] bash
# benchmarks/gpu_session34_call.sh
S=${SESSION:-session34}
CAP=${CAP:-560}
. benchmarks/gpu_call_setup.sh
timeout -s KILL $(left 150) python3 -m benchmarks.gemv_l2_hot --tiling qkv=4:4:8,gate_up=2:8:8 \
  --out $OUT/gemv_l2_hot_${S}_$G.json 2>&1 | cut -c1-300
timeout -s KILL $(left 90) python3 -m benchmarks.gemv_l2_hot --tiling qkv=4:4:8,gate_up=2:8:8 \
  --projections qkv,o --delay-us 5 --out $OUT/gemv_l2_hot_d5_${S}_$G.json 2>&1 | cut -c1-300
echo "hot done at $SECONDS s"
timeout -s KILL $(left 120) python3 -m benchmarks.l2_side_stream --tiling qkv=4:4:8,gate_up=2:8:8 \
  --arms base,base+ev,pf:16:16+ev,pf:24:16+ev,pf:8:16+ev,pf:16:16,base --repeats 20 \
  --out $OUT/l2_side_stream_ev_${S}_$G.json 2>&1 | cut -c1-300
timeout -s KILL $(left 150) python3 -m benchmarks.side_prefetch_jax --loops 1 --steps 4 \
  --repeats 10 --arms ${JARMS:-base,base+ev,ffi-pf:16:16+ev,ffi-pf:16:16,pf:16:16+ev,base} \
  --out $OUT/side_prefetch_ffi_${S}_$G.json 2>&1 | grep -E "^\{|rror" | cut -c1-300
timeout -s KILL $(left 90) python3 -m pytest -q -x -p no:cacheprovider tests/test_side_prefetch.py \
  -k gpu 2>&1 | tail -3
if [ $G = h200 ] && [ "${SKIP_PART2:-0}" = 0 ]; then  # session 33's part 2, its A/B arm evict_first off (noev)
  PART=2 EARMS2="default omk noev" AB2=o_merge_noev SESSION=$S CAP=$(left 500) OUT=$OUT \
    bash benchmarks/gpu_session33_call.sh 2>&1 | grep -v "^device\|^elapsed"
fi
echo "elapsed $SECONDS s"
