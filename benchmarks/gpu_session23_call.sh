#!/usr/bin/env bash
# Session 23's GPU call: the whole decode layer in one kernel (gemv_flow with its attention
# stage, pallas_kernels/flow_attention.py) first, then session 21's prepared steps.
#   a. benchmarks.flow_layer: us per layer application (1.4B shapes, bf16, one row, 160 cached
#      keys): the engine's 6 kernels ('separate'), with the attention's merge in its kernel
#      ('merged': the bits every flow arm must match), '+flow4' + attention (2 kernels),
#      'flow5' (1 kernel), at num_stages 2, with 2 L2-prefetched blocks per waiting program;
#   b. gpu_session21_call.sh with STEPS (default 13: the flow GPU tests, then the batch-1
#      end-to-end A/B of default vs '+flow' vs '+flow4').
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session23_call.sh
# LAYER_ARMS= narrows step a; STEPS=/ARMS= pass to session 21's script (STEPS=0 skips it).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
CAP=${CAP:-570}
timeout 240 python3 -m benchmarks.flow_layer --layers 8 ${LAYER_ARMS:+--arms $LAYER_ARMS} \
  --out $OUT/flow_layer_session23_h200.json 2>&1 | grep -vE "^\s*$|Warning|warn" | cut -c1-400
echo "flow_layer done at $SECONDS s"
[ "${STEPS:-13}" != 0 ] && STEPS=${STEPS:-13} CAP=$((CAP - SECONDS)) OUT=$OUT \
  bash benchmarks/gpu_session21_call.sh
echo "elapsed $SECONDS s"
