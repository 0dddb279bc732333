"""Where a streaming GEMV's per-call time goes, from inside the kernels: every program records
the GPU's global timer when it starts and when it has issued its last store, and the SM it ran
on. Needs a GPU.

    python -m benchmarks.gemv_timeline --layers 24 --out timeline.json

Batch-1 decode pays ~2-4 us per GEMV call beyond its bytes (benchmarks.gemv_scaling), and a
chain of the four plain projections takes 33.6 us per layer against 22.3 us of bytes at XLA's
read bandwidth (session 15, benchmarks.mgpu_pdl_chain). This splits that overhead, per kernel
of a chain qkv -> o -> gate/up -> down (plain one-row streaming GEMVs on the engine's tilings,
own weights per layer, each reading the previous output), into:

* gap: from the previous kernel's last program end to this kernel's first program start
  (launch, PDL wait, the memory flush);
* ramp: from the first program's start to the last program's start (programs that start late:
  later waves, or CTAs placed late);
* body: the median program's duration;
* tail: from the median program's end to the last program's end (imbalance across programs
  and SMs), and the per-SM program counts.

The timer (`%globaltimer`, ns) is read through impure inline PTX (pallas_kernels.ref_ptx), so
it stays where it is in program order; a program's "end" is when its last store is issued.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gemv import SHAPES  # name -> (N, K, gated), the 1.4B projections


def _kernel(x_ref, w_ref, y_ref, t_ref, *, k, block_n, block_k, per_program, gated, up_offset):
    from pallas_kernels.gemv_blocks import block_loader, stream_blocks
    from pallas_kernels.gemv_rows import row_inputs
    from pallas_kernels._common import pl
    from pallas_kernels.ref_ptx import global_timer, store_timeline
    p = pl.program_id(0)
    start = global_timer(t_ref)
    nk = k // block_k
    load = block_loader(w_ref, block_n=block_n, block_k=block_k, nk=nk, gated=gated,
                        up_offset=up_offset)
    first = load(p)
    xs = row_inputs((x_ref, None, None, None, None), m=1, nk=nk, block_k=block_k, k=k,
                    dt=y_ref.dtype, prologue="", eps=0.0, first_program=p == 0, row2d=False)
    stream_blocks(load, first, xs, y_ref, p=p, programs=pl.num_programs(0),
                  per_program=per_program, block_n=block_n, block_k=block_k, nk=nk,
                  gated=gated)
    store_timeline(t_ref, p, start)


def gemv_timed(x, w, name: str, tuning: dict):
    """The plain streaming GEMV of projection `name` (x may be wider than K: its first K
    values are read) with a timeline: (y [1, N], timeline int32 [programs, 3])."""
    from pallas_kernels._common import compiler_params, pl
    from pallas_kernels.gemv_stream import _config, check_supported
    n, k, gated = SHAPES[name]
    n_out = n // 2 if gated else n
    cfg = _config(dict(tuning), k)
    check_supported(1, k, n_out, block_n=cfg["block_n"], block_k=cfg["block_k"],
                    per_program=cfg["per_program"], num_warps=cfg["num_warps"])
    programs = n_out // cfg["block_n"] // cfg["per_program"]
    kernel = functools.partial(_kernel, k=k, block_n=cfg["block_n"], block_k=cfg["block_k"],
                               per_program=cfg["per_program"], gated=gated, up_offset=n_out)
    return pl.pallas_call(
        kernel, grid=(programs,),
        out_shape=(jax.ShapeDtypeStruct((1, n_out), x.dtype),
                   jax.ShapeDtypeStruct((programs, 3), jnp.int32)),
        compiler_params=compiler_params(cfg["num_warps"], 1), name=f"gemv_timed_{name}",
    )(x, w)


def chain(ws, x, tuning, counters=None, programs=None):
    """ws: per layer {name: W}; returns (x, [timeline per kernel, in order], counters).
    With `programs` the kernels are gemv_queue's (the work queue) on that many programs,
    counters int32 [4] threaded through (projection i takes slot i, zeroes slot i - 1)."""
    from pallas_kernels.gemv_queue import gemv_queue
    lines = []
    for lw in ws:
        for i, name in enumerate(SHAPES):
            if programs is None:
                x, t = gemv_timed(x, lw[name], name, tuning[name])
            else:
                x, counters, t = gemv_queue(x, lw[name], counters, programs=programs, use=i,
                                            zero=(i - 1) % 4, gated=SHAPES[name][2],
                                            timeline=True, **tuning[name])
            lines.append(t)
    return x, lines, counters


def summarize(lines, names, sms: int, skip: int = 0):
    """Per projection: medians over its kernels of gap / ramp / body / tail (us), the
    kernel span, and the spread of programs per SM (over the SM ids seen; `sms` is not used
    to index them). The first `skip` kernels only give their end to the next one's gap."""
    del sms
    i32 = lambda a: np.asarray(a, np.int64)
    out = {n: {"gap": [], "ramp": [], "body": [], "tail": [], "span": [], "min_duration": [],
               "per_sm": []}
           for n in dict.fromkeys(names)}
    prev_end = None
    for index, (t, name) in enumerate(zip(lines, names)):
        t = i32(t)
        rel = lambda v, ref: ((v - ref + 2**31) % 2**32) - 2**31  # wrap-aware, ns
        first = int(rel(t[:, 0], t[0, 0]).min())  # the earliest start, relative to row 0's
        base = (int(t[0, 0]) + first) % 2**32
        start, end = rel(t[:, 0], base), rel(t[:, 1], base)
        dur = end - start
        med = int(np.argsort(end)[len(end) // 2])
        if index < skip:
            prev_end = base + int(end.max())
            continue
        rec = out[name]
        if prev_end is not None:
            rec["gap"].append(((base - prev_end + 2**31) % 2**32 - 2**31) / 1e3)
        rec["ramp"].append(float(start.max()) / 1e3)
        rec["body"].append(float(np.median(dur)) / 1e3)
        rec["min_duration"].append(float(dur.min()) / 1e3)  # < 0: the timer reads moved
        rec["tail"].append(float(end.max() - end[med]) / 1e3)
        rec["span"].append(float(end.max()) / 1e3)
        _, counts = np.unique(t[:, 2], return_counts=True)  # SMs with no program: not seen
        rec["per_sm"].append((int(counts.min()), int(counts.max())))
        prev_end = base + int(end.max())
    res = {}
    for name, rec in out.items():
        res[name] = {k: float(np.median(v)) for k, v in rec.items() if k != "per_sm" and v}
        res[name]["programs_per_sm_min_max"] = list(rec["per_sm"][0])
    return res


def run(layers: int, reps: int, arms):
    """arms: {label: None (the engine's streaming GEMV and tilings) or (programs, block_n
    per projection) for the work queue}. Returns {label: per-projection figures}."""
    from benchmarks.mgpu_pdl_chain import weights
    from ouro_jax.projections import STREAM_TUNING
    ws = weights(layers)
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 2048), jnp.float32).astype(jnp.bfloat16)
    names = [n for _ in range(layers) for n in SHAPES]
    sms = getattr(jax.devices()[0], "core_count", None)
    out, ref = {}, None
    for label, arm in arms.items():
        tuning = {n: dict(STREAM_TUNING[n]) for n in SHAPES}
        programs = None
        if isinstance(arm, dict):  # the streaming GEMV with some projections' tilings changed
            tuning.update({n: dict(t) for n, t in arm.items()})
        elif arm is not None:
            programs, block_n = arm
            tuning = {n: dict(block_n=block_n[n], num_warps=4) for n in SHAPES}
        fn = jax.jit(lambda ws, x, c, t=tuning, p=programs: chain(ws, x, t, c, p),
                     donate_argnums=2)
        counters = jnp.zeros((4,), jnp.int32)
        y, _, counters = fn(ws, x, counters)
        y = np.asarray(y, np.float32)
        ref = y if ref is None else ref
        summaries = []
        for _ in range(reps):
            _, lines, counters = fn(ws, x, counters)
            lines = [np.asarray(t) for t in jax.device_get(lines)]
            summaries.append(summarize(lines, names, sms, skip=4))  # layer 0: no predecessor
        res = {}
        for name in SHAPES:
            res[name] = {k: float(np.median([s[name][k] for s in summaries]))
                         for k in ("gap", "ramp", "body", "tail", "span")}
            res[name]["min_duration"] = float(min(s[name]["min_duration"] for s in summaries))
            res[name]["programs"] = len(lines[names.index(name)])
            res[name]["programs_per_sm_min_max"] = summaries[-1][name]["programs_per_sm_min_max"]
        res["per_layer_us"] = {k: sum(res[n][k] for n in SHAPES) for k in ("gap", "span")}
        res["max_abs_diff_vs_first_arm"] = float(np.abs(y - ref).max())
        print(json.dumps({label: res}), flush=True)
        out[label] = res
    return out


