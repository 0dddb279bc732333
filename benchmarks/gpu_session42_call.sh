#!/usr/bin/env bash
# Session 42's call on any card but an H200 (gpu_session42_any.sh sends an H200 to the
# prepared H200 call), in order:
#   1. the ragged kernel's direct store (pallas_kernels.ragged, q_len calls without the XLA
#      tile map and gather; on by default since this call measured it): its bits against the
#      tile map's on the GPU
#      (tests/test_ragged_uniform.py's gpu tests), then end to end, direct=0 against direct=1
#      the batch-invariant mode at batch 1 (k 0,4: every attention call is the ragged
#      kernel) in order 0 1 1 0, and the default at batch 64 k=4 (its verification's) in
#      order 0 1 0, interleaved;
#   2. with the time left, session 41's routes call (gpu_session41_combined.sh), short form:
#      the probe, the sweep at 320 rows (wide tiles) and 1 row (16-row tiles), the pick, and
#      the mode end to end with the pick as far as time allows.
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=585] bash benchmarks/gpu_session42_call.sh
S=${SESSION:-session42}
CAP=${CAP:-585}
. benchmarks/gpu_call_setup.sh
timeout -s KILL $(left 90) python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_ragged_uniform.py 2>&1 | tail -3
echo "direct test done at ${SECONDS}s"
D="python3 -m benchmarks.decode --synthetic 1.4b --attention pallas --temperature 0 --repeats 2"
D="$D --compile-cache /tmp/cc"
show() { grep -E "^ *[0-9]+ +(native|spec)|rror|bandwidth" | cut -c1-170; }
# (each run compiles its programs first: ~5-8 s each for the mode at batch 1, ~18 s for the
# default's batch-64 k=4, session 40; plus the process start and the synthetic weights)
b1() { timeout -s KILL $(left 60) $D --batch-invariant --batch 1 --k 0,4 --ragged-kernel direct=$1 \
  --out $OUT/decode_direct$1_inv_b1_p$2_${S}_$G.json 2>&1 | show; }
b64() { timeout -s KILL $(left 75) $D --batch 64 --k 4 --ragged-kernel direct=$1 \
  --out $OUT/decode_direct$1_b64_k4_p$2_${S}_$G.json 2>&1 | show; }
b1 0 1; b64 0 1; b1 1 2; b64 1 2; b1 1 3; b1 0 4; b64 0 3
echo "direct A/B done at ${SECONDS}s"
SESSION=$S CAP=$(left 585) WIDE_ROWS=320 FEW_ROWS=1 OUT=$OUT \
  bash benchmarks/gpu_session41_combined.sh 2>&1 | grep -v "^device"
echo "elapsed ${SECONDS}s"
