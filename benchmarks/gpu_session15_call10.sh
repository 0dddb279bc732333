#!/usr/bin/env bash
# Session 15 call 10: are the ~3.5 us gaps between Mosaic GPU kernels (call 2) host launch
# cost? The Mosaic PDL chain again, without and with XLA command buffers (CUDA graphs) that
# capture custom calls.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session15_call10.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 200 python3 -W ignore::DeprecationWarning -m benchmarks.mgpu_pdl_chain --layers 24 \
  --steps 0,last --out $OUT/mgpu_pdl_chain_b_session15_h200.json 2>&1 | cut -c1-300
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1" \
  timeout 200 python3 -W ignore::DeprecationWarning -m benchmarks.mgpu_pdl_chain --layers 24 \
  --steps 0,last --out $OUT/mgpu_pdl_chain_cmdbuf_session15_h200.json 2>&1 | cut -c1-300
