#!/usr/bin/env bash
# Session 41, second call: the batch-64 k=4 d=2 kernel traces again, with the prefill
# subtracted name by name (benchmarks.kernel_trace --minus-prefill): the first call's traces
# spread the prefill's compute-bound GEMMs over the units, and in the batch-invariant mode
# they share the decode kernels' names.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=400] bash benchmarks/gpu_session41_trace.sh
S=${SESSION:-session41}
CAP=${CAP:-400}
. benchmarks/gpu_call_setup.sh
T="python3 -m benchmarks.kernel_trace --synthetic 1.4b --attention pallas --new-tokens 32 --top 40 --minus-prefill"
sel() { grep -v "^ *$" | sed -n '/^{/p;/decode only/,/^ *MemcpyH2D/p' | head -${1:-100}; }
timeout -s KILL $(left 200) $T --batch-invariant --batch 64 --k 0,4 \
  --out $OUT/kernel_trace_inv_b64_k4_dec_${S}_$G.json 2>&1 | sel 400
timeout -s KILL $(left 200) $T --batch 64 --k 0,4 \
  --out $OUT/kernel_trace_default_b64_k4_dec_${S}_$G.json 2>&1 | sel 400
echo "elapsed ${SECONDS}s"
