#!/usr/bin/env bash
# Prepared at the end of session 7 for the next session (issue 6), device call B (~7 min):
#   1. Batch-1 cells of the default ('gemv+norms+stream') that session 7 lost: k=2, and
#      T=0.8 native and k=4 (native greedy and k=4 again, for same-call comparisons).
#   2. A batch-1 kernel trace of the default (what is left per layer application).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session_b.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 280 $D --batch 1 --k 0,2,4 --temperature 0,0.8 \
  --out $OUT/decode_default_b1_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
timeout 100 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 20 --out $OUT/kernel_trace_stream_norms_b1_h200.json 2>&1 | grep -v Memcpy | tail -34
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
