#!/usr/bin/env bash
# Session 24's second GPU call (after call 1 on an H100: [attention, o] as one kernel was
# level in the microbenchmark and 2% slower end to end; the deferred norm scale 1.6% faster):
#   a. benchmarks.flow_layer: merged, ao_n8, and ao_n8 with the waiting programs sleeping
#      between re-reads (are 256 spinning programs what eats the overlap?), num_stages 2;
#   b. batch-1 greedy end to end (benchmarks.decode, 1.4B synthetic, bf16): default vs
#      --stream-set qkv.defer_norm=1,gate_up.defer_norm=1, native two passes (the second in
#      reverse order), then speculative k=4 d=2 once each (token digests: native vs
#      speculative within each arm).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session24_call2.sh
# LAYER_ARMS= overrides a's arms (none: skip a); CAP= seconds (default 570). Results are
# named by the card (h200 / h100), read from nvidia-smi.
. benchmarks/gpu_call_setup.sh
LA=${LAYER_ARMS:-merged,ao_n8,ao_n8_bo,ao_n8_ns2,merged}
[ "$LA" != none ] && timeout $(left 150) python3 -m benchmarks.flow_layer --layers 8 \
  --arms $LA --out $OUT/flow_layer_ao2_session24_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-300
echo "flow_layer done at $SECONDS s"
A=$OUT/arms24b; rm -rf $A; mkdir -p $A
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --temperature 0"
DEFER=qkv.defer_norm=1,gate_up.defer_norm=1
run() { [ $SECONDS -lt $((CAP - 45)) ] && timeout $(left 90) $D "${@:2}" --out $A/$1.json 2>&1 | grep -E "rror" ; }
run default_p1 --k 0; run defer_p1 --k 0 --stream-set $DEFER
run defer_p2 --k 0 --stream-set $DEFER; run default_p2 --k 0
run default_k4 --k 4; run defer_k4 --k 4 --stream-set $DEFER
ls $A/*.json >/dev/null 2>&1 && python3 -m benchmarks.ab_arms $A $OUT/ab_defer_b1_session24_$G.json
echo "elapsed $SECONDS s"
