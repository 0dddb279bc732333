"""Kernel-level profile of whole generate calls: what runs on the GPU and how busy it is.

    python -m benchmarks.kernel_trace --synthetic 1.4b --batch 1,64 --k 0,4 --out trace.json

Each configuration is warmed up (compiles excluded), then one `generate` call runs under
`jax.profiler.trace`. The device events of the trace are read back with
`jax.profiler.ProfileData` (no TensorBoard needed) and summarised:
- kernels launched per decode step (or per speculative round) and their summed time, counted
  over the whole call (the prefill's kernels and memcpys are included, spread over the units);
- the GPU's busy time (union of kernel intervals) against the span of the call's device
  events, which separates "kernels are slow" from "the GPU waits for launches";
- the top kernels by total time, grouped by name, with bytes/s where a GEMM's name says
  nothing about size (we only report time and counts; no hardware counters on this machine).

`--minus-prefill` also traces the same prompts at max_tokens=1 (the prefill and its first
token alone) and subtracts that call's kernels, name by name, from the main call's: a
`decode_only` table per row, without the prefill's share. At batch 64 that share is large
(the prefill's 8,192 rows of GEMMs are compute-bound), and in the batch-invariant mode the
prefill runs the same Pallas kernels as decode under the same names, so only the
subtraction can tell them apart. The max_tokens=1 call may be another compiled program
(its block table is sized for fewer tokens), so an XLA fusion may carry another number
there: names that call ran more often than the main one are listed in `negative`, and a
prefill fusion renamed that way would stay in the decode table. Check `negative` first.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import glob
import json
import re
import sys
import tempfile

import jax
import numpy as np


def _event_stats(ev) -> dict:
    """An event's profiler stats (bytes, memcpy details) as plain values, where readable."""
    try:
        return {str(k): (v if isinstance(v, (int, float, str)) else str(v)) for k, v in ev.stats}
    except Exception:  # noqa: BLE001 - stats are best effort; names and times are what count
        return {}


def device_events(xspace_path: str, lines_seen: list | None = None,
                  memcpy_stats: list | None = None) -> list[tuple[str, float, float]]:
    """(name, start_ns, duration_ns) of every event on a GPU device plane's kernel lines.
    `lines_seen` collects (plane, line, events) for every device line, kept or not;
    `memcpy_stats` the stats of the 8 longest memcpy events (what is copied, how many bytes,
    which HLO op of which module): a long device-to-device copy is usually a donation that
    did not hold."""
    pd = jax.profiler.ProfileData.from_file(xspace_path)
    out = []
    for plane in pd.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            # Stream lines hold kernels and memcpys; skip the per-op/XLA-module summary lines,
            # which would double count.
            lname = line.name.lower()
            if lines_seen is not None:
                lines_seen.append((plane.name, line.name, len(list(line.events))))
            if "stream" not in lname or "xla" in lname:
                continue
            for ev in line.events:
                out.append((ev.name, float(ev.start_ns), float(ev.duration_ns)))
                if memcpy_stats is not None and ev.name.startswith("Memcpy"):
                    memcpy_stats.append({**_event_stats(ev), "name": ev.name,
                                         "us": ev.duration_ns / 1e3})
                    memcpy_stats.sort(key=lambda m: -m["us"])
                    del memcpy_stats[8:]
    return out


def busy_ns(events) -> float:
    """Length of the union of the events' intervals."""
    spans = sorted((s, s + d) for _, s, d in events)
    total, cur_s, cur_e = 0.0, None, None
    for s, e in spans:
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def kernel_kind(name: str) -> str:
    """A kernel name without XLA's instance number: 'input_scatter_fusion_47' and
    'input_scatter_fusion_8' are one kind. XLA compiles one kernel per distinct fusion, so a
    fusion that differs per layer (a constant baked in) appears under 24 names that each run
    a few times per step and none of which reaches the top by name; grouped, it does."""
    return re.sub(r"[_.]\d+$", "", name)


def _table(groups: dict, units: int, kernel_ns: float, top: int) -> list[dict]:
    rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
    return [{"name": n[:160], "count": c, "per_unit": c / units, "total_ms": t / 1e6,
             "mean_us": t / c / 1e3, "share": t / kernel_ns} for n, (c, t) in rows[:top]]


