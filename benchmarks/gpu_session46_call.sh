#!/usr/bin/env bash
# Session 46's call (any card; about 9 minutes). First, pipelined self-speculation
# (ouro_jax.pipelined, new in session 46: the loops in S = T/d stages, each pass running
# every stage on its own position), never run on a GPU before:
#   1. native and k=4 d=2 greedy at batch 1, 8, 32 (the baseline, same lease), then
#      pipelined (k=1) greedy at d=2 (2 stages) and d=1 (4 stages) at the same batch sizes,
#      and T=0.8 at batch 1;
#   2. pipelined at batch 1 with its 2- and 4-row projections through the Pallas GEMV with
#      its norm prologues (gemv@2 / gemv@4: one-row calls still stream, the others take
#      pallas_kernels.gemv, as STREAM_MAX_ROWS is 1) and d=2 through the streaming GEMV
#      (gemv@2+norms+stream@2+inv@3-64; '+stream@2' new in session 46, its 2-row tilings
#      compile without spills, offline_compile --stream-rows), rather than the '+inv' GEMM
#      and add_norm kernels (7 kernels per layer against 5, lower_time's count);
#   3. kernel traces of pipelined batch 1, d=2 and d=1, prefill subtracted (per tick).
# Then, in what is left of CAP: on an H200 the prepared table (gpu_session45_call.sh's H200
# branch: today's default, never run on an H200); elsewhere the rest of
# gpu_session45_last.sh (the shipped decode tuning against the old, the 2-row GEMV and the
# attention kernels by device time).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=570] bash benchmarks/gpu_session46_call.sh
S=${SESSION:-session46}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --repeats 3"
show() { grep -A8 "^  B mode"; }
timeout -s KILL $(left 150) $D --temperature 0 --batch 1,8,32 --k 0,4 \
  --out $OUT/pipe_base_${S}_$G.json 2>&1 | show
P="$D --k 1 --pipelined"
timeout -s KILL $(left 120) $P --temperature 0 --batch 1,8,32 --draft-loops 2 \
  --out $OUT/pipe_d2_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 120) $P --temperature 0 --batch 1,8,32 --draft-loops 1 \
  --out $OUT/pipe_d1_${S}_$G.json 2>&1 | show
for d in 2 1; do
  timeout -s KILL $(left 50) $P --temperature 0.8 --batch 1 --draft-loops $d \
    --out $OUT/pipe_d${d}_t08_${S}_$G.json 2>&1 | show
done
for arm in "2 gemv@2+norms+stream+inv@3-64 gemv2" "2 gemv@2+norms+stream@2+inv@3-64 stream2" \
           "1 gemv@4+norms+stream+inv@5-64 gemv4"; do
  set -- $arm
  timeout -s KILL $(left 60) $P --temperature 0 --batch 1 --draft-loops $1 --projections $2 \
    --out $OUT/pipe_d$1_$3_${S}_$G.json 2>&1 | show
done
for d in 2 1; do
  timeout -s KILL $(left 90) python3 -m benchmarks.kernel_trace --synthetic 1.4b \
    --attention pallas --new-tokens 32 --top 25 --minus-prefill --batch 1 --k 1 --pipelined \
    --draft-loops $d --out $OUT/kernel_trace_b1_pipe_d${d}_${S}_$G.json 2>&1 | \
    grep -v "^ *$" | sed -n '/^{/p;/decode only/,/^  top_kinds/p' | head -30
done
echo "pipelined part: ${SECONDS}s"
if [ $G = h200 ]; then
  [ $(left 600) -gt 200 ] && CAP=$(left 600) SESSION=$S OUT=$OUT bash benchmarks/gpu_session45_call.sh
else
  [ $(left 600) -gt 120 ] && CAP=$(left 600) SESSION=$S OUT=$OUT bash benchmarks/gpu_session45_last.sh
fi
echo "elapsed ${SECONDS}s"
