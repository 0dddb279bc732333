#!/usr/bin/env bash
# Session 8, device call 1 (~5 min): Programmatic Dependent Launch (XLA's xla_gpu_enable_pdl).
#   1. Which PDL flags this jaxlib has, and whether XLA's kernels and our Pallas kernels carry
#      griddepcontrol instructions with the flag off and on (benchmarks/pdl_probe.py).
#   2. Batch-1 native greedy A/B of the default engine, PDL flag off vs on (same call).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session8_pdl.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
python3 -m benchmarks.pdl_probe --dump /tmp/pdl_off > $OUT/pdl_probe_default_h200.json 2>/dev/null
XLA_FLAGS=--xla_gpu_enable_pdl=true python3 -m benchmarks.pdl_probe --dump /tmp/pdl_on \
  > $OUT/pdl_probe_on_h200.json 2>/dev/null
grep -hE 'xla_gpu|"griddep|ptx"' $OUT/pdl_probe_*_h200.json | sort | uniq -c | head -30
ls /tmp/pdl_on | grep -iE "ptx|triton|llir" | head; grep -lr griddepcontrol /tmp/pdl_on /tmp/pdl_off | head
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
XLA_FLAGS=--xla_gpu_enable_pdl=false timeout 60 $D --out $OUT/ab_pdl_off_b1_h200.json 2>&1 | grep -E "^ *1 native|rror"
XLA_FLAGS=--xla_gpu_enable_pdl=true timeout 60 $D --out $OUT/ab_pdl_on_b1_h200.json 2>&1 | grep -E "^ *1 native|rror"
if grep -q xla_gpu_enable_pdl_launch $OUT/pdl_probe_default_h200.json; then
  XLA_FLAGS="--xla_gpu_enable_pdl=true --xla_gpu_enable_pdl_launch=true" timeout 60 $D \
    --out $OUT/ab_pdl_launch_b1_h200.json 2>&1 | grep -E "^ *1 native|rror"
fi
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