def memcpy_neighbours(events, limit: int = 6) -> list[dict]:
    """The kernels launched just before and after the longest memcpys: a whole-buffer copy
    inside a program shows up as a memcpy between two of its kernels, which says where in
    the program it sits (then read the dumped HLO for its copy instruction)."""
    order = sorted(events, key=lambda e: e[1])
    idx = [i for i, e in enumerate(order) if e[0].startswith("Memcpy")]
    idx.sort(key=lambda i: -order[i][2])
    out = []
    for i in idx[:limit]:
        out.append({"name": order[i][0], "us": order[i][2] / 1e3,
                    "before": [e[0] for e in order[max(0, i - 3):i]],
                    "after": [e[0] for e in order[i + 1:i + 4]]})
    return out


def _groups(events, key=lambda n: n) -> dict:
    out = collections.defaultdict(lambda: [0, 0.0])
    for name, _, d in events:
        out[key(name)][0] += 1
        out[key(name)][1] += d
    return out


def subtract(events, base_events, units: int, top: int = 25) -> dict:
    """Per-name kernel counts and times of `events` less those of `base_events` (the same
    prompts' prefill alone), per unit. Names the base ran more often than the main call
    (none should) are reported in `negative`, not hidden."""
    out: dict = {"units": units}
    for title, key in (("top", lambda n: n), ("top_kinds", kernel_kind)):
        main, base = _groups(events, key), _groups(base_events, key)
        diff = {n: [main.get(n, (0, 0.0))[0] - base.get(n, (0, 0.0))[0],
                    main.get(n, (0, 0.0))[1] - base.get(n, (0, 0.0))[1]]
                for n in set(main) | set(base)}
        pos = {n: ct for n, ct in diff.items() if ct[0] > 0 and ct[1] > 0}
        if title == "top":
            total = sum(t for _, t in pos.values())
            out["kernels_per_unit"] = sum(c for c, _ in pos.values()) / units
            out["kernel_sum_per_unit_us"] = total / units / 1e3
            out["negative"] = sorted(n for n, (c, _) in diff.items() if c < 0)[:20]
            out["base_kernels"] = len(base_events)
        out[title] = _table(pos, units, max(total, 1e-9), top)
    return out


def summarize(events, units: int, top: int = 25) -> dict:
    if not events:
        return {"error": "no GPU events in the trace (CPU run, or the profiler saw no device)"}
    start = min(s for _, s, _ in events)
    end = max(s + d for _, s, d in events)
    by_name, by_kind = _groups(events), _groups(events, kernel_kind)
    kernel_ns = max(sum(d for _, _, d in events), 1e-9)
    span = max(end - start, 1e-9)
    return {
        "units": units,
        "kernels": len(events),
        "kernels_per_unit": len(events) / units,
        "span_ms": (end - start) / 1e6,
        "busy_ms": busy_ns(events) / 1e6,
        "kernel_sum_ms": kernel_ns / 1e6,
        "busy_fraction": busy_ns(events) / span,
        "per_unit_span_us": (end - start) / units / 1e3,
        "per_unit_busy_us": busy_ns(events) / units / 1e3,
        "top": _table(by_name, units, kernel_ns, top),
        "top_kinds": _table(by_kind, units, kernel_ns, top),
        "memcpy_neighbours": memcpy_neighbours(events),
    }


def _traced(llm, prompts, sps, spec, lines: list | None = None,
            memcpys: list | None = None):
    """One warm generate call under the profiler: (result, device events)."""
    llm.generate(prompts, sps, speculative=spec)  # compile + warm
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            res = llm.generate(prompts, sps, speculative=spec)
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        return res, (device_events(files[0], lines, memcpys) if files else [])


