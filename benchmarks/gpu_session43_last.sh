#!/usr/bin/env bash
# Session 43's last ~200 s of device time: on an H200 the batch-64 line of "done means" for
# session 43's default (k=4 against native) beside the previous default; on any other card
# '+inv' for the batch-64 verification's 320 rows (inv@2-320) against the default, k=4.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN bash benchmarks/gpu_session43_last.sh
S=${SESSION:-session43}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --batch 64"
if [ $G = h200 ]; then
  $D --k 0,4 --out $OUT/decode_now_b64_${S}_$G.json 2>&1 | grep -A4 "^  B mode"
  $D --k 0,4 --projections gemv+norms+stream --decode-kernel ragged_from=0 \
    --out $OUT/decode_before_b64_${S}_$G.json 2>&1 | grep -A4 "^  B mode"
else
  $D --k 4 --projections gemv+norms+stream+inv@2-320 --out $OUT/decode_inv320_b64_${S}_$G.json 2>&1 | grep -A3 "^  B mode"
  $D --k 4 --out $OUT/decode_now_b64_k4_${S}_$G.json 2>&1 | grep -A3 "^  B mode"
fi
echo "elapsed ${SECONDS}s"
