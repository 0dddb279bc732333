#!/usr/bin/env bash
# Session 14 (issue 6), sixth call (the last ~5 device minutes). The persistent o -> gate/up
# kernel (pallas_kernels/gemv_chain.py, session 11: 32.5 us per layer at 128 programs against
# 23.9 for the two streaming kernels) keeps only one weight block per program in flight, with
# 128 programs; its barrier also leaves the memory system idle. Its new l2_ahead=N keeps N
# more blocks requested into L2 (N up front, before the barrier for gate/up, then one per
# block), which is what a persistent grid lacks. Fused at N = 0, 2, 6 against the engine's
# two kernels; then the kernel's GPU test (results equal to the two kernels', with and
# without l2_ahead).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session14_call6.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 150 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_chain --programs 128 \
  --l2-ahead 0,2,6 --separate engine --out $OUT/gemv_chain_l2_session14_h200.json 2>&1 | tail -2 | cut -c1-600
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -W ignore::DeprecationWarning \
  tests/test_gemv_chain.py > $OUT/gpu_tests_gemv_chain_session14.txt 2>&1
tail -2 $OUT/gpu_tests_gemv_chain_session14.txt
