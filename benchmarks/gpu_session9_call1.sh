#!/usr/bin/env bash
# Session 9, device call 1 (~8 min of commands): benchmarks/gpu_next_session.sh as prepared at
# the end of session 8, plus the decode kernel that merges its own splits (last_combine, new
# this session: GPU test and batch-1 A/B), minus the command-buffer A/B (no gain in session 4)
# and benchmarks.hlo_copies (the trace's memcpy fields answer the same question).
# Prepared at the end of session 8 for the next session (issue 6), one device call (~8.5 min of commands).
# Session 8 ran out of device time before its call 4 (the add_norm tilings), which this
# script contains, plus the other open questions of the batch-1 profile
# (kernel_trace_session8_b1_h200.json, docs/performance.md "Session 8"):
#   0. GPU tests of the streaming GEMV, including the add_norm prologue at every tiling below
#      (tests/test_gemv_stream.py: PROLOGUE_CANDIDATES), so whichever one wins is checked.
#   1. Streaming tilings WITH the add_norm prologue (qkv 11.5 us with it vs 8.5 us with the
#      plain norm; gate/up 15.9 us vs 14.1 alone): microbenchmark, then batch-1 native with the
#      fastest tiling per shape against the default, same call.
#   2. Decode attention at batch 1: 6.2 us per call plus a 1.3 us XLA combine of its 4 splits
#      (~16% of a layer application): one split (no combine kernel), same call (an older
#      kernel was slower with 1-2 splits: 163.5 vs 170.2 tok/s, ab_splits1_b1_h200.json).
#   3. XLA command buffers over while loops with ~7 kernels per layer application.
#   4. The ~10.5 ms device-to-device copy in every generate call (prefill reads 12 ms at batch
#      1 since session 1): a trace that now keeps the longest memcpys' HLO op, module and size
#      (printed below), and plane-sized copies in the compiled programs of the demo model
#      (benchmarks.hlo_copies; at batch 1 a plane is 0.1 GB, so a plane copy would not take
#      10 ms: the trace's fields are the real answer).
# A .partial file is deleted only when its finished JSON exists; at most 8 files come back.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
V=st1_k512_p4_w4,st2_k512_p4_w4,st2_k512_p8_w4,st2_k512_p16_w4,st4_k512_p4_w4,st4_k512_p4_w8
V=$V,st8_k512_p4_w8,st1_k512_p8_w2
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gemv_stream.py tests/test_pallas_kernels.py -k "add_norm_tilings or variants_on or merges_splits_itself_gpu" 2>&1 | tail -2
timeout 70 python3 -m benchmarks.gemv --rows 1 --shapes qkv,gate_up --prologue add_norm \
  --variants $V --calls 10 --trials 3 --out $OUT/gemv_stream_add_norm_session9_h200.json 2>&1 \
  | grep -E "^(qkv|gate_up)"
PICK=$(python3 - "$OUT/gemv_stream_add_norm_session9_h200.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"]
        if "us" in r and "error" not in r and r["impl"] not in ("xla", "engine")
        and r.get("rel_err_vs_xla", 1.0) < 1e-2]
best = {}
for r in rows:
    if r["shape"] not in best or r["us"] < best[r["shape"]]["us"]:
        best[r["shape"]] = r
print(",".join(f"{s}={r['impl']}" for s, r in sorted(best.items())))
PY
)
echo "picked: $PICK"
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
timeout 50 $D --out $OUT/ab_b1_default_session9_h200.json 2>&1 | grep -E "^ *1 native|rror"
[ -n "$PICK" ] && timeout 55 $D --stream-tiling $PICK --out $OUT/ab_b1_tiling_picked_session9_h200.json \
  2>&1 | grep -E "^ *1 native|rror"
timeout 50 $D --decode-kernel last_combine=1 --out $OUT/ab_b1_last_combine_session9_h200.json 2>&1 \
  | grep -E "^ *1 native|rror"
timeout 50 $D --decode-kernel num_splits=1 --out $OUT/ab_b1_splits1_session9_h200.json 2>&1 \
  | grep -E "^ *1 native|rror"
timeout 80 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 10 --out $OUT/kernel_trace_b1_session9_h200.json 2>&1 | grep -E "Memcpy|kernels_per" | cut -c1-200
python3 -c "import json,sys; [print({k: m.get(k) for k in ('name','us','hlo_op','hlo_module','memcpy_details')}) for m in json.load(open(sys.argv[1]))['rows'][0]['memcpy_stats'][:3]]" $OUT/kernel_trace_b1_session9_h200.json
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
