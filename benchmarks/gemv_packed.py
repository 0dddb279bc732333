"""The 12-bit packed GEMV (pallas_kernels/gemv_packed.py) against the engine's streaming bf16
GEMV, on the 1.4B one-row projections. Needs a GPU for figures (on a CPU it runs the checks
in interpret mode on a tiny shape and prints no timings).

    python -m benchmarks.gemv_packed --layers 24 --out packed.json

Why: batch-1 decode is bound by the weight bytes each projection reads (session 14's cost
model: 26.1 of ~43 us per layer application are bytes), and packed12 stores bf16 weights
losslessly in ~12.5 bits. Two measurements:

* per projection and tiling: `layers` calls, each on its own weights (so they stream from
  HBM), device time per call from a profiler trace (benchmarks.timing.device_seconds), and
  the bytes each call reads as a rate;
* the chain qkv -> o -> gate/up -> down over `layers` layers (as benchmarks.mgpu_pdl_chain),
  streaming bf16 against packed on each projection's fastest tiling: us per layer.

Every packed call's output is compared with the streaming GEMV's on the same (unpacked)
weights: max |difference| in units of the bf16 ulp of the result, and the count of
differing outputs (only the fp32 summation order differs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gemv import SHAPES  # name -> (N, K, gated), the 1.4B projections
from benchmarks.mgpu_pdl_chain import _stream  # the engine's plain streaming GEMV

TILINGS = {  # name -> gemv_packed tuning. A thread's share of a chunk: block_n * 64 /
    # (32 * num_warps) words of each of the three word tiles (8 weights per word column); at
    # one word column it holds 8 weights per chunk, as the engine's bf16 qkv tiling does 16
    "b2_p2_w4": dict(block_n=2, per_program=2, num_warps=4),
    "b2_p4_w4": dict(block_n=2, per_program=4, num_warps=4),
    "b2_p8_w4": dict(block_n=2, per_program=8, num_warps=4),
    "b4_p1_w4": dict(block_n=4, per_program=1, num_warps=4),
    "b4_p2_w4": dict(block_n=4, per_program=2, num_warps=4),
    "b4_p2_w8": dict(block_n=4, per_program=2, num_warps=8),
    "b8_p1_w8": dict(block_n=8, per_program=1, num_warps=8),
    "b1_p4_w2": dict(block_n=1, per_program=4, num_warps=2),
    "b8_p1_w4": dict(block_n=8, per_program=1, num_warps=4),
}


def _packed(name, x, pw, tiling):
    from pallas_kernels.gemv_packed import gemv_packed
    return gemv_packed(x, pw, gated=SHAPES[name][2], **tiling)


MAX_ULPS = 8  # a tiling whose outputs differ more from the streaming GEMV's is not picked


def ulp_diff(y, ref) -> tuple[float, int]:
    """(max |y - ref| in bf16 ulps of ref, count of differing outputs); an output whose
    reference is 0 is measured in ulps of the smallest normal bf16, so it reads large."""
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    ulp = np.spacing(np.abs(ref).astype(jnp.bfloat16).astype(np.float32)) * 65536.0
    ulp = np.where(ulp > 0, ulp, np.finfo(np.float32).tiny)
    return float(np.max(np.abs(y - ref) / ulp)), int((y != ref).sum())


def projection_rows(name, ws, pws, x, tilings, calls):
    from benchmarks.timing import device_seconds
    n, k, _ = SHAPES[name]
    layers = len(ws)
    bf16_bytes = n * k * 2
    stream = jax.jit(lambda ws, x: [_stream(name, x, w) for w in ws])
    ref = stream(ws, x)
    rows = []
    t, _ = device_seconds(stream, ws, x, calls=calls, units=layers)
    rows.append(dict(projection=name, arm="stream", us=t * 1e6, bytes=bf16_bytes,
                     tb_s=bf16_bytes / t / 1e12))
    print(json.dumps(rows[-1]), flush=True)
    packed_bytes = float(np.mean([p.nbytes for p in pws]))
    for label, tiling in tilings.items():
        f = jax.jit(lambda pws, x, tiling=tiling: [_packed(name, x, p, tiling) for p in pws])
        try:
            ys = f(pws, x)
            t, _ = device_seconds(f, pws, x, calls=calls, units=layers)
        except Exception as e:  # noqa: BLE001 - a tiling that does not fit: report, go on
            rows.append(dict(projection=name, arm=label, error=f"{type(e).__name__}: "
                             f"{str(e)[:300]}"))
            print(json.dumps(rows[-1]), flush=True)
            continue
        diffs = [ulp_diff(a, b) for a, b in zip(ys, ref)]
        rows.append(dict(projection=name, arm=label, tiling=tiling, us=t * 1e6,
                         bytes=packed_bytes, tb_s=packed_bytes / t / 1e12,
                         bf16_equiv_tb_s=bf16_bytes / t / 1e12,
                         max_ulps=max(d[0] for d in diffs),
                         differing=sum(d[1] for d in diffs)))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def chain(ws, pws, x, best, reps, calls):
    """us per layer of the four-projection chain: streaming bf16, then packed on `best`."""
    from benchmarks.timing import device_seconds

    def run(ws, pws, x, packed):
        for lw, lp in zip(ws, pws):
            for name in SHAPES:
                # the first K values of the previous output (qkv's 6144 feed o's 2048)
                x = _packed(name, x[:, :SHAPES[name][1]], lp[name], best[name]) if packed \
                    else _stream(name, x, lw[name])
        return x
    out = []
    for packed in (False, True):
        fn = jax.jit(lambda ws, pws, x, packed=packed: run(ws, pws, x, packed))
        try:
            y = fn(ws, pws, x)
            t0 = time.perf_counter()
            for _ in range(reps):
                y = fn(ws, pws, x)
            jax.block_until_ready(y)
            wall = (time.perf_counter() - t0) / reps / len(ws) * 1e6
            kernel, span = device_seconds(fn, ws, pws, x, calls=calls, units=len(ws))
        except Exception as e:  # noqa: BLE001 - report it and keep the rows before it
            out.append(dict(arm="packed" if packed else "stream",
                            error=f"{type(e).__name__}: {str(e)[:300]}"))
            print(json.dumps(out[-1]), flush=True)
            continue
        out.append(dict(arm="packed" if packed else "stream", wall_us_per_layer=wall,
                        kernel_us_per_layer=kernel * 1e6, span_us_per_layer=span * 1e6,
                        finite=bool(np.isfinite(np.asarray(y, np.float32)).all())))
        print(json.dumps(out[-1]), flush=True)
    return out


def clamp_tiny(w: jax.Array) -> jax.Array:
    """w with every |value| below 2**-9 of its std raised to that (sign kept): on these
    Gaussian weights no packing chunk then spans more than 16 binades, so nothing escapes
    (the kernel is compiled without its escape path). A speed probe, not a model."""
    t = (jnp.std(w.astype(jnp.float32)) * 2.0 ** -9).astype(w.dtype)
    return jnp.where(jnp.abs(w) < t, jnp.where(w < 0, -t, t), w)


def run(layers: int, names, tilings, reps: int, calls: int, no_escapes: bool,
        save=lambda partial: None) -> dict:
    """save(partial result) runs after each projection, so a run cut short keeps its rows."""
    from benchmarks.mgpu_pdl_chain import weights
    from pallas_kernels.packed12 import pack
    ws = weights(layers)
    if no_escapes:
        ws = [{name: clamp_tiny(w) for name, w in lw.items()} for lw in ws]
    t0 = time.perf_counter()
    pws = [{name: pack(lw[name]) for name in SHAPES} for lw in ws]
    pack_s = time.perf_counter() - t0
    escapes = {name: [p[name].escapes for p in pws] for name in SHAPES}
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 5632), jnp.float32).astype(jnp.bfloat16)
    rows, best, compared = [], {}, {}
    for name in names:
        k = SHAPES[name][1]
        r = projection_rows(name, [lw[name] for lw in ws], [p[name] for p in pws],
                            x[:, :k], tilings, calls)
        rows += r
        save(dict(pack_seconds=pack_s, escapes=escapes, projections=rows, partial=True))
        # the chain's tiling: the fastest whose outputs stayed within MAX_ULPS of streaming
        ok = [row for row in r if row["arm"] != "stream" and "us" in row
              and row["max_ulps"] <= MAX_ULPS]
        if ok:
            best[name] = min(ok, key=lambda row: row["us"])["tiling"]
        compared[name] = len(ok)
    chain_rows = []
    if set(best) == set(SHAPES):
        chain_rows = chain(ws, pws, x[:, :2048], best, reps, calls)
    return dict(pack_seconds=pack_s, escapes=escapes, projections=rows, best=best,
                tilings_compared=compared, chain=chain_rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--projections", default=",".join(SHAPES))
    ap.add_argument("--tilings", default=",".join(TILINGS),
                    help=f"comma list of {sorted(TILINGS)}")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--no-escapes", action="store_true",
                    help="raise the weights' tiniest values (clamp_tiny) so that no chunk "
                         "escapes: times the kernel without its escape path")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    names = [s for s in a.projections.split(",") if s]
    tl = [s for s in a.tilings.split(",") if s]
    for s in names:
        if s not in SHAPES:
            ap.error(f"unknown projection {s!r}; valid: {sorted(SHAPES)}")
    for s in tl:
        if s not in TILINGS:
            ap.error(f"unknown tiling {s!r}; valid: {sorted(TILINGS)}")
    if a.layers < 1 or a.reps < 1 or a.calls < 1:
        ap.error("--layers, --reps and --calls must be >= 1")
    from benchmarks.grid_barrier import require_gpu
    require_gpu("gemv_packed", "it times GPU kernels (tests/test_gemv_packed.py checks the "
                "kernel on a CPU)")
    head = dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
                command="python -m benchmarks.gemv_packed " + " ".join(sys.argv[1:]),
                no_escapes=a.no_escapes)

    def save(res):
        if a.out:
            with open(a.out, "w") as f:
                json.dump(dict(head, **res), f, indent=1)
    save(run(a.layers, names, {s: TILINGS[s] for s in tl}, a.reps, a.calls, a.no_escapes,
             save))


if __name__ == "__main__":
    main()
