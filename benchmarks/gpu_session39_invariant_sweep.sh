#!/usr/bin/env bash
# Prepared in session 38 for the next GPU call: the batch-invariant mode's GEMM tilings
# (ouro_jax.invariant; 2.9x slower than the default at batch 1 on an H100, 0.81x at 64).
# Each 1.4B projection through every GEMM_VARIANTS tiling with its row block fixed, and the
# mode's own tiling ('invariant'), at 1 row (batch-1 decode and draft) and 320 rows (batch-64
# verification at k=4); the fastest tiling over both row counts per projection is the
# candidate for GEMM_TUNING's invariant use (any one tiling per weight keeps the guarantee).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=540] bash benchmarks/gpu_session39_invariant_sweep.sh
S=${SESSION:-session39}
CAP=${CAP:-540}
. benchmarks/gpu_call_setup.sh
for shape in qkv gate_up down o; do
  timeout -s KILL $(left 150) python3 -m benchmarks.gemv --variants gemm_few --fixed-rows \
    --shapes $shape --rows 1,320 --device-time --out $OUT/gemm_invariant_${shape}_${S}_$G.json \
    2>&1 | grep -E "M= ?[0-9]+ " | sort -k5 -n | head -8
done
echo "elapsed ${SECONDS}s"
