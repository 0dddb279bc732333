"""What programmatic dependent launch (PDL) would buy the one-row GEMV chain if a kernel could
request its weights *before* waiting on the kernel ahead of it (docs/performance.md, "Not yet
done": XLA puts PDL's wait at every kernel's start, so our Pallas kernels cannot).

This runs outside JAX, on the GPU machine's own PyTorch + Triton (python3 there): a Triton
GEMV written like pallas_kernels/gemv_stream.py's (x loaded once per program, a program's
blocks p, p + programs, ..., the next block's weights requested before the math on the
current one; SiLU(gate) * up for gate/up), chained as a decoder layer's four projections
(qkv -> o -> gate/up -> down -> the next layer's qkv) over `--layers` layers of distinct
weights (1.4B shapes, bf16, no L2 reuse), `--loops` times, captured in one CUDA graph so that
host launch cost is out of the figure. Arms (`--arms`):

  plain        no PDL: each kernel starts when the one ahead has ended.
  wait_first   PDL launch, griddepcontrol.wait at the kernel's start, trigger at the start
               (session 10's early trigger under XLA's wait).
  xla_like     PDL launch, the wait at the start, no trigger (the kernel ahead lets the next
               one launch only as it ends): what XLA does with its kernels today.
  weights_first PDL launch; each program requests its first weight block, then waits, then
               reads x (the previous kernel's output) and computes; trigger at the start.
  weights_late as weights_first, the trigger once the program's last block is requested.
  weights_only as weights_first with no trigger: the early weight requests alone, against
               xla_like (what they would add to XLA's own PDL launches).

qkv and gate/up RMS-normalise their input (as the engine's prologues do), so values stay O(1)
and every arm must give the same bits as the first (same math, same order); the run fails if
not, or if the result is zero or not finite. (Session 25's recorded runs predate the norm:
their values had decayed to ~0, so their bit checks were weak; their timings stand.)
Prints one JSON line per arm (us per layer application: the four GEMVs, median of
`--repeats` graph replays) and writes them with the machine and command to --out.

  python3 -m benchmarks.pdl_chain --out benchmarks/results/pdl_chain_h200.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from pallas_kernels._common import next_pow2

# qkv, o, gate/up (gated: 2 x 5632 rows), down at the 1.4B shape: (n_out, K, gated)
SHAPES = {"qkv": (6144, 2048, False), "o": (2048, 2048, False),
          "gate_up": (5632, 2048, True), "down": (2048, 5632, False)}
# The engine's one-row streaming tilings up to session 30 (ouro_jax/projection_tuning.
# STREAM_TUNING then; since session 31 qkv and gate/up read K in one 2048-wide block at 8
# warps): (block_n, per_program, num_warps)
TILING = {"qkv": (4, 4, 4), "o": (2, 2, 4), "gate_up": (2, 8, 4), "down": (1, 4, 4)}
# arm: (MODE: 0 no wait, 1 wait at the start, 2 wait after the first weight block;
#       LATE: 0 trigger at the start, 1 once the last block is requested, 2 no trigger)
MODES = {"plain": (0, 0), "wait_first": (1, 0), "xla_like": (1, 2), "weights_first": (2, 0),
         "weights_late": (2, 1), "weights_only": (2, 2)}


def _block_helpers():
    """The GEMV's block load and block store as Triton device functions."""
    import triton
    import triton.language as tl

    @triton.jit
    def _load(w_ptr, j, rows, cols, BN: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
              GATED: tl.constexpr, UP: tl.constexpr, POL: tl.constexpr):
        # POL: the weight loads' L2 eviction policy ("" the default, or "evict_first")
        r = j * BN + rows
        if KP == K:  # no mask: the loads vectorise
            g = tl.load(w_ptr + r[:, None] * K + cols[None, :], eviction_policy=POL)
            if GATED:
                u = tl.load(w_ptr + (UP + r)[:, None] * K + cols[None, :],
                            eviction_policy=POL)
            else:
                u = g
        else:
            mask = cols[None, :] < K
            g = tl.load(w_ptr + r[:, None] * K + cols[None, :], mask=mask, other=0.0,
                        eviction_policy=POL)
            if GATED:
                u = tl.load(w_ptr + (UP + r)[:, None] * K + cols[None, :], mask=mask,
                            other=0.0, eviction_policy=POL)
            else:
                u = g
        return g, u

    @triton.jit
    def _store(y_ptr, j, g, u, x, rows, BN: tl.constexpr, GATED: tl.constexpr):
        a = tl.sum(g.to(tl.float32) * x[None, :], axis=1)
        if GATED:
            b = tl.sum(u.to(tl.float32) * x[None, :], axis=1)
            a = a.to(tl.bfloat16).to(tl.float32)
            b = b.to(tl.bfloat16).to(tl.float32)
            out = (a * tl.sigmoid(a) * b).to(tl.bfloat16)
        else:
            out = a.to(tl.bfloat16)
        tl.store(y_ptr + j * BN + rows, out)

    return _load, _store


