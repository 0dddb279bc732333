"""How fast is each one-row projection when its weights are already in L2?

Why (session 34): the weight prefetcher on a stream of its own (benchmarks.l2_side_stream)
ran alongside the chain on an H100 and gained nothing (pf:24:16 0.9% under the first base,
level with the pair of bases). Before any other L2 route is built, this puts a ceiling on
all of them: for each projection, a CUDA graph of --calls launches of the one-row GEMV,
launched as XLA launches them (PDL, the wait at each kernel's start), on

  cold: --distinct copies of the same weights taken in turn (far more bytes than L2
        holds, so every launch reads DRAM);
  hot:  one copy every time (the launch before left it in L2, where it fits);
  pfd:  before each launch, a kernel that asks L2 for that launch's copy
        (`cp.async.bulk.prefetch.L2`, one 64 KB chunk per lane) and a --delay-us spin
        for the requests to land; pfd0 is the same without the GEMV, so pfd - pfd0 is the
        GEMV's time on weights another kernel prefetched (does the mechanism work?).

The copies hold the same values, so every launch of every arm must give the same bits.
`hot` minus `cold` per call is the most that any L2 prefetch, from any stream, could save
on that kernel; if it is small, the per-call cost is the kernel's own (ramp, first
requests, tail), not DRAM's. Prints one JSON line per arm and a summary (the saving per
layer application, qkv + o + gate/up + down, and the GEMV after a prefetch), and writes
them to --out.

  python3 -m benchmarks.gemv_l2_hot --tiling qkv=4:4:8,gate_up=2:8:8 --out R.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

from benchmarks.pdl_chain import (MODES, SHAPES, parse_tiling, tiling_record, time_replays,
                                  torch_fields)

ARMS = ("cold", "hot", "pfd", "pfd0")
CHUNK = 64 << 10  # bytes per bulk prefetch
LANES = 32  # chunks per prefetch program (one warp, one chunk a lane)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--projections", default="qkv,o,gate_up,down")
    ap.add_argument("--calls", type=int, default=96, help="launches per graph replay")
    ap.add_argument("--distinct", type=int, default=24, help="weight copies in the cold arm")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--tiling", default="",
                    help="overrides, e.g. qkv=4:4:8 (block_n:per_program:warps)")
    ap.add_argument("--delay-us", type=float, default=30.0,
                    help="the pfd arms' spin after each prefetch")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    names = args.projections.split(",")
    bad = [n for n in names if n not in SHAPES]
    if bad:
        ap.error(f"unknown projection(s) {bad}; choose from {sorted(SHAPES)}")
    if args.calls < 2 or args.distinct < 2 or args.repeats < 1 or args.delay_us <= 0:
        ap.error("--calls and --distinct must be at least 2, --repeats at least 1, "
                 "--delay-us positive")
    args.names = names
    return args


def summarize(rows):
    """Per projection hot - cold (us per call) and their sum over one layer application."""
    by = {(r["projection"], r["arm"]): r["us_per_call"] for r in rows}
    saving = {n: round(by[(n, "cold")] - by[(n, "hot")], 3)
              for n in dict.fromkeys(r["projection"] for r in rows)
              if (n, "cold") in by and (n, "hot") in by}
    after_pf = {n: round(by[(n, "pfd")] - by[(n, "pfd0")], 3)
                for n in dict.fromkeys(r["projection"] for r in rows)
                if (n, "pfd") in by and (n, "pfd0") in by}
    return {"saving_us_per_call": saving,
            "saving_us_per_layer_application": round(sum(saving.values()), 3),
            "gemv_after_prefetch_us": after_pf}


def build_helpers():
    """The pfd arms' two kernels: the L2 prefetch of one weight copy and the spin."""
    import triton
    import triton.language as tl
    pf_asm = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;")
    clock = tl.constexpr("mov.u64 $0, %globaltimer;")

    @triton.jit
    def prefetch(base, sink_ptr, chunk, V: tl.constexpr):
        pid = tl.program_id(0)
        lanes = tl.arange(0, V)
        addr = base + (pid * V + lanes).to(tl.int64) * chunk
        r = tl.inline_asm_elementwise(pf_asm, "=r,l,r", [addr, chunk], dtype=tl.int32,
                                      is_pure=False, pack=1)
        tl.store(sink_ptr + pid * V + lanes, r)

    @triton.jit
    def spin(sink_ptr, ns, V: tl.constexpr):
        z = tl.zeros((V,), tl.int32)
        t0 = tl.inline_asm_elementwise(clock, "=l,r", [z], dtype=tl.int64, is_pure=False,
                                       pack=1)
        t = t0
        while tl.min(t - t0, axis=0) < ns:
            t = tl.inline_asm_elementwise(clock, "=l,r", [z], dtype=tl.int64, is_pure=False,
                                          pack=1)
        tl.store(sink_ptr + tl.arange(0, V), (t - t0).to(tl.int32))

    return prefetch, spin


