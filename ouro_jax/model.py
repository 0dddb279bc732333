"""The Ouro forward pass as pure functions over an `OuroParams` pytree.

Math follows ../shared/OURO.md: a stack of L "sandwich" decoder layers applied T times, with
`model.norm` inside the loop; every loop's normed hidden state feeds the next loop, the exit
gate and the LM head. fp32 is kept where the reference keeps it: RMSNorm statistics, RoPE
frequencies, and the softmax. Everything else runs in the activation dtype.

Attention is pluggable. `decoder_layer` hands (q, k, v) after RoPE to an `attend` function
together with an opaque state; the dense forward passes causal self-attention with no state,
the engine passes a paged-cache writer/reader whose state is the KV cache. That keeps one
copy of the layer math for the dense, prefill, decode and speculative paths. An `attend` with
a `qkv` attribute (the engine's pallas decode; the batch-invariant mode at any C) takes the
fused projection before RoPE instead and applies RoPE and the K/V write in a kernel
(ouro_jax.attention.make_paged_attend).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from ouro_jax import graph_loop, persistent
from ouro_jax.config import OuroConfig
# the exit selection (re-exported: its callers have always found it here)
from ouro_jax.exit import (ExitSpec, exit_cdf, exit_probabilities,  # noqa: F401
                           select_exit, threshold_exit_step)
from ouro_jax.params import FUSED, LayerParams, OuroParams
from ouro_jax.projections import XLA as _XLAProjections
from ouro_jax.projections import Prepared, Residual
from ouro_jax.split_attn import SplitAttn

XLA_PROJECTIONS = _XLAProjections()

# attend(q [..., S, H, hd], k [..., S, KVH, hd], v, state, loop, layer) -> (out [..., S, H, hd], state)
# optional attend.qkv(qkv [..., S, H + 2 KVH, hd] before RoPE, cos, sin, state, loop, layer)
AttendFn = Callable[..., tuple[jax.Array, Any]]

# Test instrumentation: when set, called at trace time as hook(loop, hidden_shape) for every
# loop a program contains (tests use it to prove no (position, loop) is computed twice).
TRACE_HOOK: Optional[Callable[[int, tuple], None]] = None


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """The roundings here are the model's; pallas_kernels (the GEMV prologues, add_norm)
    repeat them."""
    xf = x.astype(jnp.float32)
    ms = jnp.mean(xf * xf, axis=-1, keepdims=True)
    y = xf * lax.rsqrt(ms + eps)
    return y.astype(x.dtype) * weight.astype(x.dtype)


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype) -> tuple[jax.Array, jax.Array]:
    """cos/sin [..., head_dim] for integer positions; frequencies in fp32, cast to dtype."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Half rotation (rotate_half). x [..., S, N, hd]; cos/sin [..., S, hd]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w[out, in]^T, the HF layout."""
    return jnp.einsum("...i,oi->...o", x, w.astype(x.dtype))


def embed(params: OuroParams, ids: jax.Array, dtype=None) -> jax.Array:
    table = params.embed_tokens
    return jnp.take(table, ids, axis=0).astype(dtype or table.dtype)


