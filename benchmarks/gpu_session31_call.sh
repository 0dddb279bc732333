#!/usr/bin/env bash
# Session 31's GPU call, after session 30's prepared call (first step of this session, on an
# H100: ab_b1_fold_row2d_session30_h100.json) put fold_sums at +0.4% and qkv and gate/up at
# block_k = K = 2048 with 8 warps at +0.6-1.0% over the default, row2d at -0.8%, all with
# the default's greedy token digest:
#   e. batch-1 native greedy, three passes (the second in reverse order), arms:
#      default; w8 (qkv st4_k2048_p4_w8, gate_up st2_k2048_p8_w8); w8o (w8 and o at
#      st2_k2048_p2_w8); w8x2 (qkv st4_k2048_p2_w8, gate_up st2_k2048_p4_w8: twice the
#      programs); w8d (w8 and down at st1_k512_p2_w8); fold (fold_sums on qkv and gate/up);
#      EARMS picks a subset. Arms for after w8 became the default (calls 3 on): k512 (the
#      old 512-wide tiling: st4_k512_p4_w4, st2_k512_p8_w4), w16 (qkv st4_k2048_p4_w16,
#      gate_up st2_k2048_p8_w16), w16q8 (qkv st8_k2048_p2_w16, gate_up as w16). PASSES
#      (default 3) and AB_NAME (default k2048w8) name the passes and the result file.
#      Decode attention arms (prepared in session 31, not yet run): one program per KV head
#      reading the whole context in one tile, no splits and no combine kernel: a256w8
#      (num_splits=1, block_t=256, 8 warps, 1 stage; offline 216 registers, 76 KB shared;
#      at 4 warps it spills), a128w8 / a128w4 (block_t=128, two tiles at 192 keys, 2 stages).
#      Session 9's one-split kernel read 32-key blocks in series (-4%); these read one or
#      two. E.g. EARMS="default a256w8 a128w8 a128w4" AB_NAME=attn1.
#   s. with w8, greedy native against k=4 d=2 speculative tokens (a default must keep them
#      equal), batch 1 and 8.
#   t. (H200 only) the batch-1 table rows at today's default code, k 0,2,4, T 0 and 0.8.
#   c. (H200 only) the CLI's first and cached start, native and k=4 (session 19's step 3).
#   r. (H200 only) the table's cells not rerun in session 31: batch 8, 32, 64 at k=2 and
#      k=4, greedy and T=0.8 (k=4 greedy again, for the ratio in the same run).
#   m. (session 32) o_merge: tests/test_gemv_merge.py's GPU test, and greedy native against
#      k=4 d=2 speculative tokens with o_merge at batch 1.
#   p. (session 33) benchmarks.l2_side_stream: the one-row GEMV chain (PyTorch + Triton)
#      with and without a weight prefetcher on a stream of its own; PARMS picks its arms.
#      Arms of step e from session 33: ev (every streaming GEMV's weight loads evict_first),
#      lc (the decode kernel merges its own splits), lcpdl (lc with its PDL trigger); from
#      session 34, when evict_first became the default: noev (evict_first off); from session
#      35: pick (--stream-tiling $PICK, the tilings a sweep picked), d2 (the engine's tilings
#      with two blocks' loads in flight ahead of the math: gemv_stream depth=2).
#   n. (after w8 became the default) ncu on a decode step's six Pallas kernels, as in
#      session 30's profile (ncu_b1_session30_h100_*), to see what the one-chunk prologue
#      changed in the stalls.
#   g. the streaming GEMV's GPU tests (the engine's picks against XLA), the graph loops'
#      (which compile the engine's tilings through the triton package) and gemv_flow's
#      (whose stages follow the engine's block sizes).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session31_call.sh; STEPS= a subset
# of "pestcngrm" (default estc; they run in the order p e s m n g t r c; t, r and c run on an H200
# only unless FORCE_TC=1); CAP= seconds (default 560). Step c's CLI runs print their
# load_phases (since session 31) in the stats JSON. SESSION (default session31) tags the
# result files: sessions after 31 reuse this script with SESSION=sessionNN.
CAP=${CAP:-560}
S=${SESSION:-session31}
. benchmarks/gpu_call_setup.sh
STEPS=${STEPS:-estc}
on() { [[ $STEPS == *$1* ]]; }
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
W8="qkv=st4_k2048_p4_w8,gate_up=st2_k2048_p8_w8"
if on p; then
  timeout -s KILL $(left 200) python3 -m benchmarks.l2_side_stream --tiling qkv=4:4:8,gate_up=2:8:8 \
    --arms ${PARMS:-base,pf:8:16,pf:16:16,pf:24:16,pf:32:16,pf:16:4,pf:16:64,pf:16:16:256,base} \
    --repeats 20 --out $OUT/l2_side_stream_${S}_$G.json 2>&1 | cut -c1-300
  echo "p done at $SECONDS s"
