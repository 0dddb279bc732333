"""Where the Mosaic GEMV's add_norm residual x' = x + rms_norm(branch, branch_w) parts from
XLA's on the GPU (session 13: 574 of 2048 bf16 elements differ; the streaming GEMV, 0). It
computes x' five ways at the 1.4B hidden size and prints how many elements each pair
disagrees on:
  xla      the engine's XLA path (model.rms_norm, jitted);
  stream   gemv_stream_normed (Triton);
  mgpu     gemv_mgpu_normed (Mosaic GPU);
  exact    numpy on the host with every rounding of model.rms_norm made explicit
           (fp32 statistic, x * scale rounded to bf16, times the weight rounded, add rounded);
  fused    the same without the rounding of the normed branch before the add (what an XLA
           fusion allowed excess precision may compute).
Run with XLA_FLAGS=--xla_allow_excess_precision=false as well to see whether XLA's
fusion is the odd one out.
Usage: PYTHONPATH=. python -m benchmarks.mgpu_add_norm_probe [out.json]"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


def host_versions(x, b, wb, eps):
    """(exact, fused) x' computed on the host from bf16 inputs."""
    bf = ml_dtypes.bfloat16
    xf, bfl, wf = (np.asarray(a, np.float32) for a in (x, b, wb))
    s = 1.0 / np.sqrt(np.mean(bfl.astype(np.float64) ** 2) + eps)
    nb = (bfl * np.float32(s)).astype(bf).astype(np.float32) * wf
    exact = (xf + nb.astype(bf).astype(np.float32)).astype(bf)
    fused = (xf + nb).astype(bf)
    return np.asarray(exact, np.float32), np.asarray(fused, np.float32)


def main(argv):
    from ouro_jax.model import rms_norm
    from ouro_jax.projections import STREAM_TUNING
    from pallas_kernels.gemv_mgpu_normed import gemv_mgpu_normed
    from pallas_kernels.gemv_stream import gemv_stream_normed
    k, n, eps = 2048, 6144, 1e-6
    ks = jax.random.split(jax.random.PRNGKey(n + k), 5)
    x = jax.random.normal(ks[0], (1, k)).astype(jnp.bfloat16)
    b = (jax.random.normal(ks[1], (1, k)) * 3).astype(jnp.bfloat16)
    wb, wx = ((1 + 0.1 * jax.random.normal(kk, (k,))).astype(jnp.bfloat16) for kk in ks[2:4])
    w = (jax.random.normal(ks[4], (n, k)) * k ** -0.5).astype(jnp.bfloat16)
    args = dict(eps=eps, branch=b, branch_w=wb)
    got = {
        "xla": jax.jit(lambda x, b: x + rms_norm(b, wb, eps))(x, b),
        "stream": jax.jit(lambda x: gemv_stream_normed(x, wx, w, **args,
                                                       **STREAM_TUNING["qkv"])[1])(x),
        "mgpu": jax.jit(lambda x: gemv_mgpu_normed(x, wx, w, **args, block_n=64, block_k=128,
                                                   k_splits=1, stages=4)[1])(x),
    }
    got = {key: np.asarray(v, np.float32).reshape(-1) for key, v in got.items()}
    got["exact"], got["fused"] = (a.reshape(-1) for a in host_versions(x, b, wb, eps))
    keys = list(got)
    table = {a: {c: int((got[a] != got[c]).sum()) for c in keys} for a in keys}
    flags = os.environ.get("XLA_FLAGS", "")
    print(f"elements of x' (of {k}) that differ, XLA_FLAGS={flags!r}")
    print("        " + "".join(f"{c:>8}" for c in keys))
    for a in keys:
        print(f"{a:>8}" + "".join(f"{table[a][c]:8d}" for c in keys))
    if argv:
        with open(argv[0], "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax_version=jax.__version__,
                           xla_flags=flags, mismatches=table,
                           command="python -m benchmarks.mgpu_add_norm_probe"), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
