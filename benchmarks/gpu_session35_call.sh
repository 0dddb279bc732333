#!/usr/bin/env bash
# Session 35's calls.
#   PART=all (the default on an H200; one call of about 10 minutes):
#     1. session 34's prepared part 1 (benchmarks/gpu_session34_call.sh with SKIP_PART2=1: the
#        L2 bound, the side-stream prefetcher with evict-first GEMVs, the prefetcher launched
#        by side_call inside a fori_loop, the side launch's GPU test), about 1.5 minutes: the
#        L2 prefetch route's deciding run, on the one card whose DRAM idles ~40% of a layer
#        application;
#     2. batch-1 native greedy, default (evict_first) against noev, two passes: evict_first's
#        H200 figure;
#     3. the decode table at today's defaults: batch 1 at k 0,2,4 and T 0,0.8; batch 8, 32, 64
#        native and k=4 d=2 greedy; the d=1 k=4 batch-1 row;
#     4. the CLI's first and cached start, as far as CAP allows.
#   PART=table: step 3 without the d=1 row (call 1 ran it on an H100).
#   PART=cost (the default on any other card): the one-row projections' cost model at today's
#     tilings (benchmarks.gemv_scaling: fixed us per call and steady TB/s) and a kernel trace
#     of batch-1 native decode, to set the H100's per-kernel costs beside the H200's
#     (gemv_scaling_session14_h200.json, kernel_trace_b1_session31_h200.json). PART=all runs
#     the cost model too.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [PART=all|table|cost] [CAP=570] bash
# benchmarks/gpu_session35_call.sh
S=${SESSION:-session35}
CAP=${CAP:-570}
. benchmarks/gpu_call_setup.sh
[ $G = h200 ] && P=${PART:-all} || P=${PART:-cost}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth"; }
if [ $P = all ]; then
  SESSION=$S CAP=$(left 150) SKIP_PART2=1 OUT=$OUT bash benchmarks/gpu_session34_call.sh 2>&1 \
    | grep -v "^device"
  SESSION=$S STEPS=e PASSES=2 EARMS="default noev" AB_NAME=noev CAP=$(left 330) OUT=$OUT \
    bash benchmarks/gpu_session31_call.sh 2>&1 | grep -v "^device"
fi
if [ $P = all ] || [ $P = cost ]; then
  timeout -s KILL $(left 120) python3 -m benchmarks.gemv_scaling \
    --out $OUT/gemv_scaling_${S}_$G.json 2>&1 | tail -12 | cut -c1-300
fi
if [ $P = cost ]; then
  timeout -s KILL $(left 240) python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 \
    --attention pallas --top 12 --out $OUT/kernel_trace_b1_${S}_$G.json 2>&1 | tail -20 | cut -c1-300
  echo "elapsed $SECONDS s"; exit 0
fi
timeout -s KILL $(left 220) $D --batch 1 --k 0,2,4 --temperature 0,0.8 \
  --out $OUT/decode_b1_${S}_$G.json 2>&1 | show
echo "batch 1 done at $SECONDS s"
timeout -s KILL $(left 400) $D --batch 8,32,64 --k 0,4 --temperature 0 \
  --out $OUT/decode_b8_b64_${S}_$G.json 2>&1 | show
echo "batch 8-64 done at $SECONDS s"
if [ $P = all ]; then
  timeout -s KILL $(left 120) $D --batch 1 --k 4 --draft-loops 1 --temperature 0 \
    --out $OUT/decode_b1_d1_${S}_$G.json 2>&1 | show
  SESSION=$S STEPS=c CAP=$(left 200) OUT=$OUT bash benchmarks/gpu_session31_call.sh 2>&1 \
    | grep -v "^device"
fi
echo "elapsed $SECONDS s"
