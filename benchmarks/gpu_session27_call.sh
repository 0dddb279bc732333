#!/usr/bin/env bash
# Session 27's prepared GPU call (no machine was lent that session): the engine's decode
# attention on Mosaic GPU (pallas_kernels/decode_mgpu_paged.py: paged, RoPE and the K/V write
# fused, one program per row and KV head, no splits and so no XLA merge kernel), first in
# isolation, then end to end; every step under a KILL timeout, the smallest first:
#   t. its GPU tests (1.4B shape, batch 1 and 8, against the Triton kernel and the reference;
#      the predicated page copies run only here);
#   a. benchmarks.attention_paged_mgpu: device time per layer application, Triton (+ XLA
#      merge; + last_combine) vs three tilings, batch 1 and 8, 192 and 1,024 positions;
#   d. batch-1 native greedy decode (1.4B synthetic, bf16): default vs --decode-kernel
#      mgpu=1, two interleaved passes (the second in reverse order); the table goes to
#      ab_mgpu_b1_session27_$G.json;
# Not in the default (a second call: STEPS=gcl):
#   g. the whole-layer persistent kernel's GPU tests (tests/test_chain_attention.py: tiny
#      shapes on 1-3 programs through the handover, then the 1.4B shapes), Mosaic's ptxas
#      logs kept (layer_dump.tgz);
#   c. session 26's persistent GEMV chain: its GPU tests and benchmarks.chain_mgpu (STEPS=ts
#      of benchmarks/gpu_session26_call.sh);
#   l. benchmarks.layer_mgpu: whole layers per layer application, the engine's kernels vs
#      the persistent kernel with and without its attention stage.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session27_call.sh
# STEPS= a subset of "tadgcl" (default tad); ARMS= d's arms (default "default mgpu"; also
# mgpu128: block 128, 2 stages; persistent: --persistent-layers, each loop's 24 layers as
# one kernel; persistent_smema: the same with --persistent-tiling uniform=1,smem_a=1);
# BATCH= d's batch (default 1); CAP= seconds (default 570).
# Suggested calls, each within one 600 s command: STEPS=tga (every new kernel's GPU tests,
# then the attention benchmark); STEPS=d ARMS="default mgpu persistent"; STEPS=lc.
. benchmarks/gpu_call_setup.sh
STEPS=${STEPS:-tad}
on() { [[ $STEPS == *$1* ]]; }
if on t; then
  timeout -s KILL $(left 150) python3 -m pytest -q -m gpu tests/test_decode_mgpu_paged.py \
    2>&1 | tail -4
  echo "t done at $SECONDS s"
fi
if on g; then
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_TO=$OUT/layer_dump timeout -s KILL $(left 200) \
    python3 -m pytest -q -x -m gpu tests/test_chain_attention.py 2>&1 | tail -4
  (cd $OUT && tar czf layer_dump.tgz layer_dump 2>/dev/null; rm -rf layer_dump)
  echo "g done at $SECONDS s"
fi
if on a; then
  timeout -s KILL $(left 200) python3 -m benchmarks.attention_paged_mgpu \
    --out $OUT/attention_paged_mgpu_session27_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-600
  echo "a done at $SECONDS s"
fi
if on d; then
  A=$OUT/arms27; rm -rf $A; mkdir -p $A
  D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch ${BATCH:-1} --temperature 0 --k 0"
  run() { [ $SECONDS -lt $((CAP - 60)) ] && timeout -s KILL $(left 110) $D "${@:2}" \
    --out $A/$1.json 2>&1 | grep -E "tok/s|rror" | cut -c1-300; }
  arm() {
    case $1 in
      default) run default_p$2 ;;
      mgpu) run mgpu_p$2 --decode-kernel mgpu=1 ;;
      mgpu128) run mgpu128_p$2 --decode-kernel mgpu=1,mgpu_block=128,mgpu_stages=2 ;;
      persistent) run persistent_p$2 --persistent-layers ;;
      persistent_smema) run persistent_smema_p$2 --persistent-layers \
        --persistent-tiling uniform=1,smem_a=1 ;;
    esac
  }
  ARMS=${ARMS:-"default mgpu"}
  for a in $ARMS; do arm $a 1; done
  for a in $(echo $ARMS | tr ' ' '\n' | tac); do arm $a 2; done
  ls $A/*.json >/dev/null 2>&1 && python3 -m benchmarks.ab_arms $A \
    $OUT/ab_mgpu_b${BATCH:-1}_session27_$G.json
  echo "d done at $SECONDS s"
fi
if on l; then
  timeout -s KILL $(left 240) python3 -m benchmarks.layer_mgpu \
    --out $OUT/layer_mgpu_session27_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-600
  echo "l done at $SECONDS s"
fi
if on c; then
  STEPS=ts CAP=$((CAP - SECONDS)) bash benchmarks/gpu_session26_call.sh
fi
echo "elapsed $SECONDS s"
