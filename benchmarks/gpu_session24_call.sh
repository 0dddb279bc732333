#!/usr/bin/env bash
# Session 24's GPU call: the attention and the next layer's o in one kernel (gemv_flow
# [attention, o], benchmarks.flow_layer's ao arms), so that o's weights stream while the
# attention's latency chain runs; against the engine's kernels and session 23's flow5.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session24_call.sh
# LAYER_ARMS= overrides the arms; CAP= seconds for the whole call (default 570). The
# results are named by the card (h200 / h100), read from nvidia-smi.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
CAP=${CAP:-570}
DEV=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$DEV" in *H200*) D=h200 ;; *H100*) D=h100 ;; *) D=gpu ;; esac
echo "device: $DEV"
ARMS=${LAYER_ARMS:-separate,merged,ao,ao_n8,ao_n4,ao_n16,ao_n8_ns2,flow5,separate}
timeout $((CAP - 20)) python3 -m benchmarks.flow_layer --layers 8 --arms $ARMS \
  --out $OUT/flow_layer_ao_session24_$D.json 2>&1 | grep -E '^\{|rror' | cut -c1-400
echo "elapsed $SECONDS s"
