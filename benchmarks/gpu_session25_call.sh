#!/usr/bin/env bash
# Session 25's GPU call:
#   p. benchmarks.pdl_chain (PyTorch + Triton, outside JAX): the one-row GEMV chain of a
#      decoder layer with and without PDL, the wait at the kernel's start (what XLA does;
#      `xla_like` since session 25's mends) and after the first weight block is requested
#      (what XLA does not allow), at the engine's tilings and at half the blocks per
#      program (session 25 ran it before the xla_like / weights_only arms and the norm);
#   a-c. on an H200 only: gpu_session24_call3.sh's steps (flow diagnostics, defer_norm A/B,
#      the CLI's first and cached start), never measured on that card.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session25_call.sh
# STEPS= a subset of "pabc" (default pabc); CAP= seconds (default 570); TAG= a suffix for
# the pdl_chain files (e.g. _rerun: session 25 committed the untagged names).
. benchmarks/gpu_call_setup.sh
STEPS=${STEPS:-pabc}
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [[ $STEPS == *p* ]]; then
  timeout $(left 150) python3 -m benchmarks.pdl_chain --out $OUT/pdl_chain_session25${TAG:-}_$G.json
  timeout $(left 120) python3 -m benchmarks.pdl_chain --arms plain,xla_like,weights_only,weights_first,weights_late,plain \
    --tiling qkv=4:2:4,o=2:1:4,gate_up=2:4:4,down=1:2:4 --out $OUT/pdl_chain_pp_half_session25${TAG:-}_$G.json
fi
echo "p done at $SECONDS s"
if [ "$G" = h200 ]; then
  S=${STEPS//p/}
  [ -n "$S" ] && STEPS=$S CAP=$((CAP - SECONDS)) OUT=$OUT bash benchmarks/gpu_session24_call3.sh
fi
echo "elapsed $SECONDS s"
