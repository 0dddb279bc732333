#!/usr/bin/env bash
# Session 13 (issue 6), third call. Call 2 found (1) the Mosaic GEMV's add_norm x' is the one
# that parts from XLA, the streaming GEMV and the host's exact rounding (it equals x' computed
# without rounding the normed branch before the add), now fixed with an SMEM round trip;
# (2) the down microbenchmark is not repeatable (bn64 bk64 ks8 st4: 17.09 us in call 1,
# 35.08 in call 2, the streaming GEMV 20.41 and 18.13), and 'gemv+norms+stream+mgpu:down' at
# call 2's pick (bn64_bk256_ks11_st2) decoded 231.5 tok/s against 241.8 for 'auto', same
# tokens. So:
#   1. the add_norm GPU tests and the x' probe after the fix;
#   2. batch-1 native greedy A/B, 'auto' against mgpu:down at MGPU_TUNING's bn64 bk64 ks8 st4,
#      ABAB, and every projection on the Mosaic kernel ('gemv+norms+mgpu') once;
#   3. kernel traces of batch-1 decode, 'auto' and mgpu:down: the down kernel's time in the
#      engine, which the microbenchmark could not pin down.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session13_call3.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 45 python3 -W ignore::DeprecationWarning -m benchmarks.mgpu_add_norm_probe \
  $OUT/mgpu_add_norm_probe_fixed_session13_h200.json 2>&1 | tail -6
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=line -s -W ignore::DeprecationWarning \
  tests/test_gemv_mgpu.py -k "normed_gpu and True" > $OUT/gpu_tests_add_norm_fixed_session13.txt 2>&1
grep -E "differ|passed|failed|rror" $OUT/gpu_tests_add_norm_fixed_session13.txt | cut -c1-120 | tail -30
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --temperature 0 --batch 1 --k 0"
for pass in 1 2; do
  timeout 75 $D --out $OUT/ab2_b1_auto_p${pass}_session13_h200.json 2>&1 | grep -E "^ *1 |rror"
  timeout 75 $D --projections gemv+norms+stream+mgpu:down --out $OUT/ab2_b1_mgpu_down_p${pass}_session13_h200.json 2>&1 | grep -E "^ *1 |rror"
done
timeout 90 $D --projections gemv+norms+mgpu --out $OUT/ab2_b1_mgpu_all_session13_h200.json 2>&1 | grep -E "^ *1 |rror"
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/ab2_b1_*_session13_h200.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1][:-18], r["batch"], r["k"], round(r["decode_tok_s"], 1),
              round(r["decode_tok_s_min"], 1), round(r["decode_tok_s_max"], 1),
              r["tokens_sha"], r["compile_s"])
PY
for p in auto gemv+norms+stream+mgpu:down; do
  tag=$([ $p = auto ] && echo auto || echo mgpu_down)
  timeout 70 python3 -m benchmarks.kernel_trace --attention pallas --projections $p --batch 1 --k 0 \
    --top 12 --out $OUT/kernel_trace_b1_${tag}_session13_h200.json 2>&1 | grep -vE "^\s*$" | cut -c1-170 | head -16
done
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
