"""Would a weight prefetcher on a stream of its own speed up the one-row GEMV chain?

Why (session 33): at batch 1 a layer application takes ~43 us on the H200 against ~25 us of
weight bytes at the copy rate. Every overlap measured so far (docs/performance.md, "Tried,
did not help": L2 prefetch from the consuming kernel or the one before it, PDL, graphs,
grid barriers, counter handovers, persistent chains) was issued by the kernels of the chain
itself, so it only ran while one of them ran and competed with that kernel's own stream.
Here a separate persistent kernel, launched on another CUDA stream and never waited for by
the chain, walks the chain's weights in the order the chain reads them and asks L2 for them
(`cp.async.bulk.prefetch.L2`, one instruction per chunk), staying at most `--lead` MB ahead
of the kernel the chain is running (program 0 of each GEMV writes its index to a progress
word as it starts). DRAM can then stay busy through the chain's gaps, ramps, tails and
prologues, and the GEMVs read what the prefetcher fetched from L2. Prefetches never change
values: every arm must give the first arm's bits.

Like benchmarks.pdl_chain this runs outside JAX, on the GPU machine's PyTorch + Triton: the
four one-row projections of `--layers` layers (1.4B shapes, bf16, distinct weights) x
`--loops`, launched as XLA launches its kernels (PDL, the wait at each kernel's start, no
trigger), captured in one CUDA graph. Arms (`--arms`): `base` (no prefetcher) and
`pf:LEAD_MB:CTAS[:CHUNK_KB]`, either with `+ev`: the GEMVs' weight loads then carry L2's
evict-first policy, so a kernel's own stream of lines it reads once does not push out what
the prefetcher fetched for the kernels after it (session 34). Prints one JSON line per arm
(us per layer application, median of `--repeats` replays) and writes them with the machine
and command to --out.

  python3 -m benchmarks.l2_side_stream --arms base,pf:16:32,pf:32:32,base --out R.json
"""
from __future__ import annotations

import json
import statistics
import sys

from benchmarks.pdl_chain import SHAPES, chain_parser, parse_tiling, save_chain_record
from pallas_kernels.side_prefetch import LANES, schedule, whole_groups

ORDER = ("qkv", "o", "gate_up", "down")
BIG = 1 << 30  # the progress word once the chain has ended: every chunk may go


def split_ev(spec: str) -> tuple[str, bool]:
    """'ARM+ev' -> ('ARM', True): the GEMVs' weight loads evict-first; 'ARM' -> ('ARM', False)."""
    return (spec[:-3], True) if spec.endswith("+ev") else (spec, False)


def parse_arm(spec: str):
    """'base' -> None; 'pf:LEAD_MB:CTAS[:CHUNK_KB]' -> (lead_bytes, ctas, chunk_bytes)."""
    if spec == "base":
        return None
    parts = spec.split(":")
    try:
        if parts[0] != "pf" or len(parts) not in (3, 4):
            raise ValueError
        lead, ctas = float(parts[1]), int(parts[2])
        chunk = int(parts[3]) if len(parts) == 4 else 64
    except ValueError:
        raise SystemExit(f"arm {spec!r}: expected 'base' or 'pf:LEAD_MB:CTAS[:CHUNK_KB]'")
    if lead <= 0 or ctas < 1 or chunk < 1 or (chunk * 1024) % 16:
        raise SystemExit(f"arm {spec!r}: lead, CTAs and chunk must be positive")
    return int(lead * 2 ** 20), ctas, chunk * 1024


def build_kernels():
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_wait

    from benchmarks.pdl_chain import _block_helpers
    _load, _store = _block_helpers()

    # one compile for every kernel index: the graph capture must not meet a new one
    @triton.jit(do_not_specialize=["ki"])
    def gemv(w_ptr, x_ptr, y_ptr, prog_ptr, ki, K: tl.constexpr, KP: tl.constexpr,
             BN: tl.constexpr, PP: tl.constexpr, GATED: tl.constexpr, UP: tl.constexpr,
             NORM: tl.constexpr, POL: tl.constexpr):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        rows = tl.arange(0, BN)
        cols = tl.arange(0, KP)
        gdc_wait()  # as XLA's launch: the wait at the kernel's start
        if pid == 0:
            tl.atomic_xchg(prog_ptr, ki)
        g, u = _load(w_ptr, pid, rows, cols, BN, K, KP, GATED, UP, POL)
        if KP == K:
            x = tl.load(x_ptr + cols).to(tl.float32)
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        if NORM:
            x = x / tl.sqrt(tl.sum(x * x, axis=0) / K + 1e-6)
        for i in tl.static_range(PP - 1):
            g2, u2 = _load(w_ptr, pid + (i + 1) * programs, rows, cols, BN, K, KP, GATED, UP,
                           POL)
            _store(y_ptr, pid + i * programs, g, u, x, rows, BN, GATED)
            g, u = g2, u2
        _store(y_ptr, pid + (PP - 1) * programs, g, u, x, rows, BN, GATED)

    # one bulk prefetch per thread: each of the warp's 32 lanes takes one chunk
    asm = tl.constexpr("cp.async.bulk.prefetch.L2.global [$1], $2;\nmov.u32 $0, 0;")

    @triton.jit
    def prefetcher(addr_ptr, need_ptr, prog_ptr, sink_ptr, n_groups, chunk, V: tl.constexpr):
        # the work list comes in groups of V chunks (padded by the host): one coalesced load
        # of a group's addresses and needs, one wait for the group's largest need
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        lanes = tl.arange(0, V)
        seen = tl.load(prog_ptr, volatile=True)
        acc = tl.zeros((V,), tl.int32) + seen  # the first value it read: did it start early?
        for g in range(pid, n_groups, step):
            need = tl.max(tl.load(need_ptr + g * V + lanes), axis=0)
            while seen < need:
                seen = tl.load(prog_ptr, volatile=True)
            addr = tl.load(addr_ptr + g * V + lanes)
            acc += tl.inline_asm_elementwise(asm, "=r,l,r", [addr, chunk], dtype=tl.int32,
                                             is_pure=False, pack=1)
        tl.store(sink_ptr + pid * V + lanes, acc)

    return gemv, prefetcher