def parse_arms(queue_programs: str, block_n: str, stream_tilings=()):
    """{label: arm} for run(): the streaming GEMV, the streaming GEMV with each of
    `stream_tilings` (--stream-tiling specs: benchmarks.tuning.parse_stream_tiling), then the
    work queue at each grid size."""
    bn = dict(qkv=4, o=4, gate_up=2, down=2)
    for item in filter(None, block_n.split(",")):
        name, _, v = item.partition("=")
        if name not in bn or not (v.isascii() and v.isdigit()) or int(v) < 1:
            raise ValueError(f"--queue-block-n takes NAME=N, NAME in {sorted(bn)}, got {item!r}")
        bn[name] = int(v)
    arms = {"stream": None}
    for spec in stream_tilings:
        from benchmarks.tuning import parse_stream_tiling
        arms[f"stream[{spec}]"] = parse_stream_tiling(spec)
    for q in filter(None, queue_programs.split(",")):
        if not (q.isascii() and q.isdigit()) or int(q) < 1:
            raise ValueError(f"--queue-programs takes ints >= 1, got {q!r}")
        arms[f"queue{q}"] = (int(q), bn)
    return arms


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--queue-programs", default="",
                    help="also run the chain on pallas_kernels.gemv_queue (blocks from an "
                         "atomic counter) with these grid sizes, comma-separated")
    ap.add_argument("--queue-block-n", default="",
                    help="the queue's block_n per projection, e.g. qkv=4,o=4,gate_up=2,down=2 "
                         "(those are the defaults)")
    ap.add_argument("--stream-tiling", action="append", default=[],
                    help="an extra streaming arm with these projections' tilings, e.g. "
                         "gate_up=st2_k512_p11_w4 (benchmarks.gemv STREAM_VARIANTS; repeatable)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.layers < 2 or a.reps < 1:
        ap.error("--layers must be >= 2 (layer 0 has no predecessor) and --reps >= 1")
    try:
        arms = parse_arms(a.queue_programs, a.queue_block_n, a.stream_tiling)
    except ValueError as e:
        ap.error(str(e))
    from benchmarks.grid_barrier import require_gpu
    require_gpu("gemv_timeline", "it reads the GPU's timer inside the kernels")
    res = run(a.layers, a.reps, arms)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
                           command="python -m benchmarks.gemv_timeline " + " ".join(
                               sys.argv[1:] if argv is None else argv),
                           layers=a.layers, reps=a.reps, arms=res), f, indent=1)


if __name__ == "__main__":
    main()
