#!/usr/bin/env bash
# Session 15 call 9: streaming tilings with 256-program grids (per-program counts that are
# not powers of two: one or two programs on every SM, where the engine's grids put 2-3 or 3-4
# on an SM), timed from inside the kernels (benchmarks.gemv_timeline; call 7: tails 0.5-1.4
# us per kernel).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session15_call9.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
timeout 300 python3 -W ignore::DeprecationWarning -m benchmarks.gemv_timeline --layers 24 --reps 5 \
  --stream-tiling qkv=st4_k512_p6_w4 --stream-tiling gate_up=st2_k512_p11_w4 \
  --stream-tiling o=st2_k512_p4_w4 --stream-tiling down=st1_k512_p8_w4 \
  --stream-tiling qkv=st4_k512_p6_w4,o=st2_k512_p4_w4,gate_up=st2_k512_p11_w4,down=st1_k512_p8_w4 \
  --out $OUT/gemv_timeline_grid256_session15_h200.json 2>&1 \
  | python3 -c "
import json, sys
for line in sys.stdin:
    try: d = json.loads(line)
    except ValueError: print(line.rstrip()[:300]); continue
    for arm, r in d.items():
        print(arm, 'per layer', r['per_layer_us'], 'diff', r['max_abs_diff_vs_first_arm'])
        for n in ('qkv', 'o', 'gate_up', 'down'):
            print('  ', n, {k: round(v, 3) if isinstance(v, float) else v for k, v in r[n].items() if k in ('span', 'tail', 'body', 'programs', 'programs_per_sm_min_max')})
"
