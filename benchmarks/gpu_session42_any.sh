#!/usr/bin/env bash
# Session 42: whichever card comes. On an H200 the prepared H200 call (gpu_session35_call.sh,
# the unmet batch-1 line's levers); on any other card gpu_session42_call.sh (the ragged
# kernel's direct store, then session 41's routes).
# Usage on the GPU machine: OUT=dir SESSION=sessionNN [CAP=585] bash benchmarks/gpu_session42_any.sh
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
  *H200*) CAP=${CAP:-585} bash benchmarks/gpu_session35_call.sh ;;
  *) bash benchmarks/gpu_session42_call.sh ;;
esac
