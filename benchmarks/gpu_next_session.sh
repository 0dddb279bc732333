#!/usr/bin/env bash
# Nothing new is prepared for the next session (issue 6; docs/performance.md, "Not yet done").
# Session 14's prepared sweep ran in session 15 as gpu_session15_call1.sh (results:
# benchmarks/results/README.md, session 15); this reruns it: barrier and chain GPU tests,
# barrier cost by spin mode, the persistent o -> gate/up sweep, and a table check at batch 1,
# 8 and 64. About 8 minutes.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
exec bash "$(dirname "$0")/gpu_session15_call1.sh"
