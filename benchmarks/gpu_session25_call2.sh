#!/usr/bin/env bash
# Session 25's later GPU calls: tests/test_pdl_launch.py (NOTEST=1 skips it), then
# benchmarks.pdl_jax_chain, the engine's streaming GEMVs in one jitted program, launched by
# JAX or by pallas_kernels/pdl_launch (arms: CHAIN_ARGS="--arms ..."), and with NOGRAPH_ARMS
# set once more with XLA's command buffers off (those arms override CHAIN_ARGS' --arms; in
# session 25's call 6 the order was the other way round, so both runs took CHAIN_ARGS').
# Results: pdl_jax_chain[_nograph]_session25${TAG}_<card>.json.
# Usage: OUT=dir [TAG=_x] [CHAIN_ARGS=...] bash benchmarks/gpu_session25_call2.sh
. benchmarks/gpu_call_setup.sh
[ -z "${NOTEST:-}" ] && timeout $(left 120) python3 -m pytest -q -x tests/test_pdl_launch.py 2>&1 | tail -15
timeout $(left 300) python3 -m benchmarks.pdl_jax_chain ${CHAIN_ARGS:-} \
  --out $OUT/pdl_jax_chain_session25${TAG:-}_$G.json 2>&1 | grep -v "^WARNING" | cut -c1-400
# the same with XLA's command buffers (CUDA graphs) off: every launch from the host
[ -n "${NOGRAPH_ARMS:-}" ] && XLA_FLAGS=--xla_gpu_enable_command_buffer= timeout $(left 200) \
  python3 -m benchmarks.pdl_jax_chain ${CHAIN_ARGS:-} --arms $NOGRAPH_ARMS \
  --out $OUT/pdl_jax_chain_nograph_session25${TAG:-}_$G.json 2>&1 | grep -v "^WARNING" | cut -c1-400
echo "elapsed $SECONDS s"
