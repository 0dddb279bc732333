#!/usr/bin/env bash
# Session 41, end to end: the batch-invariant mode with the shipped row-count routes
# (ouro_jax.invariant.ROUTES, picked from gpu_session41_routes.sh's sweep and bits probe)
# against session 40's tiling without routes, on the same card; the GPU tests of the routes'
# bits and of the mode's identity first.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=540] bash benchmarks/gpu_session41_e2e.sh
S=${SESSION:-session41}
CAP=${CAP:-540}
. benchmarks/gpu_call_setup.sh
timeout -s KILL $(left 150) python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_invariant.py 2>&1 | tail -4
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --batch-invariant"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|identical|bandwidth" | cut -c1-170; }
timeout -s KILL $(left 260) $D --batch 1,8,64 --k 0,4 \
  --out $OUT/decode_inv_routes_${S}_$G.json 2>&1 | show
S40=qkv=mm64_n64_k128_w4_s4,o=mm64_n64_k128_w4_s4_x4,gate_up=mm64_n64_k128_w8_s4
S40=$S40,down=mm64_n64_k128_w4_s4_x4
timeout -s KILL $(left 200) $D --batch 1,64 --k 0,4 --invariant-tiling $S40 \
  --out $OUT/decode_inv_noroutes_${S}_$G.json 2>&1 | show
echo "elapsed ${SECONDS}s"
