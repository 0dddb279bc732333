#!/usr/bin/env bash
# Session 15 call 8: the work-queue GEMV (pallas_kernels/gemv_queue.py: a fixed grid, blocks
# from an atomic counter) against the streaming GEMV, from inside the kernels
# (benchmarks.gemv_timeline: gap, ramp, body, tail per kernel of the 4-projection chain).
# Call 7 found the streaming chain's tails at 0.5-1.4 us and 2-3 (3-4) programs per SM.
#   1. GPU tests: the queue chain bit-identical to the streaming GEMV, 132/264/396 programs.
#   2. Timelines: streaming vs queue at 264 and 396 programs (blocks qkv 4, o 4, gate/up 2,
#      down 2 rows), then at 528 with o 2 and down 1.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session15_call8.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short -W ignore::DeprecationWarning \
  tests/test_gemv_queue.py 2>&1 | tail -4 | tee $OUT/gpu_tests_gemv_queue_session15.txt
timeout 200 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_timeline --layers 24 --reps 5 \
  --queue-programs 264,396 --out $OUT/gemv_timeline_queue_session15_h200.json 2>&1 \
  | python3 -c "
import json, sys
for line in sys.stdin:
    try: d = json.loads(line)
    except ValueError: print(line.rstrip()[:300]); continue
    for arm, r in d.items():
        print(arm, 'per layer', r['per_layer_us'], 'diff', r['max_abs_diff_vs_first_arm'])
        for n in ('qkv', 'o', 'gate_up', 'down'):
            print('  ', n, {k: round(v, 3) if isinstance(v, float) else v for k, v in r[n].items()})
"
timeout 150 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_timeline --layers 24 --reps 5 \
  --queue-programs 528 --queue-block-n o=2,down=1 --out $OUT/gemv_timeline_queue528_session15_h200.json 2>&1 \
  | grep -o '"queue528": {.*per_layer_us": {[^}]*}' | grep -o 'per_layer_us": {[^}]*}'
