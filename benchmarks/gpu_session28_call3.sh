#!/usr/bin/env bash
# Session 28's third call: why the graph loops ran slower end to end (196.0 against 202.8
# tok/s, call 2): kernel traces of batch-1 native decode, default against '+graph' (per
# kernel kind: count and mean us; busy share), then the graph loop's GPU tests again (call 2's
# 24-layer bound was a fixed 2%, now relative to XLA's einsum path).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session28_call3.sh
. benchmarks/gpu_call_setup.sh
K="python3 -m benchmarks.kernel_trace --attention pallas --batch 1 --k 0 --top 14"
timeout -s KILL $(left 120) $K --out $OUT/kernel_trace_default_b1_session28_$G.json 2>&1 \
  | grep -vi warn | tail -22 | cut -c1-200
timeout -s KILL $(left 120) $K --projections gemv+norms+stream+graph \
  --out $OUT/kernel_trace_graph_b1_session28_$G.json 2>&1 | grep -vi warn | tail -22 | cut -c1-200
echo "traces done at $SECONDS s"
timeout -s KILL $(left 200) python3 -m pytest -q -m gpu tests/test_graph_loop.py 2>&1 \
  | grep -E "passed|failed|Error|assert" | tail -12 | cut -c1-400
echo "elapsed $SECONDS s"
