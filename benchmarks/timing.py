"""Timing of compiled JAX calls, shared by the benchmarks: wall clock, and the GPU's own kernel
time from a profiler trace (device_seconds)."""

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


def copy_bandwidth(gbytes: float | None = None) -> float:
    """Device copy bandwidth in bytes/s (read + write counted) of an XLA `a + 1` over `gbytes`
    (default 2 GiB on a GPU; 0.25 elsewhere, where 2 GiB took 74 s and 4.4 GB of memory on
    a CPU), launched back to back (pipelined_rate). Until session 3 every call was synced,
    which timed the dispatch and sync with each ~1 ms copy and read 2.9-3.4 TB/s where the
    pipelined figure is ~4.2 TB/s."""
    import jax.numpy as jnp
    if gbytes is None:
        gbytes = 2.0 if jax.default_backend() == "gpu" else 0.25
    x = jnp.ones((int(gbytes * 2**30 / 4),), jnp.float32)
    return pipelined_rate(jax.jit(lambda a: a + 1), x, 2 * x.nbytes)


def device_seconds(fn, *args, calls: int = 4, units: int = 1) -> tuple[float, float]:
    """(kernel seconds, span seconds) per unit of fn(*args) from the GPU's clock: after one
    untimed call, `calls` calls run under jax.profiler.trace; the durations of the device's
    kernels are summed (kernel) and first start to last end measured (span), each divided
    by calls x units (units: e.g. the projections one call of fn chains). NaN where the
    trace has no GPU kernels (a CPU). Why: for short kernels the wall clock can be
    host-bound; session 13 read the streaming down GEMV at 18-20 us per call by wall clock
    and 7.6-8.5 us by this (7.7 in the engine's trace)."""
    jax.block_until_ready(fn(*args))

    def run():
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    events = [e for e in traced_device_events(run) if not e[0].startswith("Memcpy")]
    if not events:
        return float("nan"), float("nan")
    n = calls * units
    kernel = sum(e[2] for e in events) / n / 1e9
    span = (max(e[1] + e[2] for e in events) - min(e[1] for e in events)) / n / 1e9
    return kernel, span


def traced_device_events(run) -> list[tuple[str, float, float]]:
    """(name, start_ns, duration_ns) of the GPU's events while run() runs under
    jax.profiler.trace (run must wait for its own results); [] where there are none."""
    import glob
    import tempfile

    from benchmarks.kernel_trace import device_events
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            run()
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        return device_events(files[0]) if files else []
