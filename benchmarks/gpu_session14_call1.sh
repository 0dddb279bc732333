#!/usr/bin/env bash
# Session 14 (issue 6), first call: L2 prefetch in the streaming GEMV
# (pallas_kernels/l2_prefetch.py; gemv_stream's l2_prefetch and next_w).
#   1. GPU tests: bit-identical results with and without the prefetches.
#   2. Batch-1 native greedy, six arms, twice (second pass in reverse order):
#      default; own later blocks prefetched by the two prologue GEMVs (qkv, gate/up) or all
#      four; the next projection's first rows prefetched (qkv->o, o->gate/up, gate/up->down,
#      down->next qkv) at the programs' end or start; both.
#   3. A kernel trace of the arm with both, for per-kernel times.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session14_call1.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -W ignore::DeprecationWarning \
  tests/test_l2_prefetch.py > $OUT/gpu_tests_l2_prefetch_session14.txt 2>&1
tail -3 $OUT/gpu_tests_l2_prefetch_session14.txt
A=$OUT/arms; mkdir -p $A
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
S4="qkv=all,o=all,gate_up=all,down=all"; NX="qkv=2,o=2,gate_up=2,down=3"
run() { timeout 60 $D "${@:2}" --out $A/$1_p$pass.json 2>&1 | grep -E "rror" ; }
arms() {
  run default
  run self2 --l2-prefetch qkv=all,gate_up=all
  run self4 --l2-prefetch $S4
  run next_end --l2-next $NX
  run next_start --l2-next $NX --l2-next-at start
  run both --l2-prefetch $S4 --l2-next $NX
}
pass=1; arms
pass=2; run both --l2-prefetch $S4 --l2-next $NX; run next_start --l2-next $NX --l2-next-at start
run next_end --l2-next $NX; run self4 --l2-prefetch $S4; run self2 --l2-prefetch qkv=all,gate_up=all
run default
python3 -m benchmarks.ab_arms $A $OUT/ab_l2_b1_session14_h200.json
rm -rf $A
timeout 80 python3 -m benchmarks.kernel_trace --attention pallas --batch 1 --k 0 --top 12 \
  --l2-prefetch $S4 --l2-next $NX --out $OUT/kernel_trace_b1_l2_both_session14_h200.json 2>&1 \
  | grep -vE "^\s*$" | cut -c1-170 | head -16
