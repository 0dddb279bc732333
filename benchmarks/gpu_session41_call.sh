#!/usr/bin/env bash
# Session 41, first call. On an H200: the prepared H200 call (gpu_session35_call.sh, PART=all).
# On any other card: where a speculative round's time goes at batch 64, in the
# batch-invariant mode (whose k=4 d=2 ran at 0.94x its native in session 40) and in the
# default (1.08x on an H100 in session 35): kernel traces of k=4 d=2 at batch 64, both.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=520] bash benchmarks/gpu_session41_call.sh
S=${SESSION:-session41}
CAP=${CAP:-520}
. benchmarks/gpu_call_setup.sh
if [ $G = h200 ]; then
  SESSION=$S CAP=$CAP OUT=$OUT bash benchmarks/gpu_session35_call.sh
  exit
fi
T="python3 -m benchmarks.kernel_trace --synthetic 1.4b --attention pallas --new-tokens 32 --top 40"
timeout -s KILL $(left 200) $T --batch-invariant --batch 64 --k 0,4 \
  --out $OUT/kernel_trace_inv_b64_k4_${S}_$G.json 2>&1 | grep -v "^ *$" | head -120
timeout -s KILL $(left 200) $T --batch 64 --k 0,4 \
  --out $OUT/kernel_trace_default_b64_k4_${S}_$G.json 2>&1 | grep -v "^ *$" | head -120
echo "elapsed ${SECONDS}s"
