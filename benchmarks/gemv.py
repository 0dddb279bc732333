"""Decode projections on the GPU: XLA's GEMM fusion vs the Pallas GEMV (pallas_kernels/gemv.py).
Shapes: the 1.4B/2.6B projections (hidden 2048, intermediate 5632), in bf16; needs a GPU.

Each timed program applies one projection shape to `--layers` distinct weight matrices in a
row (as a decode step does; nothing stays in L2 between them), and back-to-back launches of
it are timed with one sync at the end (benchmarks/timing.py), so launch gaps between the
kernels count as they do in decode, and no per-call dispatch or sync does. Reports us per
projection and the weight-read rate.

  python -m benchmarks.gemv --rows 1,8 --out benchmarks/results/gemv_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp

from benchmarks.gemm_tilings import (  # noqa: F401 (GEMM_VARIANTS: re-exported)
    FEW_ROW_VARIANTS, GEMM_VARIANTS, pick_invariant, pick_routes)
from benchmarks.record import save_record
from benchmarks.timing import device_seconds, pipelined_seconds
from pallas_kernels.gemm import gemm
from pallas_kernels.gemv import gemv, gemv_reference
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed

# name -> (N, K, gated) for the 1.4B/2.6B shape (hidden 2048, intermediate 5632, 16x128 heads)
SHAPES = {"qkv": (6144, 2048, False), "o": (2048, 2048, False),
          "gate_up": (11264, 2048, True), "down": (2048, 5632, False)}

VARIANTS = {  # name -> gemv tuning; "xla" is the model's einsum (+ SiLU for gate_up)
    "dot16_k256_w4_s4": dict(use_dot=True, block_n=16, block_k=256, num_warps=4, num_stages=4),
    "dot16_k512_w4_s3": dict(use_dot=True, block_n=16, block_k=512, num_warps=4, num_stages=3),
    "dot16_k128_w4_s6": dict(use_dot=True, block_n=16, block_k=128, num_warps=4, num_stages=6),
    "dot16_k256_w2_s4": dict(use_dot=True, block_n=16, block_k=256, num_warps=2, num_stages=4),
    "dot32_k256_w4_s4": dict(use_dot=True, block_n=32, block_k=256, num_warps=4, num_stages=4),
    "dot32_k512_w8_s3": dict(use_dot=True, block_n=32, block_k=512, num_warps=8, num_stages=3),
    "fma8_k256_w4": dict(use_dot=False, block_n=8, block_k=256, num_warps=4, num_stages=1),
    "fma4_k512_w4": dict(use_dot=False, block_n=4, block_k=512, num_warps=4, num_stages=1),
    "fma8_k512_w4_s2": dict(use_dot=False, block_n=8, block_k=512, num_warps=4, num_stages=2),
    "fma16_k256_w8": dict(use_dot=False, block_n=16, block_k=256, num_warps=8, num_stages=1),
    "fma2_k512_w2": dict(use_dot=False, block_n=2, block_k=512, num_warps=2, num_stages=1),
    # one load per program where K allows (no loop: every byte of the tile in flight at once)
    "fma4_k2048_w4": dict(use_dot=False, block_n=4, block_k=2048, num_warps=4, num_stages=1),
    "fma2_k2048_w4": dict(use_dot=False, block_n=2, block_k=2048, num_warps=4, num_stages=1),
    "fma1_k2048_w2": dict(use_dot=False, block_n=1, block_k=2048, num_warps=2, num_stages=1),
    "fma4_k1024_w4": dict(use_dot=False, block_n=4, block_k=1024, num_warps=4, num_stages=1),
    "fma8_k1024_w8": dict(use_dot=False, block_n=8, block_k=1024, num_warps=8, num_stages=1),
    "fma2_k1024_w2": dict(use_dot=False, block_n=2, block_k=1024, num_warps=2, num_stages=1),
    "fma4_k512_w2": dict(use_dot=False, block_n=4, block_k=512, num_warps=2, num_stages=1),
    "fma4_k256_w2": dict(use_dot=False, block_n=4, block_k=256, num_warps=2, num_stages=1),
}
# prefetch=P (session 6): P K-chunks requested ahead of the math; "fma" + block_n, block_k,
# warps, depth.
VARIANTS.update({
    f"fma{bn}_k{bk}_w{w}_pf{pf}": dict(use_dot=False, block_n=bn, block_k=bk, num_warps=w,
                                       num_stages=1, prefetch=pf)
    for bn, bk, w, pf in [(4, 256, 2, 2), (4, 256, 2, 3), (2, 256, 2, 3), (4, 512, 4, 2),
                          (2, 512, 2, 2), (8, 256, 4, 2), (8, 512, 4, 1), (16, 256, 8, 2),
                          (2, 1024, 2, 1), (4, 1024, 4, 1)]
})
# The streaming GEMV (pallas_kernels/gemv_stream.py, session 7): "st" + block_n, block_k,
# output blocks per program, warps; "_x2d": rows loaded as [1, block_k] tiles (row2d).
STREAM_VARIANTS = {
    f"st{bn}_k{bk}_p{pp}_w{w}" + ("_x2d" if x2 else ""):
        dict(block_n=bn, block_k=bk, per_program=pp, num_warps=w,
             **({"row2d": True} if x2 else {}))
    for bn, bk, pp, w in [(1, 512, 4, 4), (1, 512, 8, 2), (1, 256, 8, 2), (2, 512, 2, 4),
                          (2, 512, 4, 4), (2, 512, 8, 4), (2, 512, 16, 4), (2, 256, 4, 2),
                          (2, 1024, 4, 4), (4, 512, 4, 4), (4, 512, 4, 8), (8, 512, 4, 8),
                          # second round (fewer blocks per program did better in the first)
                          (1, 512, 2, 4), (1, 512, 1, 4), (2, 512, 1, 4), (1, 256, 2, 4),
                          (1, 512, 2, 8), (2, 1024, 1, 4),
                          # one warp per output row (block_k = 32 lanes x 8): an intra-warp sum
                          (4, 256, 1, 4), (8, 256, 1, 8), (2, 256, 1, 2),
                          # third round, around session 9's add_norm picks (st4_k512_p4_w4 for
                          # qkv, st2_k512_p8_w4 for gate/up)
                          (4, 512, 2, 4), (4, 512, 8, 4), (8, 512, 2, 4), (4, 512, 4, 2),
                          (2, 512, 8, 2), (8, 512, 2, 8),
                          # fourth round (session 15): per-program counts that are not powers
                          # of two, for grids of 256 programs (one or two per SM on all 132,
                          # where the engine's 352-512 put 2-3 or 3-4 on an SM):
                          # qkv, gate/up, down
                          (4, 512, 6, 4), (2, 512, 11, 4), (1, 512, 8, 4),
                          # fifth round (session 30): the whole K = 2048 row as one chunk for
                          # qkv and gate/up, so the norm prologue converts and reduces once
                          # (offline: qkv 15 barriers against 41, 124 registers; at 8 warps 72)
                          (4, 2048, 4, 4), (4, 2048, 4, 8), (2, 2048, 8, 4), (2, 2048, 8, 8),
                          # sixth round (session 31, after block_k 2048 at 8 warps came out
                          # +0.6-1.0% end to end on an H100): o at block_k 2048, and qkv and
                          # gate/up with half the blocks per program (twice the programs)
                          (2, 2048, 2, 8), (2, 2048, 2, 4), (1, 2048, 4, 8), (4, 2048, 2, 8),
                          (2, 2048, 4, 8),
                          # seventh round (session 31, 8 warps having beaten 4 at block_k
                          # 2048): 16 warps, and twice the rows per block at the same grid
                          (4, 2048, 4, 16), (2, 2048, 8, 16), (8, 2048, 2, 16), (8, 2048, 2, 8)]
    for x2 in (False, True)
}
# eighth round (session 35): two blocks' loads in flight ahead of the math (gemv_stream's
# depth=2) at the engine's tilings and their 16-warp and larger-block neighbours: the H200
# reads at 81-92% of XLA's rate through these kernels where an H100 reads at its rate
STREAM_VARIANTS.update({
    f"st{bn}_k{bk}_p{pp}_w{w}_d2": dict(block_n=bn, block_k=bk, per_program=pp, num_warps=w,
                                        depth=2)
    for bn, bk, pp, w in [(4, 2048, 4, 8), (2, 2048, 8, 8), (2, 512, 2, 4), (1, 512, 4, 4),
                          (4, 2048, 4, 16), (2, 2048, 8, 16), (4, 2048, 4, 4), (2, 2048, 8, 4),
                          (2, 2048, 4, 8), (4, 2048, 2, 8), (2, 512, 4, 4), (1, 512, 2, 8),
                          (2, 2048, 2, 8)]
})
ENGINE_PF = tuple(f"engine_pf{p}" for p in (1, 2, 3))

def engine_tuning(impl: str, shape: str) -> dict:
    """'engine' (ouro_jax.projections' tiling for this shape) or 'engine_pfN' (the same with
    prefetch depth N)."""
    from ouro_jax.projections import GEMV_TUNING
    tuning = dict(GEMV_TUNING[shape])
    if impl != "engine":
        tuning["prefetch"] = int(impl.removeprefix("engine_pf"))
    return tuning


NORM_W = 0.7  # the prologue's norm weights (constants: any value, the same for every impl)


def prologue_inputs(m: int, k: int, layers: int, seed: int = 0) -> list:
    """One (x, branch) pair per weight of the chain, all distinct: with one shared input XLA
    would compute the prologue once for the whole chain while the kernels pay it per call."""
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), 2 * layers)
    return [tuple(jax.random.normal(kk, (m, k), jnp.float32).astype(jnp.bfloat16) * sc
                  for kk, sc in ((keys[2 * i], 1.0), (keys[2 * i + 1], 3.0)))
            for i in range(layers)]


def chain_fn(impl, gated, shape, prologue="", fixed_rows=False):
    """One program: the projection of x with each weight in turn (outputs stacked). impl:
    "xla", "engine" (the tiling ouro_jax.projections uses for this shape), "engine_pfN" or a
    VARIANTS key. prologue="add_norm" (xla, engine and STREAM_VARIANTS only): x is then a
    list of (x_i, branch_i) pairs, one per weight (prologue_inputs), and each projection first
    computes rms_norm(x_i + rms_norm(branch_i)), the sandwich layer's residual add and norm,
    in the streaming kernel (the engine's one-row path) or as XLA ops. fixed_rows: the GEMM
    tilings keep their row block at any row count, as ouro_jax.invariant runs them;
    impl "invariant" is that mode's own tiling for this shape and row count
    (ouro_jax.invariant.tiling_for)."""
    if prologue:
        from ouro_jax.model import rms_norm
        from ouro_jax.projections import STREAM_TUNING
        tuning = STREAM_TUNING[shape] if impl == "engine" else STREAM_VARIANTS.get(impl)

        def chain(pairs, ws):
            out = []
            for (x, b), w in zip(pairs, ws):
                nw = jnp.full((x.shape[-1],), NORM_W, x.dtype)
                if impl == "xla":
                    y = gemv_reference(rms_norm(x + rms_norm(b, nw, 1e-6), nw, 1e-6), w,
                                       gated=gated)
                else:
                    y = gemv_stream_normed(x, nw, w, eps=1e-6, branch=b, branch_w=nw,
                                           gated=gated, **tuning)[0]
                out.append(y)
            return jnp.stack(out)
        return jax.jit(chain)
    if impl == "xla":
        one = lambda x, w: gemv_reference(x, w, gated=gated)
    elif impl in STREAM_VARIANTS:
        one = lambda x, w: gemv_stream(x, w, gated=gated, **STREAM_VARIANTS[impl])
    elif impl in GEMM_VARIANTS or impl == "invariant":
        from ouro_jax.invariant import tiling_for

        def one(x, w):  # the mode's tiling: its route for this row count, if any
            t = tiling_for(shape, x.shape[0]) if impl == "invariant" else GEMM_VARIANTS[impl]
            return gemm(x, w, gated=gated, fixed_rows=fixed_rows, **t)
    else:
        tuning = engine_tuning(impl, shape) if impl.startswith("engine") else VARIANTS[impl]
        one = lambda x, w: gemv(x, w, gated=gated, **tuning)
    return jax.jit(lambda x, ws: jnp.stack([one(x, w) for w in ws]))


def max_rel_error(fn, x, ws, ref) -> float:
    """Largest |y - XLA| / max|XLA| over the chain's first weight (bf16 accumulation-order
    noise); ref: XLA's output for that weight."""
    y = fn(x, ws[:1])[0].astype(jnp.float32)
    r = ref.astype(jnp.float32)
    return float(jnp.max(jnp.abs(y - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30))


def run(args) -> list:
    rows_list = [int(r) for r in args.rows.split(",")]
    if args.variants == "gemm":  # the skinny GEMM's tilings against XLA
        impls = ["xla"] + (["invariant"] if args.fixed_rows else []) + list(GEMM_VARIANTS)
    elif args.fixed_rows:  # 'gemm_few' or GEMM_VARIANTS keys, beside the mode's own tiling
        chosen = FEW_ROW_VARIANTS if args.variants == "gemm_few" else args.variants.split(",")
        impls = ["xla", "invariant"] + [v for v in chosen if v not in ("xla", "invariant")]
    elif args.variants == "stream":  # the streaming GEMV's tilings against XLA and the engine
        impls = ["xla", "engine"] + list(STREAM_VARIANTS)
    elif args.prologue:  # only XLA, the engine and streaming tilings take a prologue here
        impls = ["xla", "engine"] + [v for v in args.variants.split(",")
                                     if v not in ("xla", "engine")]
    else:
        impls = ["xla", "engine"] + [v for v in (args.variants.split(",") if args.variants
                                                 else VARIANTS) if v != "engine"]
    results = []
    for name in args.shapes.split(","):
        n, k, gated = SHAPES[name]
        keys = jax.random.split(jax.random.PRNGKey(0), args.layers + 1)
        ws = [(jax.random.normal(kk, (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
              for kk in keys[1:]]
        nbytes = n * k * 2
        for m in rows_list:
            x = jax.random.normal(keys[0], (m, k), jnp.float32).astype(jnp.bfloat16)
            if args.prologue:
                x = prologue_inputs(m, k, args.layers)
            ref = chain_fn("xla", gated, name, args.prologue)(x, ws[:1])[0]  # once per shape
            for impl in impls:
                row = dict(shape=name, rows=m, impl=impl, N=n, K=k, gated=gated,
                           prologue=args.prologue or None, fixed_rows=args.fixed_rows)
                try:
                    fn = chain_fn(impl, gated, name, args.prologue, args.fixed_rows)
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(x, ws))
                    row["compile_s"] = round(time.perf_counter() - t0, 2)
                    sec = pipelined_seconds(fn, x, ws, calls=args.calls,
                                            trials=args.trials) / args.layers
                    row.update(us=round(sec * 1e6, 2), TBps=round(nbytes / sec / 1e12, 3))
                    if args.device_time:  # the GPU's own kernel time (see device_seconds)
                        dev, _ = device_seconds(fn, x, ws, units=args.layers)
                        row.update(device_us=round(dev * 1e6, 2),
                                   device_TBps=round(nbytes / dev / 1e12, 3))
                    if impl != "xla":
                        row["rel_err_vs_xla"] = max_rel_error(fn, x, ws, ref)
                except Exception as e:  # an unsupported tiling for this shape, or a compile error
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                results.append(row)
                dev = f" | device {row['device_us']:8.2f} us" if "device_us" in row else ""
                print(f"{name:8s} M={m:2d} {impl:18s} " + (
                    f"{row['us']:8.2f} us {row['TBps']:6.3f} TB/s{dev}" if "us" in row
                    else row["error"]), flush=True)
    return results


def pick_fastest(results: list, max_rel_err: float = 1e-2) -> str:
    """The fastest streaming tiling per shape among a run's rows that ran without error and
    agree with XLA, as a --stream-tiling spec ('gate_up=st2_...,qkv=st4_...'); '' if none.
    Ranked by device time where the run has it (--device-time), else by wall clock."""
    best = {}
    time_of = lambda r: r["device_us"] if "device_us" in r else r["us"]  # noqa: E731
    for r in results:
        if "us" not in r or "error" in r or r["impl"] not in STREAM_VARIANTS \
                or r.get("rel_err_vs_xla", 1.0) >= max_rel_err:
            continue
        if r["shape"] not in best or time_of(r) < time_of(best[r["shape"]]):
            best[r["shape"]] = r
    return ",".join(f"{s}={r['impl']}" for s, r in sorted(best.items()))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gemv", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=None,
                    help=f"comma list from {list(SHAPES)} (default all; qkv,gate_up with --prologue)")
    ap.add_argument("--rows", default=None,
                    help="comma list of row counts (batch x tokens); default 1,8 (1 with --prologue)")
    ap.add_argument("--variants", default="", help=f"comma list from "
                    f"{sorted(VARIANTS) + list(ENGINE_PF)} (default all GEMV variants; 'none': "
                    "only XLA and the engine's tiling; 'gemm': XLA and "
                    "every GEMM_VARIANTS tiling of the skinny GEMM; 'stream': XLA, the engine and every "
                    "STREAM_VARIANTS tiling of the streaming GEMV)")
    ap.add_argument("--prologue", default="", choices=["", "add_norm"],
                    help="add_norm: time the streaming tilings with the sandwich layer's residual "
                         "add + RMSNorm prologue (the engine's qkv and gate/up calls), the engine's "
                         "tiling and XLA with the same ops, a distinct input per weight; "
                         "--variants must then be 'stream', 'engine' or STREAM_VARIANTS keys")
    ap.add_argument("--layers", type=int, default=24,
                    help="distinct weights per timed program (default 24, one per layer)")
    ap.add_argument("--calls", type=int, default=20,
                    help="back-to-back launches per timed trial, one sync at the end (default 20)")
    ap.add_argument("--trials", type=int, default=5,
                    help="timed trials; the median is reported (default 5)")
    ap.add_argument("--device-time", action="store_true",
                    help="also the GPU's own kernel time per projection from a profiler trace "
                         "(device_us; the wall clock can be host-bound for short kernels)")
    ap.add_argument("--fixed-rows", action="store_true",
                    help="with --variants gemm, gemm_few (the few-row tilings) or GEMM_VARIANTS "
                         "keys: the GEMM keeps each tiling's row block at any "
                         "row count, as the batch-invariant mode runs it (ouro_jax.invariant), "
                         "and the mode's own tiling is timed as 'invariant'")
    ap.add_argument("--out", default="", help="JSON result path")
    ap.add_argument("--pick", default=None, metavar="RESULT.json",
                    help="print the fastest streaming tiling per shape in a saved run as a "
                         "--stream-tiling spec (benchmarks.decode), and exit")
    ap.add_argument("--pick-invariant", default=None, metavar="RESULT.json[,...]",
                    help="print the batch-invariant mode's GEMM tiling per weight from saved "
                         "--fixed-rows runs as a --invariant-tiling spec (benchmarks.decode; "
                         "pick_invariant says how), and exit")
    ap.add_argument("--pick-routes", default=None, metavar="RESULT.json[,...]",
                    help="print the batch-invariant mode's row-count routes per weight from "
                         "saved --fixed-rows runs and a benchmarks.gemm_tiling_bits probe "
                         "(--bits) as a --invariant-tiling spec (pick_routes says how), "
                         "and exit")
    ap.add_argument("--bits", default=None, metavar="PROBE.json",
                    help="with --pick-routes: the gemm_tiling_bits probe's result")
    return ap


def check_args(args) -> None:
    """Fills the defaults of --variants/--shapes/--rows and refuses what cannot be timed."""
    if args.variants == "none":
        args.variants = "engine"
    args.shapes = args.shapes or ("qkv,gate_up" if args.prologue else ",".join(SHAPES))
    args.rows = args.rows or ("1" if args.prologue else "1,8")
    unknown = set(filter(None, args.variants.split(","))) - set(VARIANTS) - set(GEMM_VARIANTS) \
        - set(STREAM_VARIANTS) - set(ENGINE_PF) - {"engine", "gemm", "gemm_few", "stream"}
    if unknown or set(args.shapes.split(",")) - set(SHAPES):
        raise SystemExit(f"unknown variants/shapes: {sorted(unknown)} {args.shapes}")
    if args.prologue and set(filter(None, args.variants.split(","))) - set(STREAM_VARIANTS) \
            - {"stream", "xla", "engine"}:
        raise SystemExit("--prologue add_norm times XLA, the engine's tiling and streaming "
                         "tilings only: give --variants stream, engine or STREAM_VARIANTS keys")
    if args.fixed_rows and (args.variants not in ("gemm", "gemm_few") and (
            not args.variants or set(args.variants.split(",")) - set(GEMM_VARIANTS))):
        raise SystemExit("--fixed-rows changes the skinny GEMM's tilings only: give "
                         "--variants gemm, gemm_few, or a list of GEMM_VARIANTS keys "
                         "(gemm and gemm_few are not list items)")
    if args.variants == "gemm_few" and not args.fixed_rows:
        raise SystemExit("--variants gemm_few is the few-row GEMM sweep: add --fixed-rows")
    if args.prologue and not args.variants:
        raise SystemExit("--prologue add_norm needs --variants (stream, engine or "
                         "STREAM_VARIANTS keys)")
    from pallas_kernels.gemv_stream import MAX_ROWS
    if args.prologue and max(int(r) for r in args.rows.split(",")) > MAX_ROWS:
        raise SystemExit(f"--prologue add_norm: the streaming GEMV takes 1..{MAX_ROWS} rows, "
                         f"got --rows {args.rows}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.pick:
        with open(args.pick) as f:
            print(pick_fastest(json.load(f)["results"]))
        return 0
    if args.pick_invariant:
        rows = []
        for path in args.pick_invariant.split(","):
            with open(path) as f:
                rows += json.load(f)["results"]
        print(pick_invariant(rows))
        return 0
    if args.pick_routes:
        if not args.bits:
            raise SystemExit("--pick-routes needs --bits PROBE.json (benchmarks."
                             "gemm_tiling_bits): a route tile must keep TUNING's bits")
        rows = []
        for path in args.pick_routes.split(","):
            with open(path) as f:
                rows += json.load(f)["results"]
        with open(args.bits) as f:
            print(pick_routes(rows, json.load(f)["rows"]))
        return 0
    check_args(args)
    results = run(args)
    save_record("benchmarks.gemv", argv, args.out, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
