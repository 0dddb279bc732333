#!/usr/bin/env bash
# Session 43: whichever card comes. On an H200 the prepared H200 call (gpu_session35_call.sh,
# the unmet batch-1 line's levers); on any other card session 41's batch-64 k=4 traces with
# the prefill subtracted (STEP=41_trace: gpu_session41_trace.sh, where the batch-invariant
# mode's speculative round, 0.97x its native, spends its time; the first call ran it) or, by
# default, the '+inv' A/B (gpu_session43_inv.sh).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=585] bash benchmarks/gpu_session43_any.sh
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
  *H200*) CAP=${CAP:-585} bash benchmarks/gpu_session35_call.sh ;;
  *) CAP=${CAP:-585} bash benchmarks/gpu_session${STEP:-43_inv}.sh ;;
esac
