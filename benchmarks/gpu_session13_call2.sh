#!/usr/bin/env bash
# Session 13 (issue 6), second call. Call 1 (gpu_session13_call1.sh) ran the Mosaic GPU GEMV
# on the GPU for the first time: its 54 GPU tests pass; it beats the streaming GEMV only at
# down (17.09 vs 20.41 us at bn64 bk64 ks8 st4, bit-identical to XLA) and loses at qkv, o,
# gate/up; its add_norm residual x' differs from XLA's in 574 of 2048 elements (the streaming
# GEMV's in 0), the count by which the host's exactly rounded x' and one without the
# rounding of the normed branch differ on the CPU. So:
#   1. the x' probe, with XLA's default flags and with excess precision off;
#   2. a second down sweep (deeper rings, 11 and 22 splits);
#   3. batch-1 greedy decode A/B, 'auto' (gemv+norms+stream) against
#      'gemv+norms+stream+mgpu:down' with the fastest down tiling of 1-2, interleaved ABAB
#      (pass 1 native and k=4 d=2, pass 2 native).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session13_call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 45 python3 -W ignore::DeprecationWarning -m benchmarks.mgpu_add_norm_probe \
  $OUT/mgpu_add_norm_probe_session13_h200.json 2>&1 | tail -8
XLA_FLAGS=--xla_allow_excess_precision=false timeout 45 python3 -W ignore::DeprecationWarning \
  -m benchmarks.mgpu_add_norm_probe $OUT/mgpu_add_norm_probe_noexcess_session13_h200.json 2>&1 | tail -8
timeout 90 python3 -W ignore::DeprecationWarning -m pallas_kernels.gemv_mgpu_normed \
  $OUT/gemv_mgpu_down2_session13_h200.json down2 2>&1 | grep -v "^down:" | cut -c1-150
PICK=$(python3 - "$OUT" <<'PY'
import glob, json, sys
rows = [r for f in glob.glob(sys.argv[1] + "/gemv_mgpu_*session13_h200.json")
        for r in json.load(open(f))["rows"]
        if r.get("name") == "down" and r["kernel"] == "gemv_mgpu_plain" and "us" in r]
best = min(rows, key=lambda r: r["us"])
print("bn{}_bk{}_ks{}_st{}".format(*best["tiling"]))
PY
)
echo "down pick: $PICK"
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --temperature 0 --batch 1"
B="--projections gemv+norms+stream+mgpu:down --mgpu-tiling down=$PICK"
for pass in 1 2; do
  ks=$([ $pass = 1 ] && echo 0,4 || echo 0); t=$([ $pass = 1 ] && echo 110 || echo 80)
  timeout $t $D --k $ks --out $OUT/ab_b1_auto_p${pass}_session13_h200.json 2>&1 | grep -E "^ *1 |rror"
  timeout $t $D --k $ks $B --out $OUT/ab_b1_mgpu_down_p${pass}_session13_h200.json 2>&1 | grep -E "^ *1 |rror"
done
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/ab_b1_*_session13_h200.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1][:-18], r["batch"], r["k"], round(r["decode_tok_s"], 1),
              round(r["decode_tok_s_min"], 1), round(r["decode_tok_s_max"], 1),
              r.get("acceptance"), r["tokens_sha"], r["compile_s"])
PY
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
