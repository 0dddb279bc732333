"""The engine's one-row GEMV chain with and without a weight prefetcher on XLA's stream 1.

Why (session 33): benchmarks.l2_side_stream asks, outside JAX, whether a prefetcher on a
stream of its own speeds the chain; this asks it inside JAX, the way the engine would run it:
the engine's streaming GEMVs with their add_norm prologues (as benchmarks.pdl_jax_chain's
`xla` arm: 24 layers x 4 loops in one jitted program, XLA's own launch), each storing its
index to a progress word as it starts (gemv_stream `progress=`), and
pallas_kernels/side_prefetch.py's kernel wrapped in `compute_on("gpu_stream:1")` at the
program's start, never waited for by the chain. Arms (`--arms`):

  base                     the chain as the engine ran it before session 34 (weight loads
                           without evict_first; `base+ev` is today's default);
  stores                   the chain with the progress stores, no prefetcher (their cost);
  pf:LEAD_MB:PROGRAMS[:CHUNK_KB]  stores and the prefetcher, LEAD MB ahead;
  ffi-pf:...               the same prefetcher launched by pallas_kernels.side_launch.
                           side_call on a stream of the launcher's own, outside XLA's
                           scheduler (session 34: XLA ran the compute_on call after the
                           chain, and overlaps nothing inside a loop body);

any arm with `+ev`: the GEMVs' weight loads evict-first. --steps N runs the chain N times
in a fori_loop, the prefetcher launched at each iteration's start, as in the decode loop.

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

from jax import lax

from benchmarks.l2_side_stream import parse_arm, split_ev
from benchmarks.pdl_chain import SHAPES, chain_parser
from benchmarks.pdl_jax_chain import EPS, NORMED, ORDER, make_weights
from benchmarks.record import save_record
from benchmarks.stream_probe import on_stream
from ouro_jax.projection_tuning import STREAM_TUNING
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
from pallas_kernels.side_launch import side_call, side_sync
from pallas_kernels.side_prefetch import chunk_tables, schedule, side_prefetch, split_address


def parse_jax_arm(spec: str):
    """An arm of this benchmark -> (kind, pf, evict): kind 'base' | 'stores' | 'xla' (the
    prefetcher under compute_on) | 'ffi' (launched by pallas_kernels.side_launch.side_call on
    a stream of the launcher's own, outside XLA's scheduler); `+ev` at the end: the GEMVs'
    weight loads evict-first (gemv_stream evict_first)."""
    spec, evict = split_ev(spec)
    if spec in ("base", "stores"):
        return spec, None, evict
    ffi = spec.startswith("ffi-")
    pf = parse_arm(spec[4:] if ffi else spec)
    if pf is None:
        raise SystemExit(f"arm {spec!r}: 'ffi-' goes with a prefetcher arm (ffi-pf:...)")
    return ("ffi" if ffi else "xla"), pf, evict


def chain_fn(loops: int, arm: str, steps: int = 1, side=None):
    """jit(f)(h, layers, word, base, lo, hi, need) -> (h, the last layer's output, and per
    prefetcher program its give-ups and the progress it first read, or zeros). With steps >
    1 the chain runs that many times in a fori_loop, the prefetcher launched at each
    iteration's start (as the engine's decode loop would); side: the prefetcher compiled
    for side_launch.side_call (the 'ffi' arms)."""
    kind, pf, evict = parse_jax_arm(arm)
    tune = {name: dict(STREAM_TUNING[name], evict_first=evict) for name in ORDER}

    def f(h, layers, word, base, lo, hi, need):
        per_step = 4 * loops * len(layers)

        def step(it, carry):
            h, d, gave, seen = carry
            b = base + it * per_step
            if kind == "xla":
                seen, gave = on_stream(1)(lambda *a: side_prefetch(
                    *a, chunk=pf[2], programs=pf[1]))(lo, hi, need, word, b)
                seen = seen[:, 0]
            elif kind == "ffi":
                zeros = side_call(side, [jax.ShapeDtypeStruct((pf[1], 32), jnp.int32),
                                         jax.ShapeDtypeStruct((pf[1],), jnp.int32)],
                                  lo, hi, need, word, b, static_args=3)
                # the chain's inputs only after the launch: XLA may not move it behind the
                # chain (a barrier, no kernel)
                h, d, _ = lax.optimization_barrier((h, d, zeros))
            ki = 0

            def prog():
                nonlocal ki
                ki += 1
                return dict(progress=(word, b, ki - 1)) if kind != "base" else {}
            for _ in range(loops):
                for lw in layers:
                    y, h = gemv_stream_normed(h, lw["qkv_nw"], lw["qkv"], eps=EPS, branch=d,
                                              branch_w=lw["qkv_bw"], **prog(), **tune["qkv"])
                    o = gemv_stream(y[:, :2048], lw["o"], **prog(), **tune["o"])
                    y, h = gemv_stream_normed(h, lw["gate_up_nw"], lw["gate_up"], eps=EPS,
                                              branch=o, branch_w=lw["gate_up_bw"],
                                              gated=True, **prog(), **tune["gate_up"])
                    d = gemv_stream(y, lw["down"], **prog(), **tune["down"])
            return h, d, gave, seen
        z = jnp.zeros((1,), jnp.int32)
        carry = (h, jnp.zeros_like(h), z, z)
        if steps == 1:
            carry = step(0, carry)
        else:  # (the give-ups and first reads of the loop's last iteration)
            if kind == "xla":
                carry = (h, carry[1], jnp.zeros((pf[1],), jnp.int32),
                         jnp.zeros((pf[1],), jnp.int32))
            carry = lax.fori_loop(0, steps, step, carry)
        return carry  # (summed on the host: no extra kernel)
    return jax.jit(f)


def compile_side(pf, lo, hi, need, word, base):
    """The prefetcher as a cubin for side_launch.side_call (the `triton` package compiles the
    IR Pallas emits; GPU machine)."""
    from pallas_kernels.pdl_launch import compile_pallas
    return compile_pallas(lambda *a: side_prefetch(*a, chunk=pf[2], programs=pf[1]),
                          lo, hi, need, word, base, num_warps=1, num_stages=1)


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
    ap.add_argument("--steps", type=int, default=1,
                    help="the chain this many times in a fori_loop, the prefetcher launched "
                         "at each iteration's start (1: no loop)")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    for a in arms:
        parse_jax_arm(a)
    if args.tiling:
        raise SystemExit("--tiling: this benchmark runs the engine's tilings (STREAM_TUNING)")
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    layers = make_weights(args.layers)
    x0 = jax.random.normal(jax.random.PRNGKey(1), (1, 2048), jnp.float32).astype(jnp.bfloat16)
    mb = sum(w.size * 2 for lw in layers for w in lw.values()) / args.layers / 1e6
    kernels = 4 * args.layers * args.loops * args.steps  # per call
    word_buf = jnp.full((1,), -1, jnp.int32)  # the progress word; kept alive to the end
    word = jnp.asarray(split_address(word_buf.unsafe_buffer_pointer()), jnp.int32)
    calls = iter(range(1 << 20))  # every call's indices above every earlier call's
    rows, ref = [], None
    for arm in arms:
        kind, pf, _ = parse_jax_arm(arm)
        t0 = time.perf_counter()
        tab = tables(layers, args.loops, pf)
        bases = [jnp.full((1,), next(calls) * kernels, jnp.int32)
                 for _ in range(args.repeats + 1)]
        side = compile_side(pf, *tab, word, bases[0]) if kind == "ffi" else None
        f = chain_fn(args.loops, arm, args.steps, side)
        out = jax.block_until_ready(f(x0, layers, word, bases[0], *tab))
        compile_s = time.perf_counter() - t0
        got = np.asarray(out[1])
        ref = got if ref is None else ref
        times, gave, seen = [], int(np.sum(out[2])), [np.asarray(out[3])]
        for b in bases[1:]:
            t = time.perf_counter()
            last = jax.block_until_ready(f(x0, layers, word, b, *tab))
            times.append((time.perf_counter() - t) * 1e6
                         / (args.loops * args.layers * args.steps))
            gave += int(np.sum(last[2]))
            seen.append(np.asarray(last[3]))
        seen = np.concatenate(seen)
        med = statistics.median(times)
        row = dict(arm=arm, us_per_layer=round(med, 3), us_min=round(min(times), 3),
                   us_max=round(max(times), 3), tb_s=round(mb / med, 3),
                   compile_s=round(compile_s, 2),
                   bit_equal_to_first_arm=bool(np.array_equal(got, ref)),
                   timed_run_equal=bool(np.array_equal(np.asarray(last[1]), got)))
        if kind == "xla":  # (side_call's results are zeros: the 'ffi' arms report none, so
            # only their time says whether they ran beside the chain)
            # the progress the prefetcher's programs read first, less the iteration's base:
            # -1 = it started before the chain; the step's kernels - 1 = after it (no overlap)
            row.update(gave_up_groups=gave, first_seen_min=int(seen.min()),
                       first_seen_max=int(seen.max()))
        if kind == "ffi":  # a lagging side kernel must not run into the next arm
            side_sync()
        print(json.dumps(row), flush=True)
        rows.append(row)
        # written after every arm: a step cut short by its time limit keeps what it measured
        save_record("benchmarks.side_prefetch_jax", argv, args.out, layers=args.layers,
                    loops=args.loops, steps=args.steps, mb_per_layer=mb,
                    normed=list(NORMED), tiling={k: dict(STREAM_TUNING[k]) for k in ORDER},
                    rows=rows)
    del word_buf
    if not all(r["bit_equal_to_first_arm"] and r["timed_run_equal"] for r in rows):
        print("ERROR: an arm's result differs from the first arm's", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
