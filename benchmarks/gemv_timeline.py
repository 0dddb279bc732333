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

SHAPES = {"qkv": (6144, 2048, False), "o": (2048, 2048, False),
          "gate_up": (11264, 2048, True), "down": (2048, 5632, False)}


def _timer(ref, anchor):
    """The global timer's low 32 bits (ns), impure; `anchor` (int32, 0) orders it after the
    value it came from."""
    from pallas_kernels.ref_ptx import ref_asm
    return ref_asm(ref, anchor, "mov.u32 $0, %globaltimer_lo; // $1 (unused)")


def _smid(ref):
    from pallas_kernels.ref_ptx import ref_asm
    return ref_asm(ref, jnp.int32(0), "mov.u32 $0, %smid; // $1 (unused)")


def _kernel(x_ref, w_ref, y_ref, t_ref, *, k, block_n, block_k, per_program, gated, up_offset):
    from pallas_kernels.gemv_stream import block_loader, row_inputs, stream_blocks
    from pallas_kernels._common import pl
    p = pl.program_id(0)
    start = _timer(t_ref, jnp.int32(0))
    nk = k // block_k
    load = block_loader(w_ref, block_n=block_n, block_k=block_k, nk=nk, gated=gated,
                        up_offset=up_offset)
    first = load(p)
    xs = row_inputs((x_ref, None, None, None, None), m=1, nk=nk, block_k=block_k, k=k,
                    dt=y_ref.dtype, prologue="", eps=0.0, first_program=p == 0, row2d=False)
    stream_blocks(load, first, xs, y_ref, p=p, programs=pl.num_programs(0),
                  per_program=per_program, block_n=block_n, block_k=block_k, nk=nk,
                  gated=gated)
    end = _timer(t_ref, 0 * start)
    t_ref[p, 0] = start
    t_ref[p, 1] = end
    t_ref[p, 2] = _smid(t_ref)


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


def chain(ws, x, tuning):
    """ws: per layer {name: W}; returns (x, [timeline per kernel, in order])."""
    lines = []
    for lw in ws:
        for name in SHAPES:
            x, t = gemv_timed(x, lw[name], name, tuning[name])
            lines.append(t)
    return x, lines


def summarize(lines, names, sms: int):
    """Per projection: medians over its kernels of gap / ramp / body / tail (us), the
    kernel span, and the spread of programs per SM."""
    i32 = lambda a: np.asarray(a, np.int64)
    out = {n: {"gap": [], "ramp": [], "body": [], "tail": [], "span": [], "min_duration": [],
               "per_sm": []}
           for n in dict.fromkeys(names)}
    prev_end = None
    for t, name in zip(lines, names):
        t = i32(t)
        rel = lambda v, ref: ((v - ref + 2**31) % 2**32) - 2**31  # wrap-aware, ns
        first = int(rel(t[:, 0], t[0, 0]).min())  # the earliest start, relative to row 0's
        base = (int(t[0, 0]) + first) % 2**32
        start, end = rel(t[:, 0], base), rel(t[:, 1], base)
        dur = end - start
        med = int(np.argsort(end)[len(end) // 2])
        rec = out[name]
        if prev_end is not None:
            rec["gap"].append(((base - prev_end + 2**31) % 2**32 - 2**31) / 1e3)
        rec["ramp"].append(float(start.max()) / 1e3)
        rec["body"].append(float(np.median(dur)) / 1e3)
        rec["min_duration"].append(float(dur.min()) / 1e3)  # < 0: the timer reads moved
        rec["tail"].append(float(end.max() - end[med]) / 1e3)
        rec["span"].append(float(end.max()) / 1e3)
        counts = np.bincount(t[:, 2] % 1024, minlength=sms)[:sms]
        rec["per_sm"].append((int(counts.min()), int(counts.max())))
        prev_end = base + int(end.max())
    res = {}
    for name, rec in out.items():
        res[name] = {k: float(np.median(v)) for k, v in rec.items() if k != "per_sm" and v}
        res[name]["programs_per_sm_min_max"] = list(rec["per_sm"][0])
    return res


def run(layers: int, reps: int):
    from ouro_jax.projections import STREAM_TUNING
    key = jax.random.PRNGKey(0)
    ws = [{n: (jax.random.normal(jax.random.fold_in(key, 4 * i + j), (s[0], s[1]),
                                 jnp.float32) * s[1] ** -0.5).astype(jnp.bfloat16)
           for j, (n, s) in enumerate(SHAPES.items())} for i in range(layers)]
    x = jax.random.normal(jax.random.PRNGKey(1), (1, 2048), jnp.float32).astype(jnp.bfloat16)
    tuning = {n: dict(STREAM_TUNING[n]) for n in SHAPES}
    fn = jax.jit(lambda ws, x: chain(ws, x, tuning))
    jax.block_until_ready(fn(ws, x))
    names = [n for _ in range(layers) for n in SHAPES]
    sms = jax.devices()[0].core_count if hasattr(jax.devices()[0], "core_count") else 132
    summaries = []
    for _ in range(reps):
        _, lines = fn(ws, x)
        lines = [np.asarray(t) for t in jax.device_get(lines)]
        summaries.append(summarize(lines[4:], names[4:], sms))  # skip layer 0 (no predecessor)
    res = {}
    for name in SHAPES:
        res[name] = {k: float(np.median([s[name][k] for s in summaries]))
                     for k in ("gap", "ramp", "body", "tail", "span")}
        res[name]["min_duration"] = float(min(s[name]["min_duration"] for s in summaries))
        res[name]["programs"] = len(lines[names.index(name)])
        res[name]["programs_per_sm_min_max"] = summaries[-1][name]["programs_per_sm_min_max"]
        print(json.dumps({name: res[name]}), flush=True)
    per_layer = {k: sum(res[n][k] for n in SHAPES) for k in ("gap", "span")}
    print(json.dumps({"per_layer_us": per_layer}), flush=True)
    return res, per_layer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.layers < 2 or a.reps < 1:
        ap.error("--layers must be >= 2 (layer 0 has no predecessor) and --reps >= 1")
    from benchmarks.grid_barrier import require_gpu
    require_gpu("gemv_timeline", "it reads the GPU's timer inside the kernels")
    res, per_layer = run(a.layers, a.reps)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=str(jax.devices()[0].device_kind), jax_version=jax.__version__,
                           command="python -m benchmarks.gemv_timeline " + " ".join(
                               sys.argv[1:] if argv is None else argv),
                           layers=a.layers, reps=a.reps, projections=res,
                           per_layer_us=per_layer), f, indent=1)


if __name__ == "__main__":
    main()
