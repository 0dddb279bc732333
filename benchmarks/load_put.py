"""Where a checkpoint load's transfer seconds go (load_checkpoint's put_s): the same bytes
handed to the device in different ways, in one fresh process per way.

    python -m benchmarks.load_put --checkpoint DIR [--out FILE]

Ways (each on the engine layout's tensors of a bf16 checkpoint, page cache warm):
- engine: convert.load.load_checkpoint(layout="engine"), as Ouro.load runs it (phases);
- engine_copy: the same with the host copy of every mapped tensor that the loader makes
  before a CPU transfer (params._Put; before session 32 it made it for a GPU too);
- engine_pageable: the same without the pinned staging (params.PINNED_STAGING off), i.e.
  device_put's pageable path, as the loader ran between the two session-32 changes;
- touch: only reading the mapped bytes on the host (a sum over every tensor as uint16 words
  in 64 MB slices): the page-fault and page-cache share;
- copy: np.array of every tensor (a host memcpy from the map);
- put_each: jax.device_put per tensor, from the map, then block_until_ready;
- put_list: one jax.device_put of the list of every tensor (the client may overlap them);
- put_copied: np.array first (timed apart), then put_each on the copies;
- put_threadsN: put_each from N Python threads (device_put releases the GIL);
- put_pinned: each tensor to the device's pinned host memory first (memory_kind
  "pinned_host"), then to the device; put_pinned_list: the same as two list puts.
The backend is started before each way and not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

WAYS = ("engine", "engine_copy", "engine_pageable", "touch", "copy", "put_each", "put_list", "put_copied",
        "put_threads4", "put_threads8", "put_pinned", "put_pinned_list")


def _tensors(folder: str) -> list:
    from convert import load as L
    kind, files = L._weight_files(folder)
    if kind != "safetensors":
        raise SystemExit("load_put: needs a safetensors checkpoint")
    tensors, _ = L._read_safetensors(folder, files)
    return [tensors[n] for n in sorted(tensors)]


def one(folder: str, way: str) -> dict:
    import jax
    import numpy as np
    jax.devices()
    t = time.perf_counter()
    out: dict = {}
    if way in ("engine", "engine_copy", "engine_pageable"):
        from convert.load import load_checkpoint
        from ouro_jax import params
        if way == "engine_copy":  # (the CPU's path: copies, then the pageable put)
            params._default_platform = lambda: "cpu"
        if way == "engine_pageable":
            params.PINNED_STAGING = False
        ck = load_checkpoint(folder, "bf16", layout="engine")
        out["phases"] = ck.phases
    else:
        arrays = _tensors(folder)
        out["bytes"] = int(sum(a.nbytes for a in arrays))
        if way == "touch":
            step = 1 << 25
            total = 0
            for a in arrays:
                flat = a.reshape(-1).view(np.uint16)
                for i in range(0, flat.size, step):
                    total += int(flat[i:i + step].sum(dtype=np.uint64))
            out["checksum"] = total
        elif way == "copy":
            copies = [np.array(a) for a in arrays]
            out["copied"] = len(copies)
        elif way == "put_each":
            jax.block_until_ready([jax.device_put(a) for a in arrays])
        elif way.startswith("put_threads"):
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(int(way[len("put_threads"):])) as pool:
                jax.block_until_ready(list(pool.map(jax.device_put, arrays)))
        elif way.startswith("put_pinned"):
            dev = jax.devices()[0]
            pinned = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
            on_dev = jax.sharding.SingleDeviceSharding(dev)
            if way == "put_pinned":
                jax.block_until_ready([jax.device_put(jax.device_put(a, pinned), on_dev)
                                       for a in arrays])
            else:
                staged = jax.block_until_ready(jax.device_put(arrays, pinned))
                out["stage_s"] = time.perf_counter() - t
                jax.block_until_ready(jax.device_put(staged, on_dev))
        elif way == "put_list":
            jax.block_until_ready(jax.device_put(arrays))
        elif way == "put_copied":
            copies = [np.array(a) for a in arrays]
            out["copy_s"] = time.perf_counter() - t
            t1 = time.perf_counter()
            jax.block_until_ready([jax.device_put(a) for a in copies])
            out["put_s"] = time.perf_counter() - t1
    out["seconds"] = time.perf_counter() - t
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.load_put", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--ways", default=",".join(WAYS))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--one", help=argparse.SUPPRESS)  # (a child process: one way, JSON out)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.checkpoint, args.one)))
        return 0
    ways = [w for w in args.ways.split(",") if w]
    bad = sorted(set(ways) - set(WAYS))
    if bad:
        raise SystemExit(f"load_put: unknown ways {bad}; choose from {WAYS}")
    runs = {}
    for r in range(args.repeats):
        for way in ways:
            res = subprocess.run([sys.executable, "-m", "benchmarks.load_put", "--checkpoint",
                                  args.checkpoint, "--one", way], capture_output=True,
                                 text=True, check=True)
            runs.setdefault(way, []).append(json.loads(res.stdout.strip().splitlines()[-1]))
            print(way, r, runs[way][-1], flush=True)
    from benchmarks.record import save_record
    save_record("benchmarks.load_put", argv, args.out, what=__doc__.split("\n")[0],
                checkpoint=args.checkpoint, runs=runs, cpus=os.cpu_count())
    return 0


if __name__ == "__main__":
    sys.exit(main())
