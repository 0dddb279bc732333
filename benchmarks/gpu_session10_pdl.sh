#!/usr/bin/env bash
# Session 10 (issue 6): programmatic dependent launch. XLA launches every Pallas kernel with
# the PDL attribute and a griddepcontrol.wait at its start (xla_gpu_enable_pdl, default on);
# nothing of ours has let the next kernel launch early so far. --pdl qkv,o,gate_up makes those
# streaming GEMVs emit griddepcontrol.launch_dependents at their start; --decode-kernel
# last_combine=1,pdl=1 the decode kernel (with its own split merge, so that its next kernel is
# the o GEMV). Batch 1, greedy, native and k=4 d=2; every row records its tokens' digest
# (tokens_sha), which must equal the default's, and whether the repeats agreed.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session10_pdl.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --temperature 0"
run() {
  local tag=$1 t=$2; shift 2
  timeout $t $D "$@" --out $OUT/pdl_${tag}_session10_h200.json 2>&1 | grep -E "^ *1 |rror"
}
run default 150 --k 0,4
run stream 150 --k 0,4 --pdl qkv,o,gate_up
run merge 70 --k 0 --decode-kernel last_combine=1
run all 150 --k 0,4 --pdl qkv,o,gate_up --decode-kernel last_combine=1,pdl=1
XLA_FLAGS=--xla_gpu_enable_pdl=false run xla_pdl_off 70 --k 0
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/pdl_*_session10_h200.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1][4:-20], r["k"], round(r["decode_tok_s"], 1),
              r.get("acceptance"), r["tokens_sha"], r["repeats_identical"])
PY
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