def trace_generate(llm, batch, k, args) -> dict:
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    rng = np.random.default_rng(batch)
    prompts = [[int(t) for t in rng.integers(1, llm.cfg.vocab_size, args.prompt_len)]
               for _ in range(batch)]
    sps = [SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)] * batch
    spec = (SpeculativeConfig(k, args.draft_loops, rounds_per_fetch=args.new_tokens,
                              pipelined=args.pipelined) if k else None)
    if spec is not None and spec.pipelined:  # (one fetch per call, as for rounds)
        from ouro_jax.pipelined import ticks_for
        spec = dataclasses.replace(spec, rounds_per_fetch=ticks_for(args.new_tokens, spec,
                                                                    llm.cfg))
    lines: list = []
    memcpys: list = []
    res, events = _traced(llm, prompts, sps, spec, lines, memcpys)
    # Rounds the device ran: every row rounds in lockstep until the last is done, so the
    # longest row's count (stats.spec["rounds"] sums over rows).
    units = max(o.spec["rounds"] for o in res.outputs) if k else args.new_tokens - 1
    row = {"batch": batch, "k": k, "pipelined": args.pipelined,
           "unit": ("tick" if args.pipelined else "round") if k else "decode step",
           "decode_tok_s": res.stats.decode_tok_s}
    row.update(summarize(events, max(1, units)))
    row["device_lines"] = lines
    row["memcpy_stats"] = memcpys
    if args.minus_prefill:
        # the prefill and the first token alone: max_tokens=1 stops before any decode step
        # or round, so what it launches is the main call's prefill share
        one = [SamplingParams(max_tokens=1, ignore_eos=True)] * batch
        _, base = _traced(llm, prompts, one, spec)
        row["decode_only"] = subtract(events, base, max(1, units), args.top)
    return row


def main(argv=None) -> int:
    from benchmarks.decode import add_model_args
    from benchmarks.tuning import add_stream_args, apply_kernel_tuning, check_graph_pdl

    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernel_trace", description=__doc__)
    add_model_args(ap)
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--k", default="0,4", help="0 = native; >0 = speculative")
    ap.add_argument("--draft-loops", type=int, default=2, help="the draft's loops (d)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--unroll-loops", action="store_true")
    ap.add_argument("--pipelined", action="store_true",
                    help="speculative runs (k=1) as pipelined self-speculation "
                         "(ouro_jax.pipelined); the unit is then a tick")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--minus-prefill", action="store_true",
                    help="also trace the prefill alone (max_tokens=1) and report the "
                         "kernels per unit without it (decode_only)")
    ap.add_argument("--decode-kernel", default="", metavar="K=V,...",
                    help="the decode kernel's tuning overrides, as benchmarks.decode takes "
                         "them (e.g. fuse_o=1)")
    add_stream_args(ap)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    check_graph_pdl(args)
    apply_kernel_tuning(args.decode_kernel, "", l2_spec=args.l2_prefetch,
                        l2_next_spec=args.l2_next,
                        l2_next_at=args.l2_next_at, stream_set=args.stream_set,
                        graph_pdl=args.graph_pdl)
    try:
        return _main(args, argv)
    finally:
        apply_kernel_tuning("", "")


def _main(args, argv) -> int:
    from benchmarks.decode import engine_for, save_record

    llm = engine_for(args, args.new_tokens, args.unroll_loops)
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        for k in [int(x) for x in args.k.split(",")]:
            row = trace_generate(llm, b, k, args)
            rows.append(row)
            head = {kk: (round(v, 3) if isinstance(v, float) else v)
                    for kk, v in row.items() if kk not in ("top", "top_kinds", "device_lines",
                                                           "memcpy_neighbours", "memcpy_stats",
                                                           "decode_only")}
            print(json.dumps(head), flush=True)
            tables = [(t, row) for t in ("top", "top_kinds")]
            if "decode_only" in row:
                dec = row["decode_only"]
                print(f"  decode only: {dec['kernels_per_unit']:.1f} kernels, "
                      f"{dec['kernel_sum_per_unit_us']:.1f} us of kernels per unit "
                      f"(less {dec['base_kernels']} prefill kernels; negative: "
                      f"{dec['negative']})", flush=True)
                tables += [(t, dec) for t in ("top", "top_kinds")]
            for title, src in tables:
                print(f"  {title}{' (decode only)' if src is not row else ''}:", flush=True)
                for t in src.get(title, [])[:args.top]:
                    print(f"   {t['share']:6.1%} {t['per_unit']:7.1f}/unit {t['mean_us']:8.1f} us"
                          f"  {t['name'][:110]}", flush=True)
            for mc in row.get("memcpy_neighbours", [])[:3]:
                print(f"  {mc['name']} {mc['us']:.1f} us after {mc['before'][-1:]} before "
                      f"{mc['after'][:1]}", flush=True)
    save_record("benchmarks.kernel_trace", argv, args.out, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
