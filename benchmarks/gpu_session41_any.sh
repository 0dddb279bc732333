#!/usr/bin/env bash
# Session 41: whichever card comes. On an H200 the prepared H200 call (gpu_session35_call.sh,
# the unmet batch-1 line's levers); on any other card the combined routes call
# (gpu_session41_combined.sh).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=585] bash benchmarks/gpu_session41_any.sh
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
  *H200*) CAP=${CAP:-585} bash benchmarks/gpu_session35_call.sh ;;
  *) bash benchmarks/gpu_session41_combined.sh ;;
esac