def build_kernel():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _load, _store = _block_helpers()
    pol = tl.constexpr("")  # the weight loads' default L2 policy

    @triton.jit
    def gemv(w_ptr, x_ptr, y_ptr, K: tl.constexpr, KP: tl.constexpr, BN: tl.constexpr,
             PP: tl.constexpr, GATED: tl.constexpr, UP: tl.constexpr, MODE: tl.constexpr,
             LATE: tl.constexpr, NORM: tl.constexpr):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        rows = tl.arange(0, BN)
        cols = tl.arange(0, KP)
        if MODE == 1:
            gdc_wait()
        if MODE != 0 and LATE == 0:
            gdc_launch_dependents()
        g, u = _load(w_ptr, pid, rows, cols, BN, K, KP, GATED, UP, pol)
        if MODE == 2:
            gdc_wait()  # only x depends on the kernel ahead; the weights were requested above
        if KP == K:
            x = tl.load(x_ptr + cols).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        if NORM:  # the input's RMS norm, as the engine's qkv and gate/up prologues: keeps the
            # chain's values O(1) over 96 layer applications, so the bit checks mean something
            x = x / tl.sqrt(tl.sum(x * x, axis=0) / K + 1e-6)
        for i in tl.static_range(PP - 1):
            g2, u2 = _load(w_ptr, pid + (i + 1) * programs, rows, cols, BN, K, KP, GATED,
                           UP, pol)
            if LATE == 1 and i == PP - 2:
                gdc_launch_dependents()
            _store(y_ptr, pid + i * programs, g, u, x, rows, BN, GATED)
            g, u = g2, u2
        if LATE == 1 and PP == 1:
            gdc_launch_dependents()
        _store(y_ptr, pid + (PP - 1) * programs, g, u, x, rows, BN, GATED)

    return gemv


