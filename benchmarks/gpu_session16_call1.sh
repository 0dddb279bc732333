#!/usr/bin/env bash
# Session 16 call 1: the lossless 12-bit packed GEMV (pallas_kernels/gemv_packed.py) on the
# GPU: its tests (bit-level round trip on the device, every tiling against the streaming
# GEMV), then benchmarks.gemv_packed: device time per call per projection and tiling against
# the engine's streaming bf16 GEMV, and the 24-layer four-projection chain.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session16_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 150 python3 -m pytest -q -x tests/test_gemv_packed.py -k gpu 2>&1 | tail -15
timeout 400 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_packed --layers 24 \
  --out $OUT/gemv_packed_session16_h200.json 2>&1 | cut -c1-400
