#!/usr/bin/env bash
# Session 26's prepared GPU call (not run: the device time ran out), for the persistent Mosaic
# GPU GEMV chain in its committed form (tile-major weights, one x broadcast per K step for
# all of a program's units). The first run of that form lost its machine ("stopped
# answering", no output), so every step here runs under a KILL timeout, the smallest first:
#   t. tests/test_chain_mgpu.py (the GPU tests at the 1.4B shapes: one layer, each stage vs
#      XLA; two layers with the add_norm prologues);
#   s. benchmarks.chain_mgpu: XLA's chain and the engine's streaming GEMVs with their
#      add_norm prologues vs the persistent kernel at its default tilings (plain and
#      normed), with the no-math and no-x diagnostics (wrong results) that split its time;
#   d. batch-1 native greedy decode, today's default, for the card's baseline.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session26_call.sh
# STEPS= a subset of "tsd" (default tsd); CAP= seconds (default 570); TAG= a file suffix.
. benchmarks/gpu_call_setup.sh
STEPS=${STEPS:-tsd}
on() { [[ $STEPS == *$1* ]]; }
on t && timeout -s KILL $(left 120) python3 -m pytest -q -x tests/test_chain_mgpu.py 2>&1 | tail -4
echo "t done at $SECONDS s"
on s && timeout -s KILL $(left 300) python3 -m benchmarks.chain_mgpu --repeats 10 \
  --baselines xla,stream_normed,xla_normed \
  ${CHAIN_TILINGS:+--tilings $CHAIN_TILINGS} --out $OUT/chain_mgpu_session26${TAG:-}_$G.json 2>&1 \
  | grep -E '^\{|rror' | cut -c1-600
echo "s done at $SECONDS s"
on d && timeout -s KILL $(left 150) python3 -m benchmarks.decode --attention pallas --repeats 3 \
  --branch-scale 0.003 --batch 1 --temperature 0 --k 0 --synthetic 1.4b \
  --out $OUT/decode_b1_session26${TAG:-}_$G.json 2>&1 | grep -E "tok/s|rror" | cut -c1-300
echo "elapsed $SECONDS s"
