#!/usr/bin/env bash
# Session 6, device call 4 (issue 6): where the fused RoPE + K/V write stops paying: native
# greedy at batch 16 and 32 with --kv-write fused against --kv-write xla.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session6_call4.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
for W in fused xla; do
  timeout 100 $D --batch 16,32 --k 0 --temperature 0 --kv-write $W \
    --out $OUT/ab_kvwrite_${W}_b16_b32_session6_h200.json 2>&1 | grep -E "^ *[0-9]+ native"
done
ls $OUT
