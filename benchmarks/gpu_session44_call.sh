#!/usr/bin/env bash
# Prepared in session 43 for the next GPU call (whichever card comes).
#   On an H200 (PART=h200, its default; about 9 minutes):
#     1. the decode table at session 43's default ('+inv', RAGGED_FROM = 64) beside the
#        previous default (--projections gemv+norms+stream --decode-kernel ragged_from=0),
#        batch 1,8,32,64, k 0,4, greedy: the H200 table predates session 43, and whether k=4
#        stays no slower than native at batch 64 there is the line to check (1.01x on an H100);
#     2. the prepared H200 call for the unmet batch-1 line (gpu_session35_call.sh) in what is
#        left of CAP.
#   On any other card (PART=next, its default):
#     1. '+inv' for the verification's calls: --projections gemv+norms+stream+inv@2-320 and
#        @2-160 against the default, batch 32 and 64, k 0,4 (session 42's sweep timed the
#        mode's 320-row GEMMs below XLA's on qkv and gate/up);
#     2. kernel traces of batch 64 k=4 with the ragged decode route and with the decode
#        kernel (--decode-kernel ragged_from=0), prefill subtracted: why the decode kernel
#        slows the round under '+inv' (6,719 against 7,104 tok/s in session 43);
#     3. benchmarks.attention_kernels' decode rows with the ragged route (`[ragged q_len=1]`)
#        at batch 64 over short and long contexts.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [PART=h200|next] [CAP=570] bash
#   benchmarks/gpu_session44_call.sh
S=${SESSION:-session44}
. benchmarks/gpu_call_setup.sh
[ $G = h200 ] && P=${PART:-h200} || P=${PART:-next}
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2"
T="python3 -m benchmarks.kernel_trace --synthetic 1.4b --attention pallas --new-tokens 32 --top 40 --minus-prefill"
table() { grep -A12 "^  B mode"; }
if [ $P = h200 ]; then
  for arm in now before now; do  # (now twice: the first process pays the compiles)
    case $arm in
      now) a="" ;;
      before) a="--projections gemv+norms+stream --decode-kernel ragged_from=0" ;;
    esac
    echo "== $arm"
    timeout -s KILL $(left 170) $D --batch 1,8,32,64 --k 0,4 $a \
      --out $OUT/decode_${arm}_${SECONDS}_${S}_$G.json 2>&1 | table
  done
  CAP=$(left 600) SESSION=$S OUT=$OUT bash benchmarks/gpu_session35_call.sh
else
  for arm in base inv320 inv160 base; do
    case $arm in
      base) a="" ;;
      inv320) a="--projections gemv+norms+stream+inv@2-320" ;;
      inv160) a="--projections gemv+norms+stream+inv@2-160" ;;
    esac
    echo "== $arm"
    timeout -s KILL $(left 120) $D --batch 32,64 --k 0,4 $a \
      --out $OUT/decode_${arm}_${SECONDS}_${S}_$G.json 2>&1 | table
  done
  sel() { grep -v "^ *$" | sed -n '/^{/p;/decode only/,/^ *MemcpyH2D/p' | head -${1:-100}; }
  for r in 64 0; do
    timeout -s KILL $(left 150) $T --batch 64 --k 4 --decode-kernel ragged_from=$r \
      --out $OUT/kernel_trace_b64_k4_r${r}_${S}_$G.json 2>&1 | sel 60
  done
  timeout -s KILL $(left 120) python3 -m benchmarks.attention_kernels --no-sweep \
    --points decode:64:192,decode:64:2048,decode:8:2048 --variant-set short \
    --out $OUT/attention_ragged_decode_${S}_$G.json 2>&1 | tail -30
fi
echo "elapsed ${SECONDS}s"
