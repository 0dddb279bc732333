"""Checkpoint load time for the Ouro-1.4B shape (bf16), on a synthetic checkpoint.

    python -m benchmarks.load_time                       # synthesizes 1.4B bf16 to a temp dir
    python -m benchmarks.load_time --checkpoint DIR      # or times an existing folder
    python -m benchmarks.load_time --runs 5 --out benchmarks/results/load_time_cpu.json

Times `convert.load.load_checkpoint` (config, header validation, stacking the per-layer
tensors, transfer to the default JAX device) as the median of several runs:
- warm: the weight files are in the OS page cache (the usual case after a first load);
- cold: each file's pages are dropped with posix_fadvise(DONTNEED) first, so the bytes come
  from disk (no root needed; it drops clean cached pages of those files only).
A per-phase breakdown of one warm run shows where the time goes. On a shared machine, check
the recorded load average: other processes inflate every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import jax

from convert import load as L


def drop_page_cache(folder: str, files: list[str]) -> bool:
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in files:
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages (a freshly written file) cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def timed_load(folder: str, dtype: str, layout: str = "stacked", unstack: bool = False) -> float:
    """Seconds to load (layout: load_checkpoint's); unstack: then model.unstack_layers(fuse=
    True), which is what Ouro.load did with the stacked layout before session 18."""
    from ouro_jax.model import unstack_layers
    t0 = time.perf_counter()
    ck = L.load_checkpoint(folder, dtype, layout=layout)
    params = unstack_layers(ck.params, fuse=True) if unstack else ck.params
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    del ck, params
    return seconds


def phases(folder: str, dtype: str) -> dict[str, float]:
    """One load (stacked layout) split into its steps: load_checkpoint's own phases (open,
    convert, check_compile, transfer_wait, check_finite; convert.load.LoadedCheckpoint)."""
    return dict(L.load_checkpoint(folder, dtype).phases)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_time", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="existing HF folder (default: synthesize one)")
    p.add_argument("--preset", default="1.4b")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                  "load_time_cpu.json"))
    args = p.parse_args(argv)

    tmp = None
    folder = args.checkpoint
    synth_s = None
    if folder is None:
        tmp = tempfile.mkdtemp(prefix="ouro-load-")
        folder = os.path.join(tmp, "ck")
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "convert.synthesize", "--preset", args.preset,
                        "--dtype", "bf16", "--out", folder, "--seed", "0"], check=True)
        synth_s = time.perf_counter() - t
    try:
        _, files = L._weight_files(folder)
        nbytes = sum(os.path.getsize(os.path.join(folder, f)) for f in files)
        timed_load(folder, args.dtype)  # first load: jax/XLA start-up, not counted
        warm = [timed_load(folder, args.dtype) for _ in range(args.runs)]
        cold = []
        for _ in range(args.runs):
            if not drop_page_cache(folder, files):
                break
            cold.append(timed_load(folder, args.dtype))
        breakdown = phases(folder, args.dtype)
        # what the engine loads: Ouro.load before session 18 (stacked, then unstacked and
        # fused on the device) and since (the engine layout, built on the host)
        engine = {"stacked_then_unstack_s": [timed_load(folder, args.dtype, unstack=True)
                                             for _ in range(args.runs)],
                  "engine_layout_s": [timed_load(folder, args.dtype, "engine")
                                      for _ in range(args.runs)]}
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)

    result = {
        "what": "convert.load.load_checkpoint wall time (stacked layout), median of runs; "
                "engine_load_*: the engine's weights, stacked then unstacked on the device "
                "against the engine layout built on the host",
        "checkpoint": args.checkpoint or f"synthetic --preset {args.preset} bf16 (seed 0)",
        "weight_files": files, "weight_bytes": nbytes, "load_dtype": args.dtype,
        "warm_page_cache_s": statistics.median(warm), "warm_runs_s": warm,
        "cold_page_cache_s": statistics.median(cold) if cold else None, "cold_runs_s": cold,
        "warm_GBps": nbytes / statistics.median(warm) / 1e9,
        "phases_one_warm_run": breakdown,
        "engine_load_warm_median_s": {k: statistics.median(v) for k, v in engine.items()},
        "engine_load_warm_runs_s": engine,
        "synthesize_s": synth_s,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "jax_device": str(jax.devices()[0]), "jax": jax.__version__,
                    "ram_GB": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                                    / 2**30, 1),
                    "loadavg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    print(json.dumps(result, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
