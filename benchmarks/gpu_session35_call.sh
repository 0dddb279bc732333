#!/usr/bin/env bash
# Session 35's calls.
#   PART=34 (the default on an H200): session 34's prepared call (benchmarks/gpu_session34_call.sh:
#     the L2 prefetch route's deciding run on the one card whose DRAM idles ~40% of a layer
#     application, evict_first's noev A/B at batch 1, the CLI's start, the d=1 k=4 row).
#   PART=table (the default on any other card): the decode table at today's defaults
#     (evict_first weight loads since session 34): batch 1 at k 0,2,4 and T 0,0.8, then
#     batch 8, 32, 64 native and k=4 d=2 greedy. No H100 table beyond batch 1 was on file.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [PART=34|table] [CAP=560] bash
# benchmarks/gpu_session35_call.sh
S=${SESSION:-session35}
CAP=${CAP:-560}
. benchmarks/gpu_call_setup.sh
[ $G = h200 ] && P=${PART:-34} || P=${PART:-table}
if [ $P = 34 ]; then
  SESSION=$S CAP=$CAP OUT=$OUT bash benchmarks/gpu_session34_call.sh 2>&1 | grep -v "^device"
else
  D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
  timeout -s KILL $(left 220) $D --batch 1 --k 0,2,4 --temperature 0,0.8 \
    --out $OUT/decode_b1_${S}_$G.json 2>&1 | grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth"
  echo "batch 1 done at $SECONDS s"
  timeout -s KILL $(left 400) $D --batch 8,32,64 --k 0,4 --temperature 0 \
    --out $OUT/decode_b8_b64_${S}_$G.json 2>&1 | grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth"
fi
echo "elapsed $SECONDS s"
