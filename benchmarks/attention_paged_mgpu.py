"""The engine's decode attention at the 1.4B shape (16 KV heads x 128, pages of 16, bf16, RoPE
and the new token's K/V write): the Triton kernel as the engine runs it (flash-decoding
splits, then the XLA merge; `triton_lc`: the splits merged by the kernel, last_combine)
against pallas_kernels/decode_mgpu_paged.py's tilings (one program per row and KV head, no
splits), at each batch size and length.

Each jitted call runs `--planes` kernel calls, one per cache plane (the engine's layer
applications: the K/V come from HBM, not L2), the caches donated and fed back call after
call as the engine threads them. Reported per kernel call: the device time of every kernel
the arm launches (from a profiler trace, by kernel name: the XLA merge shows apart), their
sum, and the wall clock; and per arm its largest difference from the Triton arm's output
and whether it wrote the same new K/V rows.

    python3 -m benchmarks.attention_paged_mgpu --out benchmarks/results/attention_paged_mgpu_h200.json
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.record import save_record
from benchmarks.timing import traced_device_events
from benchmarks.tuning import block_stage_tilings

KVH, HEAD_DIM, PAGE = 16, 128, 16


def case(bsz, length, planes, seed=0):
    """(qkv, k, v, block table, kv_lens, page, slot, cos, sin): every row at `length` with
    its pages shuffled over the pool, the new token at position length - 1."""
    from ouro_jax.model import rope_cos_sin
    max_pages = -(-length // PAGE)
    n_pages = 1 + bsz * max_pages
    rng = np.random.default_rng(seed)
    table = (1 + rng.permutation(bsz * max_pages)).reshape(bsz, max_pages).astype(np.int32)
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    shape = (planes, n_pages, PAGE, KVH, HEAD_DIM)
    k = jax.random.normal(ks[0], shape, jnp.bfloat16)
    v = jax.random.normal(ks[1], shape, jnp.bfloat16)
    qkv = jax.random.normal(ks[2], (bsz, 3 * KVH, HEAD_DIM), jnp.bfloat16)
    pos = np.full(bsz, length - 1, np.int32)
    page = table[np.arange(bsz), pos // PAGE]
    cos, sin = rope_cos_sin(jnp.asarray(pos), HEAD_DIM, 10000.0, jnp.bfloat16)
    return (qkv, k, v, jnp.asarray(table), jnp.full((bsz,), length, jnp.int32),
            jnp.asarray(page), jnp.asarray(pos % PAGE), cos, sin)


def arms(tilings, interpret=False):
    from pallas_kernels.decode import paged_decode_attention_qkv
    from pallas_kernels.decode_mgpu_paged import paged_decode_attention_mgpu

    def triton(qkv, k, v, e, bt, lens, page, slot, cos, sin):
        return paged_decode_attention_qkv(qkv, k, v, e, bt, lens, page, slot, rope=(cos, sin),
                                          trash_page=0, interpret=interpret)

    def triton_lc(qkv, k, v, e, bt, lens, page, slot, cos, sin):
        cnt = jnp.zeros((qkv.shape[0], KVH), jnp.int32)
        return paged_decode_attention_qkv(qkv, k, v, e, bt, lens, page, slot, rope=(cos, sin),
                                          trash_page=0, counters=cnt,
                                          interpret=interpret)[:3]
    out = {"triton": triton, "triton_lc": triton_lc}
    for block, stages in tilings:
        out[f"mgpu_b{block}_s{stages}"] = (
            lambda qkv, k, v, e, bt, lens, page, slot, cos, sin, b=block, s=stages:
            paged_decode_attention_mgpu(qkv, k, v, e, bt, lens, page, slot, rope=(cos, sin),
                                        trash_page=0, block=b, stages=s,
                                        interpret=interpret))
    return out


def chained(fn, planes):
    """One jitted call: fn on every plane in turn, the caches threaded through, donated; the
    planes' calls share one trace (trace_once, as in the engine: the plane is an operand)."""
    from ouro_jax import trace_once

    def run(k, v, qkv, bt, lens, page, slot, cos, sin):
        outs = []
        for e in range(planes):
            o, k, v = trace_once.call(fn, qkv, k, v, np.asarray(e, np.int32), bt, lens,
                                      page, slot, cos, sin)
            outs.append(o)
        return jnp.stack(outs), k, v
    return jax.jit(run, donate_argnums=(0, 1))


def timed(f, k, v, rest, calls, trials=5):
    """(device us per kernel name, wall us, first output, caches) per jitted call; the
    caches fed back call after call."""
    from ouro_jax import trace_once
    with trace_once.scope():  # the first call traces and compiles
        out, k, v = f(k, v, *rest)
    first = np.asarray(out, np.float32)
    walls = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            out, k, v = f(k, v, *rest)
        jax.block_until_ready((out, k, v))
        walls.append((time.perf_counter() - t0) / calls)
    state = [k, v]

    def run():  # the caches fed back call after call, under the profiler
        for _ in range(calls):
            o, state[0], state[1] = f(*state, *rest)
        jax.block_until_ready((o, *state))
    per_name = collections.Counter()
    for name, _, dur in traced_device_events(run):
        per_name[name] += dur / 1e3 / calls
    k, v = state
    return per_name, float(np.median(walls)) * 1e6, first, (k, v)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--lengths", default="192,1024")
    ap.add_argument("--planes", type=int, default=48)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--tilings", default="64:4,128:2,64:2",
                    help="block:stages,... for the Mosaic kernel")
    ap.add_argument("--interpret", action="store_true",
                    help="the kernels' CPU interpret modes (a smoke test: no device times)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    tilings = block_stage_tilings(args.tilings)
    rows = []
    for bsz in map(int, args.batch.split(",")):
        for length in map(int, args.lengths.split(",")):
            want = None
            for name, fn in arms(tilings, args.interpret).items():
                qkv, k, v, *rest = case(bsz, length, args.planes)
                page, slot = np.asarray(rest[2]), np.asarray(rest[3])
                try:
                    per, wall, first, (k, v) = timed(chained(fn, args.planes), k, v,
                                                     (qkv, *rest), args.calls)
                    written = np.asarray(k[:, page, slot], np.float32)
                except Exception as e:  # noqa: BLE001 - report the arm and go on
                    row = dict(batch=bsz, length=length, arm=name,
                               error=f"{type(e).__name__}: {str(e)[:500]}")
                else:
                    if want is None:
                        want = (first, written)
                    units = args.planes
                    row = dict(batch=bsz, length=length, arm=name,
                               device_us=round(sum(per.values()) / units, 3),
                               wall_us=round(wall / units, 3),
                               kernels={n: round(t / units, 3) for n, t in per.items()},
                               max_abs_diff_vs_triton=float(np.abs(first - want[0]).max()),
                               same_kv_write=bool(np.array_equal(written, want[1])))
                del k, v
                print(json.dumps(row), flush=True)
                rows.append(row)
    save_record("benchmarks.attention_paged_mgpu", argv, args.out, kv_heads=KVH,
                head_dim=HEAD_DIM, page_size=PAGE, planes=args.planes, rows=rows)


if __name__ == "__main__":
    main()
