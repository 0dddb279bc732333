#!/usr/bin/env bash
# Prepared in session 13 for the next session (issue 6); NOT YET RUN. About 8 minutes (the
# time-outs add up to 540 s). Session 13 ran the other half of session 11's version of this
# script (batch-8 token reproducibility, the in-kernel merge: gpu_session13_call5.sh).
#   1. The streaming GEMV's tilings ranked by the GPU's own kernel time
#      (benchmarks.gemv --device-time; the wall clock can be host-bound, session 13): the
#      engine's tiling and its neighbours, qkv and gate/up with the add_norm prologue, o and
#      down plain, one row. `python -m benchmarks.gemv --pick FILE` then names the fastest.
#   2. Batch-1 native greedy with 2 and 4 decode splits against the default, interleaved
#      twice (the second pass in another order).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
V=engine,st4_k512_p4_w4,st4_k512_p8_w4,st4_k512_p2_w4,st2_k512_p8_w4,st2_k512_p4_w4,st2_k512_p16_w4,st1_k512_p4_w4,st1_k512_p8_w2,st8_k512_p2_w4
timeout 200 python3 -m benchmarks.gemv --device-time --prologue add_norm --variants $V \
  --shapes qkv,gate_up --rows 1 --out $OUT/gemv_stream_add_norm_device_h200.json 2>&1 | grep -E "device|rror"
timeout 160 python3 -m benchmarks.gemv --device-time --variants $V,st2_k512_p2_w4,st1_k512_p2_w4 \
  --shapes o,down --rows 1 --out $OUT/gemv_stream_plain_device_h200.json 2>&1 | grep -E "device|rror"
for f in $OUT/gemv_stream_*_device_h200.json; do python3 -m benchmarks.gemv --pick $f; done
A=$OUT/arms; mkdir -p $A
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
run() { timeout 30 $D $2 --out $A/$1_p$pass.json 2>&1 | grep -E "rror" ; }
pass=1; run default ""; run splits2 "--decode-kernel num_splits=2"; run splits4 "--decode-kernel num_splits=4"
pass=2; run splits4 "--decode-kernel num_splits=4"; run splits2 "--decode-kernel num_splits=2"; run default ""
python3 - "$A" "$OUT/ab_splits_b1_h200.json" <<'PY'
import glob, json, os, sys
arms = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + "/*.json"))}
for arm, rec in arms.items():
    for r in rec["rows"]:
        print(arm, round(r["decode_tok_s"], 1), round(r["decode_tok_s_min"], 1),
              round(r["decode_tok_s_max"], 1), r["tokens_sha"], round(r["compile_s"], 1))
json.dump(arms, open(sys.argv[2], "w"), indent=1)
PY
rm -rf $A
