#!/usr/bin/env bash
# Prepared at the end of session 7 for the next session (issue 6), one device call, ~9 minutes.
#   1. GPU tests of the streaming GEMV (the revised row-count test's result did not come back
#      in session 7) and of the fused decode kernel.
#   2. Batch-1 cells of the new default ('gemv+norms+stream') that session 7 lost: k=2, and
#      T=0.8 native and k=4 (native greedy again, for the same-call comparison).
#   3. The one-block streaming tilings end to end (session 7's second microbenchmark round).
#   4. XLA command buffers over while loops (CUDA graphs) at batch 1: no gain in session 2
#      with ~20 kernels per layer application; now there are ~5 plus their launch gaps.
#   5. A batch-1 kernel trace of the new default (what is left per layer application).
# A .partial file is deleted only when its finished JSON exists (session 7 lost rows by
# deleting the partial of a command that timed out); at most 8 files come back per call.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv_stream.py \
  tests/test_pallas_kernels.py -k "stream or fused" 2>&1 | tail -2
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 240 $D --batch 1 --k 0,2,4 --temperature 0,0.8 \
  --out $OUT/decode_default_b1_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
P1=qkv=st1_k512_p1_w4,o=st1_k512_p1_w4,gate_up=st1_k512_p1_w4
timeout 60 $D --batch 1 --k 0 --temperature 0 --stream-tiling $P1 \
  --out $OUT/ab_stream_p1_b1_h200.json 2>&1 | grep -E "^ *1 native"
XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL \
  timeout 45 $D --batch 1 --k 0 --temperature 0 --out $OUT/ab_cmdbuf_b1_h200.json 2>&1 \
  | grep -E "^ *1 native"
timeout 90 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 20 --out $OUT/kernel_trace_stream_norms_b1_h200.json 2>&1 | grep -v Memcpy | tail -34
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
