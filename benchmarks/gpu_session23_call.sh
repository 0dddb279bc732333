#!/usr/bin/env bash
# Session 23's GPU call: the whole decode layer in one kernel (gemv_flow with its attention
# stage, pallas_kernels/flow_attention.py), the microbenchmark first, then end to end.
#   a. benchmarks.flow_layer: us per layer application (1.4B shapes, bf16, one row, 160 cached
#      keys): the engine's 6 kernels ('separate'), with the attention's merge in its kernel
#      ('merged': the bits every flow arm must match), '+flow4' + attention (2 kernels),
#      'flow5' (1 kernel), at num_stages 2, with 2 L2-prefetched blocks per waiting program;
#   b. batch-1 native greedy end to end (benchmarks.decode, 1.4B synthetic, bf16): default,
#      default with the decode kernel's in-kernel split merge ('default_lc': the bits of
#      '+flow5'), '+flow4', '+flow5', two passes in reverse order; token digests: flow4 =
#      default, flow5 = default_lc;
#   c. (STEPS21=1) session 21's GPU tests of the flow kernel (give-up and trap included).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session23_call.sh
# LAYER_ARMS= narrows a (LAYER_ARMS=none skips it); ARMS= narrows b (default
# "default default_lc flow4 flow5"); CAP= seconds for the whole call (default 570).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
CAP=${CAP:-570}
left() { local l=$((CAP - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
[ "${LAYER_ARMS:-}" != none ] && timeout $(left 230) python3 -m benchmarks.flow_layer \
  --layers 8 ${LAYER_ARMS:+--arms $LAYER_ARMS} --out $OUT/flow_layer_session23_h200.json 2>&1 | \
  grep -E '^\{|rror' | cut -c1-300
echo "flow_layer done at $SECONDS s"
A=$OUT/arms23; mkdir -p $A
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --temperature 0 --k 0"
P="--projections gemv+norms+stream"
run() { [ $SECONDS -lt $((CAP - 45)) ] && timeout $(left 80) $D "${@:2}" --out $A/$1.json 2>&1 | grep -E "rror" ; }
arm() {
  case $1 in
    default) run default_p$2 ;;
    default_lc) run default_lc_p$2 --decode-kernel last_combine=1 ;;
    flow4) run flow4_p$2 $P+flow4 ;;
    flow5) run flow5_p$2 $P+flow5 ;;
  esac
}
ARMS=${ARMS:-"default default_lc flow4 flow5"}
for a in $ARMS; do arm $a 1; done
for a in $(echo $ARMS | tr ' ' '\n' | tac); do arm $a 2; done
ls $A/*.json >/dev/null 2>&1 && python3 -m benchmarks.ab_arms $A $OUT/ab_flow5_b1_session23_h200.json
echo "A/B done at $SECONDS s"
[ "${STEPS21:-0}" = 1 ] && timeout $(left 150) python3 -m pytest -q -rfE --tb=short -m gpu \
  tests/test_gemv_flow.py 2>&1 | tail -12
echo "elapsed $SECONDS s"
