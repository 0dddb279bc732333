"""Do the skinny GEMM's row blocks change a row's bits? (a probe for the batch-invariant mode)

    python -m benchmarks.gemm_block_m_bits [--out probe.json]

Until session 42 the mode kept one row block (block_m) at every row count (its routes now
rest on this probe's and benchmarks.gemm_tiling_bits' findings), because a 16-row tile may lower
to other tensor-core instructions (mma.sync) than a 64-row one (wgmma), and nothing
documents that the two accumulate alike. Were they bit-equal, few-row calls could take the
16-row tiles (faster at one row) and many-row calls the 64-row ones. This compares, at the
1.4B projection shapes, each block_m in 16/32/64 against 64 with the rest of the tiling
equal (block_n, block_k, k_splits, warps, stages), on 320 random bf16 rows, and counts the
elements that differ. A probe: it shows what one card did, not a guarantee.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np


def probe(seed: int = 0) -> list[dict]:
    from benchmarks.gemm_tiling_bits import differing
    from benchmarks.gemv import SHAPES
    from pallas_kernels.gemm import gemm
    rows = []
    for name, (n, k, gated) in SHAPES.items():
        kx, kw = jax.random.split(jax.random.PRNGKey(seed))
        x = jax.random.normal(kx, (320, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (n, k), jnp.float32) * 0.02).astype(jnp.bfloat16)
        for splits in (1, 4):
            tiling = dict(block_n=64, block_k=128, num_warps=4, num_stages=4, k_splits=splits)
            ref = np.asarray(gemm(x, w, gated=gated, fixed_rows=True, block_m=64, **tiling))
            for bm in (16, 32):
                got = np.asarray(gemm(x, w, gated=gated, fixed_rows=True, block_m=bm, **tiling))
                rows.append(dict(shape=name, k_splits=splits, block_m=bm,
                                 differing=differing(got, ref),
                                 elements=int(ref.size)))
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemm_block_m_bits",
                                 description=__doc__)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        raise SystemExit("benchmarks.gemm_block_m_bits compares compiled GPU kernels: run it "
                         "on a GPU")
    from benchmarks.record import save_record
    save_record("benchmarks.gemm_block_m_bits", argv, args.out, rows=probe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
