#!/usr/bin/env bash
# Session 16 call 2: what call 1 did not reach (its benchmark runs hit their time limits
# before writing; their rows are in gemv_packed_call1_session16_h200.jsonl): the packed
# GEMV's GPU tests, then down without escapes on four tilings (results now saved per
# projection).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session16_call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 200 python3 -m pytest -q -x tests/test_gemv_packed.py -k gpu 2>&1 | tail -6
timeout 150 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_packed --layers 24 \
  --no-escapes --projections down --tilings b2_p4_w4,b4_p2_w4,b1_p4_w2,b8_p1_w8 \
  --out $OUT/gemv_packed_down_noesc_session16_h200.json 2>&1 | cut -c1-300
