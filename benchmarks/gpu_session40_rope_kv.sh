#!/usr/bin/env bash
# Session 40, fourth call: the batch-invariant mode's RoPE and K/V write in one kernel
# (pallas_kernels.rope_kv), on top of the third call's add_norm.
#   1. the GPU tests: rope_kv's and add_norm's compiled row bits, the mode's compiled bit
#      identity;
#   2. end to end, the protocol: batch 1 native and k=4 d=2, batch 64 native and k=4;
#   3. a kernel trace of batch-1 native decode (kernels per layer application).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=330] bash benchmarks/gpu_session40_rope_kv.sh
S=${SESSION:-session40}
CAP=${CAP:-330}
. benchmarks/gpu_call_setup.sh
timeout -s KILL $(left 90) python3 -m pytest -q -p no:cacheprovider tests/test_rope_kv.py \
  tests/test_add_norm.py tests/test_invariant.py -m gpu 2>&1 | tail -4
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --compile-cache /tmp/cc --batch-invariant"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|identical|bandwidth"; }
timeout -s KILL $(left 90) $D --batch 1 --k 0,4 --out $OUT/decode_inv_rope_kv_b1_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 100) $D --batch 64 --k 0,4 --out $OUT/decode_inv_rope_kv_b64_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 60) python3 -m benchmarks.kernel_trace --synthetic 1.4b --attention pallas \
  --new-tokens 32 --top 20 --batch-invariant --batch 1 --k 0 \
  --out $OUT/kernel_trace_inv_rope_kv_b1_${S}_$G.json 2>&1 | grep -v "^ *$" | head -50
echo "elapsed ${SECONDS}s"
