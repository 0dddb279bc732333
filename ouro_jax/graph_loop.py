"""A one-row loop's layers as one CUDA graph of our own (experimental, opt-in: projections
'gemv+norms+stream+graph', e.g. `benchmarks.decode --projections gemv+norms+stream+graph`).
Measured slower end to end: 196.0 against 202.8 tok/s at batch 1 on an H100 (session 28,
benchmarks/results/ab_graph_b1_session28_h100.json; docs/performance.md).

Why: XLA launches every kernel with PDL but puts `griddepcontrol.wait` at its start, so no
kernel requests its weights before the kernel ahead of it has ended, and XLA's command
buffers drop PDL edges. Session 26 measured the four one-row projections in a CUDA graph
with programmatic edges, each GEMV requesting its first weight blocks before its wait and
letting the next kernel launch from its start: 35.9 against 40.1 us per layer application
(an H100, PyTorch's graph; docs/performance.md).

Here a loop's layers (five kernels each: qkv with its norm prologue, the decode attention with
RoPE, the K/V write and its own split merge, o, gate/up with its prologue, down) are the
engine's own Pallas kernels, compiled by the `triton` package (pallas_kernels.pdl_launch:
XLA's Triton is not callable), recorded once into a CUDA graph whose PDL launches are
programmatic edges, and replayed on XLA's stream by one custom call per loop
(pdl_launch.sequence(graph=True)). The GEMVs use gemv_stream's pdl="start" mode; the decode
kernel its pdl=1 mode (trigger, then wait) where it merges its splits itself.

Exact to the model: the same kernels and tilings as the default path. Only the Triton that
compiles them differs from XLA's, and may round differently (the GPU tests compare).
XLA adds the last layer's down branch and the final norm, as the default path does.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

KERNEL_PDL = "start"  # gemv_stream's PDL mode in the graph: weights first, trigger at start
_lock = threading.Lock()
_kernels: dict = {}  # compiled kernels by (kind, operand signature, tiling)


def applies(params, h, attend, proj) -> bool:
    """Whether this block's loop runs as a graph: '+graph', one row of one position, per-layer
    fused weights, and an attention that gives the graph its inputs."""
    return (getattr(proj, "graph", False) and not hasattr(h, "resid")
            and h.shape[:-1] == (1, 1) and isinstance(params.layers, (tuple, list))
            and params.layers[0].qkv_proj is not None and hasattr(attend, "graph_inputs"))


def check_available() -> None:
    """RuntimeError naming what '+graph' needs and this machine lacks."""
    if jax.default_backend() != "gpu":
        raise RuntimeError("projections '+graph' launches CUDA graphs: it needs a GPU (this "
                           f"backend is {jax.default_backend()!r})")
    import importlib.util
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError("projections '+graph' compiles its kernels with the `triton` "
                           "package, which is not installed")


def _sd(a):
    return jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)


def _compiled(key, fn, args, num_warps, num_stages):
    from pallas_kernels import pdl_launch
    with _lock:
        if key not in _kernels:
            _kernels[key] = pdl_launch.compile_pallas(fn, *args, num_warps=num_warps,
                                                      num_stages=num_stages)
        return _kernels[key]


def _sig(*args):
    return tuple((tuple(a.shape), str(a.dtype)) for a in args)


def _stream_tuning(name, n_out, k):
    from ouro_jax.projection_tuning import STREAM_TUNING, fit_stream_tuning
    return dict(fit_stream_tuning(STREAM_TUNING[name], n_out, k), pdl=KERNEL_PDL)


def gemv_kernel(name, x, w, gated=False):
    """The streaming GEMV of `name` (operands x, w; result y)."""
    from pallas_kernels.gemv_stream import gemv_stream
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    t = _stream_tuning(name, n_out, x.shape[-1])
    fn = functools.partial(gemv_stream, gated=gated, **t)
    return _compiled(("gemv", name, gated, _sig(x, w), tuple(sorted(t.items()))), fn,
                     (_sd(x), _sd(w)), t["num_warps"], 1)


def normed_kernel(name, x, norm_w, w, eps, gated, branch):
    """The streaming GEMV with its norm prologue: operands (x, norm_w, w) -> y, or with a
    branch (x, branch, branch_w, norm_w, w) -> (y, x + rms_norm(branch, branch_w))."""
    from pallas_kernels.gemv_stream import gemv_stream_normed
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    t = _stream_tuning(name, n_out, x.shape[-1])
    if branch:
        def fn(x, b, bw, nw, w):
            return gemv_stream_normed(x, nw, w, eps=eps, branch=b, branch_w=bw, gated=gated,
                                      **t)
        args = (x, x, norm_w, norm_w, w)
    else:
        def fn(x, nw, w):
            return gemv_stream_normed(x, nw, w, eps=eps, gated=gated, **t)[0]
        args = (x, norm_w, w)
    return _compiled(("normed", name, gated, branch, float(eps), _sig(*args),
                      tuple(sorted(t.items()))), fn, tuple(map(_sd, args)), t["num_warps"], 1)


@contextlib.contextmanager
def _decode_pdl(on: bool):
    """decode.TUNING['pdl'] set while the attention kernel is traced (the kernel reads it)."""
    from pallas_kernels import decode
    old = decode.TUNING.get("pdl")
    decode.TUNING["pdl"] = int(on)
    try:
        yield
    finally:
        if old is None:
            decode.TUNING.pop("pdl")
        else:
            decode.TUNING["pdl"] = old


def attention_kernel(q, kc, vc, cos, sin, g, counters):
    """The decode attention with RoPE and the K/V write (decode.paged_decode_attention_qkv as
    the engine calls it), its pallas_call operands in order: (base, offset, block tables,
    kv_lens, q, k cache, v cache, cos, sin, page, slot[, counters]); results (partials, lse,
    k cache, v cache[, merged output, counters]). With more than one split it merges them
    itself and triggers the o GEMV from its start (pdl=1); returns (kernel, splits)."""
    from pallas_kernels import decode
    one = jax.ShapeDtypeStruct((1,), jnp.int32)
    bt, lens, page, slot = g["block_tables"], g["kv_lens"], g["page"], g["slot"]
    kvh = kc.shape[-2]
    group = (q.shape[1] - 2 * kvh) // kvh
    _, splits, _ = decode.key_tiling(1, kvh, group, kc.dtype, bt.shape[1] * kc.shape[2], True)
    merges = splits > 1

    def fn(base, off, bt, lens, q, kc, vc, cos, sin, page, slot, *cnt):
        return decode.paged_decode_attention_qkv(
            q, kc, vc, (base, off), bt, lens, page, slot, rope=(cos, sin),
            trash_page=g["trash_page"], entry_stride=g["entry_stride"],
            counters=cnt[0] if cnt else None)
    args = (one, one, bt, lens, q, kc, vc, cos, sin, page, slot) + ((counters,) if merges
                                                                   else ())
    tuning = tuple(sorted((k, v) for k, v in decode.TUNING.items() if k != "pdl"))
    key = ("attention", _sig(*args), g["trash_page"], g["entry_stride"], tuning)
    num_warps = decode.TUNING.get("num_warps", decode.default_num_warps(1, kc.dtype, True))
    num_stages = decode.TUNING.get("num_stages", 2)
    with _decode_pdl(merges):  # (tracing is single-threaded: the patch is seen by this call)
        kern = _compiled(key, fn, tuple(map(_sd, args)), num_warps, num_stages)
    return kern, splits


class Plan:
    """A sequence call's operands, results and kernel steps, built in order. `updated`
    operands are aliased to a result of their own (the caches)."""

    def __init__(self):
        self.args, self.outs, self.steps, self.aliases = [], [], [], {}

    def arg(self, a):
        self.args.append(a)
        return ("in", len(self.args) - 1)

    def out(self, shape, dtype):
        self.outs.append(jax.ShapeDtypeStruct(tuple(shape), dtype))
        return ("out", len(self.outs) - 1)

    def updated(self, a):
        i, o = self.arg(a), self.out(a.shape, a.dtype)
        self.aliases[i[1]] = o[1]
        return o

    def step(self, kernel, params, pdl=True):
        self.steps.append((kernel, list(params), bool(pdl) and kernel.has_wait))


def build(params, x, cos, sin, cfg, g, kc, vc, counters, loop):
    """The plan of one loop's layers at one row: (Plan, the results holding the last layer's
    residual stream x and its down output, the caches' and counters' results)."""
    dt = x.dtype
    p = Plan()
    caches = (p.updated(kc), p.updated(vc), p.updated(counters))
    base = p.arg(jnp.reshape(jnp.asarray(loop, jnp.int32), (1,)))
    shared = dict(base=base, caches=caches,
                  tables=[p.arg(g[k].astype(jnp.int32))
                          for k in ("block_tables", "kv_lens", "page", "slot")],
                  rope=[p.arg(cos.astype(dt)), p.arg(sin.astype(dt))])
    attn = attention_kernel(jax.ShapeDtypeStruct((1, cfg.num_attention_heads
                                                  + 2 * cfg.num_key_value_heads,
                                                  cfg.head_dim), dt),
                            kc, vc, cos.astype(dt), sin.astype(dt), g, counters)
    cur, branch, d = p.arg(x), None, None
    for layer, lp in enumerate(params.layers):
        if layer:  # the previous layer's down output, added up in this qkv's prologue
            prev = params.layers[layer - 1]
            branch = (d, p.arg(prev.post_attention_layernorm_2.astype(dt)))
        cur, d = _layer(p, lp, layer, x, cur, branch, cfg, attn, shared)
    return p, cur, d, caches


def _layer(p, lp, layer, x, cur, branch, cfg, attn, shared):
    """Appends one layer's five kernels (branch: the previous layer's (down output, norm
    weight) for qkv's add_norm prologue, None on a loop's first layer); returns the results
    holding its residual stream and its down output."""
    eps, dt, d_model = cfg.rms_norm_eps, x.dtype, x.shape[-1]
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    kc_r, vc_r, cnt_r = shared["caches"]
    nw, w = p.arg(lp.input_layernorm.astype(dt)), p.arg(lp.qkv_proj)
    y = p.out((1, lp.qkv_proj.shape[0]), dt)
    k = normed_kernel("qkv", x, lp.input_layernorm.astype(dt), lp.qkv_proj, eps, False,
                      branch is not None)
    if branch is None:  # a loop's first layer: its input is a plain array
        p.step(k, [cur, nw, w, y])
        resid = cur
    else:
        resid = p.out((1, d_model), dt)
        p.step(k, [cur, branch[0], branch[1], nw, w, y, resid])
    ak, splits = attn
    group, merges = nh // nkv, splits > 1
    # the partials [1, KVH, splits, group, hd] (fp32 when merged) and their lse
    part = [p.out((1, nkv, splits, group, hd), jnp.float32 if merges else dt),
            p.out((1, nkv, splits, group), jnp.float32)]
    ins = [shared["base"], p.arg(np.asarray([layer], np.int32)), *shared["tables"][:2], y,
           kc_r, vc_r, *shared["rope"], *shared["tables"][2:]]
    if merges:
        att = p.out((1, nkv, group, hd), dt)
        p.step(ak, ins + [cnt_r] + part + [kc_r, vc_r, att, cnt_r])
    else:
        att = part[0]
        p.step(ak, ins + part + [kc_r, vc_r])
    o = p.out((1, d_model), dt)
    p.step(gemv_kernel("o", jax.ShapeDtypeStruct((1, nh * hd), dt), lp.o_proj),
           [att, p.arg(lp.o_proj), o])
    m, x2 = p.out((1, lp.gate_up_proj.shape[0] // 2), dt), p.out((1, d_model), dt)
    k = normed_kernel("gate_up", x, lp.post_attention_layernorm.astype(dt), lp.gate_up_proj,
                      eps, True, True)
    p.step(k, [resid, o, p.arg(lp.input_layernorm_2.astype(dt)),
               p.arg(lp.post_attention_layernorm.astype(dt)), p.arg(lp.gate_up_proj), m, x2])
    d = p.out((1, d_model), dt)
    p.step(gemv_kernel("down", jax.ShapeDtypeStruct(p.outs[m[1]].shape, dt), lp.down_proj),
           [m, p.arg(lp.down_proj), d])
    return x2, d


def run_loop(params, h, cos, sin, cfg, attend, state, loop, proj):
    """model.run_loop for one row as one graph: (normed state, state)."""
    from ouro_jax.model import rms_norm
    from ouro_jax.projections import Residual
    from pallas_kernels import pdl_launch
    check_available()
    g = attend.graph_inputs
    eps = cfg.rms_norm_eps
    x = h.reshape(1, -1)
    counters = state[2] if g["counters_in_state"] else jnp.zeros(
        (1, cfg.num_key_value_heads), jnp.int32)
    p, x_r, d_r, (kc_r, vc_r, cnt_r) = build(params, x, cos[:, 0], sin[:, 0], cfg, g,
                                             state[0], state[1], counters, loop)
    res = pdl_launch.sequence(p.steps, p.outs, *p.args, graph=True, aliases=p.aliases)
    last = params.layers[-1]
    x = proj.materialize(Residual(res[x_r[1]], res[d_r[1]], last.post_attention_layernorm_2),
                         eps)
    rest = state[3:] if g["counters_in_state"] else state[2:]
    kept = (res[cnt_r[1]],) if g["counters_in_state"] else ()
    state = (res[kc_r[1]], res[vc_r[1]], *kept, *rest)
    return rms_norm(x, params.norm, eps).reshape(h.shape), state
