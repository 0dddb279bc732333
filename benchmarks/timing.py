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


def pipelined_seconds(fn, *args, calls: int = 10, trials: int = 5) -> float:
    """Seconds per call of fn(*args): `calls` back-to-back launches per trial, one sync at the
    end (so dispatch and sync latency are not timed with each call), median of `trials`,
    after one untimed call (compile, warm-up)."""
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(calls):
            y = fn(*args)
        jax.block_until_ready(y)
        ts.append((time.perf_counter() - t0) / calls)
    return statistics.median(ts)


def pipelined_rate(fn, x, nbytes: float, calls: int = 10, trials: int = 5) -> float:
    """Bytes/s of fn(x) moving `nbytes`, timed as in pipelined_seconds."""
    return nbytes / pipelined_seconds(fn, x, calls=calls, trials=trials)
