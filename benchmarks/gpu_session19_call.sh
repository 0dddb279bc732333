#!/usr/bin/env bash
# Session 19's last GPU call (about 9 minutes, each step only while time is left):
#   1. the decode table at today's code (session 11's was the last full one; since then
#      trace_once and the engine-layout load changed how programs are built and weights
#      loaded, not the kernels): batch 1, 8, 32, 64 x k 0, 2, 4 (d=2) x T 0, 0.8;
#   2. a start, phase by phase (benchmarks.start_time), bf16, native and k=4, twice each on
#      one fresh persistent cache (the second process is a cached start);
#   3. the CLI itself in bf16, twice (wall seconds as a user sees them; session 19's first
#      CLI run used the default fp32);
#   4. benchmarks.load_time on the synthesized 1.4B bf16 checkpoint.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session19_call.sh
# STEPS= picks steps (default 1234); session 20 ran 1-3 with CAP=440, so what is left is
#   STEPS=34 CAP=300 OUT=dir bash benchmarks/gpu_session19_call.sh
# (step 3 then also runs the CLI at k=4 d=2: CLI_K="0 4").
set -u
STEPS=${STEPS:-1234}
CLI_K=${CLI_K:-0}
on() { [[ $STEPS == *$1* ]]; }
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
CAP=${CAP:-585}  # seconds the whole call may take
left() { local l=$((CAP - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
# the card's short name in the result files (session 24: the H100 that came got _h200 files)
TAG=${TAG:-}  # put into every result file's name (e.g. _session24_call3), so reruns keep old ones
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
case "$CARD" in *H200*) CARD=h200 ;; *H100*) CARD=h100 ;; *) CARD=gpu ;; esac
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
on 1 && timeout $(left 330) $D --batch 1,8,32,64 --k 0,2,4 --temperature 0,0.8 \
  --out $OUT/decode_table_session19${TAG}_$CARD.json 2>&1 | grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth"
on 1 && [ -f $OUT/decode_table_session19${TAG}_$CARD.json ] && rm -f $OUT/decode_table_session19${TAG}_$CARD.json.partial
echo "table done at $SECONDS s"
M=${M:-/tmp/ouro_1p4b}; PRESET=${PRESET:-1.4b}
[ -d $M ] || timeout $(left 100) python3 -m convert.synthesize --preset $PRESET --dtype bf16 --branch-scale 0.003 \
  --norm-jitter 0 --out $M | tail -1
S="python3 -m benchmarks.start_time --model $M --dtype bf16"
on 2 && for k in 0 4; do rm -rf /tmp/cc_st$k; for r in 1 2; do
  [ $SECONDS -lt $((CAP - 25)) ] || break
  echo "== start_time k=$k process $r"
  timeout $(left 60) $S --speculative-k $k --compile-cache /tmp/cc_st$k \
    --out $OUT/start_time_bf16_k${k}_p${r}${TAG}_$CARD.json | tr -d ' \n' | cut -c1-600; echo
done; done
G="python3 -m ouro_jax.generate --model $M --dtype bf16 --compile-cache /tmp/cc_cli --max-tokens 64
   --ignore-eos --json --prompt-ids $(seq -s, 1 128)"
TIMEFORMAT="wall %R s"
on 3 && for k in $CLI_K; do rm -rf /tmp/cc_cli; for r in 1 2; do
  [ $SECONDS -lt $((CAP - 25)) ] || break
  echo "cli k=$k bf16 run $r"
  { time timeout $(left 40) $G --speculative-k $k 2>&1 | tail -1 | cut -c1-800 ; } 2>&1
done; done | tee $OUT/cli_start_bf16${TAG}_$CARD.txt
on 4 && [ $SECONDS -lt $((CAP - 45)) ] && timeout $(left 120) python3 -m benchmarks.load_time --checkpoint $M --runs 3 \
  --out $OUT/load_time${TAG}_$CARD.json | grep -E "warm_page_cache_s|cold_page_cache_s|_s\": [0-9]" | head -12
echo "elapsed $SECONDS s"
