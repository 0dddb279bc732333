#!/usr/bin/env bash
# Session 13 (issue 6), fifth call, with the device time left (~7 min): the reproducibility
# half of benchmarks/gpu_next_session.sh (batch-8 greedy tokens across processes without the
# compile cache, then with XLA's autotuning off), and its in-kernel merge arm at batch 1
# against the default, interleaved ABAB.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session13_call5.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
A=$OUT/arms; mkdir -p $A
N=(python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003
   --compile-cache "" --batch 8 --k 0 --temperature 0)
for i in 1 2; do
  timeout 50 "${N[@]}" --out $A/b8_nocache_$i.json 2>&1 | grep -E "rror"
done
for i in 1 2; do
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 50 "${N[@]}" --out $A/b8_autotune0_$i.json 2>&1 | grep -E "rror"
done
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
for pass in 1 2; do
  timeout 40 $D --out $A/b1_default_p$pass.json 2>&1 | grep -E "rror"
  timeout 40 $D --decode-kernel last_combine=1 --out $A/b1_merge_p$pass.json 2>&1 | grep -E "rror"
done
python3 - "$A" "$OUT/repro_merge_session13_h200.json" <<'PY'
import glob, json, os, sys
arms = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    arm = os.path.basename(f)[:-5]
    arms[arm] = json.load(open(f))
    for r in arms[arm]["rows"]:
        print(arm, round(r["decode_tok_s"], 1), round(r["decode_tok_s_min"], 1),
              round(r["decode_tok_s_max"], 1), r["tokens_sha"], r["repeats_identical"],
              round(r["compile_s"], 1))
json.dump(arms, open(sys.argv[2], "w"), indent=1)
PY
rm -rf $A
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
