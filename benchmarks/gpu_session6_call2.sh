#!/usr/bin/env bash
# Ran at commit fc50366, where the API was paged_decode_attention(..., new_kv=...) and the flag
# --kvxla; today: paged_decode_attention_qkv and --kv-write xla.
# Session 6, device call 2 (issue 6): decode's K/V write inside the Pallas decode kernel
# (new_kv, the default now) against the separate XLA scatter (--kvxla): GPU tests of the
# fused kernel, then native greedy A/B at batch 1, 8 and 64, and the speculative cells
# (batch 1 k=4 d=2 and d=1, batch 64 d=1 k=2) with the fused write.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session6_call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pallas_kernels.py \
  > $OUT/gpu_tests_attention_session6_h200.log 2>&1; tail -3 $OUT/gpu_tests_attention_session6_h200.log
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --temperature 0"
for B in 1 8 64; do
  for W in fused kvxla; do
    X=""; [ $W = kvxla ] && X="--kvxla"
    timeout 90 $D --batch $B --k 0 $X --out $OUT/ab_kvwrite_${W}_b${B}_session6_h200.json 2>&1 \
      | grep -E "^ *$B (native|spec)"
  done
done
timeout 100 $D --batch 1 --k 4 --out $OUT/decode_session6_b1_k4_d2_h200.json 2>&1 | grep -E "^ *1 spec"
timeout 100 $D --batch 1 --k 4 --draft-loops 1 --out $OUT/decode_session6_b1_k4_d1_h200.json 2>&1 | grep -E "^ *1 spec"
timeout 110 $D --batch 64 --k 2 --draft-loops 1 --out $OUT/decode_session6_b64_k2_d1_h200.json 2>&1 | grep -E "^ *64 spec"
timeout 90 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 26 --out $OUT/kernel_trace_fused_kv_b1_h200.json 2>&1 | grep -v Memcpy | tail -40
rm -f $OUT/*.partial*; ls $OUT
