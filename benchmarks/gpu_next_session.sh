#!/usr/bin/env bash
# Prepared in session 11 for the next session (issue 6): session 11's last call, which found
# no machine and then too little device time, plus a reproducibility check (about 9 min of
# commands; the time-outs add up to 520 s). The decode kernel's
# split count at batch 1 (default: one 32-key block per split, 8 splits over the 256-token
# table) against 2 and 4 splits, and the in-kernel merge (last_combine=1, which drops the
# XLA merge kernel, 1.25 us per layer application in the session-10 trace) now that batch 1
# runs 32-key blocks. Batch 1, native, greedy; the arms interleaved twice, the second pass in
# another order, so drift hits every arm alike.
# Then whether batch-8 greedy tokens repeat across processes: session 11 saw the same command
# give 05a65f5ca42e8e10 on one machine and a63176f50a04edb8 on another (the 64-key kernels
# too: ac595cac1abb3c2f, d1c2d20be5cfeceb), while batch 1 (our own kernels only) always gave
# 3961d77b5e94e06f. Suspect: XLA's per-process GEMM autotuning (timing-based picks, other
# summation orders) at 8 rows. Two processes without the compile cache, then two with
# XLA's autotuning off (--xla_gpu_autotune_level=0), which also shows what it costs.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_next_session.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-benchmarks/results}
A=$OUT/arms; mkdir -p $A  # 12 arm files, merged into one at the end (8 files come back)
D="python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003 --compile-cache /tmp/cc --batch 1 --k 0 --temperature 0"
run() {  # name, extra arguments
  timeout 40 $D $2 --out $A/$1_p$pass.json 2>&1 | grep -E "rror" ; }
pass=1
run default ""; run splits2 "--decode-kernel num_splits=2"; run splits4 "--decode-kernel num_splits=4"
run merge "--decode-kernel last_combine=1"
pass=2
run merge "--decode-kernel last_combine=1"; run splits4 "--decode-kernel num_splits=4"
run splits2 "--decode-kernel num_splits=2"; run default ""
N=(python3 -m benchmarks.decode --attention pallas --repeats 3 --branch-scale 0.003
   --compile-cache "" --batch 8 --k 0 --temperature 0)
for i in 1 2; do
  timeout 50 "${N[@]}" --out $A/b8_nocache_$i.json 2>&1 | grep -E "rror"
done
for i in 1 2; do
  XLA_FLAGS=--xla_gpu_autotune_level=0 timeout 50 "${N[@]}" --out $A/b8_autotune0_$i.json 2>&1 | grep -E "rror"
done
python3 - "$A" "$OUT/ab3_next_session_h200.json" <<'PY'
import glob, json, os, sys
arms = {}
for f in sorted(glob.glob(sys.argv[1] + "/*.json")):
    arm = os.path.basename(f)[:-5]
    arms[arm] = json.load(open(f))
    for r in arms[arm]["rows"]:
        print(arm, round(r["decode_tok_s"], 1), round(r["decode_tok_s_min"], 1),
              round(r["decode_tok_s_max"], 1), r["tokens_sha"], r["repeats_identical"],
              round(r["compile_s"], 1))
json.dump(arms, open(sys.argv[2], "w"), indent=1)
PY
rm -rf $A
for f in $OUT/*.partial; do [ -e "$f" ] && [ -e "${f%.partial}" ] && rm -f "$f"; done
