#!/usr/bin/env bash
# Session 4, device call 2 (issue 6), batch 1: projections through the Pallas GEMV vs XLA end to
# end, more GEMV tilings, decode-attention split counts, and the optimized HLO of the batch-1
# decode program with a kernel trace that places its device-to-device memcpys. ~8 minutes.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session4_call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc"
timeout 100 python3 -m benchmarks.gemv --rows 1 --variants fma8_k256_w4,fma4_k512_w4,fma16_k256_w8,fma4_k2048_w4,fma2_k2048_w4,fma1_k2048_w2,fma4_k1024_w4,fma8_k1024_w8,fma2_k1024_w2,fma4_k512_w2,fma4_k256_w2 \
  --out $OUT/gemv_session4_m1_h200.json 2>&1 | grep -v "^{"
for P in xla gemv gemv:gate_up; do
  timeout 95 $D --batch 1 --k 0,4 --temperature 0 --projections $P \
    --out $OUT/ab_proj_${P/:/_}_b1_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
done
for S in 1 4; do
  timeout 60 $D --batch 1 --k 0 --temperature 0 --decode-kernel num_splits=$S \
    --out $OUT/ab_splits${S}_b1_h200.json 2>&1 | grep -E "^ *1 (native|spec)"
done
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_chunk.*" \
  timeout 90 python3 -m benchmarks.kernel_trace --synthetic 1.4b --batch 1 --k 0 --attention pallas \
  --top 12 --out $OUT/kernel_trace_b1_memcpy_h200.json 2>&1 | grep -E "Memcpy|decode_tok_s" | head -8
ls /tmp/hlo | head -20
tar czf $OUT/hlo_decode_b1.tgz -C /tmp hlo 2>/dev/null; ls -la $OUT
