#!/usr/bin/env bash
# The GPU-marked tests, one file at a time, each under its own time limit, the output
# written under $OUT as it comes (session 32 ran `pytest -m gpu tests` in one go: it
# reached the call's limit and nothing came back). Skips files once less than PER seconds
# of CAP are left, and says which.
# Usage on the GPU machine: OUT=dir [CAP=540] [PER=120] [FILES="tests/a.py ..."] \
#   bash benchmarks/gpu_tests.sh
# FILES defaults to every tests/*.py holding a gpu mark; the next call can pass the ones
# this call skipped (listed at the end of the log).
. benchmarks/gpu_call_setup.sh
PER=${PER:-120}
LOG=$OUT/gpu_tests_$G.txt
FILES=${FILES:-$(grep -l "mark.gpu" tests/*.py | tr '\n' ' ')}
skipped=""
for f in $FILES; do
  if [ $((CAP - SECONDS)) -lt $PER ]; then skipped="$skipped $f"; continue; fi
  echo "== $f (at $SECONDS s)" >> $LOG
  timeout -s INT $(left $PER) python3 -m pytest -q -m gpu -p no:cacheprovider -rf "$f" \
    2>&1 | tail -12 >> $LOG
done
echo "== not run (time):$skipped" >> $LOG
grep -E "^== |passed|failed|skipped|FAILED|error" $LOG | cut -c1-200
echo "elapsed $SECONDS s"
