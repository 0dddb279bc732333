#!/usr/bin/env bash
# Session 27's last call: ptxas serialised the persistent chain's wgmma instructions
# ("insufficient register resources for the wgmma pipeline", ptxas_chain_session27_h100.txt).
# `uniform` takes the per-program condition off the MMAs (every program computes umax
# units). Here: ptxas's verdict on the uniform kernel, then the chain benchmark with it.
# Usage on the GPU machine: OUT=dir bash benchmarks/gpu_session27_uniform.sh
# KWS="uniform=1;smem_a=1,uniform=1": the kernels ptxas reports on (one per ';');
# TILINGS= the benchmark's --tilings; TAG= a file suffix.
. benchmarks/gpu_call_setup.sh
D=/tmp/mgpu_dump_u; rm -rf $D; mkdir -p $D
MOSAIC_GPU_DUMP_TO=$D timeout -s KILL $(left 100) python3 - <<'PY' > /dev/null 2>&1
import jax, jax.numpy as jnp
from benchmarks.chain_mgpu import make_weights
from pallas_kernels.chain_mgpu import gemv_chain_mgpu, tile_weights
ws = make_weights(1); x = jnp.ones((1, 2048), jnp.bfloat16)
w = tile_weights(ws, 16, 256)
import os
for kws in os.environ.get("KWS", "uniform=1").split(";"):  # one kernel (dump) each
    kw = {k: bool(int(v)) for k, v in (i.split("=") for i in kws.split(","))}
    jax.block_until_ready(jax.jit(lambda x, w: gemv_chain_mgpu(x, w, stages=16, **kw))(x, w))
PY
for f in $D/*ptxas*; do echo "== $(basename $f)"; grep -v "out of bound" $f | grep -v "^$" | head -20; done > $OUT/ptxas_uniform${TAG:-}_reports.txt
grep -i -E "serializ|registers" $OUT/ptxas_uniform${TAG:-}_reports.txt | head
timeout -s KILL $(left 300) python3 -m benchmarks.chain_mgpu --repeats 8 --baselines xla \
  --tilings ${TILINGS:-16:256:16:128,16:256:16:128:uniform,16:256:16:128:nosync:uniform,16:256:16:128:norm:uniform,16:256:12:128:uniform} \
  --out $OUT/chain_mgpu_uniform${TAG:-}_session27_$G.json 2>&1 | grep -E '^\{|rror' | cut -c1-260
echo "elapsed $SECONDS s"
