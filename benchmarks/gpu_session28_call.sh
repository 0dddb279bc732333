#!/usr/bin/env bash
# Session 28's GPU call: whether a CUDA graph of our own, with the PDL launches as
# programmatic edges, wins in JAX what session 26 measured in a PyTorch graph (weights first,
# trigger at the start, half the blocks per program: 35.9 against 40.1 us per layer
# application for the four one-row projections). Every step under a KILL timeout:
#   t. the launcher's GPU tests (tests/test_pdl_launch.py: the graph sequence gives the stream
#      launches' bits, a 40-kernel chain too, and is replayed);
#   g. the engine's graph loops' GPU tests (tests/test_graph_loop.py: one 24-layer loop
#      against the default path, and the engine's greedy tokens);
#   e. batch-1 native greedy decode: default against --projections gemv+norms+stream+graph
#      (each loop's 24 layers as one CUDA graph of our own), two interleaved passes;
#   p. benchmarks.pdl_jax_chain: JAX's launch against one custom call per loop (all 24
#      layers' 96 kernels) from the stream (lseq) or as our graph (gseq), at the engine's
#      tilings and at half the blocks per program;
# (Call 2 also ran a step d, --persistent-layers with the smem_a chain at 11 ring slots: the
# ring needs 12 and 12 overflow SMEM, so both arms were refused; the step is gone.)
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session28_call.sh; STEPS= a subset
# of "tgep" (default tgep); CAP= seconds (default 570).
. benchmarks/gpu_call_setup.sh
STEPS=${STEPS:-tgep}
on() { [[ $STEPS == *$1* ]]; }
if on t; then
  timeout -s KILL $(left 150) python3 -m pytest -q -m gpu tests/test_pdl_launch.py 2>&1 | tail -4
  echo "t done at $SECONDS s"
fi
if on g; then
  timeout -s KILL $(left 200) python3 -m pytest -q -x -m gpu tests/test_graph_loop.py 2>&1 \
    | tail -15 | cut -c1-400
  echo "g done at $SECONDS s"
fi
if on e; then
  A=$OUT/graph28; rm -rf $A; mkdir -p $A
  D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --temperature 0 --k 0"
  erun() { [ $SECONDS -lt $((CAP - 50)) ] && timeout -s KILL $(left 120) $D "${@:2}" \
    --out $A/$1.json 2>&1 | grep -E "tok/s|rror|^  [0-9]" | cut -c1-300; }
  for p in 1 2; do
    erun default_p$p
    erun graph_p$p --projections gemv+norms+stream+graph
  done
  ls $A/*.json >/dev/null 2>&1 && python3 -m benchmarks.ab_arms $A \
    $OUT/ab_graph_b1_session28_$G.json
  echo "e done at $SECONDS s"
fi
if on p; then
  J="python3 -m benchmarks.pdl_jax_chain --repeats ${REPEATS:-20}"
  timeout -s KILL $(left 170) $J --arms xla,lseq,gseq,lseq_start,gseq_start,gseq_end,xla \
    --out $OUT/pdl_jax_chain_graph_session28_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-330
  timeout -s KILL $(left 150) $J --arms xla,gseq,gseq_start,gseq_end,xla \
    --tiling qkv=4:2:4,o=2:1:4,gate_up=2:4:4,down=1:2:4 \
    --out $OUT/pdl_jax_chain_graph_half_session28_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-330
  echo "p done at $SECONDS s"
fi
echo "elapsed $SECONDS s"
