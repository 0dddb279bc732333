#!/usr/bin/env bash
# Session 10 (issue 6), second PDL call: the streaming GEMVs' trigger at their end (once the
# last weight block has arrived, --pdl-at end) instead of their start, which cost 3.5% at
# batch 1 (pdl_stream_session10_h200.json). Batch 1, greedy, native; tokens' digests printed.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session10_pdl_end.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
run() {
  local tag=$1; shift
  timeout 70 $D "$@" --out $OUT/pdl_${tag}_session10_h200.json 2>&1 | grep -E "^ *1 |rror"
}
run default2
run end --pdl qkv,o,gate_up --pdl-at end
run end_gate_up --pdl gate_up --pdl-at end
run start_gate_up --pdl gate_up
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/pdl_*_session10_h200.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1][4:-20], r["k"], round(r["decode_tok_s"], 1), r["tokens_sha"],
              r["repeats_identical"])
PY
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
