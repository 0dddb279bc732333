#!/usr/bin/env bash
# Session 43: the default engine with the batch-invariant mode's kernels for calls of 2-64
# rows ('+inv': Pallas GEMM tiles and add_norm kernels in place of XLA's GEMMs and its norm
# and residual fusions) and, as a separate arm, decode attention of batch >= 8 through the
# RoPE/K/V-write kernel and the ragged kernel (--decode-kernel ragged_from=8). Session 43's
# batch-64 traces (kernel_trace_{default,inv}_b64_k4_dec_session43_h100.json) put the
# mode's native step 12% under the default's.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=580] [ARMS="base inv invr"]
#   [BATCH=1,8,32,64] bash benchmarks/gpu_session43_inv.sh
S=${SESSION:-session43}
. benchmarks/gpu_call_setup.sh
CAP=${CAP:-580}
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2 --k 0,4 --batch ${BATCH:-1,8,32,64}"
for arm in ${ARMS:-base inv invr}; do
  case $arm in
    base) a="" ;;
    inv) a="--projections gemv+norms+stream+inv" ;;
    invr) a="--projections gemv+norms+stream+inv --decode-kernel ragged_from=8" ;;
    r) a="--decode-kernel ragged_from=8" ;;
  esac
  echo "== $arm: $a"
  timeout -s KILL $(left 200) $D $a --out $OUT/decode_${arm}_${S}_$G.json 2>&1 | grep -A12 "^  B mode"
done
echo "elapsed ${SECONDS}s"
