"""The engine's one-row streaming GEMVs chained as a decoder layer's projections, inside one
jitted JAX program, launched by JAX (`xla`) or by our PDL launcher
(pallas_kernels/pdl_launch.py): without PDL (`ffi`), with PDL and the trigger at the kernel's
start (`pdl_start`) or once the last weight block has arrived (`pdl_end`); the `_g` arms
through the handler XLA may record into its command buffers (CUDA graphs); the `seq` arms
with one custom call per layer launching its four kernels; the `lseq` / `gseq` arms with one
custom call per loop (all its layers' kernels), launched from the stream or replayed as a CUDA
graph of the launcher's own whose PDL launches are programmatic edges. Per layer, as the engine runs
them at one row: qkv with the add_norm prologue (residual + rms_norm(down's output), then
rms_norm) -> (slice of q, an XLA kernel, where the attention would be) -> o -> gate/up with
the add_norm prologue (the residual + rms_norm(o's output)) -> down -> the next layer's qkv,
over --layers layers of distinct weights (1.4B shapes, bf16), --loops times.

The launcher's arms must give one another's bits (the same Triton compiles them), and `xla`
arms theirs; the run fails if not. Between the two families the kernels come from two Triton
versions, so the rounding may differ (max_diff_to_first_arm). Put a launcher arm without PDL
(`ffi` or `seq`) first among the launcher arms: it is the family's reference
(`family_reference`). The last timed run must also equal the first.

    python3 -m benchmarks.pdl_jax_chain --out benchmarks/results/pdl_jax_chain_h200.json
"""
from __future__ import annotations

import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.pdl_chain import SHAPES, chain_parser, parse_arms, parse_tiling
from benchmarks.record import save_record
from ouro_jax.model import rms_norm
from ouro_jax.projection_tuning import STREAM_TUNING
from pallas_kernels import pdl_launch
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed

# arm: (the kernels' pdl mode or None for JAX's launch, launch with PDL, the graph handler)
ARMS = {"xla": (None, False, False), "ffi": (False, False, False),
        "pdl_start": ("start", True, False), "pdl_end": ("end", True, False),
        "ffi_g": (False, False, True), "pdl_start_g": ("start", True, True),
        "pdl_end_g": ("end", True, True),
        # one custom call per layer launching its four kernels (pdl_launch.sequence)
        "seq": (False, False, "seq"), "seq_start": ("start", True, "seq"),
        "seq_end": ("end", True, "seq"),
        # one custom call per loop launching its 24 layers' 96 kernels (session 28), from the
        # stream (`lseq`) or replayed as a CUDA graph of the launcher's own (`gseq`), where a
        # PDL launch is a programmatic edge (session 26's fastest arm in a PyTorch graph:
        # weights first, trigger at the start, half the blocks per program)
        "lseq": (False, False, "lseq"), "lseq_start": ("start", True, "lseq"),
        "gseq": (False, False, "gseq"), "gseq_start": ("start", True, "gseq"),
        "gseq_end": ("end", True, "gseq"),
        # diagnostics (session 26), JAX's launch: qkv and gate/up without their add_norm
        # prologue (`xla_plain`: plain GEMVs on the branch, no norms at all; other bits), or
        # with the add_norm as separate XLA kernels before plain GEMVs (`xla_sepnorm`)
        "xla_plain": (None, False, False), "xla_sepnorm": (None, False, False)}
PROLOGUE = {"xla_plain": "none", "xla_sepnorm": "xla"}  # the rest: in the kernel
ORDER = ("qkv", "o", "gate_up", "down")
NORMED = ("qkv", "gate_up")  # the add_norm prologue: (x, branch, branch_w, norm_w, w)
EPS = 1e-6
TILING_OVERRIDES = {}  # --tiling: name -> block_n / per_program / num_warps over STREAM_TUNING


