"""Does XLA run a `compute_on("gpu_stream:N")` computation beside the main stream's kernels?

Why (session 33): a weight prefetcher on a stream of its own (benchmarks.l2_side_stream)
would enter the engine's decode program through JAX's `compute_on(compute_type=
"gpu_stream:1")`, which asks XLA to wrap the call in an async start/done on another stream.
Whether the two streams' kernels then overlap, also inside a `lax.fori_loop` (the engine's
decode loop), is measured here with two one-program Pallas kernels that each run a long
serial chain of multiply-adds (one SM each, ~ms): overlapped, the pair takes about one
kernel's time; serialised, two. Prints one JSON line per arm (median ms of --runs calls) and
whether the compiled HLO holds async ops.

  python3 -m benchmarks.stream_probe --out R.json
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from benchmarks.timing import median_time


def spin(x, n: int, interpret: bool = False):
    """One program: n dependent multiply-adds on a 128-lane fp32 vector (~1 SM)."""
    def kernel(x_ref, o_ref):
        o_ref[...] = lax.fori_loop(0, n, lambda i, v: v * 0.999999 + 1e-6, x_ref[...])
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          grid=(1,), interpret=interpret)(x)


def on_stream(stream: int):
    """fn -> fn run as a call on XLA's GPU stream `stream` (jax 0.10's compute_on2 is 0.11's
    compute_on; 0.10's compute_on is a context manager)."""
    import jax.experimental.compute_on as co
    wrap = getattr(co, "compute_on2", None) or co.compute_on
    return wrap(compute_type=f"gpu_stream:{stream}", out_memory_spaces=jax.memory.Space.Device)


def arms(n: int, interpret: bool = False):
    side = on_stream(1)
    run = lambda v: spin(v, n, interpret)  # noqa: E731

    def one(x, y):
        return run(x), y

    def serial(x, y):
        return run(x), run(y)

    def streams(x, y):
        return run(x), side(run)(y)

    def streams_loop(x, y):  # four rounds inside a fori_loop, as in the decode loop
        def body(i, c):
            a, b = c
            return run(a), side(run)(b)
        return lax.fori_loop(0, 4, body, (x, y))

    def serial_loop(x, y):
        return lax.fori_loop(0, 4, lambda i, c: (run(c[0]), run(c[1])), (x, y))
    return dict(one=one, serial=serial, streams=streams, serial_loop=serial_loop,
                streams_loop=streams_loop)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=200_000, help="multiply-adds per kernel")
    ap.add_argument("--runs", type=int, default=11)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    x = jnp.ones((128,), jnp.float32)
    y = jnp.full((128,), 2.0, jnp.float32)
    rows = []
    for name, fn in arms(args.iters).items():
        f = jax.jit(fn)
        hlo = f.lower(x, y).compile().as_text()
        ms = median_time(f, x, y, runs=args.runs) * 1e3
        row = dict(arm=name, ms=round(ms, 3), async_ops=hlo.count("async-start")
                   + hlo.count("async_start"), stream_attr="_xla_stream_annotation" in hlo)
        print(json.dumps(row), flush=True)
        rows.append(row)
    from benchmarks.record import save_record
    save_record("benchmarks.stream_probe", argv, args.out, iters=args.iters, rows=rows)


if __name__ == "__main__":
    main()
