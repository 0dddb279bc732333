#!/usr/bin/env bash
# Session 40, second call: where the batch-invariant mode's time goes, after session 40's
# tiling (o and down at 64-row split-K tiles). Kernel traces (benchmarks.kernel_trace) of
# the mode at batch 1 native and k=4 d=2 and at batch 64 native, and of the default at
# batch 1 native on the same card, for the per-layer-application comparison.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=300] bash benchmarks/gpu_session40_trace.sh
S=${SESSION:-session40}
CAP=${CAP:-300}
. benchmarks/gpu_call_setup.sh
T="python3 -m benchmarks.kernel_trace --synthetic 1.4b --attention pallas --new-tokens 32 --top 30"
timeout -s KILL $(left 120) $T --batch-invariant --batch 1 --k 0,4 \
  --out $OUT/kernel_trace_inv_b1_${S}_$G.json 2>&1 | grep -v "^ *$" | head -90
timeout -s KILL $(left 60) $T --batch 1 --k 0 --top 15 \
  --out $OUT/kernel_trace_default_b1_${S}_$G.json 2>&1 | head -40
timeout -s KILL $(left 90) $T --batch-invariant --batch 64 --k 0 --top 20 \
  --out $OUT/kernel_trace_inv_b64_${S}_$G.json 2>&1 | head -50
echo "elapsed ${SECONDS}s"
