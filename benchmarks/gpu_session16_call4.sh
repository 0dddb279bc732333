#!/usr/bin/env bash
# Session 16 call 4: benchmarks.gemv_packed's chain after the review fix (each packed call
# now reads the first K values of the previous output), on weights without escapes and two
# tilings per projection: us per layer of the qkv -> o -> gate/up -> down chain, streaming
# bf16 against packed on each projection's faster tiling.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session16_call4.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 200 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_packed --layers 24 \
  --no-escapes --tilings b2_p4_w4,b4_p2_w4 \
  --out $OUT/gemv_packed_chain_noesc_session16_h200.json 2>&1 | grep -v '"projection"' | cut -c1-300
