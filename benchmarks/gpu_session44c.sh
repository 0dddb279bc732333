#!/usr/bin/env bash
# Session 44's short call (gpu_session44b.sh cut to what ~450 s of a lease can hold, after
# failed starts took the rest of the budget). Whichever card comes:
#   On an H200: session 44's default (finished rows skip their context, '+inv', ragged
#     decode from batch 64) then the defaults before session 43 (--projections
#     gemv+norms+stream --decode-kernel ragged_from=0,skip_done=0), batch 1,8,32,64, k 0,4.
#   Elsewhere: skip (the default), noskip (--decode-kernel skip_done=0), skip again, k=4 at
#     batch 32 and 64 (native decode is unchanged by it here: every row finishes at the
#     same step), with native batch 32,64 in the first arm.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=450] bash benchmarks/gpu_session44c.sh
S=${SESSION:-session44}
CAP=${CAP:-450}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2"
show() { grep -A12 "^  B mode"; }
if [ $G = h200 ]; then
  timeout -s KILL $(left 240) $D --batch 1,8,32,64 --k 0,4 \
    --out $OUT/decode_now_${S}_$G.json 2>&1 | show
  timeout -s KILL $(left 240) $D --batch 1,8,32,64 --k 0,4 --projections gemv+norms+stream \
    --decode-kernel ragged_from=0,skip_done=0 --out $OUT/decode_before_${S}_$G.json 2>&1 | show
else
  timeout -s KILL $(left 160) $D --batch 32,64 --k 0,4 \
    --out $OUT/decode_skip_${S}_$G.json 2>&1 | show
  timeout -s KILL $(left 140) $D --batch 32,64 --k 4 --decode-kernel skip_done=0 \
    --out $OUT/decode_noskip_${S}_$G.json 2>&1 | show
  timeout -s KILL $(left 100) $D --batch 32,64 --k 4 \
    --out $OUT/decode_skip2_${S}_$G.json 2>&1 | show
fi
echo "elapsed ${SECONDS}s"
