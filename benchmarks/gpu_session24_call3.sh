#!/usr/bin/env bash
# Session 24's third GPU call, for the H200 (calls 1-2 ran on an H100):
#   a. benchmarks.flow_layer's diagnostics: merged, ao_n8 and flow5 against their _nowait
#      twins (no stage waits: wrong results, the time of the overlap with no handover);
#   b. batch-1 native greedy, default vs --stream-set qkv.defer_norm=1,gate_up.defer_norm=1,
#      two passes (the second in reverse order);
#   c. the CLI's first and cached start and the load time (gpu_session19_call.sh STEPS=34,
#      its files tagged _session24_call3 and named for the card).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session24_call3.sh
# STEPS= a subset of "abc" (default abc); LAYER_ARMS= a's arms; CAP= seconds (default 570).
# Results are named by the card (h200 / h100), read from nvidia-smi.
. benchmarks/gpu_call_setup.sh
STEPS=${STEPS:-abc}
on() { [[ $STEPS == *$1* ]]; }
on a && timeout $(left 120) python3 -m benchmarks.flow_layer --layers 8 \
  --arms ${LAYER_ARMS:-merged,ao_n8,ao_n8_nowait,flow5,flow5_nowait,merged} \
  --out $OUT/flow_layer_nowait_session24_call3_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-300
echo "a done at $SECONDS s"
A=$OUT/arms24c; rm -rf $A; mkdir -p $A
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --temperature 0 --k 0"
DEFER=qkv.defer_norm=1,gate_up.defer_norm=1
run() { [ $SECONDS -lt $((CAP - 45)) ] && timeout $(left 80) $D "${@:2}" --out $A/$1.json 2>&1 | grep -E "rror" ; }
if on b; then
  run default_p1; run defer_p1 --stream-set $DEFER
  run defer_p2 --stream-set $DEFER; run default_p2
  ls $A/*.json >/dev/null 2>&1 && python3 -m benchmarks.ab_arms $A $OUT/ab_defer_b1_session24_call3_$G.json
fi
echo "b done at $SECONDS s"
on c && [ $SECONDS -lt $((CAP - 100)) ] && TAG=_session24_call3 STEPS=34 CLI_K="0 4" CAP=$((CAP - SECONDS)) OUT=$OUT \
  bash benchmarks/gpu_session19_call.sh
echo "elapsed $SECONDS s"
