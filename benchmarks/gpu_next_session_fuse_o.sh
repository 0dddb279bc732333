#!/usr/bin/env bash
# Prepared in session 17, which was lent no GPU: the fused decode attention + o projection
# (pallas_kernels/attention_o.py; `--decode-kernel fuse_o=1`) on the H200, in three calls
# of under 10 minutes each, back to back (the compile cache in /tmp/cc lasts while the
# machine stays warm; cold, every arm compiles afresh, which the timeouts allow for).
# Session 11's batch-1 trace has attention 4.4 us + split combine 1.3 + o GEMV 4.0 per layer
# application, plus two kernel boundaries; the fused kernel does all three in one launch.
# It pays if it runs under ~8 us per layer application (a win of ~3 us per layer
# application is ~7% at batch 1, ~258 tok/s).
# Offline sm_90 compiles (Triton 3.9, session 17): 168 registers at block_n 128 / 4 warps /
# block_t 32 (the default; 21.5 KB shared), 168 at block_t 64 (38.9 KB), 167 at block_t
# 128 (73.7 KB); split_keys 167 at block_n 128 / 4 warps (256 programs, resident at 2 per
# SM, which its handover needs) and 156 at block_n 256 / 8 warps (128 programs; at 4 warps
# it spills); no spills in any arm below. Unsplit, the kernel attends over all keys in one
# program per head, and one split cost the decode kernel 4% at batch 1 in session 9: hence
# the arms with longer key blocks (fewer dependent iterations) and split_keys (the head's
# programs each take a split, then wait for the others through a counter and merge).
#   PART=1: the GPU tests (compiled atomics, CTA barriers and the handover against the
#           unfused kernels; split_keys checks its give-up counts), then batch-1 native
#           greedy pass 1: default; fuse_o at block_t 32 / 64 / 128; split_keys at
#           block_n 128 and at 256 with 8 warps.
#   PART=2: pass 2 of the same arms in reverse order, and the default with
#           OURO_JAX_TRACE_ONCE=0 (session 18: every kernel call traced anew, as before; the
#           program XLA compiles should be the same, so should tok/s and the tokens' digest).
#   PART=3: k=4 d=2 greedy, default against fuse_o (the draft runs the one-row kernels;
#           FO_BEST: the tuning keys of the best arm, e.g. o_split=1; default the shipped
#           tuning), and a kernel trace of batch-1 native with it (the fused kernel's time
#           per layer application).
#   PART=4 (session 18): trace, lowering and XLA compile times of the batch-1 prefill,
#           decode and k=4 programs with and without ouro_jax.trace_once, each in a fresh
#           process, then with the persistent cache twice (the second process is the CLI's
#           cached start). On the CPU here, trace + lower: decode 10.41 -> 0.78 s, k=4
#           23.03 -> 1.71 s (lower_time_cuda_cpu_jax0102.json). Each row's compiled_digest
#           (the compiled HLO without names and metadata) should match across sharing.
#   PART=5 (session 18, optional): the user's view of start-up: `python -m ouro_jax.generate`
#           on a synthesized 1.4B bf16 checkpoint, twice with a fresh persistent cache (the
#           second run is a cached start), native then k=4; wall time and the JSON stats
#           (load_s, compile_s) per run -> cli_start_h200.txt.
# Run order if device time is short: 1, 2, 4, 3, 5.
# Usage on the GPU machine: PART=1 OUT=dir bash benchmarks/gpu_next_session_fuse_o.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
PART=${PART:-1}
A=${ARMS:-$OUT/arms}; mkdir -p $A  # ARMS: keep the per-arm JSONs elsewhere
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --temperature 0"
run() { timeout 70 $D "${@:2}" --out $A/$1_p$pass.json 2>&1 | grep -E "rror" ; }
FO="--decode-kernel fuse_o=1"
arms() {  # the arms in the given order
  for arm in "$@"; do
    case $arm in
      default) run default --k 0 ;;
      fo) run fo --k 0 $FO ;;
      fo_t64) run fo_t64 --k 0 $FO,block_t=64 ;;
      fo_t128) run fo_t128 --k 0 $FO,block_t=128 ;;
      fos) run fos --k 0 $FO,o_split=1 ;;
      fos256w8) run fos256w8 --k 0 $FO,o_split=1,o_block_n=256,num_warps=8 ;;
      noshare) OURO_JAX_TRACE_ONCE=0 run noshare --k 0 ;;
    esac
  done
}
case $PART in
  1)
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short \
      -W ignore::DeprecationWarning tests/test_attention_o.py > $OUT/gpu_tests_attention_o.txt 2>&1
    tail -2 $OUT/gpu_tests_attention_o.txt
    pass=1; arms default fo fo_t64 fo_t128 fos fos256w8
    python3 -m benchmarks.ab_arms $A $OUT/ab_fuse_o_b1_p1_h200.json ;;
  2)
    pass=2; arms fos256w8 fos fo_t128 fo_t64 fo default noshare
    python3 -m benchmarks.ab_arms $A $OUT/ab_fuse_o_b1_p2_h200.json ;;
  3)
    F="$FO${FO_BEST:+,$FO_BEST}"
    pass=1; run spec_default --k 4; run spec_fo --k 4 $F
    pass=2; run spec_fo --k 4 $F; run spec_default --k 4
    python3 -m benchmarks.ab_arms $A $OUT/ab_fuse_o_spec_b1_h200.json
    timeout 100 python3 -m benchmarks.kernel_trace --attention pallas --batch 1 --k 0 --top 10 \
      --decode-kernel ${F#--decode-kernel } --out $OUT/kernel_trace_b1_fuse_o_h200.json 2>&1 \
      | grep -E "kernels_per_unit|us  |rror" | cut -c1-160 ;;
  4)
    L="python3 -m benchmarks.lower_time --k 0,4 --compile"
    timeout 330 $L --compare-sharing --out $OUT/lower_time_h200.json 2>&1 | grep -E "run|rror"
    rm -rf /tmp/cc_lt
    timeout 200 $L --runs 2 --compile-cache /tmp/cc_lt --out $OUT/lower_time_cached_h200.json \
      2>&1 | grep -E "run|rror" ;;
  5)
    M=/tmp/ouro_1p4b; C=/tmp/cc_cli; rm -rf $C
    [ -f $M/config.json ] || timeout 200 python3 -m convert.synthesize --preset 1.4b \
      --dtype bf16 --branch-scale 0.003 --norm-jitter 0 --out $M | tail -1
    G="python3 -m ouro_jax.generate --model $M --dtype bf16 --compile-cache $C --max-tokens 64 --ignore-eos
       --json --prompt-ids $(seq -s, 1 128)"
    TIMEFORMAT="wall %R s"
    for k in 0 4; do
      for run in 1 2; do
        echo "k=$k run $run"
        { time timeout 150 $G --speculative-k $k 2>&1 | tail -1 | cut -c1-400 ; } 2>&1
      done
    done | tee $OUT/cli_start_h200.txt ;;
esac
[ -z "${ARMS:-}" ] && rm -rf $A
