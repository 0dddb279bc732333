"""A readable summary of an Nsight Compute report exported as CSV (`ncu --import R.ncu-rep
--csv --page raw > R_raw.csv`), one line per profiled kernel: duration, DRAM bytes and
throughput, achieved occupancy, registers, grid, and where its warps stall (the sampled
stall reasons, as shares of all samples).

    python -m benchmarks.ncu_summary benchmarks/results/ncu_b1_session29_h200_raw.csv
    python -m benchmarks.ncu_summary R_raw.csv --json out.json   # also {"source", "kernels"}

The raw page has a header row of metric names, a row of units, then a row per kernel.
Metrics a report lacks are left out of its lines (they depend on ncu's version and set)."""
from __future__ import annotations

import argparse
import csv
import json
import re

# (label, metric names in order of preference, None); the sections ncu collects decide which
# of a label's names a report has. dram_MB counts reads and writes (dram__bytes.sum, or the
# per-second rate that SpeedOfLight alone gives times the duration); dram_read_MB, where the
# report has it (--set full), the reads alone.
FIELDS = (
    ("us", "gpu__time_duration.sum", None),
    ("dram_MB", "dram__bytes.sum", None),
    ("dram_read_MB", "dram__bytes_read.sum", None),
    ("dram_TB_s", "dram__bytes.sum.per_second", None),
    ("dram_pct", ("dram__throughput.avg.pct_of_peak_sustained_elapsed",
                  "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"), None),
    ("occupancy_pct", "sm__warps_active.avg.pct_of_peak_sustained_active", None),
    ("registers", "launch__registers_per_thread", None),
    ("grid", "launch__grid_size", None),
    ("block", "launch__block_size", None),
    ("waves", "launch__waves_per_multiprocessor", None),
)
# the sampled stall counters (SourceCounters / --set full) or WarpStateStats' averages
STALL = re.compile(r"^smsp__(?:pcsamp_warps_issue_stalled_([a-z_]+)|average_warps?_(?:latency_)?"
                   r"issue_stalled_([a-z_]+?)_per_(?:warp|issue)_active\.ratio)$")
# ncu's unit strings: the raw page says "us" (session 30's ncu), others "usecond"; a unit not
# listed is an error, not a silent 1.0
TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
         "second": 1e6, "s": 1e6}
TO_MB = {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}
TO_TB_S = {"byte/s": 1e-12, "Kbyte/s": 1e-9, "Mbyte/s": 1e-6, "Gbyte/s": 1e-3, "Tbyte/s": 1.0}


def _num(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def read(path: str) -> list[dict]:
    """One dict per kernel: name, the FIELDS found, and `stalls` {reason: share}."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    # ncu may print its own lines (==PROF==...) before the table
    start = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
    if start is None or start + 1 >= len(rows):
        raise SystemExit(f"{path}: no ncu raw-page table (a 'Kernel Name' header and a units "
                         f"row); export it with ncu --import R.ncu-rep --csv --page raw")
    head, units, data = rows[start], rows[start + 1], rows[start + 2:]
    col = {name: i for i, name in enumerate(head)}
    out = []
    for r in data:
        if len(r) != len(head):
            continue
        k = {"name": r[col["Kernel Name"]], "id": r[col["ID"]] if "ID" in col else None}
        exact = {}  # (rounded once, after the bytes are derived)
        for label, metrics, _ in FIELDS:
            metric = next((m for m in ((metrics,) if isinstance(metrics, str) else metrics)
                           if m in col and _num(r[col[m]]) is not None), None)
            if metric is None:
                continue
            v, unit = _num(r[col[metric]]), units[col[metric]]
            scale = {"us": TO_US, "dram_MB": TO_MB, "dram_read_MB": TO_MB,
                     "dram_TB_s": TO_TB_S}.get(label)
            if scale is not None:
                if unit not in scale:
                    raise SystemExit(f"{path}: {metric} in unit {unit!r}, which this reader "
                                     f"does not know (known: {sorted(scale)})")
                v *= scale[unit]
            exact[label] = v
        if "dram_MB" not in exact and {"dram_TB_s", "us"} <= exact.keys():  # rate x duration
            exact["dram_MB"] = exact["dram_TB_s"] * exact["us"]
        k.update({label: round(v, 3) for label, v in exact.items()})
        # one family: the sampled counts where the report has them, else the averages
        # (the two have different units and must not be added)
        found = {1: {}, 2: {}}
        for name, i in col.items():
            m = STALL.match(name)
            if not m:
                continue
            fam = 1 if m.group(1) else 2
            reason = m.group(fam)
            if not reason.endswith("_not_issued") and (v := _num(r[i])):
                found[fam][reason] = v
        stalls = found[1] or found[2]
        total = sum(stalls.values())
        if total:
            top = sorted(stalls.items(), key=lambda kv: -kv[1])[:6]
            k["stalls"] = {s: round(v / total, 3) for s, v in top}
        out.append(k)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw_csv")
    p.add_argument("--json", help="also write the summary here")
    args = p.parse_args(argv)
    kernels = read(args.raw_csv)
    for k in kernels:
        fields = " ".join(f"{label}={k[label]}" for label, _, _ in FIELDS if label in k)
        stalls = ", ".join(f"{s} {v:.0%}" for s, v in k.get("stalls", {}).items())
        print(f"{k['name'][:40]:40s} {fields}" + (f"\n    stalls: {stalls}" if stalls else ""))
    if args.json:  # a dict, as the other records in benchmarks/results are
        with open(args.json, "w") as f:
            json.dump({"source": args.raw_csv, "kernels": kernels}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
