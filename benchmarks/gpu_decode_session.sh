#!/usr/bin/env bash
# One device call (~9 min): the decode benchmark on the 1.4B shape (xla attention); the same at
# batch 1/8 with XLA command buffers allowed to capture while loops; batch 1 with unfused
# projections; and the per-part profile of a decode step and a speculative round.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_decode_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee $OUT/gpu.txt
timeout 290 python3 -m benchmarks.decode --synthetic 1.4b --attention xla --batch 1,8,64 \
  --k 0,4 --temperature 0,0.8 --repeats 3 --sweep-branch-scale 0.002,0.003,0.005 \
  --out $OUT/decode_xla_h200.json 2>&1 | tee $OUT/decode_xla_h200.log
SCALE=$(python3 -c "import json;print(json.load(open('$OUT/decode_xla_h200.json'))['branch_scale'])" 2>/dev/null || echo 0.003)
timeout 80 python3 -m benchmarks.profile_round --synthetic 1.4b --attention xla --batch 1,64 \
  --out $OUT/profile_round_h200.json 2>&1 | tee $OUT/profile_round_h200.log
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL" \
timeout 110 python3 -m benchmarks.decode --synthetic 1.4b --attention xla --batch 1,8 \
  --k 0,4 --temperature 0 --repeats 3 --branch-scale $SCALE \
  --out $OUT/decode_xla_cmdbuf_h200.json 2>&1 | tail -6
timeout 45 python3 -m benchmarks.decode --synthetic 1.4b --attention xla --batch 1 --no-fuse \
  --k 0 --temperature 0 --repeats 3 --out $OUT/decode_xla_unfused_h200.json 2>&1 | tail -3
timeout 70 python3 -m benchmarks.decode --synthetic 1.4b --attention xla --batch 1 --unroll-loops \
  --k 0,4 --temperature 0 --repeats 3 --branch-scale $SCALE \
  --out $OUT/decode_xla_unrolled_h200.json 2>&1 | tail -4
