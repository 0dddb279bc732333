#!/usr/bin/env bash
# Session 8, device call 2 (~9 min), on a warm machine after call 1 (gpu_session8_pdl.sh), whose
# probe with xla_gpu_enable_pdl=true was cut off by the time-out (its slow binary scan, since fixed):
#   1. Batch-1 default (gemv+norms+stream) k=0,2,4 x T=0,0.8: session 7's lost cells.
#   2. Batch-1 native A/B of the streaming tilings: row2d (x2d) and one output block per program.
#   3. Batch-1 native with xla_gpu_enable_pdl=true, time-boxed (does the decode step hang too?).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1"
timeout 250 $D --k 0,2,4 --temperature 0,0.8 --out $OUT/decode_session8_b1_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
X2=qkv=st1_k512_p4_w4_x2d,o=st2_k512_p2_w4_x2d,gate_up=st1_k512_p4_w4_x2d,down=st1_k512_p4_w4_x2d
timeout 60 $D --k 0 --temperature 0 --stream-tiling $X2 --out $OUT/ab_stream_x2d_b1_session8_h200.json 2>&1 | grep -E "^ *1 native|rror"
P1=qkv=st1_k512_p1_w4,o=st1_k512_p1_w4,gate_up=st1_k512_p1_w4
timeout 60 $D --k 0 --temperature 0 --stream-tiling $P1 --out $OUT/ab_stream_p1_b1_session8_h200.json 2>&1 | grep -E "^ *1 native|rror"
XLA_FLAGS=--xla_gpu_enable_pdl=true timeout 80 $D --k 0 --temperature 0 --out $OUT/ab_pdl_on_b1_session8_h200.json 2>&1 | grep -E "^ *1 native|rror"
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