def attention_core(q, k, v, mask) -> jax.Array:
    """Grouped-query attention with an explicit boolean mask.

    q [..., Sq, H, hd]; k, v [..., Sk, KVH, hd]; mask broadcastable to [..., Sq, Sk].
    Scores and softmax in fp32; probabilities cast to the activation dtype for the PV product.
    Rows with no visible key return zeros (they only arise for padding).
    """
    *lead, sq, h, hd = q.shape
    kvh = k.shape[-2]
    g = h // kvh
    qg = q.reshape(*lead, sq, kvh, g, hd)
    scores = jnp.einsum("...qkgd,...skd->...kgqs", qg, k,
                        preferred_element_type=jnp.float32) * (hd ** -0.5)
    mask = mask[..., None, None, :, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    smax = jnp.max(scores, axis=-1, keepdims=True)
    smax = jnp.where(jnp.isfinite(smax), smax, 0.0)
    p = jnp.exp(scores - smax)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("...kgqs,...skd->...qkgd", p.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(*lead, sq, h, hd).astype(q.dtype)


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x) in fp32, rounded once to x.dtype (as torch's F.silu in bf16)."""
    xf = x.astype(jnp.float32)
    return (xf * jax.nn.sigmoid(xf)).astype(x.dtype)


def dense_causal_attend(q, k, v, state, loop, layer):
    """No-cache causal self-attention over the sequence axis (the dense forward's attend)."""
    s = q.shape[-3]
    mask = jnp.tril(jnp.ones((s, s), dtype=bool))
    return attention_core(q, k, v, mask), state


def _attention(lp: LayerParams, x, cos, sin, cfg: OuroConfig, attend: AttendFn, state, loop,
               layer, proj):
    """Input norm, q/k/v projections, RoPE and attention: (attention output, x as an array,
    state, whether the output is already o-projected). With the fused qkv weight and an
    `attend` that has `.qkv` (the engine's pallas decode, the batch-invariant mode) the
    unrotated projection goes to the kernels, which do RoPE and the K/V write; `.qkv_o`
    (opt-in, one row) also applies the o projection."""
    eps = cfg.rms_norm_eps
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    if isinstance(x, Prepared) and x.attn is not None:  # '+flow5': attention done too
        return x.attn, x.x, state, False
    if isinstance(x, Prepared):  # '+flow4': the previous layer's kernel computed it
        qkv, x = x.qkv, x.x
    elif lp.qkv_proj is not None:
        qkv, x = proj.normed("qkv", x, lp.input_layernorm, lp.qkv_proj, eps,
                             next_weight=(lp.o_proj, 1))
    if lp.qkv_proj is not None:
        if hasattr(attend, "qkv"):
            packed = qkv.reshape(*x.shape[:-1], nh + 2 * nkv, hd)
            if hasattr(attend, "qkv_o"):
                o, state = attend.qkv_o(packed, lp.o_proj, cos, sin, state, loop, layer)
                return o, x, state, True
            attn, state = attend.qkv(packed, cos, sin, state, loop, layer)
            return attn, x, state, False
        q, k, v = qkv[..., :nh * hd], qkv[..., nh * hd:(nh + nkv) * hd], qkv[..., (nh + nkv) * hd:]
    else:
        x = proj.materialize(x, eps)
        hx = rms_norm(x, lp.input_layernorm, eps)
        q, k, v = (proj.project("qkv", hx, w) for w in (lp.q_proj, lp.k_proj, lp.v_proj))
    lead = x.shape[:-1]
    q = q.reshape(*lead, nh, hd)
    k = k.reshape(*lead, nkv, hd)
    v = v.reshape(*lead, nkv, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attn, state = attend(q, k, v, state, loop, layer)
    return attn, x, state, False


def decoder_layer(lp: LayerParams, x, cos, sin, cfg: OuroConfig, attend: AttendFn, state,
                  loop, layer, proj=None, next_qkv=None, next_lp=None):
    """One sandwich-norm decoder layer. lp holds a single layer's weights (no [L] axis);
    `proj` (ouro_jax.projections) computes the projections, XLA's einsums by default. `x` and
    the result are the residual stream: an array, or with proj 'norms' a deferred
    projections.Residual that the next projection's prologue adds up (proj.materialize).
    Each projection is told the weight the next one reads (`next_weight`; next_qkv: the next
    layer's fused qkv), which the streaming GEMV may prefetch into L2; results never depend
    on it. next_lp: the next layer's weights when it follows in the same loop ('+flow4'
    computes its qkv in this layer's kernel and hands it on in a projections.Prepared)."""
    proj = proj or XLA_PROJECTIONS
    eps = cfg.rms_norm_eps
    flow = x.flow if isinstance(x, (Residual, Prepared)) else None  # gemv_flow's counters
    attn, x, state, projected = _attention(lp, x, cos, sin, cfg, attend, state, loop, layer,
                                           proj)
    lead = x.shape[:-1]
    if not projected:
        if not isinstance(attn, SplitAttn):  # (o_merge: the o projection merges the splits)
            attn = attn.reshape(*lead, cfg.num_attention_heads * cfg.head_dim)
        if hasattr(proj, "flows") and proj.flows(attn, lp):
            attn = attn.merged() if isinstance(attn, SplitAttn) else attn
            return _mlp_flow(proj, attn, x, lp, eps, flow, next_lp, attend, cos, sin, state,
                             loop, layer)
        attn = proj.project("o", attn, lp.o_proj, next_weight=None if lp.gate_up_proj is None
                            else (lp.gate_up_proj, 2))
    h = Residual(x, attn, lp.input_layernorm_2)  # h = x + rms_norm(attn, input_layernorm_2)
    if lp.gate_up_proj is not None:
        m, h = proj.normed("gate_up", h, lp.post_attention_layernorm, lp.gate_up_proj, eps,
                           gated=True, next_weight=(lp.down_proj, 1))
    else:
        h = proj.materialize(h, eps)
        m = rms_norm(h, lp.post_attention_layernorm, eps)
        m = silu(linear(m, lp.gate_proj)) * linear(m, lp.up_proj)
    m = proj.project("down", m, lp.down_proj,
                     next_weight=None if next_qkv is None else (next_qkv, 1))
    return proj.residual(h, m, lp.post_attention_layernorm_2, eps), state


def _mlp_flow(proj, attn, x, lp, eps, flow, next_lp, attend, cos, sin, state, loop, layer):
    """proj.mlp_flow; with '+flow5' (and an attend that gives its decode attention as a
    gemv_flow stage) the next layer's attention runs in this layer's kernel too, and the
    caches it wrote become the state. Returns (the layer's output, state)."""
    attention = None
    if getattr(proj, "flow", 0) == 5 and next_lp is not None and hasattr(attend, "qkv_stage"):
        attention = attend.qkv_stage(cos, sin, state, loop, layer + 1)
    out = proj.mlp_flow(attn, x, lp, eps, flow, next_lp, attention=attention)
    if isinstance(out, Prepared) and out.caches is not None:
        state = (*out.caches, *state[3:])
        out = out._replace(caches=None)
    return out, state


def run_loop(params: OuroParams, h, cos, sin, cfg: OuroConfig, attend: AttendFn, state, loop,
             proj=None):
    """One recurrent step: all L layers, then `model.norm`. `loop` may be traced.

    Stacked layer weights ([L, ...] arrays) run as a `lax.scan` (small programs, quick
    compiles: tests, training). A tuple of per-layer weights (`unstack_layers`, what the
    engine uses) is unrolled, so every GEMM reads its weight in place; slicing a stacked
    weight inside a loop makes XLA copy it first, tripling the weight traffic of decode."""
    if persistent.applies(params, h, attend):  # one row: all layers as one kernel
        return persistent.run_loop(params, h, cos, sin, cfg, attend, state, loop)
    if graph_loop.applies(params, h, attend, proj):  # one row: the layers as one CUDA graph
        return graph_loop.run_loop(params, h, cos, sin, cfg, attend, state, loop, proj)
    if isinstance(params.layers, (tuple, list)):
        n = len(params.layers)
        for layer, lp in enumerate(params.layers):
            # after the last layer the next loop's first (after the last loop the prefetch,
            # when STREAM_TUNING asks for one, reads ~3 MB nobody uses: `loop` is traced)
            h, state = decoder_layer(lp, h, cos, sin, cfg, attend, state, loop, layer, proj,
                                     next_qkv=params.layers[(layer + 1) % n].qkv_proj,
                                     next_lp=params.layers[layer + 1] if layer + 1 < n
                                     else None)
        proj = proj or XLA_PROJECTIONS
        return proj.final_norm(h, params.norm, cfg.rms_norm_eps), state

    def body(carry, xs):
        x, st = carry
        lp, layer = xs
        x, st = decoder_layer(lp, x, cos, sin, cfg, attend, st, loop, layer, proj)
        # A scan carry keeps one type: the residual stream goes on as an array.
        return ((proj or XLA_PROJECTIONS).materialize(x, cfg.rms_norm_eps), st), None

    layer_ids = jnp.arange(cfg.num_hidden_layers, dtype=jnp.int32)
    (h, state), _ = lax.scan(body, (h, state), (params.layers, layer_ids))
    return rms_norm(h, params.norm, cfg.rms_norm_eps), state


def unstack_layers(params: OuroParams, fuse: bool = False) -> OuroParams:
    """Stacked [L, ...] layer weights -> a tuple of per-layer LayerParams (see run_loop).
    With `fuse`, q/k/v and gate/up are concatenated so each is one GEMM."""
    if isinstance(params.layers, (tuple, list)):
        return params
    n = params.layers.q_proj.shape[0]
    layers = []
    for i in range(n):
        lp = jax.tree.map(lambda x, i=i: x[i], params.layers)
        if fuse:
            fused = {name: jnp.concatenate([getattr(lp, n) for n in parts], axis=0)
                     for name, parts in FUSED.items()}
            lp = dataclasses.replace(lp, **fused, **{n: None for parts in FUSED.values()
                                                     for n in parts})
        layers.append(lp)
    return dataclasses.replace(params, layers=tuple(layers))


def exit_gate_logit(params: OuroParams, h: jax.Array, sum_rows=None) -> jax.Array:
    """early_exit_gate(h) in the activation dtype: [...].

    The dot and the bias add stay in fp32 and are rounded once, as torch's nn.Linear does in
    bf16 (rounding the dot first, then the sum, differs in ~30% of bf16 gate logits, enough to
    move threshold exits). sum_rows: the same fp32 products summed by a fixed-order sum
    instead of a dot (ouro_jax.invariant.row_sum)."""
    w = params.exit_gate_w.astype(h.dtype)
    if sum_rows is None:
        z = jnp.einsum("...i,oi->...o", h, w, preferred_element_type=jnp.float32)
    else:
        z = sum_rows(h.astype(jnp.float32) * w.astype(jnp.float32)[0])[..., None]
    return (z + params.exit_gate_b.astype(jnp.float32)).astype(h.dtype)[..., 0]


def lm_head(params: OuroParams, h: jax.Array) -> jax.Array:
    return linear(h, params.lm_head)


def run_loops(params, h, cos, sin, cfg, attend, state, loops, unroll: bool = False, proj=None,
              loop_offset=None):
    """Runs a contiguous range of loops in a `lax.fori_loop` (one copy of the loop body in
    the program, whatever the range), or unrolled in Python with `unroll`.
    loop_offset: int32 [B] added to each row's loop (rows of one call at different loops,
    ouro_jax.pipelined); the attention then gets a [B] loop, the layers' weights are shared.
    Returns states [n, ...], gate logits [n, ...], state."""
    loops = list(loops)
    start, n = loops[0], len(loops)
    if loops != list(range(start, start + n)):
        raise ValueError(f"loops must be a contiguous range, got {loops}")
    if TRACE_HOOK is not None:
        TRACE_HOOK(tuple(loops), tuple(h.shape))
    # (ouro_jax.invariant's projections compute the gate per row, not as a dot)
    gate_logit = getattr(proj, "gate_logit", exit_gate_logit)
    at = (lambda loop: loop) if loop_offset is None else (lambda loop: loop + loop_offset)
    if unroll:
        hs, gs = [], []
        for loop in loops:
            h, state = run_loop(params, h, cos, sin, cfg, attend, state, at(loop), proj)
            hs.append(h)
            gs.append(gate_logit(params, h))
        return jnp.stack(hs), jnp.stack(gs), state
    hs = jnp.zeros((n, *h.shape), h.dtype)
    gs = jnp.zeros((n, *h.shape[:-1]), h.dtype)

    def body(i, carry):
        h, state, hs, gs = carry
        h, state = run_loop(params, h, cos, sin, cfg, attend, state, at(start + i), proj)
        return h, state, hs.at[i].set(h), gs.at[i].set(gate_logit(params, h))

    _, state, hs, gs = lax.fori_loop(0, n, body, (h, state, hs, gs))
    return hs, gs, state


# --- dense forward ---------------------------------------------------------------------------

class DenseOutput(NamedTuple):
    hidden_states: jax.Array  # [T, B, S, D] normed state after each loop
    gate_logits: jax.Array  # [T, B, S]
    exit_probs: jax.Array  # [T, B, S]
    logits: jax.Array  # [B, S, V] under the exit spec
    exit_steps: jax.Array  # [B, S]


def forward_dense(params: OuroParams, ids: jax.Array, cfg: OuroConfig,
                  spec: ExitSpec = ExitSpec(), positions: Optional[jax.Array] = None,
                  num_loops: Optional[int] = None) -> DenseOutput:
    """No-cache forward of ids [B, S] through all loops (or the first `num_loops`)."""
    n = cfg.total_ut_steps if num_loops is None else num_loops
    dtype = params.dtype
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(ids.shape[-1], dtype=jnp.int32), ids.shape)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, dtype)
    h = embed(params, ids, dtype)
    hidden, gates, _ = run_loops(params, h, cos, sin, cfg, dense_causal_attend, None, range(n))
    logits, steps = select_exit(params, hidden, gates, cfg, spec)
    return DenseOutput(hidden, gates, exit_probabilities(gates), logits, steps)


def loop_logits(params: OuroParams, hidden: jax.Array) -> jax.Array:
    """LM-head logits of every loop: [T, ..., V]."""
    return jax.vmap(lambda h: lm_head(params, h))(hidden)