def time_arm(torch, kernels, name, copies, x, arm, tiling, args):
    """--calls launches in one CUDA graph, replayed --repeats times; (row, output)."""
    n, k, gated = SHAPES[name]
    bn, pp, warps = tiling[name]
    out = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    wait, late = MODES["xla_like"]
    from pallas_kernels._common import next_pow2
    gemv, prefetch, spin = kernels
    sink = torch.zeros(max(copies[0].numel() * 2 // CHUNK, LANES), dtype=torch.int32,
                       device="cuda")

    def launch(i):
        w = copies[0] if arm == "hot" else copies[i % len(copies)]
        if arm in ("pfd", "pfd0"):
            chunks = w.numel() * 2 // CHUNK
            prefetch[(chunks // LANES,)](w.data_ptr(), sink, CHUNK, V=LANES, num_warps=1)
            spin[(1,)](sink, int(args.delay_us * 1e3), V=LANES, num_warps=1)
            if arm == "pfd0":
                return
        gemv[(n // (bn * pp),)](w, x, out, K=k, KP=next_pow2(k), BN=bn, PP=pp, GATED=gated,
                                UP=n, MODE=wait, LATE=late, NORM=name in ("qkv", "gate_up"),
                                num_warps=warps, num_stages=1, launch_pdl=True)

    launch(0)  # compile
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        for i in range(args.calls):
            launch(i)
    torch.cuda.synchronize()
    graph.replay()  # warm
    torch.cuda.synchronize()
    times = time_replays(torch, graph, args.repeats, args.calls)
    med = statistics.median(times)
    mb = copies[0].numel() * 2 / 1e6
    l2_mb = torch.cuda.get_device_properties(0).L2_cache_size / 1e6
    row = dict(projection=name, arm=arm, us_per_call=round(med, 3),
               us_min=round(min(times), 3), us_max=round(max(times), 3), mb=round(mb, 3),
               tb_s=round(mb / med, 3), l2_mb=round(l2_mb, 1),
               # above ~0.6 of L2, `hot` is only partly hot (gate/up's 46 MB in 50 MB): its
               # saving is a lower bound
               fits_l2=bool(mb < 0.6 * l2_mb))
    del graph
    return row, out.clone()


def main(argv=None):
    args = parse_args(argv)
    tiling = parse_tiling(args.tiling)
    import torch  # the GPU machine's PyTorch and Triton (not the project's dependencies)

    from benchmarks.pdl_chain import build_kernel
    kernels = (build_kernel(),) + build_helpers()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, ok = [], True
    for name in args.names:
        n, k, gated = SHAPES[name]
        w = (torch.randn(2 * n if gated else n, k, generator=gen, device="cuda")
             * k ** -0.5).to(torch.bfloat16)
        if (w.numel() * 2) % (CHUNK * LANES):
            raise SystemExit(f"{name}: {w.numel() * 2} bytes are not whole prefetch groups")
        copies = [w] + [w.clone() for _ in range(args.distinct - 1)]
        x = torch.randn(k, generator=gen, device="cuda").to(torch.bfloat16)
        outs = {}
        for arm in ARMS:
            row, outs[arm] = time_arm(torch, kernels, name, copies, x, arm, tiling, args)
            if arm != "pfd0":  # (no GEMV: its output stays zero)
                row["finite"] = bool(torch.isfinite(outs[arm].float()).all())
                row["bit_equal_to_cold"] = same = bool(torch.equal(outs[arm], outs["cold"]))
                if not same:
                    ok = False
                    print(f"ERROR: {name}: {arm} and cold outputs differ", file=sys.stderr)
            rows.append(row)
            print(json.dumps(row), flush=True)
        del copies, w
        torch.cuda.empty_cache()
    summary = summarize(rows)
    print(json.dumps(summary), flush=True)
    from benchmarks.record import save_record
    save_record("benchmarks.gemv_l2_hot", argv, args.out, **torch_fields(torch),
                calls=args.calls, distinct=args.distinct, tiling=tiling_record(tiling),
                rows=rows, **summary)
    if not (ok and all(r.get("finite", True) for r in rows)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