def make_weights(n_layers, seed=0):
    key = jax.random.PRNGKey(seed)
    layers = []
    for _ in range(n_layers):
        lw = {}
        for name in ORDER:
            n, k, gated = SHAPES[name]
            key, sub = jax.random.split(key)
            scale = k ** -0.5
            lw[name] = (jax.random.normal(sub, (2 * n if gated else n, k), jnp.float32)
                        * scale).astype(jnp.bfloat16)
            if name in NORMED:
                key, a, b = jax.random.split(key, 3)
                lw[name + "_bw"] = (1 + 0.1 * jax.random.normal(a, (k,))).astype(jnp.bfloat16)
                lw[name + "_nw"] = (1 + 0.1 * jax.random.normal(b, (k,))).astype(jnp.bfloat16)
        layers.append(lw)
    return layers


def projection(name, kernel_pdl, launch_pdl, graph, kernels, prologue="kernel"):
    """f(x, w) (plain) or f(x, branch, branch_w, norm_w, w) -> (y, x') (add_norm prologue;
    prologue "none": y = x @ w, x' = x; "xla": the add_norm by XLA, then the plain GEMV)."""
    n, k, gated = SHAPES[name]
    tuning = dict(STREAM_TUNING[name], **TILING_OVERRIDES.get(name, {}))
    if kernel_pdl is not None:
        tuning["pdl"] = kernel_pdl
    if name in NORMED and prologue != "kernel":
        def f(x, b, bw, nw, w):
            if prologue == "xla":
                x = x + rms_norm(b, bw, EPS)
                return gemv_stream(rms_norm(x, nw, EPS), w, gated=gated, **tuning), x
            # no norms: the branch is the input, so the chain stays one dependent line
            return gemv_stream(b, w, gated=gated, **tuning), b
    elif name in NORMED:
        def f(x, b, bw, nw, w):
            return gemv_stream_normed(x, nw, w, eps=EPS, branch=b, branch_w=bw, gated=gated,
                                      **tuning)
    else:
        f = functools.partial(gemv_stream, gated=gated, **tuning)
    if kernel_pdl is None:  # JAX's own launch
        return f
    key = (name, kernel_pdl)
    bf = jnp.bfloat16
    row = jax.ShapeDtypeStruct((1, k), bf)
    w = jax.ShapeDtypeStruct((2 * n if gated else n, k), bf)
    vec = jax.ShapeDtypeStruct((k,), bf)
    ins = (row, row, vec, vec, w) if name in NORMED else (row, w)
    if key not in kernels:
        kernels[key] = pdl_launch.compile_pallas(f, *ins, num_warps=tuning["num_warps"],
                                                 num_stages=1)
    kern = kernels[key]
    out = jax.ShapeDtypeStruct((1, n), bf)
    outs = [out, row] if name in NORMED else out
    return lambda *a: pdl_launch.call(kern, outs, *a, pdl=launch_pdl, graph=graph)


def chain_fn(arm, loops, kernels):
    if ARMS[arm][2] == "seq":
        return seq_chain_fn(arm, loops, kernels)
    if ARMS[arm][2] in ("lseq", "gseq"):
        return loop_chain_fn(arm, loops, kernels)
    proj = {name: projection(name, *ARMS[arm], kernels, PROLOGUE.get(arm, "kernel"))
            for name in ORDER}

    def f(h, layers):
        d = h if PROLOGUE.get(arm) == "none" else jnp.zeros_like(h)
        outs = []
        for _ in range(loops):
            for lw in layers:
                y, h = proj["qkv"](h, d, lw["qkv_bw"], lw["qkv_nw"], lw["qkv"])
                o = proj["o"](y[:, :2048], lw["o"])
                y, h = proj["gate_up"](h, o, lw["gate_up_bw"], lw["gate_up_nw"],
                                       lw["gate_up"])
                d = proj["down"](y, lw["down"])
                outs.append(d)
        return h, jnp.concatenate(outs)  # every layer's output: the bits compared
    return jax.jit(f)


