#!/usr/bin/env bash
# Session 4, device call 4 (issue 6): batch 1 with one-row GEMV projections (the default after
# call 3 showed 5-row GEMVs slow verification), two projection subsets (the GEMV is slower
# than XLA alone for qkv and down), k=2 at batch 64, batch-8 speculative with
# one decode split (before the split rule). ~5.5 minutes, most important first.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session4_call4.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 130 $D --batch 1 --k 0,2,4 --temperature 0 --out $OUT/decode_session4_b1_h200.json 2>&1 | grep -v "^{" | tail -5
rm -f $OUT/*.partial
for P in gemv:qkv,o,gate_up gemv:o,gate_up,down; do
  timeout 40 $D --batch 1 --k 0 --temperature 0 --projections $P \
    --out $OUT/ab_proj_${P//[:,]/_}_b1_h200.json 2>&1 | grep -E "^ *1 native"
done
timeout 75 $D --batch 64 --k 2 --temperature 0 --out $OUT/decode_session4_k2_b64_h200.json 2>&1 | grep -v "^{" | tail -2
rm -f $OUT/*.partial
timeout 50 $D --batch 8 --k 4 --temperature 0 --decode-kernel num_splits=1 \
  --out $OUT/ab_splits1_b8_spec_h200.json 2>&1 | grep -E "^ *8 spec"
rm -f $OUT/*.partial; ls $OUT
