#!/usr/bin/env bash
# Prepared at the end of session 9 for the next session (issue 6), one device call (~8 min of
# commands). Open questions after session 9 (docs/performance.md "Session 9"):
#   1. The ~8.4 ms wait before prefill in every generate call: session 9's trace put it on a
#      4-byte convert_element_type copy (jnp.zeros' fill value); the request path has run no
#      eager device op since (commit after c450a95). A trace of the default says whether the
#      wait went with it (memcpy rows printed below), and the decode run's prefill_s (12 ms at
#      batch 1 since session 1) and e2e tok/s say what it cost.
#   2. Decode attention at batch 1 (6.2 us per call plus a 1.3 us combine for 128-160 keys, a
#      latency chain): 2 warps, 32-key blocks (8 splits), one pipeline stage.
#   3. The in-kernel split merge: its GPU test (the merge now loops over the splits; the
#      session-9 GPU run had it unrolled) and an A/B at batch 8 (batch 1: 231.8 vs 232.7).
# A .partial file is deleted only when its finished JSON exists; at most 8 files come back.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session10_call1.sh (ran in session 10)
# A second call, benchmarks/gpu_session10_call2.sh, times a third round of streaming
# tilings around session 9's picks and A/Bs the fastest end to end.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 60 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_pallas_kernels.py \
  -k "merges_splits_itself_gpu" 2>&1 | tail -2
timeout 80 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 10 --out $OUT/kernel_trace_b1_next_h200.json 2>&1 | grep -E "Memcpy|kernels_per" | cut -c1-200
python3 -c "import json,sys; [print({k: m.get(k) for k in ('name','us','hlo_op','hlo_module','memcpy_details')}) for m in json.load(open(sys.argv[1]))['rows'][0]['memcpy_stats'][:3]]" $OUT/kernel_trace_b1_next_h200.json
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --k 0 --temperature 0"
timeout 50 $D --batch 1 --out $OUT/ab_b1_default_next_h200.json 2>&1 | grep -E "^ *1 native|rror"
python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print('prefill_s', r['prefill_s'], 'e2e', r['e2e_tok_s'])" $OUT/ab_b1_default_next_h200.json
for t in num_warps=2 block_t=32 num_stages=1; do
  timeout 50 $D --batch 1 --decode-kernel $t --out $OUT/ab_b1_decode_${t%%=*}_next_h200.json 2>&1 \
    | grep -E "^ *1 native|rror"
done
timeout 55 $D --batch 8 --out $OUT/ab_b8_default_next_h200.json 2>&1 | grep -E "^ *8 native|rror"
timeout 55 $D --batch 8 --decode-kernel last_combine=1 --out $OUT/ab_b8_last_combine_next_h200.json \
  2>&1 | grep -E "^ *8 native|rror"
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
ls $OUT
