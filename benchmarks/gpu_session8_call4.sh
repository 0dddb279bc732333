#!/usr/bin/env bash
# Session 8, device call 4 (~4 min): the add_norm prologue is paid once per program, and the
# batch-1 trace (kernel_trace_session8_b1_h200.json) shows it costs ~3 us on qkv (11.5 us with
# add_norm vs 8.5 us with the plain norm) and ~2.3 us on gate/up (15.9 vs 13.6 alone): with
# one-row blocks and 4 per program each program reads as many prologue bytes from L2 (x, the
# branch, two norm weights: 16 KB) as weight bytes from HBM. Session 7 tuned the tilings
# without the prologue. A/B at batch 1, native greedy, same call: more rows per program for
# the two add_norm projections.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
timeout 55 $D --out $OUT/ab_tiling_default_b1_session8_h200.json 2>&1 | grep -E "^ *1 native|rror"
for v in st2_k512_p8_w4 st2_k512_p16_w4 st4_k512_p4_w8; do
  timeout 60 $D --stream-tiling qkv=$v,gate_up=$v --out $OUT/ab_tiling_${v}_b1_session8_h200.json \
    2>&1 | grep -E "^ *1 native|rror"
done
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