def chain_kernels(layers, loops):
    """The chain's kernels in launch order: (projection, layer weights dict)."""
    return [(name, lw) for _ in range(loops) for lw in layers for name in ORDER]


def run_chain(gemv, kernels, bufs, prog, tiling, evict=False):
    from pallas_kernels._common import next_pow2
    src = bufs["x"]
    for ki, (name, lw) in enumerate(kernels):
        n, k, gated = SHAPES[name]
        bn, pp, warps = tiling[name]
        out = bufs["x"] if name == "down" else bufs[name]
        gemv[(n // (bn * pp),)](lw[name], src, out, prog, ki, K=k, KP=next_pow2(k), BN=bn,
                                PP=pp, GATED=gated, UP=n, NORM=name in ("qkv", "gate_up"),
                                POL="evict_first" if evict else "", num_warps=warps,
                                num_stages=1, launch_pdl=True)
        src = out


def prefetch_tables(torch, kernels, lead, chunk):
    sizes = [lw[name].numel() * lw[name].element_size() for name, lw in kernels]
    work = schedule(sizes, lead, chunk, [2 if SHAPES[name][2] else 1 for name, _ in kernels])
    base = [lw[name].data_ptr() for name, lw in kernels]
    work = whole_groups(work)
    addr = torch.tensor([base[i] + off for i, off, _ in work], dtype=torch.int64, device="cuda")
    need = torch.tensor([need for _, _, need in work], dtype=torch.int32, device="cuda")
    return addr, need


def time_arm(torch, kernels_fns, layers, arm, tiling, args, mb):
    gemv, prefetcher = kernels_fns
    spec, evict = split_ev(arm)
    kernels = chain_kernels(layers, args.loops)
    bufs = {n: torch.zeros(SHAPES[n][0], dtype=torch.bfloat16, device="cuda")
            for n in ("qkv", "o", "gate_up")}
    x0 = torch.randn(2048, device="cuda", generator=torch.Generator(device="cuda")
                     .manual_seed(1)).to(torch.bfloat16)
    bufs["x"] = x0.clone()
    prog = torch.full((1,), -1, dtype=torch.int32, device="cuda")
    # compile (not during the capture), warm
    run_chain(gemv, kernels[:4], bufs, prog, tiling, evict)
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph, stream=s):
            run_chain(gemv, kernels, bufs, prog, tiling, evict)
    torch.cuda.synchronize()
    pf = parse_arm(spec)
    side = torch.cuda.Stream()
    if pf:
        addr, need = prefetch_tables(torch, kernels, pf[0], pf[2])
        sink = torch.zeros(pf[1] * LANES, dtype=torch.int32, device="cuda")
    times, result = [], None
    for rep in range(args.repeats + 1):
        bufs["x"].copy_(x0)
        prog.fill_(-1)
        torch.cuda.synchronize()
        if pf:
            with torch.cuda.stream(side):
                prefetcher[(pf[1],)](addr, need, prog, sink, addr.numel() // LANES, pf[2],
                                         V=LANES, num_warps=1)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        prog.fill_(BIG)  # lets a prefetcher still waiting finish
        torch.cuda.synchronize()
        if rep == 0:
            result = bufs["x"].clone()  # the first replay: its result, untimed (warm-up)
        else:
            times.append(a.elapsed_time(b) * 1e3 / (args.loops * args.layers))
    med = statistics.median(times)
    host = result.double().cpu()
    row = dict(arm=arm, us_per_layer=round(med, 3), us_min=round(min(times), 3),
               us_max=round(max(times), 3), tb_s=round(mb / med, 3),
               result_rms=float(host.pow(2).mean().sqrt()),
               finite=bool(torch.isfinite(host).all()), evict_first=evict)
    if pf:  # first_seen: the progress each prefetcher CTA read first (-1: before the chain)
        first = sink.view(pf[1], LANES)[:, 0].cpu()
        row.update(lead_mb=pf[0] / 2 ** 20, ctas=pf[1], chunk_kb=pf[2] // 1024,
                   chunks=int(addr.numel()), first_seen_min=int(first.min()),
                   first_seen_max=int(first.max()))
    del graph
    return row, result


def main(argv=None):
    ap = chain_parser(__doc__, "base,pf:16:32,pf:32:32,pf:16:8,base")
    args = ap.parse_args(argv)
    arms = args.arms.split(",")
    for a in arms:
        parse_arm(split_ev(a)[0])
    tiling = parse_tiling(args.tiling)
    import torch

    from benchmarks.pdl_chain import make_layers
    fns = build_kernels()
    layers = make_layers(torch, args.layers)
    mb = sum(w.numel() * 2 for lw in layers for w in lw.values()) / args.layers / 1e6
    rows, ref = [], None
    for arm in arms:
        row, result = time_arm(torch, fns, layers, arm, tiling, args, mb)
        ref = result if ref is None else ref
        row["bit_equal_to_first_arm"] = bool(torch.equal(result, ref))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if not save_chain_record("benchmarks.l2_side_stream", argv, args, torch, mb, tiling,
                             rows):
        print("ERROR: an arm's result differs from the first arm's, or is not finite",
              file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
