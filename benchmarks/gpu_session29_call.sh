#!/usr/bin/env bash
# Session 29's first GPU call: what sessions 21-28 measured only on H100s, on the card this
# call gets (an H200 for the figures), each step under a KILL timeout:
#   n. Nsight Compute on one batch-1 step's Pallas kernels (five sections; gpu_ncu.sh);
#   e. batch-1 native greedy: default against '+graph' (session 28: 196.0 against 202.8 on
#      an H100), the graph with its GEMVs triggering the next kernel at their end
#      (--graph-pdl end; session 28 ran the start only), and the opt-in defer_norm
#      (session 24: +1.3-1.6% on an H100), two passes in reverse order;
#   c. the CLI's first and cached start in bf16, native and k=4 d=2 (the cached start has
#      only been measured on an H100): gpu_session19_call.sh step 3;
#   t. the batch-1 rows of the decode table at today's code (k 0, 2, 4; T 0, 0.8);
#   g. the graph loops' GPU tests (the 2-layer K/V bound loosened in session 28, not rerun);
#   p. benchmarks.pdl_jax_chain's JAX, stream-PDL and graph-PDL arms.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session29_call.sh; STEPS= a subset
# of "necgpt" (default necgpt; they run in that order); CAP= seconds (default 570);
# EARMS= step e's arms (default "default graph graph_end defer").
. benchmarks/gpu_call_setup.sh
STEPS=${STEPS:-necgpt}
on() { [[ $STEPS == *$1* ]]; }
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
if on n && [ $SECONDS -lt $((CAP - 120)) ]; then
  # Nsight Compute on six Pallas kernels (qkv, attention, o, gate/up, down, the next qkv) of
  # a batch-1 decode step, L2 flushed before each, clocks not locked; through
  # gpu_ncu.sh's ncu_run since session 30 (this step's first form hung the call twice)
  . benchmarks/gpu_ncu.sh
  NCU_TAG=_session29 ncu_run b1 120 'gemv_stream|paged_decode_attention' 300 ${NCU_COUNT:-6} \
    $D --batch 1 --temperature 0 --k 0 --repeats 1 --warmup ${NCU_WARMUP:-0} --new-tokens 8 \
    --compile-cache /tmp/cc_ncu
  echo "n done at $SECONDS s"
fi
if on e; then
  A=/tmp/ab29; rm -rf $A; mkdir -p $A  # (the arms' files stay there: 8 files come back)
  erun() { [ $SECONDS -lt $((CAP - 60)) ] && timeout -s KILL $(left 100) $D --batch 1 \
    --temperature 0 --k 0 "${@:2}" --out $A/$1.json 2>&1 | grep -E "tok/s|rror|^  [0-9]" \
    | cut -c1-300; }
  DEFER="--stream-set qkv.defer_norm=1,gate_up.defer_norm=1"
  GR="--projections gemv+norms+stream+graph"
  arm() { case $1 in default) erun default_p$2 ;; graph) erun graph_p$2 $GR ;;
    graph_end) erun graph_end_p$2 $GR --graph-pdl end ;; defer) erun defer_p$2 $DEFER ;; esac; }
  EARMS=${EARMS:-"default graph graph_end defer"}  # pass 2 in reverse order
  for a in $EARMS; do arm $a 1; done
  for a in $(echo $EARMS | tr ' ' '\n' | tac); do arm $a 2; done
  ls $A/*.json >/dev/null 2>&1 && python3 -m benchmarks.ab_arms $A $OUT/ab_b1_session29_$G.json
  echo "e done at $SECONDS s"
fi
if on c && [ $SECONDS -lt $((CAP - 90)) ]; then
  STEPS=3 CLI_K="0 4" TAG=_session29 CAP=$(left 150) OUT=$OUT \
    bash benchmarks/gpu_session19_call.sh 2>&1 | tail -12
  echo "c done at $SECONDS s"
fi
if on g && [ $SECONDS -lt $((CAP - 60)) ]; then
  timeout -s KILL $(left 150) python3 -m pytest -q -m gpu tests/test_graph_loop.py 2>&1 \
    | grep -E "passed|failed|Error|assert" | tail -8 | cut -c1-400
  echo "g done at $SECONDS s"
fi
if on p && [ $SECONDS -lt $((CAP - 60)) ]; then
  timeout -s KILL $(left 150) python3 -m benchmarks.pdl_jax_chain --repeats 20 \
    --arms xla,lseq_start,gseq_start,xla --out $OUT/pdl_jax_chain_session29_$G.json 2>&1 \
    | grep -E '^\{|rror' | cut -c1-330
  echo "p done at $SECONDS s"
fi
if on t && [ $SECONDS -lt $((CAP - 90)) ]; then
  timeout -s KILL $(left 150) $D --batch 1 --k 0,2,4 --temperature 0,0.8 \
    --out $OUT/decode_b1_session29_$G.json 2>&1 | grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth"
  echo "t done at $SECONDS s"
fi
echo "elapsed $SECONDS s"
