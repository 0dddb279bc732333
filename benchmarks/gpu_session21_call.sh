#!/usr/bin/env bash
# Prepared in session 21, which was lent no GPU: the ticket-ordered GEMV chain
# (pallas_kernels/gemv_flow.py; projections '+flow') on the H200, in one call of under
# 10 minutes, each step only while time is left (CAP seconds in all).
#   1. its GPU tests: the real grid (1,760 programs, 4 stages, spinning waits) against the
#      separate streaming GEMVs, ticket and program-id order, 8 calls each, no give-ups;
#   2. benchmarks.gemv_flow: us per layer (o -> gate/up -> down -> next qkv), each variant
#      against the separate kernels at its own tiling. Offline sm_90 compiles (Triton 3.9):
#      146 registers at the engine's tilings (gate/up at 8 blocks per program alone: 140),
#      110 with gate/up at 2 blocks per program; no spills;
#   3. end to end at batch 1, native greedy: default vs '+flow' (o -> gate/up -> down per
#      layer as one kernel) vs '+flow4' (and the next layer's qkv, but after a loop's last
#      layer), two passes in reverse order (benchmarks.ab_arms prints them); the tokens'
#      digest should match the default's (same bits by construction);
#   4. the same at k=4 d=2 (the draft runs the one-row kernels): default vs FLOW_K4 (default
#      flow4; set it to the better of step 3);
#   5. what session 19's call left (the CLI's cached start native and k=4, the load alone):
#      gpu_session19_call.sh STEPS=34;
#   6. (runs before 5) a kernel trace of batch-1 native with FLOW_K4: the flow kernel's time
#      per layer application against session 11's per-kernel figures.
# Two calls, the decisive number first: STEPS=13 (the GPU tests, then the end-to-end A/B;
# about 7 minutes), then STEPS=2456 (the microbenchmark, which says why, then k=4, the
# trace and the leftovers; steps run in the script's order, 2 4 6 5).
# The chain pays if it saves >= ~1 us per layer (96 layer applications per decode step:
# ~0.1 ms per step per us, ~2.3% at batch 1).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session21_call.sh
# STEPS= picks steps (default 13); CAP= the seconds the call may take (default 570).
# ARMS= step 3's arms (default "default flow flow4"); VARIANTS= step 2's (default:
# benchmarks.gemv_flow's DEFAULT_VARIANTS).
set -u
STEPS=${STEPS:-13}
on() { [[ $STEPS == *$1* ]]; }
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
CAP=${CAP:-570}
left() { local l=$((CAP - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
on 1 && timeout $(left 120) python3 -m pytest -q -rfE --tb=short -m gpu tests/test_gemv_flow.py 2>&1 | tail -12
echo "tests done at $SECONDS s"
on 2 && timeout $(left 270) python3 -m benchmarks.gemv_flow --layers 8 \
  ${VARIANTS:+--variants $VARIANTS} \
  --out $OUT/gemv_flow_session21_h200.json 2>&1 | \
  grep -oE '"variant": "[a-z0-9_]+"|"(max_abs_diff_vs_separate|give_ups_first_call|guess_misses_first_call|separate_us_per_layer|flow_us_per_layer|saving_us_per_layer)": [-0-9.e]+|rror.*|needs a GPU.*' | paste -sd' ' | sed 's/"variant"/\n&/g'
echo "microbenchmark done at $SECONDS s"
A=$OUT/arms_flow; mkdir -p $A
D=${D:-"python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --temperature 0"}
P="--projections gemv+norms+stream"
run() { [ $SECONDS -lt $((CAP - 40)) ] && timeout $(left 75) $D "${@:2}" --out $A/$1.json 2>&1 | grep -E "rror" ; }
arm() {  # arm pass
  case $1 in
    default) run default_p$2 --k 0 ;;
    flow) run flow_p$2 --k 0 $P+flow ;;
    flow4) run flow4_p$2 --k 0 $P+flow4 ;;
    default_k4) run default_k4_p$2 --k 4 ;;
    flow_k4) run ${FLOW_K4:-flow4}_k4_p$2 --k 4 $P+${FLOW_K4:-flow4} ;;
  esac
}
if on 3; then
  ARMS=${ARMS:-"default flow flow4"}  # ARMS="default flow4" when device time is short
  for a in $ARMS; do arm $a 1; done
  for a in $(echo $ARMS | tr ' ' '\n' | tac); do arm $a 2; done
fi
if on 4; then
  arm default_k4 1; arm flow_k4 1; arm flow_k4 2; arm default_k4 2
fi
(on 3 || on 4) && python3 -m benchmarks.ab_arms $A $OUT/ab_flow_b1_session21_h200.json
echo "A/B done at $SECONDS s"
on 6 && timeout $(left 90) python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 \
  --attention pallas --projections gemv+norms+stream+${FLOW_K4:-flow4} --top 12 \
  --out $OUT/kernel_trace_flow_b1_session21_h200.json 2>&1 | grep -E "gemv_flow|kernels_per|busy" | cut -c1-200
on 5 && [ $SECONDS -lt $((CAP - 60)) ] && STEPS=34 CLI_K="0 4" CAP=$((CAP - SECONDS)) OUT=$OUT \
  bash benchmarks/gpu_session19_call.sh
echo "elapsed $SECONDS s"
