#!/usr/bin/env bash
# Session 14 (issue 6), fourth call. Call 3 (gemv_scaling_session14_h200.json): per call, the
# streaming GEMV costs a fixed 2.1-2.7 us plain (3.1 qkv, 4.1 gate/up with the add_norm
# prologue) plus its bytes at 3.7-4.2 TB/s (XLA reads at 4.60); the tiling sweep by device
# time kept the engine's tilings. Call 1 showed that more early weight traffic (own blocks
# prefetched at the start) slows the prologue GEMVs, as if the prologue's reads of x and
# the branch wait behind the weight stream. Here gemv_stream's x_first: those reads issued
# before the first weight block (same math).
#   1. GPU tests (bit-identical with x_first and with the prefetches);
#   2. batch-1 native greedy: default, x_first on qkv + gate/up, on all four; two passes;
#   3. a kernel trace with x_first on qkv + gate/up.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session14_call4.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE --tb=short -W ignore::DeprecationWarning \
  tests/test_l2_prefetch.py > $OUT/gpu_tests_x_first_session14.txt 2>&1
tail -3 $OUT/gpu_tests_x_first_session14.txt
A=$OUT/arms; mkdir -p $A
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
run() { timeout 50 $D "${@:2}" --out $A/$1_p$pass.json 2>&1 | grep -E "rror" ; }
X2="qkv.x_first=1,gate_up.x_first=1"; X4="$X2,o.x_first=1,down.x_first=1"
pass=1; run default; run xf2 --stream-set $X2; run xf4 --stream-set $X4
pass=2; run xf4 --stream-set $X4; run xf2 --stream-set $X2; run default
python3 -m benchmarks.ab_arms $A $OUT/ab_x_first_b1_session14_h200.json
rm -rf $A
timeout 80 python3 -m benchmarks.kernel_trace --attention pallas --batch 1 --k 0 --top 8 \
  --stream-set $X2 --out $OUT/kernel_trace_b1_x_first_session14_h200.json 2>&1 \
  | grep -vE "^\s*$|Warn|return" | cut -c1-170 | head -11
