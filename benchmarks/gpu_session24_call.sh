#!/usr/bin/env bash
# Session 24's GPU call: the attention and the next layer's o in one kernel (gemv_flow
# [attention, o]), so that o's weights stream while the attention's latency chain runs.
#   a. benchmarks.flow_layer's ao arms (us per layer application, 1.4B shapes, bf16, one
#      row) against the engine's kernels ('separate', 'merged') and session 23's flow5;
#   b. batch-1 native greedy end to end (benchmarks.decode, 1.4B synthetic, bf16): default,
#      --decode-kernel flow_o=1 (o in 8-row one-block programs), the qkv and gate/up
#      prologues' RMS scale deferred to the outputs (--stream-set ...defer_norm=1), both;
#      two passes, the second in reverse order.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session24_call.sh
# LAYER_ARMS= overrides a's arms (none: skip a); ARMS= b's (default "default flow_o defer
# flow_o_defer"; also flow_o16 / flow_o2: 16-row o blocks / the engine's o tiling); CAP=
# seconds for the whole call (default 570). Results are named by the card (h200 / h100),
# read from nvidia-smi.
. benchmarks/gpu_call_setup.sh
LA=${LAYER_ARMS:-separate,merged,ao,ao_n8,ao_n16,ao_n8_pid,separate}
[ "$LA" != none ] && timeout $(left 200) python3 -m benchmarks.flow_layer --layers 8 \
  --arms $LA --out $OUT/flow_layer_ao_session24_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-400
echo "flow_layer done at $SECONDS s"
A=$OUT/arms24; rm -rf $A; mkdir -p $A
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --temperature 0 --k 0"
run() { [ $SECONDS -lt $((CAP - 45)) ] && timeout $(left 80) $D "${@:2}" --out $A/$1.json 2>&1 | grep -E "rror" ; }
arm() {
  case $1 in
    default) run default_p$2 ;;
    flow_o) run flow_o_p$2 --decode-kernel flow_o=1 ;;
    flow_o16) run flow_o16_p$2 --decode-kernel flow_o=1,flow_o_block_n=16 ;;
    flow_o2) run flow_o2_p$2 --decode-kernel flow_o=1,flow_o_block_n=2,flow_o_per_program=2 ;;
    defer) run defer_p$2 --stream-set $DEFER ;;
    flow_o_defer) run flow_o_defer_p$2 --decode-kernel flow_o=1 --stream-set $DEFER ;;
  esac
}
DEFER=qkv.defer_norm=1,gate_up.defer_norm=1
ARMS=${ARMS:-"default flow_o defer flow_o_defer"}
for a in $ARMS; do arm $a 1; done
for a in $(echo $ARMS | tr ' ' '\n' | tac); do arm $a 2; done
ls $A/*.json >/dev/null 2>&1 && python3 -m benchmarks.ab_arms $A $OUT/ab_flow_o_b1_session24_$G.json
echo "elapsed $SECONDS s"
