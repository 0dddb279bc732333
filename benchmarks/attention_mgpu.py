"""Batch-1 decode attention at the 1.4B shape (16 heads x 128, bf16): the one-program-per-head
Mosaic GPU kernel (pallas_kernels/decode_mgpu.py) against the engine's Triton decode kernel
(pallas_kernels/decode.paged_decode_attention: flash-decoding splits, then the XLA merge;
the engine runs its fused RoPE + K/V-write variant, paged_decode_attention_qkv, at ~4.4 us
plus the merge on the H200) and XLA. `--copies` distinct caches per jitted call (so K/V come from HBM, not L2); device
time per call (the kernels' sum, the XLA merge included, and the span), the wall clock per
call, and the largest difference from the XLA reference.

    python3 -m benchmarks.attention_mgpu --out benchmarks/results/attention_mgpu_h200.json
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.record import save_record
from benchmarks.timing import device_seconds, pipelined_seconds
from benchmarks.tuning import block_stage_tilings
from pallas_kernels.decode import paged_decode_attention
from pallas_kernels.decode_mgpu import decode_attention_mgpu, reference_decode

HEADS, HEAD_DIM, PAGE = 16, 128, 16


def inputs(length, capacity, copies, seed=0):
    """q, and `copies` separate K and V caches (separate arrays: slicing one stacked array
    inside the timed program could add copies to the custom-call arms)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 1 + 2 * copies)
    q = jax.random.normal(ks[0], (1, HEADS * HEAD_DIM), jnp.float32).astype(jnp.bfloat16)
    shape = (capacity, HEADS, HEAD_DIM)
    k = [jax.random.normal(s, shape, jnp.float32).astype(jnp.bfloat16) for s in ks[1::2]]
    v = [jax.random.normal(s, shape, jnp.float32).astype(jnp.bfloat16) for s in ks[2::2]]
    return q, k, v


def engine_attention(q, k, v, length):
    """The engine's decode kernel on the same cache as pages of 16 ([1, pages, 16, H, D])."""
    n = k.shape[0]
    pages = k.reshape(1, n // PAGE, PAGE, HEADS, HEAD_DIM)
    vpages = v.reshape(1, n // PAGE, PAGE, HEADS, HEAD_DIM)
    table = jnp.arange(n // PAGE, dtype=jnp.int32)[None]
    out = paged_decode_attention(q.reshape(1, HEADS, HEAD_DIM), pages, vpages, jnp.int32(0),
                                 table, jnp.full((1,), length, jnp.int32))
    return out.reshape(1, HEADS * HEAD_DIM)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="192,512,2048")
    ap.add_argument("--copies", type=int, default=48)
    ap.add_argument("--tilings", default="128:2,64:4,128:3",
                    help="block:stages,... for the Mosaic kernel")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    tilings = block_stage_tilings(args.tilings)
    rows = []
    for length in map(int, args.lengths.split(",")):
        capacity = -(-length // 256) * 256
        q, k, v = inputs(length, capacity, args.copies)
        ref = np.asarray(jax.jit(reference_decode)(q, k[0], v[0], length), np.float32)
        arms = {"xla": reference_decode, "engine": engine_attention}
        for block, stages in tilings:
            arms[f"mgpu_b{block}_s{stages}"] = (
                lambda q, k, v, n, b=block, s=stages: decode_attention_mgpu(
                    q, k, v, n, block=b, stages=s))
        for name, fn in arms.items():
            def run(q, k, v, fn=fn):
                return [fn(q, ki, vi, length) for ki, vi in zip(k, v)]
            f = jax.jit(run)
            try:
                got = np.asarray(f(q, k, v)[0], np.float32)
                kernel, span = device_seconds(f, q, k, v, units=args.copies)
                wall = pipelined_seconds(f, q, k, v) / args.copies
            except Exception as e:  # noqa: BLE001 - report the arm and go on
                row = dict(length=length, arm=name, error=f"{type(e).__name__}: {str(e)[:500]}")
            else:
                row = dict(length=length, arm=name, device_us=round(kernel * 1e6, 3),
                           span_us=round(span * 1e6, 3), wall_us=round(wall * 1e6, 3),
                           max_abs_diff=float(np.abs(got - ref).max()),
                           differ=int((got != ref).sum()))
            print(json.dumps(row), flush=True)
            rows.append(row)
    save_record("benchmarks.attention_mgpu", argv, args.out, heads=HEADS, head_dim=HEAD_DIM,
                copies=args.copies, rows=rows)


if __name__ == "__main__":
    main()
