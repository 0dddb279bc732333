#!/usr/bin/env bash
# Session 16 call 1: the lossless 12-bit packed GEMV (pallas_kernels/gemv_packed.py) on the
# GPU: its GPU tests (two tilings against the streaming GEMV, escapes included), then
# benchmarks.gemv_packed: device time per call per projection and tiling against the
# engine's streaming bf16 GEMV and the 24-layer four-projection chain, first on weights with
# no escaping chunk (--no-escapes: the kernel without its escape path, the ceiling), then on
# the plain Gaussian weights (3-6% of chunks escape) for the two low-register tilings.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session16_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 150 python3 -m pytest -q -x tests/test_gemv_packed.py -k gpu 2>&1 | tail -15
timeout 250 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_packed --layers 24 \
  --no-escapes --out $OUT/gemv_packed_noesc_session16_h200.json 2>&1 | cut -c1-400
timeout 150 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_packed --layers 24 \
  --tilings b2_p4_w4,b4_p2_w4 --out $OUT/gemv_packed_esc_session16_h200.json 2>&1 | cut -c1-400
