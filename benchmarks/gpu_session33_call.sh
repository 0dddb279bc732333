#!/usr/bin/env bash
# Session 33's prepared call (no GPU came to run it in session 33), for the next session:
#   1. benchmarks.l2_side_stream: the one-row GEMV chain with and without a weight
#      prefetcher on a stream of its own (PyTorch + Triton; any card);
#   2. benchmarks.stream_probe: whether XLA overlaps a compute_on("gpu_stream:1") call with
#      the main stream, plainly and inside a fori_loop; then benchmarks.side_prefetch_jax:
#      the engine's GEMV chain (24 layers, one loop) in JAX with the progress stores and
#      pallas_kernels/side_prefetch.py on stream 1 (arms base, stores, pf:...);
#   3. batch-1 native greedy, two passes: default, ev (evict_first weight loads), lcpdl
#      (the decode kernel merging its own splits, with its PDL trigger), lc (without);
#   4. (PART=2) on an H200 only: session 32's omk arms (o_merge at block_k 2048, 8 warps) with the
#      CLI's first and cached start (the pinned loader), and the d=1 k=4 batch-1 row.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [PART=1|2] [CAP=560] bash
# benchmarks/gpu_session33_call.sh. PART 1 (default; about 6 minutes on an H100): 1-3;
# PART 2 (an H200 only, about 5 minutes): 4.
S=${SESSION:-session34}
CAP=${CAP:-560}
. benchmarks/gpu_call_setup.sh
if [ "${PART:-1}" = 1 ]; then
  SESSION=$S STEPS=p CAP=$(left 130) OUT=$OUT bash benchmarks/gpu_session31_call.sh 2>&1 | grep -v "^device"
  timeout -s KILL $(left 50) python3 -m benchmarks.stream_probe --out $OUT/stream_probe_${S}_$G.json 2>&1 | tail -6
  timeout -s KILL $(left 170) python3 -m benchmarks.side_prefetch_jax --loops 1 --repeats 20 \
    --arms ${JARMS:-base,stores,pf:16:16,pf:32:32,base} --out $OUT/side_prefetch_jax_${S}_$G.json \
    2>&1 | grep -E "^\{|rror" | cut -c1-300
  SESSION=$S STEPS=e PASSES=2 EARMS="default ev lcpdl lc" AB_NAME=evict_lc CAP=$(left 220) OUT=$OUT \
    bash benchmarks/gpu_session31_call.sh 2>&1 | grep -v "^device"
elif [ $G = h200 ]; then
  # (EARMS2 / AB2: other arms for step e, as benchmarks/gpu_session34_call.sh asks)
  SESSION=$S STEPS=ec PASSES=2 EARMS="${EARMS2:-default omk}" AB_NAME=${AB2:-o_merge_k2048} \
    CAP=$(left 330) OUT=$OUT \
    bash benchmarks/gpu_session31_call.sh 2>&1 | grep -v "^device"
  timeout -s KILL $(left 150) python3 -m benchmarks.decode --attention pallas --repeats 3 \
    --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0,4 --draft-loops 1 \
    --temperature 0 --out $OUT/decode_b1_d1_${S}_$G.json 2>&1 \
    | grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth"
else
  echo "PART 2 is for an H200 (this is $DEV)"
fi
echo "elapsed $SECONDS s"
