#!/usr/bin/env bash
# Prepared at the end of session 9 (issue 6), a second device call for the next session (~5 min):
# the third round of streaming tilings around session 9's add_norm picks (qkv st4_k512_p4_w4,
# gate/up st2_k512_p8_w4; all compile offline without spills except st4_k512_p4_w2 for
# gate/up), then batch-1 native with the fastest per shape against the default, same call.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session10_call2.sh (ran in session 10)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
V=st4_k512_p4_w4,st2_k512_p8_w4,st4_k512_p2_w4,st4_k512_p8_w4,st8_k512_p2_w4,st4_k512_p4_w2
V=$V,st2_k512_p8_w2,st8_k512_p2_w8
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv_stream.py \
  -k "add_norm_tilings" 2>&1 | tail -2
timeout 70 python3 -m benchmarks.gemv --rows 1 --shapes qkv,gate_up --prologue add_norm \
  --variants $V --calls 10 --trials 3 --out $OUT/gemv_stream_add_norm_round3_h200.json 2>&1 \
  | grep -E "^(qkv|gate_up)"
PICK=$(python3 -m benchmarks.gemv --pick $OUT/gemv_stream_add_norm_round3_h200.json)
echo "picked: $PICK"
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
timeout 50 $D --out $OUT/ab_b1_default_round3_h200.json 2>&1 | grep -E "^ *1 native|rror"
[ -n "$PICK" ] && timeout 55 $D --stream-tiling $PICK --out $OUT/ab_b1_tiling_round3_h200.json \
  2>&1 | grep -E "^ *1 native|rror"
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
