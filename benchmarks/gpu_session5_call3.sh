#!/usr/bin/env bash
# Session 5, device call 3 (issue 6): RMSNorms and residual adds in the GEMV prologues
# ('gemv+norms') against the default 'gemv' at batch 1, native and speculative k=2/4 greedy,
# the GPU tests of the prologue kernels, and a batch-1 kernel trace with 'gemv+norms'.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session5_call3.sh (<= 7 files)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv.py -k norm \
  > $OUT/gpu_tests_norms_session5_h200.log 2>&1; tail -2 $OUT/gpu_tests_norms_session5_h200.log
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
for P in gemv+norms gemv; do
  timeout 220 $D --batch 1 --k 0,2,4 --temperature 0 --projections $P \
    --out $OUT/ab_proj_${P/+/_}_b1_session5_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
done
timeout 90 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --projections gemv+norms --top 22 --out $OUT/kernel_trace_norms_b1_h200.json 2>&1 \
  | grep -v Memcpy | tail -48
rm -f $OUT/*.partial*; ls $OUT
