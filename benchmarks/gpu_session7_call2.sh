#!/usr/bin/env bash
# Session 7, device call 2 (issue 6): the streaming GEMV's GPU tests (row-count bit identity),
# its second tiling round at one row, batch-1 native A/B of the GEMV against '+stream' and
# '+norms+stream', batch-1 speculative with '+stream', then the greedy table at batch 8/32/64
# (native and d=2 k=2/4) on the final fused decode kernel.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session7_call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv_stream.py 2>&1 | tail -2
V=st1_k512_p2_w4,st1_k512_p1_w4,st2_k512_p1_w4,st1_k256_p2_w4,st1_k512_p2_w8,st2_k1024_p1_w4
V=$V,st1_k512_p4_w4,st2_k512_p2_w4
timeout 100 python3 -m benchmarks.gemv --rows 1 --variants $V \
  --out $OUT/gemv_stream2_session7_h200.json 2>&1 | grep -v Warning
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --temperature 0"
for P in gemv gemv+stream gemv+norms+stream; do
  timeout 45 $D --batch 1 --k 0 --projections $P \
    --out $OUT/ab_${P//+/_}_b1_session7_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
done
timeout 60 $D --batch 1 --k 4 --projections gemv+norms+stream \
  --out $OUT/decode_session7_stream_norms_b1_k4_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
timeout 250 $D --batch 8,32,64 --k 0,2,4 --out $OUT/decode_session7_greedy_h200.json 2>&1 \
  | grep -E "^ *[0-9]+ (native|spec)"
ls $OUT
