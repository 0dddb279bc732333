#!/usr/bin/env bash
# Session 35's calls.
#   PART=all (the default on an H200; one call of about 9 minutes), in order of worth:
#     1. the one-row GEMV tilings that put more weight bytes in flight per SM (16 warps,
#        8-row blocks, 4-row gate/up blocks, and gemv_stream's new depth=2: two blocks'
#        loads in flight ahead of the math), timed per call on the H200 (benchmarks.gemv
#        --device-time; qkv and gate/up with the add_norm prologue, o and down plain). Why: on
#        an H100 today's tilings stream at XLA's own read rate (gemv_scaling_session35_h100.json),
#        on the H200 at 81-92% of it (session 14), and these later sweep rounds ran only on
#        H100s. The fastest per projection (benchmarks.gemv --pick) becomes the pick arm;
#     2. batch-1 native greedy, two passes: default, noev (evict_first off: its H200 figure),
#        d2 (the engine's tilings at depth 2), pick (the tilings of step 1);
#     3. the batch-1 table rows at today's defaults (k 0,2,4, T 0,0.8; batch 8-64 run XLA's
#        GEMMs, which evict_first does not touch);
#     4. the cost model at today's tilings (benchmarks.gemv_scaling);
#     5. session 34's prepared part 1 (gpu_session34_call.sh with SKIP_PART2=1: the L2 prefetch
#        route on the H200);
#     6. the d=1 k=4 batch-1 row.
#   PART=table: the decode table at today's defaults, batch 1-64 (call 1 ran it on an H100).
#   PART=cost: the cost model and a batch-1 kernel trace (call 2 ran it on an H100).
#   PART=sweep (the default on any other card): step 1 and step 2 without noev, after
#     gemv_stream depth=2's GPU test.
#   PART=mini (for a short cap): depth=2's GPU test, batch-1 native greedy default against d2
#     (and noev on an H200), two passes, then qkv and gate/up at depth 1 and 2 per call.
#   PART=check: gemv_stream depth=2's GPU test (the same bits
#     as depth 1 at the engine's tilings) and one pass of batch-1 native greedy, default
#     against d2 (calls 1 and 2 ran the rest of what an H100 adds).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [PART=all|sweep|mini|table|cost|check] [CAP=555] bash
# benchmarks/gpu_session35_call.sh
S=${SESSION:-session35}
CAP=${CAP:-555}
. benchmarks/gpu_call_setup.sh
[ $G = h200 ] && P=${PART:-all} || P=${PART:-sweep}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth"; }
scaling() {
  timeout -s KILL $(left 90) python3 -m benchmarks.gemv_scaling \
    --out $OUT/gemv_scaling_${S}_$G.json 2>&1 | tail -12 | cut -c1-300; }
