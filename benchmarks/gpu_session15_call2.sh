#!/usr/bin/env bash
# Session 15 call 2: PDL placed by the kernel (Mosaic GPU GEMV, gemv_mgpu_areg pdl_step).
#   1. GPU tests: a 12-GEMV chain with PDL equals the chain without, bit for bit.
#   2. benchmarks.mgpu_pdl_chain: 24 layers of qkv -> o -> gate/up -> down (plain one-row
#      GEMVs, own weights per layer): streaming GEMV (engine tilings; XLA's wait at each
#      kernel's start) vs Mosaic without PDL vs Mosaic with the wait after the first weight
#      requests and the trigger at step 0 / 2 / the last step; and Mosaic+PDL on qkv and
#      gate/up with streaming o and down.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session15_call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -W ignore::DeprecationWarning \
  tests/test_gemv_mgpu_areg.py -k pdl 2>&1 | tail -4 | tee $OUT/gpu_tests_mgpu_pdl_session15.txt
timeout 300 python3 -W ignore::DeprecationWarning -m benchmarks.mgpu_pdl_chain --layers 24 \
  --steps 0,2,last --out $OUT/mgpu_pdl_chain_session15_h200.json 2>&1 | cut -c1-600