# A layer's operands after (h, d) and its results, in the order layer_steps takes them
LAYER_WEIGHTS = ("qkv_bw", "qkv_nw", "qkv", "o", "gate_up_bw", "gate_up_nw", "gate_up", "down")
LAYER_OUTS = ((1, 6144), (1, 2048), (1, 2048), (1, 5632), (1, 2048), (1, 2048))  # y_qkv, h',
# o, y_gu, h'', d


def layer_steps(kernels, mode, pdl, h, d, w, r):
    """One layer's four sequence steps: h, d its inputs, w its 8 weights (LAYER_WEIGHTS), r
    its 6 results (LAYER_OUTS), each as ("in", i) / ("out", j); o reads the first 2048 of
    qkv's outputs (q) in place."""
    return [(kernels[("qkv", mode)], [h, d, w[0], w[1], w[2], r[0], r[1]], pdl),
            (kernels[("o", mode)], [r[0], w[3], r[2]], pdl),
            (kernels[("gate_up", mode)], [r[1], r[2], w[4], w[5], w[6], r[3], r[4]], pdl),
            (kernels[("down", mode)], [r[3], w[7], r[5]], pdl)]


def _sequence_arm(arm, kernels):
    """(mode, pdl, how) of a sequence arm, its kernels compiled into `kernels`."""
    mode, pdl, how = ARMS[arm]
    for name in ORDER:
        projection(name, mode, pdl, False, kernels)
    return mode, pdl, how


def seq_chain_fn(arm, loops, kernels):
    """chain_fn's program with each layer's four kernels launched by one custom call."""
    mode, pdl, _ = _sequence_arm(arm, kernels)
    steps = layer_steps(kernels, mode, pdl, ("in", 0), ("in", 1),
                        [("in", 2 + j) for j in range(8)], [("out", j) for j in range(6)])
    outs = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in LAYER_OUTS]

    def f(h, layers):
        d = jnp.zeros_like(h)
        res = []
        for _ in range(loops):
            for lw in layers:
                r = pdl_launch.sequence(steps, outs, h, d, *(lw[k] for k in LAYER_WEIGHTS))
                h, d = r[4], r[5]
                res.append(d)
        return h, jnp.concatenate(res)
    return jax.jit(f)


def loop_chain_fn(arm, loops, kernels):
    """chain_fn's program with each loop's layers (all their kernels) launched by one custom
    call, from the stream or as a recorded CUDA graph; every intermediate is a result of its
    own (no buffer is written twice in a call)."""
    mode, pdl, how = _sequence_arm(arm, kernels)

    def f(h, layers):
        n = len(layers)
        steps, outs = [], [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in LAYER_OUTS] * n
        x, d = ("in", 0), ("in", 1)
        for layer in range(n):  # operands: h, d, then each layer's 8 weights
            r = [("out", 6 * layer + j) for j in range(6)]
            steps += layer_steps(kernels, mode, pdl, x, d,
                                 [("in", 2 + 8 * layer + j) for j in range(8)], r)
            x, d = r[4], r[5]
        flat = [lw[k] for lw in layers for k in LAYER_WEIGHTS]
        d = jnp.zeros_like(h)
        res = []
        for _ in range(loops):
            r = pdl_launch.sequence(steps, outs, h, d, *flat, graph=how == "gseq")
            h, d = r[-2], r[-1]
            res += [r[6 * i + 5] for i in range(n)]
        return h, jnp.concatenate(res)
    return jax.jit(f)


