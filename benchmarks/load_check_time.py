"""Times convert.load.check_finite (the load's refusal of NaN / inf weights by name) on a
synthetic checkpoint in the device's memory: the first call (with its compile) and the
cached calls, as JSON. On this CPU it took 1.19 s / 0.90 s for the 1.4B shape in bf16
(load_check_session30_cpu.json, the machine otherwise idle); on a GPU it is one pass over the weights plus a compile. The weights are
drawn on the device, with no checkpoint on disk, so a GPU call can time it in seconds;
benchmarks.load_time's per-phase breakdown also times it (check_finite_s) inside a load of
a synthesized checkpoint folder.

    python -m benchmarks.load_check_time --synthetic 1.4b --out load_check.json"""
from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp

from benchmarks.record import save_record
from convert.load import check_finite
from ouro_jax.config import PRESETS
from ouro_jax.params import random_params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--synthetic", default="1.4b", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be at least 1, got {args.repeats}")
    dtype = jnp.bfloat16 if args.dtype == "bf16" else jnp.float32
    params = jax.block_until_ready(random_params(PRESETS[args.synthetic], 0, dtype, 0.003, 0.0))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    times = []
    for _ in range(1 + args.repeats):
        t = time.perf_counter()
        check_finite(params)  # ends in a host fetch: the time is the whole check
        times.append(time.perf_counter() - t)
    cached = sorted(times[1:])[len(times[1:]) // 2]
    res = {"weights_GB": nbytes / 1e9, "first_s": times[0], "cached_median_s": cached,
           "cached_s": times[1:], "cached_GB_s": nbytes / cached / 1e9}
    print(json.dumps(res))
    if args.out:
        save_record("benchmarks.load_check_time", argv, args.out, **res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
