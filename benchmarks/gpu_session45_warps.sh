#!/usr/bin/env bash
# Session 45: the decode kernel's warps below 64 sequences, end to end. Kernel alone on an
# H100 (attention_decode_contexts_session45_h100.json, attention_ragged_decode_session44_h100.json)
# its num_warps=2 variant took 21.6 / 31.8 / 59.9 / 106.3 us at batch 8 and 512 / 1024 /
# 2048 / 4096 keys against the default tuning's (4 warps) 25.0 / 37.0 / 74.9 / 105.3, and
# was level at batch 32 and 2048 keys (203.9 against 201.7). Arms, native greedy, in two
# interleaved passes: d (the default), w2 (--decode-kernel num_warps=2), bw
# (block_t=32,num_warps=2); first at the protocol's contexts (prompt 128, batch 8 and 32),
# then at a 2048-token prompt (batch 1 and 8: the roofline fraction at a long context too).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=570] bash benchmarks/gpu_session45_warps.sh
S=${SESSION:-session45}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --k 0"
arm() { case $1 in d) echo "" ;; w2) echo "--decode-kernel num_warps=2" ;;
  bw) echo "--decode-kernel block_t=32,num_warps=2" ;; esac; }
for part in short long; do
  mkdir -p /tmp/arms_$part
  for pass in 1 2; do
    for a in d w2 bw; do
      if [ $part = short ]; then P="--batch 8,32"; T=75; else P="--batch 1,8 --prompt-len 2048"; T=70; fi
      timeout -s KILL $(left $T) $D $P $(arm $a) --out /tmp/arms_$part/${a}_$pass.json \
        >/tmp/arms_$part/${a}_$pass.log 2>&1 || tail -3 /tmp/arms_$part/${a}_$pass.log
    done
  done
  python3 -m benchmarks.ab_arms /tmp/arms_$part $OUT/ab_decode_warps_${part}_${S}_$G.json
done
echo "elapsed ${SECONDS}s"
