#!/usr/bin/env bash
# Prepared in session 11 for the next session (issue 6): session 11's last call, which found
# no machine and then too little device time (about 4 min of commands). The decode kernel's
# split count at batch 1 (default: one 32-key block per split, 8 splits over the 256-token
# table) against 2 and 4 splits, and the in-kernel merge (last_combine=1, which drops the
# XLA merge kernel, 1.25 us per layer application in the session-10 trace) now that batch 1
# runs 32-key blocks. Batch 1, native, greedy; the arms interleaved twice, the second pass in
# another order, so drift hits every arm alike.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
run() {  # name, extra arguments
  timeout 45 $D $2 --out $OUT/ab3_$1_p$pass.json 2>&1 | grep -E "rror" ; }
pass=1
run default ""; run splits2 "--decode-kernel num_splits=2"; run splits4 "--decode-kernel num_splits=4"
run merge "--decode-kernel last_combine=1"
pass=2
run merge "--decode-kernel last_combine=1"; run splits4 "--decode-kernel num_splits=4"
run splits2 "--decode-kernel num_splits=2"; run default ""
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/ab3_*.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1][4:-5], round(r["decode_tok_s"], 1), round(r["decode_tok_s_min"], 1),
              round(r["decode_tok_s_max"], 1), r["tokens_sha"], r["repeats_identical"],
              round(r["compile_s"], 1))
PY
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