def trace_arm(f, x0, layers, units):
    """Device events of three calls: per kernel kind, count and mean us per call; the span
    and busy share (the union of kernel intervals over the span)."""
    import glob
    import tempfile

    from benchmarks.kernel_trace import busy_ns, device_events, kernel_kind
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(3):
                jax.block_until_ready(f(x0, layers))
        files = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)
        events = device_events(files[0]) if files else []
    if not events:
        return {}
    kinds = {}
    for name, _, dur in events:
        c = kinds.setdefault(kernel_kind(name), [0, 0.0])
        c[0] += 1
        c[1] += dur
    span = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
    top = sorted(kinds.items(), key=lambda kv: -kv[1][1])[:8]
    return dict(span_us_per_layer=round(span / 1e3 / (3 * units), 3),
                busy_share=round(busy_ns(events) / span, 4),
                kernels={k: dict(count=c, mean_us=round(t / c / 1e3, 3)) for k, (c, t) in top})


def main(argv=None):
    ap = chain_parser(__doc__, "xla,ffi,pdl_start,pdl_end,xla")
    ap.add_argument("--trace", action="store_true",
                    help="also trace each arm: kernel kinds' mean time, span and busy share")
    args = ap.parse_args(argv)
    arms = parse_arms(args.arms, ARMS)
    given = {item.partition("=")[0] for item in args.tiling.split(",") if item}
    TILING_OVERRIDES.clear()
    TILING_OVERRIDES.update({name: dict(zip(("block_n", "per_program", "num_warps"), t))
                             for name, t in parse_tiling(args.tiling).items() if name in given})
    layers = make_weights(args.layers)
    x0 = jax.random.normal(jax.random.PRNGKey(1), (1, 2048), jnp.float32).astype(jnp.bfloat16)
    mb = sum(w.size * 2 for lw in layers for w in lw.values()) / args.layers / 1e6
    kernels, rows, ref = {}, [], {}
    for arm in arms:
        t0 = time.perf_counter()
        f = chain_fn(arm, args.loops, kernels)
        out = jax.block_until_ready(f(x0, layers))
        compile_s = time.perf_counter() - t0
        family = arm if arm.startswith("xla") else "launcher"  # xla_*: other math
        got = np.asarray(out[1])
        ref.setdefault(family, (arm, got))
        same = bool(np.array_equal(got, ref[family][1]))
        first = next(iter(ref.values()))[1].astype(np.float64)
        if family == "launcher":
            pdl_launch.host_stats(reset=True)
            pdl_launch.graph_stats(reset=True)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            last = jax.block_until_ready(f(x0, layers))
            times.append((time.perf_counter() - t) * 1e6 / (args.loops * args.layers))
        med = statistics.median(times)
        row = dict(arm=arm, us_per_layer=round(med, 3), us_min=round(min(times), 3),
                   us_max=round(max(times), 3), tb_s=round(mb / med, 3),
                   compile_s=round(compile_s, 2), bit_equal_in_family=same,
                   family_reference=ref[family][0],
                   timed_run_equal=bool(np.array_equal(np.asarray(last[1]), got)),
                   max_diff_to_first_arm=float(np.max(np.abs(got.astype(np.float64) - first))),
                   result_rms=float(np.sqrt(np.mean(got.astype(np.float64) ** 2))))
        if family == "launcher":
            row["host"] = pdl_launch.host_stats(reset=True)
            row["graphs"] = pdl_launch.graph_stats(reset=True)
        if args.trace:
            row["trace"] = trace_arm(f, x0, layers, args.loops * args.layers)
        print(json.dumps(row), flush=True)
        rows.append(row)
    kinfo = {f"{k[0]}:{k[1]}": dict(grid=v.grid, threads=v.threads, shared=v.shared,
                                    params=v.n_params, wait=v.has_wait, trigger=v.has_trigger)
             for k, v in kernels.items()}
    save_record("benchmarks.pdl_jax_chain", argv, args.out, layers=args.layers,
                loops=args.loops, mb_per_layer=mb, kernels=kinfo,
                tiling={k: dict(STREAM_TUNING[k], **TILING_OVERRIDES.get(k, {})) for k in ORDER},
                rows=rows)
    if not all(r["bit_equal_in_family"] and r["timed_run_equal"] for r in rows):
        print("ERROR: an arm's result differs from its family's first (JAX's launch, or the "
              "launcher's)", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
