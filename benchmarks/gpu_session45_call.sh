#!/usr/bin/env bash
# Prepared in session 44 for the next GPU call (whichever card comes; about 9 minutes). Its
# H200 part has not run yet (session 45 got only H100s); since session 45 today's default
# includes the decode kernel's 2-warp tuning from 2 rows up; an arm without it (batch 8 and
# 32) follows the table, and the "before" arm runs batch 8-64 with block_t=64,num_warps=4
# (the tuning before session 45) and batch 1 apart. On an H200 the call may not reach
# PART=mini within one command: run `CAP=570 SESSION=... OUT=... PART=mini bash
# benchmarks/gpu_session35_call.sh` as a follow-up while the machine is warm.
#   1. On an H200, last (session 44 measured it on an H100): finished rows skipping their
#      context (ouro_jax.attention.SKIP_DONE, on since session 44; +3.0-5.7% k=4 at batch
#      32-64 on an H100 then) against not (--decode-kernel skip_done=0), k=4 d=2 greedy
#      at batch 32 and 64, in the order skip,
#      noskip, skip (native batch 32,64 in the first arm: every row there finishes at the
#      same step, so native is unchanged by it). The records' rounds_run /
#      active_row_fraction say how much of each batch's rounds went to finished rows
#      (19 rounds, 16-19% on that H100).
#   2. On an H200, first: the decode table at today's default beside the defaults before
#      session 43 (--projections gemv+norms+stream --decode-kernel ragged_from=0,skip_done=0),
#      batch 1,8,32,64, k 0,4: the H200 table predates both; whether k=4 stays no slower
#      than native at batch 64 there is the line to check. Then session 35's prepared call
#      (gpu_session35_call.sh, the batch-1 line's last lever) in what is left of CAP.
#      Elsewhere: kernel traces of native decode (k 0) at batch 64 and 1, prefill
#      subtracted (how much of a native step is kernels), then the decode kernel's variants
#      over contexts of 512-4096 keys (benchmarks.attention_kernels).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=570] bash benchmarks/gpu_session45_call.sh
S=${SESSION:-session45}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2"
T="python3 -m benchmarks.kernel_trace --synthetic 1.4b --attention pallas --new-tokens 32 --top 25 --minus-prefill"
show() { grep -A12 "^  B mode"; }
ab() {  # the skip_done A/B (defined here, run last on an H200)
timeout -s KILL $(left 160) $D --batch 32,64 --k 0,4 --out $OUT/decode_skip_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 120) $D --batch 32,64 --k 4 --decode-kernel skip_done=0 \
  --out $OUT/decode_noskip_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 90) $D --batch 32,64 --k 4 --out $OUT/decode_skip2_${S}_$G.json 2>&1 | show
python3 - $OUT/decode_{skip,noskip,skip2}_${S}_$G.json <<'PY'
import json, sys
for f in sys.argv[1:]:
    try:
        rows = json.load(open(f))["rows"]
    except Exception as e:
        print(f, "missing:", e); continue
    for r in rows:
        if r["k"]:
            print(f.split("/")[-1], r["batch"], round(r["decode_tok_s"], 1), "rounds_run",
                  r.get("rounds_run"), "active", round(r.get("active_row_fraction", 0), 3))
PY
}
if [ $G = h200 ]; then
  timeout -s KILL $(left 170) $D --batch 1,8,32,64 --k 0,4 --out $OUT/decode_now_${S}_$G.json 2>&1 | show
  # today's default less session 45's decode tuning (its change alone on the H200)
  timeout -s KILL $(left 80) $D --batch 8,32 --k 0,4 --decode-kernel block_t=64,num_warps=4 \
    --out $OUT/decode_now_pre45_${S}_$G.json 2>&1 | show
  # (the defaults before session 43: batch 1 apart, as block_t=64 would change its blocks)
  B4="--k 0,4 --projections gemv+norms+stream --decode-kernel ragged_from=0,skip_done=0"
  timeout -s KILL $(left 60) $D --batch 1 $B4 --out $OUT/decode_before_b1_${S}_$G.json 2>&1 | show
  timeout -s KILL $(left 140) $D --batch 8,32,64 $B4,block_t=64,num_warps=4 \
    --out $OUT/decode_before_${S}_$G.json 2>&1 | show
  [ $(left 600) -gt 120 ] && CAP=$(left 600) SESSION=$S OUT=$OUT PART=mini bash benchmarks/gpu_session35_call.sh
  [ $(left 600) -gt 200 ] && ab
else
  for b in 64 1; do
    timeout -s KILL $(left 100) $T --batch $b --k 0 \
      --out $OUT/kernel_trace_b${b}_k0_${S}_$G.json 2>&1 | grep -v "^ *$" | \
      sed -n '/^{/p;/decode only/,/^  top_kinds/p' | head -30
  done
  # the decode kernel's tuning over contexts (one tuning serves all today; at batch 8 and
  # 2048 keys two variants were 20% faster in session 44)
  timeout -s KILL $(left 150) python3 -m benchmarks.attention_kernels --no-sweep \
    --points decode:8:512,decode:8:1024,decode:8:4096,decode:1:2048,decode:32:2048 \
    --variant-set short --out $OUT/attention_decode_contexts_${S}_$G.json 2>&1 | tail -70
fi
echo "elapsed ${SECONDS}s"
