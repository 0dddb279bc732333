#!/usr/bin/env bash
# Session 6, device call 5 (issue 6), run as one command line on the still-warm machine:
# batch-64 native with the fused RoPE + K/V write against the XLA path (call 2 measured the
# fused write without RoPE there), and batch-64 d=1 k=2 with the fused path.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session6_call5.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=.; OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --temperature 0"; for W in fused xla; do timeout 70 $D --batch 64 --k 0 --kv-write $W --out $OUT/ab_kvwrite_${W}_rope_b64_session6_h200.json 2>&1 | grep -E "^ *64 native"; done; timeout 80 $D --batch 64 --k 2 --draft-loops 1 --kv-write fused --out $OUT/ab_kvwrite_fused_d1_k2_b64_session6_h200.json 2>&1 | grep -E "^ *64 spec"; rm -f $OUT/*.partial
