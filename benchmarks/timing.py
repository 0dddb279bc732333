"""Wall-clock timing of compiled JAX calls, shared by the benchmarks."""

from __future__ import annotations

import statistics
import time

import jax


def median_time(fn, *args, runs: int = 11) -> float:
    """Median seconds of `runs` calls of fn(*args) after one untimed call (compile, warm-up);
    each call waits for its outputs."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(runs):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
