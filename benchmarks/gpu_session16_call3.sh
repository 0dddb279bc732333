#!/usr/bin/env bash
# Session 16 call 3 (one command on the warm machine, kept here as the record): the packed
# GEMV's GPU tests with the output saved to a file (calls 1 and 2 lost their pytest lines to
# the returned output's length).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session16_call3.sh
PYTHONPATH=. timeout 280 python3 -m pytest -q -x tests/test_gemv_packed.py tests/test_packed12.py \
  -k "gpu or round_trips" > $OUT/gpu_tests_gemv_packed_session16.txt 2>&1
tail -5 $OUT/gpu_tests_gemv_packed_session16.txt