fi
if on e; then
  A=/tmp/ab31; rm -rf $A; mkdir -p $A
  erun() { [ $SECONDS -lt $((CAP - 45)) ] && timeout -s KILL $(left 100) $D --batch 1 \
    --temperature 0 --k 0 "${@:2}" --out $A/$1.json 2>&1 | grep -E "rror" | cut -c1-300; }
  arm() { case $1 in default) erun default_p$2 ;; fold) erun fold_p$2 --stream-set \
      qkv.fold_sums=1,gate_up.fold_sums=1 ;;
    w8) erun w8_p$2 --stream-tiling $W8 ;;
    w8o) erun w8o_p$2 --stream-tiling $W8,o=st2_k2048_p2_w8 ;;
    w8x2) erun w8x2_p$2 --stream-tiling qkv=st4_k2048_p2_w8,gate_up=st2_k2048_p4_w8 ;;
    w8d) erun w8d_p$2 --stream-tiling $W8,down=st1_k512_p2_w8 ;;
    k512) erun k512_p$2 --stream-tiling qkv=st4_k512_p4_w4,gate_up=st2_k512_p8_w4 ;;
    w16) erun w16_p$2 --stream-tiling qkv=st4_k2048_p4_w16,gate_up=st2_k2048_p8_w16 ;;
    w16q8) erun w16q8_p$2 --stream-tiling qkv=st8_k2048_p2_w16,gate_up=st2_k2048_p8_w16 ;;
    a256w8) erun a256w8_p$2 --decode-kernel num_splits=1,block_t=256,num_warps=8,num_stages=1 ;;
    a128w8) erun a128w8_p$2 --decode-kernel num_splits=1,block_t=128,num_warps=8,num_stages=2 ;;
    a128w4) erun a128w4_p$2 --decode-kernel num_splits=1,block_t=128,num_warps=4,num_stages=2 ;;
    om) erun om_p$2 --decode-kernel o_merge=1 ;;
    om4) erun om4_p$2 --decode-kernel o_merge=1 --stream-tiling o=st4_k512_p2_w4 ;;
    om44) erun om44_p$2 --decode-kernel o_merge=1 --stream-tiling o=st4_k512_p4_w4 ;;
    omk) erun omk_p$2 --decode-kernel o_merge=1 --stream-tiling o=st2_k2048_p2_w8 ;;
    o4) erun o4_p$2 --stream-tiling o=st4_k512_p2_w4 ;;
    ev) erun ev_p$2 --stream-set qkv.evict_first=1,o.evict_first=1,gate_up.evict_first=1,down.evict_first=1 ;;
    noev) erun noev_p$2 --stream-set qkv.evict_first=0,o.evict_first=0,gate_up.evict_first=0,down.evict_first=0 ;;
    pick) erun pick_p$2 --stream-tiling $PICK ;;  # (session 35: PICK, a sweep's pick)
    d2) erun d2_p$2 --stream-tiling qkv=st4_k2048_p4_w8_d2,gate_up=st2_k2048_p8_w8_d2,o=st2_k512_p2_w4_d2,down=st1_k512_p4_w4_d2 ;;
    lcpdl) erun lcpdl_p$2 --decode-kernel last_combine=1,pdl=1 ;;
    lc) erun lc_p$2 --decode-kernel last_combine=1 ;;
  esac; }
  # (session 31's second call ran "default w8 w8o w8x2 w8d fold", before w8 became the
  # default; since then default = w8, and k512 is the old tiling)
  EARMS=${EARMS:-"default k512"}
  PASSES=${PASSES:-3}
  for p in $(seq 1 $PASSES); do
    [ $((p % 2)) = 0 ] && order=$(echo $EARMS | tr ' ' '\n' | tac) || order=$EARMS
    for a in $order; do arm $a $p; done
  done
  ls $A/*.json >/dev/null 2>&1 && python3 -m benchmarks.ab_arms $A $OUT/ab_b1_${AB_NAME:-k2048w8}_${S}_$G.json
  echo "e done at $SECONDS s"
fi
if on s && [ $SECONDS -lt $((CAP - 60)) ]; then
  timeout -s KILL $(left 120) $D --batch 1,8 --temperature 0 --k 0,4 --repeats 1 \
    --stream-tiling $W8 --out $OUT/decode_w8_spec_${S}_$G.json 2>&1 \
    | grep -E "^ *[0-9]+ +(native|spec)|rror" | cut -c1-300
  python3 -c "import json,sys; print('greedy_token_match', json.load(open(sys.argv[1]))['greedy_token_match'])" \
    $OUT/decode_w8_spec_${S}_$G.json 2>&1 | cut -c1-400
  echo "s done at $SECONDS s"
fi
if on m && [ $SECONDS -lt $((CAP - 60)) ]; then
  # session 32: o_merge (the o GEMV merges the decode splits): its GPU test, then greedy
  # native against k=4 d=2 speculative tokens with it, batch 1
  timeout -s KILL $(left 120) python3 -m pytest -q -s -m gpu tests/test_gemv_merge.py 2>&1 \
    | grep -E "passed|failed|bit-equal|Error|assert" | tail -8 | cut -c1-300
  timeout -s KILL $(left 120) $D --batch 1 --temperature 0 --k 0,4 --repeats 1 \
    --decode-kernel o_merge=1 --out $OUT/decode_o_merge_spec_${S}_$G.json 2>&1 \
    | grep -E "^ *[0-9]+ +(native|spec)|rror" | cut -c1-300
  python3 -c "import json,sys; print('greedy_token_match', json.load(open(sys.argv[1]))['greedy_token_match'])" \
    $OUT/decode_o_merge_spec_${S}_$G.json 2>&1 | cut -c1-400
  echo "m done at $SECONDS s"
fi
if on n && [ $SECONDS -lt $((CAP - 90)) ]; then
  . benchmarks/gpu_ncu.sh
  NCU_TAG=_$S
  ncu_run b1_w8 90 'gemv_stream|paged_decode_attention' 300 6 $D --batch 1 --temperature 0 \
    --k 0 --repeats 1 --warmup 0 --new-tokens 8 --compile-cache /tmp/cc_ncu
  mv $OUT/ncu_b1_w8_log.txt $OUT/ncu_b1_w8_${S}_${G}_log.txt 2>/dev/null
  echo "n done at $SECONDS s"
fi
if on g && [ $SECONDS -lt $((CAP - 60)) ]; then
  timeout -s KILL $(left 240) python3 -m pytest -q -m gpu tests/test_gemv_stream.py \
    tests/test_graph_loop.py tests/test_gemv_flow.py 2>&1 \
    | grep -E "passed|failed|Error|assert" | tail -8 | cut -c1-400
  echo "g done at $SECONDS s"
fi
TC=${FORCE_TC:-0}; [ $G = h200 ] && TC=1
if on t && [ $TC = 1 ] && [ $SECONDS -lt $((CAP - 90)) ]; then
  timeout -s KILL $(left 150) $D --batch 1 --k 0,2,4 --temperature 0,0.8 \
    --out $OUT/decode_b1_${S}_$G.json 2>&1 | grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth"
  echo "t done at $SECONDS s"
fi
if on r && [ $TC = 1 ] && [ $SECONDS -lt $((CAP - 120)) ]; then
  # the table cells session 31's H200 calls did not rerun: k=2 greedy beyond batch 1, and
  # speculative T=0.8 beyond batch 1
  timeout -s KILL $(left 300) $D --batch 8,32,64 --k 2,4 --temperature 0,0.8 \
    --out $OUT/decode_rest_${S}_$G.json 2>&1 | grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth"
  echo "r done at $SECONDS s"
fi
if on c && [ $TC = 1 ] && [ $SECONDS -lt $((CAP - 90)) ]; then
  STEPS=3 CLI_K="0 4" TAG=_$S CAP=$(left 150) OUT=$OUT \
    bash benchmarks/gpu_session19_call.sh 2>&1 | tail -12
  echo "c done at $SECONDS s"
fi
echo "elapsed $SECONDS s"
