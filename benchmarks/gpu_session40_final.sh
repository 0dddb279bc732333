#!/usr/bin/env bash
# Session 40, last call: the batch-invariant mode as it ships after the review mends
# (fused_kv_write honoured, one add_norm for the loop's last add and final norm):
#   1. the GPU tests of the mode's kernels and its compiled bit identity;
#   2. the mode end to end at batch 1, 8 and 64, native and k=4 d=2 (identity checked);
#   3. the default engine at batch 1 and 8 on the same card, for the ratio.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=330] bash benchmarks/gpu_session40_final.sh
S=${SESSION:-session40}
CAP=${CAP:-330}
. benchmarks/gpu_call_setup.sh
timeout -s KILL $(left 100) python3 -m pytest -q -p no:cacheprovider tests/test_rope_kv.py \
  tests/test_add_norm.py tests/test_invariant.py tests/test_gemm.py -m gpu 2>&1 | tail -3
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --compile-cache /tmp/cc"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|identical|bandwidth"; }
timeout -s KILL $(left 150) $D --batch-invariant --batch 1,8,64 --k 0,4 \
  --out $OUT/decode_inv_final_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 60) $D --batch 1,8 --k 0,4 --out $OUT/decode_default_${S}_$G.json 2>&1 | show
echo "elapsed ${SECONDS}s"
