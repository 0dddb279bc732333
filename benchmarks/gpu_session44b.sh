#!/usr/bin/env bash
# Session 44's second call (the first, gpu_session44_call.sh, came on an H100 and ran its
# PART=next). Whichever card comes:
#   On an H200: the decode table at session 43's default beside the previous default
#     (--projections gemv+norms+stream --decode-kernel ragged_from=0), batch 1,8,32,64,
#     k 0,4, greedy, in the order now, before, now (the first process pays the compiles):
#     whether k=4 stays no slower than native at batch 64 there (1.01x on the H100).
#   On any other card: kernel traces of native decode (k 0) at batch 1 and 64 with today's
#     default, prefill subtracted: how much of a native step is kernels and how much gaps,
#     beside the k=4 round's traces of the first call.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=570] bash benchmarks/gpu_session44b.sh
S=${SESSION:-session44}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2"
T="python3 -m benchmarks.kernel_trace --synthetic 1.4b --attention pallas --new-tokens 32 --top 25 --minus-prefill"
if [ $G = h200 ]; then
  for arm in now before now2; do
    case $arm in
      now|now2) a="" ;;
      before) a="--projections gemv+norms+stream --decode-kernel ragged_from=0" ;;
    esac
    echo "== $arm"
    timeout -s KILL $(left 180) $D --batch 1,8,32,64 --k 0,4 $a \
      --out $OUT/decode_${arm}_${S}_$G.json 2>&1 | grep -A12 "^  B mode"
  done
else
  for b in 1 64; do
    timeout -s KILL $(left 120) $T --batch $b --k 0 \
      --out $OUT/kernel_trace_b${b}_k0_${S}_$G.json 2>&1 | grep -v "^ *$" | \
      sed -n '/^{/p;/decode only/,/^  top_kinds/p' | head -40
  done
fi
echo "elapsed ${SECONDS}s"
