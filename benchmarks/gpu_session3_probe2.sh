#!/usr/bin/env bash
# Session 3, second probe: combined attention tuning variants (short and long contexts), and
# XLA's exhaustive Triton tiling search at batch 64. Usage: OUT=dir bash benchmarks/gpu_session3_probe2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 230 python3 benchmarks/attention_kernels.py --variant-set combo \
  --points decode:64:160,decode:64:512,decode:64:2048,decode:8:160,decode:1:160,decode:1:2048,verify:64:160 \
  --out $OUT/attention_combo_sweep_h200.json 2>&1 | grep -v Warning | grep -v "^copy\|^kernel"
XLA_FLAGS="--xla_gpu_exhaustive_tiling_search=true --xla_gpu_per_fusion_autotune_cache_dir=/tmp/atc" timeout 250 \
  python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc \
  --batch 64 --k 0 --temperature 0 --out $OUT/decode_exhaustive_tiling_b64_h200.json 2>&1 | tail -2
