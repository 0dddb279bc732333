#!/usr/bin/env bash
# Session 6, device call 1 (issue 6): software-pipelined GEMV loads (prefetch=P). GPU tests of
# the GEMV (prefetch bit-identity included), the GEMV microbenchmark at one row with prefetch
# variants, and batch-1 native decode with every GEMV at prefetch 0-3 ('gemv+pfN') and with
# the norm prologue at prefetch 2.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session6_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv.py \
  > $OUT/gpu_tests_gemv_session6_h200.log 2>&1; tail -3 $OUT/gpu_tests_gemv_session6_h200.log
V=engine,engine_pf1,engine_pf2,engine_pf3,fma4_k256_w2_pf2,fma4_k256_w2_pf3,fma2_k256_w2_pf3
V=$V,fma4_k512_w4_pf2,fma2_k512_w2_pf2,fma8_k256_w4_pf2,fma8_k512_w4_pf1,fma16_k256_w8_pf2
V=$V,fma2_k1024_w2_pf1,fma4_k1024_w4_pf1,fma4_k512_w4,fma2_k512_w2
timeout 200 python3 -m benchmarks.gemv --rows 1 --variants $V \
  --out $OUT/gemv_prefetch_session6_h200.json 2>&1 | grep -v Warning
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
for P in gemv+pf0 gemv+pf1 gemv+pf2 gemv+pf3 gemv+norms+pf2; do
  timeout 75 $D --batch 1 --k 0 --temperature 0 --projections $P \
    --out $OUT/ab_${P//+/_}_b1_session6_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
done
rm -f $OUT/*.partial*; ls $OUT
