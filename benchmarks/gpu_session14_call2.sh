#!/usr/bin/env bash
# Session 14 (issue 6), second call. Call 1 (ab_l2_b1_session14_h200.json), batch-1 native
# greedy tok/s, two passes: default 241.3 / 241.3; a program's own later blocks prefetched at
# its start: qkv + gate/up 211.6 / 210.7, all four 201.8 / 201.2 (the trace: gate/up 18.8 us,
# qkv 11.4); the next projection's first rows at the programs' start 226.2 / 226.1, at their
# end 242.8 / 243.0 (qkv=2,o=2,gate_up=2,down=3 rows per program); same tokens everywhere.
# Only the late prefetch of the next weight helps; here its size and which pairs matter:
#   nx   qkv=2,o=2,gate_up=2,down=3 (call 1's), nx2 qkv=5,o=4,gate_up=3,down=6,
#   nx3  qkv=5,o=8,gate_up=6,down=12 (gate/up capped at 5: down has 2048 rows),
#   qkv5 (o's weight during attention) alone, o4 (gate/up's) alone, down6 (next qkv's) alone;
# then batch 1 with 2 and 4 decode splits (from gpu_next_session.sh).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session14_call2.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
A=$OUT/arms; mkdir -p $A
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
run() { timeout 50 $D "${@:2}" --out $A/$1_p$pass.json 2>&1 | grep -E "rror" ; }
NX="qkv=2,o=2,gate_up=2,down=3"; NX2="qkv=5,o=4,gate_up=3,down=6"; NX3="qkv=5,o=8,gate_up=6,down=12"
pass=1
run default; run nx --l2-next $NX; run nx2 --l2-next $NX2; run nx3 --l2-next $NX3
run qkv5 --l2-next qkv=5; run o4 --l2-next o=4; run down6 --l2-next down=6
pass=2
run down6 --l2-next down=6; run o4 --l2-next o=4; run qkv5 --l2-next qkv=5
run nx3 --l2-next $NX3; run nx2 --l2-next $NX2; run nx --l2-next $NX; run default
pass=1; run splits2 --decode-kernel num_splits=2; run splits4 --decode-kernel num_splits=4
python3 -m benchmarks.ab_arms $A $OUT/ab_l2_next_b1_session14_h200.json
rm -rf $A