def make_layers(torch, n_layers, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layers = []
    for _ in range(n_layers):
        lw = {}
        for name, (n, k, gated) in SHAPES.items():
            rows = 2 * n if gated else n
            lw[name] = (torch.randn(rows, k, generator=gen, device="cuda") * k ** -0.5
                        ).to(torch.bfloat16)
        layers.append(lw)
    return layers


def run_chain(torch, gemv, layers, bufs, loops, mode, tiling):
    wait, late = MODES[mode]
    pdl = wait != 0
    for _ in range(loops):
        for lw in layers:
            src = bufs["x"]
            for name in ("qkv", "o", "gate_up", "down"):
                n, k, gated = SHAPES[name]
                bn, pp, warps = tiling[name]
                grid = (n // (bn * pp),)
                out = bufs["x"] if name == "down" else bufs[name]
                kw = dict(num_warps=warps, num_stages=1)
                if pdl:
                    kw["launch_pdl"] = True
                gemv[grid](lw[name], src, out, K=k, KP=next_pow2(k), BN=bn, PP=pp,
                           GATED=gated, UP=n, MODE=wait, LATE=late,
                           NORM=name in ("qkv", "gate_up"), **kw)
                src = out


def parse_tiling(spec: str) -> dict:
    """TILING with --tiling's overrides (name=block_n:per_program:num_warps,...)."""
    tiling = dict(TILING)
    for item in filter(None, spec.split(",")):
        name, _, val = item.partition("=")
        if name not in tiling:
            raise SystemExit(f"unknown projection {name!r} in --tiling; choose from "
                             f"{sorted(TILING)}")
        try:
            bn, pp, w = (int(v) for v in val.split(":"))
        except ValueError:
            raise SystemExit(f"--tiling {item!r}: expected {name}=block_n:per_program:num_warps")
        n = SHAPES[name][0]
        if min(bn, pp, w) < 1 or n % (bn * pp):
            raise SystemExit(f"{name}: {n} rows are not a multiple of block_n*per_program "
                             f"({bn}*{pp})")
        tiling[name] = (bn, pp, w)
    return tiling


def chain_parser(doc: str, default_arms: str) -> argparse.ArgumentParser:
    """The options both PDL chain benchmarks take (this one and benchmarks.pdl_jax_chain)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--loops", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--arms", default=default_arms)
    ap.add_argument("--out", default="")
    ap.add_argument("--tiling", default="",
                    help="overrides, e.g. qkv=4:4:4,down=1:8:4 (block_n:per_program:warps)")
    return ap


def parse_arms(spec: str, valid) -> list[str]:
    arms = spec.split(",")
    bad = [a for a in arms if a not in valid]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; choose from {sorted(valid)}")
    return arms


def main(argv=None):
    ap = chain_parser(__doc__, "plain,xla_like,weights_only,weights_late,wait_first,plain")
    args = ap.parse_args(argv)
    arms = parse_arms(args.arms, MODES)
    tiling = parse_tiling(args.tiling)
    import torch  # the GPU machine's PyTorch and Triton (not the project's dependencies)
    gemv = build_kernel()
    layers = make_layers(torch, args.layers)
    mb = sum(w.numel() * 2 for lw in layers for w in lw.values()) / args.layers / 1e6
    rows = []
    ref = None
    for arm in arms:
        row, result = time_arm(torch, gemv, layers, arm, tiling, args, mb)
        if ref is None:
            ref = result
        row["bit_equal_to_first_arm"] = same = bool(torch.equal(result, ref))
        print(json.dumps(row), flush=True)
        rows.append(row)
        if not same:
            print(f"ERROR: arm {arm} differs from arm {arms[0]}", file=sys.stderr)
    if not save_chain_record("benchmarks.pdl_chain", argv, args, torch, mb, tiling, rows):
        raise SystemExit(1)


def tiling_record(tiling: dict) -> dict:
    """A TILING table as the records write it: {projection: {block_n, per_program,
    num_warps}}."""
    return {k: dict(zip(("block_n", "per_program", "num_warps"), v)) for k, v in tiling.items()}


def torch_fields(torch) -> dict:
    """The PyTorch + Triton benchmarks' record fields (their versions and the device), with
    JAX kept off the GPU's memory: save_record only reads the device name through it."""
    import triton
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    return dict(torch=torch.__version__, torch_device=torch.cuda.get_device_name(),
                triton=triton.__version__)


def save_chain_record(module, argv, args, torch, mb, tiling, rows) -> bool:
    """Writes a chain benchmark's record (command, machine, commit, code digest, rows) to
    args.out; True when every arm gave the first arm's bits, finite and nonzero."""
    from benchmarks.record import save_record
    save_record(module, argv, args.out, **torch_fields(torch), layers=args.layers,
                loops=args.loops, mb_per_layer=mb, tiling=tiling_record(tiling), rows=rows)
    return all(r["bit_equal_to_first_arm"] and r["finite"] and r["result_rms"] > 0
               for r in rows)


def time_replays(torch, graph, repeats: int, per: int) -> list[float]:
    """us per unit of each of `repeats` replays of a CUDA graph that runs `per` units, timed
    by CUDA events."""
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per)
    return times


def time_arm(torch, gemv, layers, arm, tiling, args, mb):
    """One arm's chain captured in a CUDA graph, run once for its result and --repeats times
    timed; returns (row, result)."""
    bufs = {n: torch.zeros(SHAPES[n][0], dtype=torch.bfloat16, device="cuda")
            for n in ("qkv", "o", "gate_up")}
    x0 = torch.randn(2048, device="cuda", generator=torch.Generator(device="cuda")
                     .manual_seed(1)).to(torch.bfloat16)
    bufs["x"] = x0.clone()
    run_chain(torch, gemv, layers, bufs, 1, arm, tiling)  # compile, warm
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        bufs["x"].copy_(x0)
        with torch.cuda.graph(graph, stream=s):
            run_chain(torch, gemv, layers, bufs, args.loops, arm, tiling)
    torch.cuda.synchronize()
    bufs["x"].copy_(x0)
    graph.replay()
    torch.cuda.synchronize()
    result = bufs["x"].clone()
    times = time_replays(torch, graph, args.repeats, args.loops * args.layers)
    med = statistics.median(times)
    host = result.double().cpu()  # fp64 on the host: no flush of tiny values to zero
    row = dict(arm=arm, us_per_layer=round(med, 3), us_min=round(min(times), 3),
               us_max=round(max(times), 3), tb_s=round(mb / med, 3),
               result_rms=float(host.pow(2).mean().sqrt()),
               finite=bool(torch.isfinite(host).all()))
    del graph
    return row, result


if __name__ == "__main__":
    main()
