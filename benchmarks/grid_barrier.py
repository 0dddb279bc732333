"""What a grid-wide barrier costs inside one kernel, against a kernel boundary.

    python -m benchmarks.grid_barrier --programs 132 --barriers 0,64 --out gb.json

Batch-1 decode runs seven kernels per layer application, each paying launch, ramp and tail
(~1.9 us per projection fitted in session 9). A persistent per-layer kernel would replace the
boundaries between them with grid barriers (pallas_kernels._common.grid_barrier: an atomic
arrival counter and a spin). Whether that can pay depends on one number, measured here:

* barrier: one kernel of P programs passing N barriers; each phase every program stores a
  value, passes the barrier and reads its neighbour's (double-buffered), so the barrier's
  memory ordering is checked, and the time per barrier is (t(N) - t(0)) / N; the barrier
  state is threaded from call to call as the engine would (no zeroing kernel);
* boundary: a chain of N one-program-per-SM kernels, each reading the previous one's output;
  the time per boundary is (t(N) - t(0)) / N, the same way.

Every program must be resident at once (the barrier spins): P at most the SM count times the
programs an SM holds (132 on the H200 with 4 warps is one per SM). Needs a GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import (BARRIER, COUNTER_STEP, SPIN_MODES, compiler_params,
                                    grid_barrier, pl)


def _barrier_kernel(state_ref, out_ref, buf_ref, state_out_ref, *, phases, programs, gpu_sync,
                    spin):
    del state_ref  # aliased with state_out_ref: the atomics go through the output
    p = pl.program_id(0)

    def phase(i, acc):
        slot = lax.rem(i, 2) * programs
        buf_ref[slot + p] = (p + 1) * (i + 1)
        grid_barrier(state_out_ref, programs, gpu_sync=gpu_sync, spin=spin, program=p)
        return acc + buf_ref[slot + lax.rem(p + 1, programs)]

    out_ref[p] = lax.fori_loop(0, phases, phase, jnp.int32(0))


def barrier_call(programs: int, phases: int, *, interpret: bool = False, spin=None):
    """f(state int32[3]) -> (out int32[P], state): P programs pass `phases` barriers;
    in phase i program p stores (p + 1) (i + 1) and then reads its neighbour's store, so
    out[p] = ((p + 1) % P + 1) * phases * (phases + 1) / 2 when every barrier held, and the
    state comes back as (0, generation + phases, 0): no program gave up waiting (spin
    "counter": (arrivals + phases * COUNTER_STEP, 0, 0)). spin: None reads _common.BARRIER."""
    if interpret and programs > 1:
        raise ValueError("barrier_call in interpret mode takes one program: interpret mode runs "
                         f"programs in turn, so {programs} could not wait for each other")
    kernel = functools.partial(_barrier_kernel, phases=phases, programs=programs,
                               gpu_sync=not interpret, spin=spin or BARRIER["spin"])
    call = pl.pallas_call(
        kernel, grid=(programs,), input_output_aliases={0: 2},
        out_shape=(jax.ShapeDtypeStruct((programs,), jnp.int32),
                   jax.ShapeDtypeStruct((2 * programs,), jnp.int32),
                   jax.ShapeDtypeStruct((3,), jnp.int32)),
        compiler_params=compiler_params(4, 1), interpret=interpret, name="grid_barrier")

    def run(state):
        out, _, state = call(state)
        return out, state
    return run


def expected(programs: int, phases: int):
    return [((p + 1) % programs + 1) * phases * (phases + 1) // 2 for p in range(programs)]


def _step_kernel(x_ref, y_ref):
    p = pl.program_id(0)
    y_ref[p] = x_ref[p] + x_ref[lax.rem(p + 1, x_ref.shape[0])]


def boundary_chain(programs: int, kernels: int, *, interpret: bool = False):
    """f(x int32[P]) -> x after `kernels` dependent one-program-per-slot kernels."""
    step = pl.pallas_call(_step_kernel, grid=(programs,),
                          out_shape=jax.ShapeDtypeStruct((programs,), jnp.int32),
                          compiler_params=compiler_params(4, 1), interpret=interpret,
                          name="boundary_step")

    def run(x):
        for _ in range(kernels):
            x = step(x)
        return x
    return run


def time_threaded(step, state, calls: int, trials: int):
    """Best-of-trials mean seconds per call of step(state) -> (out, state), the state (a
    donated barrier state, or None) threaded from call to call, one sync per trial. Returns
    (seconds, the last state)."""
    best = float("inf")
    for _ in range(trials):
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(calls):
            out, state = step(state)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best, state


def time_calls(fn, args, calls: int, trials: int) -> float:
    """time_threaded for a stateless fn(*args), after one warm-up call."""
    jax.block_until_ready(fn(*args))
    return time_threaded(lambda s: (fn(*args), s), None, calls, trials)[0]


def require_gpu(module: str, why: str) -> None:
    if jax.default_backend() != "gpu":
        raise SystemExit(f"benchmarks.{module} needs a GPU ({why})")


def measure(programs: int, counts: list[int], calls: int, trials: int) -> dict:
    res = {"programs": programs, "barrier_us": {}, "boundary_us": {}, "barrier_ok": {}}
    for n in counts:
        f = jax.jit(barrier_call(programs, n), donate_argnums=0)
        out, state = f(jnp.zeros((3,), jnp.int32))
        want = [n * COUNTER_STEP, 0, 0] if BARRIER["spin"] == "counter" else [0, n, 0]
        res["barrier_ok"][n] = (jax.device_get(out).tolist() == expected(programs, n)
                                and jax.device_get(state).tolist() == want)
        res["barrier_us"][n] = 1e6 * time_threaded(f, state, calls, trials)[0]
        g = jax.jit(boundary_chain(programs, n))
        res["boundary_us"][n] = 1e6 * time_calls(g, (jnp.arange(programs, dtype=jnp.int32),), calls,
                                            trials)
    lo, hi = min(counts), max(counts)
    if hi > lo:
        res["per_barrier_us"] = (res["barrier_us"][hi] - res["barrier_us"][lo]) / (hi - lo)
        res["per_boundary_us"] = (res["boundary_us"][hi] - res["boundary_us"][lo]) / (hi - lo)
    return res


def main(argv=None) -> int:
    from benchmarks.record import save_record

    ap = argparse.ArgumentParser(prog="python -m benchmarks.grid_barrier", description=__doc__)
    ap.add_argument("--programs", default="132", help="grid sizes, comma-separated")
    ap.add_argument("--barriers", default="0,64", help="barrier (and kernel) counts")
    ap.add_argument("--spin", default="atomic",
                    help="how waiting programs re-read the barrier's generation, comma-"
                         "separated: atomic (add of 0), load (ld.relaxed.gpu), counter (no "
                         "generation: acquire loads until the arrivals reach a target)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    spins = [x for x in args.spin.split(",") if x]
    bad = set(spins) - set(SPIN_MODES)
    if bad or not spins:
        raise SystemExit(f"--spin: {sorted(bad) or args.spin!r}; valid: {SPIN_MODES}")
    require_gpu("grid_barrier", "the barrier spins on programs running at the same time; "
                "interpret mode runs them in turn")
    counts = sorted({int(x) for x in args.barriers.split(",")})
    rows = []
    before = BARRIER["spin"]
    try:
        for spin in spins:
            BARRIER["spin"] = spin  # read when each (new) barrier kernel is traced
            for programs in [int(x) for x in args.programs.split(",")]:
                rows.append(dict(spin=spin, **measure(programs, counts, args.calls,
                                                       args.trials)))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        BARRIER["spin"] = before
    save_record("benchmarks.grid_barrier", argv, args.out, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
