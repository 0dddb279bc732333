#!/usr/bin/env bash
# Session 8, device call 4 (~3 min): the add_norm prologue is paid once per program, and the
# batch-1 trace (kernel_trace_session8_b1_h200.json) shows it costs ~3 us on qkv (11.5 us with
# add_norm vs 8.5 us with the plain norm) and ~2.3 us on gate/up (15.9 us vs 13.6 alone): with
# one-row blocks and 4 per program each program reads as many prologue bytes from L2 (x, the
# branch, two norm weights: 16 KB) as weight bytes from HBM. Session 7 tuned the tilings
# without the prologue.
#   1. One-row microbenchmark of streaming tilings WITH the add_norm prologue, qkv and gate/up.
#   2. Batch-1 native greedy, same call: the default, then the fastest tiling per shape from 1.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
V=st1_k512_p4_w4,st2_k512_p4_w4,st2_k512_p8_w4,st2_k512_p16_w4,st4_k512_p4_w4,st4_k512_p4_w8
V=$V,st8_k512_p4_w8,st1_k512_p8_w2
timeout 70 python3 -m benchmarks.gemv --rows 1 --shapes qkv,gate_up --prologue add_norm \
  --variants $V --calls 10 --trials 3 --out $OUT/gemv_stream_add_norm_session8_h200.json 2>&1 \
  | grep -E "^(qkv|gate_up)"
PICK=$(python3 - "$OUT/gemv_stream_add_norm_session8_h200.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if "us" in r and r["impl"] != "xla"]
best = {}
for r in rows:
    if r["shape"] not in best or r["us"] < best[r["shape"]]["us"]:
        best[r["shape"]] = r
print(",".join(f"{s}={r['impl']}" for s, r in sorted(best.items())))
PY
)
echo "picked: $PICK"
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
timeout 50 $D --out $OUT/ab_tiling_default_b1_session8_h200.json 2>&1 | grep -E "^ *1 native|rror"
[ -n "$PICK" ] && timeout 55 $D --stream-tiling $PICK --out $OUT/ab_tiling_picked_b1_session8_h200.json \
  2>&1 | grep -E "^ *1 native|rror"
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
