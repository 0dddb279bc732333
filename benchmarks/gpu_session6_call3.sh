#!/usr/bin/env bash
# Ran at commit 96159fa, where --kv-write also had "auto" (fused for batches <= 8, the default
# then) and the batch-64 runs took the XLA path; today the fused path is the default everywhere.
# Session 6, device call 3 (issue 6): RoPE + K/V write inside the Pallas decode kernel
# (paged_decode_attention_qkv; default for decode batches <= 8). GPU tests of the fused
# kernel; batch 1 and 8 native with --kv-write xla (control) and the default (native,
# speculative k=2/4 d=2, d=1 k=4); batch-64 d=1 k=2 (XLA write path there); batch-1 T=0.8;
# a batch-1 kernel trace. At most 8 files come back from a call, so runs share files.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session6_call3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pallas_kernels.py -k fused \
  2>&1 | tail -2
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
S="^ *[0-9]+ (native|spec)"
timeout 80 $D --batch 1,8 --k 0 --temperature 0 --kv-write xla \
  --out $OUT/ab_kvwrite_xla_b1_b8_session6_h200.json 2>&1 | grep -E "$S"
timeout 200 $D --batch 1,8 --k 0,2,4 --temperature 0 \
  --out $OUT/decode_session6_rope_b1_b8_h200.json 2>&1 | grep -E "$S"
timeout 80 $D --batch 1,8 --k 4 --draft-loops 1 --temperature 0 \
  --out $OUT/decode_session6_rope_d1_b1_b8_h200.json 2>&1 | grep -E "$S"
timeout 70 $D --batch 1 --k 0,4 --temperature 0.8 \
  --out $OUT/decode_session6_rope_t08_b1_h200.json 2>&1 | grep -E "$S"
timeout 60 $D --batch 64 --k 2 --draft-loops 1 --temperature 0 \
  --out $OUT/decode_session6_d1_k2_b64_h200.json 2>&1 | grep -E "$S"
timeout 60 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 24 --out $OUT/kernel_trace_rope_kv_b1_h200.json 2>&1 | grep -v Memcpy | sed -n '/top_kinds/,$p' | head -24
rm -f $OUT/*.partial*; ls $OUT
