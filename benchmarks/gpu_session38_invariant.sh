#!/usr/bin/env bash
# Session 38: the batch-invariant mode (ouro_jax.invariant) on a GPU.
#   1. its kernel tests compiled (the GEMM at 1-320 rows, the ragged kernel one query
#      against k+1, with the default tuning's control);
#   2. benchmarks.decode --batch-invariant, 1.4B shape, bf16: batch 1, 8, 64, native and k=4
#      d=2 greedy (its greedy_token_match: identical sequences out of the batch), then the
#      default kernels' native rows at the same batches as this card's baseline;
#   3. its GPU test (tests/test_invariant.py -m gpu: 1.4B width, two layers, bf16, batch 8:
#      greedy speculative log-probs bit-identical to native, requests alone = in the batch).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=540] bash benchmarks/gpu_session38_invariant.sh
S=${SESSION:-session38}
CAP=${CAP:-540}
. benchmarks/gpu_call_setup.sh
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --compile-cache /tmp/cc"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|identical|bandwidth"; }
timeout -s KILL $(left 90) python3 -m pytest -q -p no:cacheprovider tests/test_invariant.py \
  -k "gemm_fixed or ragged_attention or row_sum" 2>&1 | tail -8
timeout -s KILL $(left 240) $D --batch-invariant --batch 1,8,64 --k 0,4 \
  --out $OUT/decode_invariant_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 120) $D --batch 1,8,64 --k 0 --out $OUT/decode_default_${S}_$G.json 2>&1 | show
timeout -s KILL $(left 200) python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_invariant.py 2>&1 | tail -8
echo "elapsed ${SECONDS}s"
