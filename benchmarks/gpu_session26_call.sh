#!/usr/bin/env bash
# Session 26's prepared GPU call (not run: the device time ran out), for the persistent Mosaic
# GPU GEMV chain in its committed form (one packed tile-major weight array read through a
# per-program tile table, one x broadcast per K step for all of a program's units, the
# add_norm prologues as an option). The first run of an earlier form of it lost its machine
# ("stopped answering", no output), so every step here runs under a KILL timeout, smallest
# first:
#   t. tests/test_chain_mgpu.py's GPU tests (-m gpu), the smallest first: tiny shapes on one
#      and two programs through the handover, then the 1.4B shapes (one layer, each stage vs
#      XLA; two layers with the add_norm prologues); Mosaic's ptxas log and SASS are kept
#      (mgpu_dump.tgz) to check the wgmma under pl.when and the register use;
#   s. benchmarks.chain_mgpu: XLA's chain and the engine's streaming GEMVs with their
#      add_norm prologues vs the persistent kernel at its default tilings (plain and
#      normed), with the no-math and no-x diagnostics (wrong results) that split its time;
#   a. benchmarks.attention_mgpu: one-row decode attention, one Mosaic program per head
#      (pallas_kernels/decode_mgpu.py) against the engine's Triton kernel + XLA merge;
#   d. batch-1 native greedy decode, today's default, for the card's baseline.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session26_call.sh
# STEPS= a subset of "tsad" (default tsad); CAP= seconds (default 570); TAG= a file suffix.
. benchmarks/gpu_call_setup.sh
STEPS=${STEPS:-tsad}
on() { [[ $STEPS == *$1* ]]; }
if on t; then
  MOSAIC_GPU_DUMP_PTXAS=1 MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=$OUT/mgpu_dump \
    timeout -s KILL $(left 150) python3 -m pytest -q -x -m gpu tests/test_chain_mgpu.py 2>&1 | tail -4
  timeout -s KILL $(left 100) python3 -m pytest -q -m gpu tests/test_decode_mgpu.py 2>&1 | tail -4
  # the dumps are many files: list some and bring them back as one archive (if under 16 MB)
  ls $OUT/mgpu_dump 2>/dev/null | head -20
  (cd $OUT && tar czf mgpu_dump.tgz mgpu_dump 2>/dev/null; rm -rf mgpu_dump)
  echo "t done at $SECONDS s"
fi
on s && timeout -s KILL $(left 300) python3 -m benchmarks.chain_mgpu --repeats 10 \
  --baselines xla,stream_normed,xla_normed \
  ${CHAIN_TILINGS:+--tilings $CHAIN_TILINGS} --out $OUT/chain_mgpu_session26${TAG:-}_$G.json 2>&1 \
  | grep -E '^\{|rror' | cut -c1-600
echo "s done at $SECONDS s"
on a && timeout -s KILL $(left 150) python3 -m benchmarks.attention_mgpu \
  --out $OUT/attention_mgpu_session26${TAG:-}_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-400
echo "a done at $SECONDS s"
on d && timeout -s KILL $(left 150) python3 -m benchmarks.decode --attention pallas --repeats 3 \
  --branch-scale 0.003 --batch 1 --temperature 0 --k 0 --synthetic 1.4b \
  --out $OUT/decode_b1_session26${TAG:-}_$G.json 2>&1 | grep -E "tok/s|rror" | cut -c1-300
echo "elapsed $SECONDS s"
