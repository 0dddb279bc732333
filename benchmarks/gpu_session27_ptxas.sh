#!/usr/bin/env bash
# Session 27: ptxas's report on the persistent chain kernel (1.4B shapes, one layer, the
# default tiling, plain and with the attention stage): registers, spills, and whether
# ptxas serialised the wgmma instructions (its warning names the reason). The dumps are
# compiled once each; only the .ptxas reports come back (ptxas_reports.txt).
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session27_ptxas.sh
. benchmarks/gpu_call_setup.sh
D=/tmp/mgpu_dump; rm -rf $D; mkdir -p $D
MOSAIC_GPU_DUMP_TO=$D timeout -s KILL $(left 120) python3 - <<'PY' > /dev/null 2>&1
import jax, jax.numpy as jnp
from benchmarks.chain_mgpu import make_weights, make_norms
from pallas_kernels.chain_mgpu import gemv_chain_mgpu, tile_weights
ws = make_weights(1); x = jnp.ones((1, 2048), jnp.bfloat16)
w = tile_weights(ws, 16, 256)
jax.block_until_ready(jax.jit(lambda x, w: gemv_chain_mgpu(x, w, stages=16))(x, w))
jax.block_until_ready(jax.jit(lambda x, w: gemv_chain_mgpu(x, w, stages=16, diag="nomma"))(x, w))
PY
for f in $D/*ptxas*; do echo "== $(basename $f)"; grep -v "^$" $f | head -30; done > $OUT/ptxas_reports.txt
ls $D | head; grep -i -E "serializ|spill|registers" $OUT/ptxas_reports.txt | head -20
