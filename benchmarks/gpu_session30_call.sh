#!/usr/bin/env bash
# Session 30's second GPU call, after its first Nsight Compute profile of a batch-1 decode
# step (ncu_b1_session30_h100: the GEMVs hold 40-65% of DRAM peak while they run, 3-4 CTAs
# of 4 warps per SM by their 122-142 registers, the norm-prologue kernels stalled on
# short-scoreboard and barrier more than on memory):
#   n. ncu on the same six kernels with fold_sums on qkv and gate/up (each row statistic
#      through one block-wide reduction, not one per K chunk: 2 instead of 8 per call),
#      with row2d on every projection (x loaded in the weight tile's register layout, no
#      shared-memory re-layout of the prologue's chunks), and on XLA's own dot and an
#      `a + 1` copy of the qkv weight's size (what the same counters read for kernels that
#      are not ours);
#   e. batch-1 native greedy: default, row2d on every projection, fold_sums on qkv and
#      gate/up, and qkv and gate/up with block_k = K = 2048 (one chunk: the prologue
#      converts and reduces once) at 4 and 8 warps ("both" = row2d + fold_sums is an arm
#      EARMS can name), two passes in reverse order (row2d changes no math; fold_sums sums
#      the same terms in another order, so its digest may differ where a rounding falls
#      differently);
#   s. with fold_sums, greedy native against k=4 d=2 speculative tokens (a default must keep
#      them equal);
#   f. the load's non-finite check (convert.load.check_finite) on the 1.4B shape in bf16,
#      first and cached calls (measured on the CPU only: 1.19 / 0.90 s).
# ncu needs XLA's command buffers off (with them the process segfaults under ncu, session
# 30's first try), and runs in its own process group under a hard kill: session 29's and
# 30's first tries, in a pipeline under `timeout`, left the target process holding the
# pipe until the call's limit.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session30_call.sh; STEPS= a subset
# of "nesf" (default nesf; they run in that order); CAP= seconds (default 480).
CAP=${CAP:-480}
. benchmarks/gpu_call_setup.sh
STEPS=${STEPS:-nesf}
NCU_TAG=_session30
on() { [[ $STEPS == *$1* ]]; }
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
R2="qkv.row2d=1,o.row2d=1,gate_up.row2d=1,down.row2d=1"
FOLD="qkv.fold_sums=1,gate_up.fold_sums=1"
. benchmarks/gpu_ncu.sh
if on n; then
  for v in fold row2d; do
    [ $v = fold ] && set_=$FOLD || set_=$R2
    ncu_run b1_$v 90 'gemv_stream|paged_decode_attention' 300 6 $D --batch 1 --temperature 0 \
      --k 0 --repeats 1 --warmup 0 --new-tokens 8 --compile-cache /tmp/cc_ncu_$v --stream-set $set_
  done
  # XLA's dot and copy after two warm-up rounds: ncu profiles from cuProfilerStart on
  # (so the compile's autotuning candidates and the constants' fills are not the kernels
  # it takes; the dot is the one autotuning picked)
  cat > /tmp/ncu_xla.py <<'PY'
import ctypes
import jax, jax.numpy as jnp
w = jnp.ones((6144, 2048), jnp.bfloat16); x = jnp.ones((1, 2048), jnp.bfloat16)
dot = jax.jit(lambda x, w: x @ w.T); add = jax.jit(lambda w: w + 1)
for i in range(4):
    if i == 2:
        ctypes.CDLL("libcuda.so.1").cuProfilerStart()
    jax.block_until_ready((dot(x, w), add(w)))
PY
  NCU_EXTRA="--profile-from-start off" ncu_run xla 60 "." 0 6 python3 /tmp/ncu_xla.py
  cat $OUT/ncu_*_log.txt > $OUT/ncu_logs_session30_$G.txt 2>/dev/null && rm -f $OUT/ncu_*_log.txt
  echo "n done at $SECONDS s"  # (3 raw CSVs and 1 log of 8 files that come back)
fi
if on e; then
  A=/tmp/ab30; rm -rf $A; mkdir -p $A
  erun() { [ $SECONDS -lt $((CAP - 45)) ] && timeout -s KILL $(left 100) $D --batch 1 \
    --temperature 0 --k 0 "${@:2}" --out $A/$1.json 2>&1 | grep -E "tok/s|rror|^  [0-9]" \
    | cut -c1-300; }
  K2="qkv=st4_k2048_p4_w4,gate_up=st2_k2048_p8_w4"
  arm() { case $1 in default) erun default_p$2 ;; row2d) erun row2d_p$2 --stream-set $R2 ;;
    fold) erun fold_p$2 --stream-set $FOLD ;; both) erun both_p$2 --stream-set $R2,$FOLD ;;
    k2048) erun k2048_p$2 --stream-tiling $K2 ;;
    k2048w8) erun k2048w8_p$2 --stream-tiling ${K2//_w4/_w8} ;; esac; }
  EARMS=${EARMS:-"default fold row2d k2048 k2048w8"}
  for a in $EARMS; do arm $a 1; done
  for a in $(echo $EARMS | tr ' ' '\n' | tac); do arm $a 2; done
  ls $A/*.json >/dev/null 2>&1 && python3 -m benchmarks.ab_arms $A $OUT/ab_b1_fold_row2d_session30_$G.json
  echo "e done at $SECONDS s"
fi
if on s && [ $SECONDS -lt $((CAP - 60)) ]; then
  # fold_sums as a default would need greedy speculative tokens equal to native ones
  timeout -s KILL $(left 120) $D --batch 1 --temperature 0 --k 0,4 --repeats 1 \
    --stream-set $FOLD --out $OUT/decode_b1_fold_session30_$G.json 2>&1 \
    | grep -E "^ *[0-9]+ +(native|spec)|rror" | cut -c1-300
  python3 -c "import json,sys; print('greedy_token_match', json.load(open(sys.argv[1]))['greedy_token_match'])" \
    $OUT/decode_b1_fold_session30_$G.json 2>&1 | cut -c1-300
  echo "s done at $SECONDS s"
fi
if on f && [ $SECONDS -lt $((CAP - 30)) ]; then
  timeout -s KILL $(left 60) python3 -m benchmarks.load_check_time \
    --out $OUT/load_check_session30_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-300
  echo "f done at $SECONDS s"
fi
echo "elapsed $SECONDS s"
