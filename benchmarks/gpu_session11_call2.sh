#!/usr/bin/env bash
# Session 11 (issue 6), second call. Call 1 (gpu_next_session.sh) read batch-8 speculative
# k=4 d=2 at 1,627.1 tok/s on the new decode block default (32-key blocks up to 8 rows),
# against 1,724.4 in session 7's table. The draft runs the decode kernel at 8 rows, so:
#   1. batch 8, k=0 and 4, default against --decode-kernel block_t=64 (the old default at 8
#      rows), interleaved twice (ABAB) so drift hits both arms alike;
#   2. batch 32 and 64, native and k=4 d=2, on today's code (the table's rows are session 7's);
#   3. batch 64, d=1 k=2 (the 10,000 tok/s target's row, session 6) on today's code.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session11_call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --temperature 0"
for pass in 1 2; do
  t=$([ $pass = 1 ] && echo 100 || echo 70)
  timeout $t $D --batch 8 --k 0,4 --out $OUT/ab_b8_default_p${pass}_session11_h200.json 2>&1 | grep -E "^ *8 |rror"
  timeout $t $D --batch 8 --k 0,4 --decode-kernel block_t=64 --out $OUT/ab_b8_block_t64_p${pass}_session11_h200.json 2>&1 | grep -E "^ *8 |rror"
done
timeout 160 $D --batch 32,64 --k 0,4 --out $OUT/decode_b32_b64_session11_h200.json 2>&1 | grep -E "^ *(32|64) |rror"
timeout 90 $D --batch 64 --k 2 --draft-loops 1 --out $OUT/decode_b64_d1_k2_session11_h200.json 2>&1 | grep -E "^ *64 |rror"
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/*_session11_h200.json")):
    for r in json.load(open(f))["rows"]:
        print(f.split("/")[-1][:-18], r["batch"], r["k"], round(r["decode_tok_s"], 1),
              round(r["decode_tok_s_min"], 1), round(r["decode_tok_s_max"], 1),
              r.get("acceptance"), r["tokens_sha"], r["compile_s"])
PY
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
