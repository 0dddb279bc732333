#!/usr/bin/env bash
# Session 3, probe call: short-context attention tuning, HLO of the B=64 programs, and
# XLA's exhaustive Triton tiling search for the GEMMs. Usage: OUT=dir bash benchmarks/gpu_session3_probe.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 200 python3 benchmarks/attention_kernels.py --points decode:64:160,decode:1:160,decode:8:160,verify:64:160 \
  --out $OUT/attention_short_sweep_h200.json 2>&1 | grep -v Warning | tail -60
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*chunk.*" \
  timeout 150 $D --batch 64 --k 0,4 --temperature 0 --out $OUT/decode_b64_dumprun_h200.json 2>&1 | tail -3
(cd /tmp/dump && ls | head -40 && tar czf $OUT/hlo_b64_chunks.tgz *after_optimizations.txt *buffer-assignment.txt)
XLA_FLAGS=--xla_gpu_exhaustive_tiling_search=true timeout 200 $D --batch 1,64 --k 0 --temperature 0 \
  --out $OUT/decode_exhaustive_tiling_h200.json 2>&1 | tail -3
ls -la $OUT
