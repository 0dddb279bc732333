#!/usr/bin/env bash
# Session 14 (issue 6), third call. Call 2 (ab_l2_next_b1_session14_h200.json): the late
# prefetch of the next weight is level at call 1's size (241.4 / 241.2 vs 240.6 / 241.6) and
# slower when larger (228, 216) or alone per pair (237-239); 2 and 4 decode splits 227.4 and
# 234.6. L2 prefetch does not pay. Now a cost model and the tiling sweep prepared in
# session 13:
#   1. benchmarks.gemv_scaling: device time per call against bytes (1x, 2x, 4x the rows),
#      fixed cost + steady bandwidth per projection, and XLA's read and copy bandwidth;
#   2. step 1 of benchmarks/gpu_next_session.sh: the streaming GEMV's tilings ranked by
#      device time, then `--pick`.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session14_call3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 170 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_scaling \
  --out $OUT/gemv_scaling_session14_h200.json 2>&1 | grep -vE "^\s*$|Warning|warn" | cut -c1-200
V=engine,st4_k512_p4_w4,st4_k512_p8_w4,st4_k512_p2_w4,st2_k512_p8_w4,st2_k512_p4_w4,st2_k512_p16_w4,st1_k512_p4_w4,st1_k512_p8_w2,st8_k512_p2_w4
timeout 190 python3 -W ignore::DeprecationWarning -m benchmarks.gemv --device-time --prologue add_norm --variants $V \
  --shapes qkv,gate_up --rows 1 --out $OUT/gemv_stream_add_norm_device_session14_h200.json 2>&1 | grep -E "device|rror" | cut -c1-160
timeout 150 python3 -W ignore::DeprecationWarning -m benchmarks.gemv --device-time --variants $V,st2_k512_p2_w4,st1_k512_p2_w4 \
  --shapes o,down --rows 1 --out $OUT/gemv_stream_plain_device_session14_h200.json 2>&1 | grep -E "device|rror" | cut -c1-160
for f in $OUT/gemv_stream_*_device_session14_h200.json; do python3 -m benchmarks.gemv --pick $f; done
