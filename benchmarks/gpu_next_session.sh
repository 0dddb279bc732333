#!/usr/bin/env bash
# Prepared for the next device session (~9 min): what this session could not run.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
# 1. The current Pallas kernels: GPU tests and the kernel microbenchmark (issue 5).
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rA tests/test_pallas_kernels.py 2>&1 \
  | tee $OUT/pallas_gpu_tests.log | tail -15
timeout 120 python3 benchmarks/attention_kernels.py --quick-sweep --out $OUT/attention_kernels.json \
  2>&1 | tee $OUT/attention_kernels.log | tail -30
# 2. End to end, xla vs pallas at batch 64 with 2k-token prompts (issue 5).
timeout 150 python3 -m benchmarks.attention_e2e --synthetic 1.4b --batch 64 --prompt-len 2048 \
  --new-tokens 32 --out $OUT/attention_e2e_h200.json 2>&1 | tail -4
# 3. Where the time goes in a decode step and a speculative round (issue 6).
timeout 100 python3 -m benchmarks.profile_round --synthetic 1.4b --attention xla --batch 1,64 \
  --out $OUT/profile_round_h200.json 2>&1 | tail -6
# 4. The protocol with the pallas backend (issue 6).
timeout 120 python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --batch 1,64 \
  --k 0,4 --temperature 0 --repeats 3 --branch-scale 0.003 --out $OUT/decode_pallas_h200.json \
  2>&1 | tail -8
