"""Do the batch-invariant mode's route tiles keep a row's bits? (GPU only)

    python -m benchmarks.gemm_tiling_bits [--shapes qkv,o,gate_up,down] [--variants K,...] [--out probe.json]

The mode may run a weight's GEMM at another tile per row count (ouro_jax.invariant.ROUTES:
16-row tiles for one-row calls, wider ones for the verification's and the prefill's many
rows), keeping the K steps (block_k, k_splits) and the order the partials are added. Its
guarantee then rests on the tile's rows, columns, warps and stages not changing any
element's bits, which nothing documents (16-row tiles lower to mma.sync, 64 and more to
wgmma). This compares, at the 1.4B shapes, each route tile (benchmarks.gemm_tilings.
ROUTE_VARIANTS of the weight's K split) against the mode's TUNING for that weight: 384
random bf16 rows through TUNING, and the same rows through the candidate at 384, 320, 64, 5
and 1 rows (whole 128-row blocks and masked ones); o's and down's split-K partials are
compared unsummed, in fp32 (what the mode hands to add_norm), qkv's and gate/up's outputs
in bf16 (what the mode uses; a difference in the fp32 accumulator that rounds away is not
seen). It counts the elements that differ, and saves after each weight. A probe of one
card, which the `gpu` test (tests/test_invariant.py) repeats for the shipped routes.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

# 384 rows: whole 128-row blocks, unmasked (the prefill's path); 320: a masked last block
ROWS = (384, 320, 64, 5, 1)


def differing(a, b) -> int:
    """Elements whose bits differ (bf16 or fp32 alike)."""
    a, b = np.asarray(a), np.asarray(b)
    view = np.uint16 if a.dtype.itemsize == 2 else np.uint32
    return int(np.sum(a.view(view) != b.view(view)))


def compare(name: str, tiling: dict, ref_tiling: dict, x, w, gated: bool,
            rows=ROWS, interpret: bool = False) -> dict:
    """{rows: differing elements} of `tiling` against `ref_tiling` on x's first rows."""
    from ouro_jax.invariant import BRANCHES
    from pallas_kernels.gemm import gemm
    part = name in BRANCHES and ref_tiling.get("k_splits", 1) > 1

    def run(t, m):
        return gemm(x[:m], w, gated=gated, fixed_rows=True, partials=part,
                    interpret=interpret, **t)
    ref = np.asarray(run(ref_tiling, x.shape[0]))
    return {m: differing(run(tiling, m), ref[:m]) for m in rows}


def probe(shapes, variants=None, seed: int = 0, save=lambda rows: None) -> list[dict]:
    from benchmarks.gemm_tilings import GEMM_VARIANTS, ROUTE_VARIANTS
    from benchmarks.gemv import SHAPES
    from ouro_jax.invariant import TUNING
    out = []
    for name in shapes:
        n, k, gated = SHAPES[name]
        kx, kw = jax.random.split(jax.random.PRNGKey(seed))
        x = jax.random.normal(kx, (max(ROWS), k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        ref = dict(TUNING[name])
        splits = ref.get("k_splits", 1)
        for key in variants or ROUTE_VARIANTS[splits]:
            t = GEMM_VARIANTS[key]
            row = dict(shape=name, variant=key, reference=ref)
            if (t["block_k"], t.get("k_splits", 1)) != (ref["block_k"], splits):
                row["error"] = "other K steps than the mode's tiling: not a route tile"
            else:
                try:
                    row["differing"] = {str(m): d for m, d in
                                        compare(name, t, ref, x, w, gated).items()}
                except Exception as e:  # a tile the GPU cannot run (shared memory, registers)
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            out.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "reference"}), flush=True)
        save(out)  # (a time-out keeps the weights done)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemm_tiling_bits",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--variants", default="",
                    help="GEMM_VARIANTS keys (default: ROUTE_VARIANTS of each weight's split)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from benchmarks.gemm_tilings import GEMM_VARIANTS
    from benchmarks.gemv import SHAPES
    shapes = args.shapes.split(",")
    variants = [v for v in args.variants.split(",") if v]
    bad = sorted(set(shapes) - set(SHAPES)) + sorted(set(variants) - set(GEMM_VARIANTS))
    if bad:
        raise SystemExit(f"benchmarks.gemm_tiling_bits: unknown shapes or variants: {bad}")
    if jax.default_backend() != "gpu":
        raise SystemExit("benchmarks.gemm_tiling_bits compares compiled GPU kernels: run it "
                         "on a GPU")
    from benchmarks.record import save_record
    probe(shapes, variants or None,
          save=lambda rows: save_record("benchmarks.gemm_tiling_bits", argv, args.out,
                                        rows=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
