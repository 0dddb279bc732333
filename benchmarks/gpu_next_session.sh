#!/usr/bin/env bash
# Prepared at the end of session 7 for the next session (issue 6), device call A (~8 min):
#   1. GPU tests of the streaming GEMV (the revised row-count test's result did not come back
#      in session 7; now also row2d) and of the fused decode kernel.
#   2. One-row microbenchmark: the engine's streaming tilings with and without row2d (rows
#      loaded as [1, block_k] tiles: fewer registers and barriers in the offline sm_90
#      compile), one-block tilings, one warp per output row.
#   3. Batch-1 native A/Bs of the default: one-block tilings, row2d, and XLA command buffers
#      over while loops (no gain in session 2 with ~20 kernels per layer application; now ~5).
# Call B (gpu_next_session_b.sh): the lost batch-1 cells and a kernel trace.
# A .partial file is deleted only when its finished JSON exists (session 7 lost rows by
# deleting the partial of a command that timed out); at most 8 files come back per call.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv_stream.py \
  tests/test_pallas_kernels.py -k "stream or fused" 2>&1 | tail -2
V=st1_k512_p4_w4,st1_k512_p4_w4_x2d,st2_k512_p2_w4,st2_k512_p2_w4_x2d,st1_k512_p1_w4
V=$V,st1_k512_p1_w4_x2d,st4_k256_p1_w4,st4_k256_p1_w4_x2d,st8_k256_p1_w8_x2d
timeout 150 python3 -m benchmarks.gemv --rows 1 --variants $V \
  --out $OUT/gemv_stream_x2d_h200.json 2>&1 | grep -v Warning
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
timeout 45 $D --out $OUT/ab_stream_default_b1_h200.json 2>&1 | grep -E "^ *1 native"
X2=qkv=st1_k512_p4_w4_x2d,o=st2_k512_p2_w4_x2d,gate_up=st1_k512_p4_w4_x2d,down=st1_k512_p4_w4_x2d
timeout 45 $D --stream-tiling $X2 --out $OUT/ab_stream_x2d_b1_h200.json 2>&1 | grep -E "^ *1 native"
P1=qkv=st1_k512_p1_w4,o=st1_k512_p1_w4,gate_up=st1_k512_p1_w4
timeout 45 $D --stream-tiling $P1 --out $OUT/ab_stream_p1_b1_h200.json 2>&1 | grep -E "^ *1 native"
XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL \
  timeout 45 $D --out $OUT/ab_cmdbuf_b1_h200.json 2>&1 | grep -E "^ *1 native"
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
