#!/usr/bin/env bash
# Session 40, fifth call: the batch-invariant mode's ragged attention key block (block_t;
# any fixed value keeps the mode's guarantee). Batch-1 decode runs the ragged kernel with one
# split, so its latency is one chain of context/block_t key blocks (3 at the protocol's
# ~190 keys with the default 64). Batch-1 native at block_t 32/64/128/256, then the best
# two at batch 64 native and k=4 (greedy identity checked by the benchmark).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=300] bash benchmarks/gpu_session40_attention.sh
S=${SESSION:-session40}
CAP=${CAP:-300}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --compile-cache /tmp/cc --batch-invariant"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|identical|bandwidth"; }
for arm in block_t=64 block_t=128 block_t=256,num_stages=1 block_t=128,num_stages=1 block_t=32; do
  tag=$(echo $arm | tr '=,' '_-')
  echo "== $arm"
  timeout -s KILL $(left 45) $D --ragged-kernel $arm --batch 1 --k 0,4 \
    --out $OUT/decode_inv_attn_${tag}_b1_${S}_$G.json 2>&1 | show
done
for arm in block_t=128 block_t=256,num_stages=1; do
  tag=$(echo $arm | tr '=,' '_-')
  echo "== $arm batch 64"
  timeout -s KILL $(left 60) $D --ragged-kernel $arm --batch 64 --k 0,4 \
    --out $OUT/decode_inv_attn_${tag}_b64_${S}_$G.json 2>&1 | show
done
echo "elapsed ${SECONDS}s"
