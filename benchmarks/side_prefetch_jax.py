"""The engine's one-row GEMV chain with and without a weight prefetcher on XLA's stream 1.

Why (session 33): benchmarks.l2_side_stream asks, outside JAX, whether a prefetcher on a
stream of its own speeds the chain; this asks it inside JAX, the way the engine would run it:
the engine's streaming GEMVs with their add_norm prologues (as benchmarks.pdl_jax_chain's
`xla` arm: 24 layers x 4 loops in one jitted program, XLA's own launch), each storing its
index to a progress word as it starts (gemv_stream `progress=`), and
pallas_kernels/side_prefetch.py's kernel wrapped in `compute_on("gpu_stream:1")` at the
program's start, never waited for by the chain. Arms (`--arms`):

  base                     the chain as the engine runs it;
  stores                   the chain with the progress stores, no prefetcher (their cost);
  pf:LEAD_MB:PROGRAMS[:CHUNK_KB]  stores and the prefetcher, LEAD MB ahead.

Every arm must give base's bits. Prints one JSON line per arm (us per layer application,
median of --repeats calls; the groups whose wait gave up, which would mean XLA ran the two
streams one after the other) and writes them with the machine and command to --out.

  python3 -m benchmarks.side_prefetch_jax --out R.json
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.l2_side_stream import parse_arm
from benchmarks.pdl_chain import SHAPES, chain_parser
from benchmarks.pdl_jax_chain import EPS, NORMED, ORDER, make_weights
from benchmarks.record import save_record
from benchmarks.stream_probe import on_stream
from ouro_jax.projection_tuning import STREAM_TUNING
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
from pallas_kernels.side_prefetch import chunk_tables, schedule, side_prefetch, split_address


def chain_fn(loops: int, stores: bool, pf):
    """jit(f)(h, layers, word, base, lo, hi, need) -> (h, every layer's output, and per
    prefetcher program its give-ups and the progress it first read, or zeros)."""
    tune = {name: dict(STREAM_TUNING[name]) for name in ORDER}

    def f(h, layers, word, base, lo, hi, need):
        seen = gave = jnp.zeros((1,), jnp.int32)
        if pf:
            seen, gave = on_stream(1)(lambda *a: side_prefetch(
                *a, chunk=pf[2], programs=pf[1]))(lo, hi, need, word, base)
            seen = seen[:, 0]
        d = jnp.zeros_like(h)
        outs, ki = [], 0

        def prog():
            nonlocal ki
            ki += 1
            return dict(progress=(word, base, ki - 1)) if stores else {}
        for _ in range(loops):
            for lw in layers:
                y, h = gemv_stream_normed(h, lw["qkv_nw"], lw["qkv"], eps=EPS, branch=d,
                                          branch_w=lw["qkv_bw"], **prog(), **tune["qkv"])
                o = gemv_stream(y[:, :2048], lw["o"], **prog(), **tune["o"])
                y, h = gemv_stream_normed(h, lw["gate_up_nw"], lw["gate_up"], eps=EPS,
                                          branch=o, branch_w=lw["gate_up_bw"], gated=True,
                                          **prog(), **tune["gate_up"])
                d = gemv_stream(y, lw["down"], **prog(), **tune["down"])
                outs.append(d)
        return h, jnp.concatenate(outs), gave, seen  # (summed on the host: no extra kernel)
    return jax.jit(f)


def tables(layers, loops: int, pf):
    """The prefetcher's chunk tables for the chain's kernels in order (placeholders when the
    arm has no prefetcher)."""
    if not pf:
        z = jnp.zeros((1, 32), jnp.int32)
        return z, z, z
    arrays = [lw[name] for _ in range(loops) for lw in layers for name in ORDER]
    work = schedule([a.size * a.dtype.itemsize for a in arrays], pf[0], pf[2],
                    [2 if SHAPES[name][2] else 1 for _ in range(loops) for _ in layers
                     for name in ORDER])
    return chunk_tables(arrays, work)


def main(argv=None):
    ap = chain_parser(__doc__, "base,stores,pf:16:16,pf:32:16,pf:16:64,base")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    for a in arms:
        if a != "stores":
            parse_arm(a)
    if args.tiling:
        raise SystemExit("--tiling: this benchmark runs the engine's tilings (STREAM_TUNING)")
    layers = make_weights(args.layers)
    x0 = jax.random.normal(jax.random.PRNGKey(1), (1, 2048), jnp.float32).astype(jnp.bfloat16)
    mb = sum(w.size * 2 for lw in layers for w in lw.values()) / args.layers / 1e6
    kernels = 4 * args.layers * args.loops
    word_buf = jnp.full((1,), -1, jnp.int32)  # the progress word; kept alive to the end
    word = jnp.asarray(split_address(word_buf.unsafe_buffer_pointer()), jnp.int32)
    calls = iter(range(1 << 20))  # every call's indices above every earlier call's
    rows, ref = [], None
    for arm in arms:
        pf = None if arm == "stores" else parse_arm(arm)
        t0 = time.perf_counter()
        f = chain_fn(args.loops, arm != "base", pf)
        tab = tables(layers, args.loops, pf)
        bases = [jnp.full((1,), next(calls) * kernels, jnp.int32)
                 for _ in range(args.repeats + 1)]
        out = jax.block_until_ready(f(x0, layers, word, bases[0], *tab))
        compile_s = time.perf_counter() - t0
        got = np.asarray(out[1])
        ref = got if ref is None else ref
        times, gave, seen = [], int(np.sum(out[2])), [np.asarray(out[3])]
        for b in bases[1:]:
            t = time.perf_counter()
            last = jax.block_until_ready(f(x0, layers, word, b, *tab))
            times.append((time.perf_counter() - t) * 1e6 / (args.loops * args.layers))
            gave += int(np.sum(last[2]))
            seen.append(np.asarray(last[3]))
        seen = np.concatenate(seen)
        med = statistics.median(times)
        row = dict(arm=arm, us_per_layer=round(med, 3), us_min=round(min(times), 3),
                   us_max=round(max(times), 3), tb_s=round(mb / med, 3),
                   compile_s=round(compile_s, 2), gave_up_groups=gave,
                   # the progress the prefetcher's programs read first, less the call's base:
                   # -1 = it started before the chain; kernels - 1 = after it (no overlap)
                   first_seen_min=int(seen.min()), first_seen_max=int(seen.max()),
                   bit_equal_to_first_arm=bool(np.array_equal(got, ref)),
                   timed_run_equal=bool(np.array_equal(np.asarray(last[1]), got)))
        print(json.dumps(row), flush=True)
        rows.append(row)
        # written after every arm: a step cut short by its time limit keeps what it measured
        save_record("benchmarks.side_prefetch_jax", argv, args.out, layers=args.layers,
                    loops=args.loops, mb_per_layer=mb, normed=list(NORMED),
                    tiling={k: dict(STREAM_TUNING[k]) for k in ORDER}, rows=rows)
    del word_buf
    if not all(r["bit_equal_to_first_arm"] and r["timed_run_equal"] for r in rows):
        print("ERROR: an arm's result differs from the first arm's", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
