#!/usr/bin/env bash
# Session 44's second call (the first, gpu_session44_call.sh, came on an H100 and ran its
# PART=next). Whichever card comes:
#   On an H200: the decode table at session 43's default beside the previous default
#     (--projections gemv+norms+stream --decode-kernel ragged_from=0), batch 1,8,32,64,
#     k 0,4, greedy, in the order now, before, now (the first process pays the compiles):
#     whether k=4 stays no slower than native at batch 64 there (1.01x on the H100).
#     (The previous default also had finished rows attend over their whole context:
#     skip_done=0.)
#   On any other card: finished rows skipping their context (ouro_jax.attention.SKIP_DONE,
#     the default) against not (--decode-kernel skip_done=0), batch 8,32,64, k 0,4, in the
#     order skip, noskip, skip; then kernel traces of native decode (k 0) at batch 64 and 1,
#     prefill subtracted, in what is left of CAP.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=570] bash benchmarks/gpu_session44b.sh
S=${SESSION:-session44}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2"
T="python3 -m benchmarks.kernel_trace --synthetic 1.4b --attention pallas --new-tokens 32 --top 25 --minus-prefill"
if [ $G = h200 ]; then
  for arm in now before now2; do
    case $arm in
      now|now2) a="" ;;
      before) a="--projections gemv+norms+stream --decode-kernel ragged_from=0,skip_done=0" ;;
    esac
    echo "== $arm"
    timeout -s KILL $(left 180) $D --batch 1,8,32,64 --k 0,4 $a \
      --out $OUT/decode_${arm}_${S}_$G.json 2>&1 | grep -A12 "^  B mode"
  done
else
  for arm in skip noskip skip2; do
    case $arm in
      skip|skip2) a="" ;;
      noskip) a="--decode-kernel skip_done=0" ;;
    esac
    echo "== $arm"
    timeout -s KILL $(left 170) $D --batch 8,32,64 --k 0,4 $a \
      --out $OUT/decode_${arm}_${S}_$G.json 2>&1 | grep -A12 "^  B mode"
  done
  for b in 64 1; do
    timeout -s KILL $(left 100) $T --batch $b --k 0 \
      --out $OUT/kernel_trace_b${b}_k0_${S}_$G.json 2>&1 | grep -v "^ *$" | \
      sed -n '/^{/p;/decode only/,/^  top_kinds/p' | head -30
  done
fi
echo "elapsed ${SECONDS}s"
