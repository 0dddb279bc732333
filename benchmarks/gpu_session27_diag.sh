#!/usr/bin/env bash
# Session 27's second call: which of the new Mosaic GPU kernels' GPU tests pass, fail or hang
# (the first call's layer-kernel tests ran into their 200 s KILL with no output). Every test
# runs alone under a KILL timeout of T seconds (default 45), smallest first; a line per test.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session27_diag.sh
. benchmarks/gpu_call_setup.sh
T=${T:-45}
one() {
  local r
  r=$(timeout -s KILL $(left $T) python3 -m pytest -q -x -p no:cacheprovider "$1" 2>&1)
  local rc=$?
  echo "== $1 rc=$rc ($SECONDS s)"
  [ $rc -ne 0 ] && echo "$r" | grep -E "^E |Error|assert" | head -${LINES_PER_FAIL:-6}
}
TESTS=${TESTS:-"
tests/test_decode_mgpu_paged.py::test_gpu_matches_the_reference_and_the_triton_kernel_at_the_1p4b_shape
tests/test_chain_mgpu.py::test_gpu_tiny_chain_with_the_handover[1]
tests/test_chain_mgpu.py::test_gpu_tiny_chain_with_the_handover[2]
tests/test_chain_attention.py::test_gpu_tiny_layers_through_the_handover[1]
tests/test_chain_attention.py::test_gpu_tiny_layers_through_the_handover[2]
tests/test_chain_mgpu.py::test_gpu_stages_match_xla_at_the_1p4b_shapes
tests/test_chain_mgpu.py::test_gpu_add_norm_chain_matches_xla_at_the_1p4b_shapes
tests/test_chain_attention.py::test_gpu_1p4b_layers_match_the_engines_math
"}
for t in $TESTS; do [ $SECONDS -lt $((CAP - 20)) ] && one "$t"; done
echo "elapsed $SECONDS s"