if [ $P = all ] || [ $P = sweep ]; then
  [ $P = sweep ] && timeout -s KILL $(left 120) python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gemv_stream_depth.py 2>&1 | tail -3
  # one process per projection, so that a timeout loses one projection's rows, not all
  NV=st4_k2048_p4_w8,st2_k2048_p8_w8,st4_k2048_p4_w16,st8_k2048_p2_w16,st4_k2048_p2_w8
  NV=$NV,st2_k2048_p4_w8,st4_k2048_p4_w8_d2,st2_k2048_p8_w8_d2,st4_k2048_p2_w8_d2
  NV=$NV,st2_k2048_p4_w8_d2,st2_k2048_p2_w8_d2
  PV=st2_k512_p2_w4,st1_k512_p4_w4,st2_k2048_p2_w8,st1_k512_p2_w8,st2_k512_p4_w4
  PV=$PV,st4_k512_p2_w4,st2_k512_p2_w4_d2,st1_k512_p4_w4_d2,st2_k2048_p2_w8_d2
  PV=$PV,st2_k512_p4_w4_d2,st1_k512_p2_w8_d2
  for sh in qkv gate_up o down; do
    case $sh in qkv|gate_up) V=$NV; PRO="--prologue add_norm" ;; *) V=$PV; PRO="" ;; esac
    timeout -s KILL $(left 75) python3 -m benchmarks.gemv $PRO --shapes $sh --rows 1 \
      --variants $V --calls 10 --trials 3 --device-time --out $OUT/gemv_sweep_${sh}_${S}_$G.json \
      2>&1 | grep -v "^ *$" | tail -14 | cut -c1-160
  done
  PICK=$(for sh in qkv gate_up o down; do [ -f $OUT/gemv_sweep_${sh}_${S}_$G.json ] && \
    python3 -m benchmarks.gemv --pick $OUT/gemv_sweep_${sh}_${S}_$G.json; done 2>/dev/null \
    | grep -v "^$" | paste -sd, )
  echo "pick: $PICK (at $SECONDS s)"
  ARMS="default noev d2"; [ $P = sweep ] && ARMS="default d2"
  [ -n "$PICK" ] && ARMS="$ARMS pick"
  PICK=$PICK SESSION=$S STEPS=e PASSES=2 EARMS="$ARMS" AB_NAME=noev_pick CAP=$(left 260) OUT=$OUT \
    bash benchmarks/gpu_session31_call.sh 2>&1 | grep -v "^device"
fi
if [ $P = all ]; then
  timeout -s KILL $(left 150) $D --batch 1 --k 0,2,4 --temperature 0,0.8 \
    --out $OUT/decode_b1_${S}_$G.json 2>&1 | show
  scaling
  SESSION=$S CAP=$(left 150) SKIP_PART2=1 OUT=$OUT bash benchmarks/gpu_session34_call.sh 2>&1 \
    | grep -v "^device"
  timeout -s KILL $(left 100) $D --batch 1 --k 4 --draft-loops 1 --temperature 0 \
    --out $OUT/decode_b1_d1_${S}_$G.json 2>&1 | show
elif [ $P = mini ]; then
  timeout -s KILL $(left 90) python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gemv_stream_depth.py 2>&1 | tail -3
  ARMS="default d2"; [ $G = h200 ] && ARMS="default d2 noev"
  SESSION=$S STEPS=e PASSES=2 EARMS="$ARMS" AB_NAME=d2 CAP=$(left 200) OUT=$OUT \
    bash benchmarks/gpu_session31_call.sh 2>&1 | grep -v "^device"
  for sh in gate_up qkv; do
    timeout -s KILL $(left 60) python3 -m benchmarks.gemv --prologue add_norm --shapes $sh \
      --rows 1 --variants st4_k2048_p4_w8,st2_k2048_p8_w8,st4_k2048_p4_w8_d2,st2_k2048_p8_w8_d2 \
      --calls 10 --trials 3 --device-time --out $OUT/gemv_sweep_${sh}_${S}_$G.json \
      2>&1 | grep -v "^ *$" | tail -8 | cut -c1-160
  done
elif [ $P = check ]; then
  timeout -s KILL $(left 120) python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/test_gemv_stream_depth.py 2>&1 | tail -3
  SESSION=$S STEPS=e PASSES=1 EARMS="default d2" AB_NAME=d2 CAP=$(left 150) OUT=$OUT \
    bash benchmarks/gpu_session31_call.sh 2>&1 | grep -v "^device"
elif [ $P = cost ]; then
  scaling
  timeout -s KILL $(left 240) python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 \
    --attention pallas --top 12 --out $OUT/kernel_trace_b1_${S}_$G.json 2>&1 | tail -20 | cut -c1-300
else
  timeout -s KILL $(left 220) $D --batch 1 --k 0,2,4 --temperature 0,0.8 \
    --out $OUT/decode_b1_${S}_$G.json 2>&1 | show
  timeout -s KILL $(left 400) $D --batch 8,32,64 --k 0,4 --temperature 0 \
    --out $OUT/decode_b8_b64_${S}_$G.json 2>&1 | show
fi
echo "elapsed $SECONDS s"
