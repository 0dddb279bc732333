#!/usr/bin/env bash
# Session 45's last call. On an H200: gpu_session45_call.sh (the table at today's default,
# session 45's decode tuning included, beside the defaults before session 43; then session
# 35's PART=mini). Elsewhere: the shipped decode-kernel default from 2 rows up (32-key
# blocks, 2 warps: pallas_kernels.decode.WIDE_BLOCK_T / MULTI_ROW_WARPS) against the one
# before it (--decode-kernel block_t=64,num_warps=4; batch 8 and 32 only, as that override
# would also change batch 1's 32-key blocks), k 0,4 greedy, two interleaved passes: the
# shipped code itself, where the session's A/B ran the same programs through overrides;
# then the streaming GEMV at 1 and 2 rows and benchmarks.attention_kernels --device-time at
# three decode points, by device time.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=560] bash benchmarks/gpu_session45_last.sh
S=${SESSION:-session45}
CAP=${CAP:-560}
. benchmarks/gpu_call_setup.sh
if [ $G = h200 ]; then
  CAP=$CAP SESSION=$S OUT=$OUT bash benchmarks/gpu_session45_call.sh
  exit
fi
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --batch 8,32 --k 0,4"
mkdir -p /tmp/arms_last
for pass in 1 2; do
  for a in new old; do
    [ $a = old ] && X="--decode-kernel block_t=64,num_warps=4" || X=""
    timeout -s KILL $(left 90) $D $X --out /tmp/arms_last/${a}_$pass.json \
      >/tmp/arms_last/${a}_$pass.log 2>&1 || tail -3 /tmp/arms_last/${a}_$pass.log
  done
done
python3 -m benchmarks.ab_arms /tmp/arms_last $OUT/ab_decode_default_vs_old_${S}_$G.json
# then, if time is left, the streaming GEMV at 1 and 2 rows by device time (the first step of
# the pipelined-speculation lead, docs/performance.md "Not yet done": its passes run 2 rows
# per sequence; the engine's tilings, qkv and gate/up with their add_norm prologue)
G2="python3 -m benchmarks.gemv --rows 1,2 --calls 10 --trials 3 --device-time"
[ $(left 600) -gt 60 ] && timeout -s KILL $(left 90) $G2 --prologue add_norm \
  --shapes qkv,gate_up --variants engine --out $OUT/gemv_rows12_normed_${S}_$G.json 2>&1 | tail -8
[ $(left 600) -gt 60 ] && timeout -s KILL $(left 90) $G2 --shapes o,down \
  --variants st2_k512_p2_w4,st1_k512_p4_w4 --out $OUT/gemv_rows12_plain_${S}_$G.json 2>&1 | tail -10
# and the attention benchmark's first --device-time figures (its wall clock read batch 1 at
# 2048 keys above the DRAM peak in session 45)
[ $(left 600) -gt 60 ] && timeout -s KILL $(left 150) python3 -m benchmarks.attention_kernels \
  --no-sweep --device-time --points decode:1:2048,decode:8:512,decode:8:2048 \
  --out $OUT/attention_device_time_${S}_$G.json 2>&1 | tail -45
echo "elapsed ${SECONDS}s"
