"""The engine's '+flow' / '+flow4' projections (ouro_jax/projections.py's mlp_flow, the
gemv_flow kernel per one-row layer; pallas_kernels/gemv_flow.py has its own tests in
tests/test_gemv_flow.py): the spec, the state threaded through a loop, and the tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.flow_sync import state_size
from test_gemv_flow import _same


def test_the_flow_spec_parses_and_refuses_what_it_cannot_do():
    from ouro_jax.projections import parse
    p = parse("gemv+norms+stream+flow")
    assert p.flow == 3 and parse(p.spec) == p and p.spec.endswith("+flow")
    p4 = parse("gemv+norms+stream+flow4")
    assert p4.flow == 4 and parse(p4.spec) == p4 and p4.spec.endswith("+flow4")
    assert not parse("gemv+norms+stream").flow
    assert parse("gemv:o,gate_up,down+norms+stream+flow").flow == 3
    for bad in ("gemv+flow", "gemv+stream+flow", "gemv+norms+stream+flow+flow",
                "gemv+norms+stream+flow+flow4", "gemv:qkv,o+norms+stream+flow",
                "gemv:o,gate_up,down+norms+stream+flow4"):
        with pytest.raises(ValueError, match="'flow"):
            parse(bad)


def test_the_engine_path_threads_its_state_and_keeps_the_tokens():
    """'+flow': a one-row layer runs the qkv GEMV and one gemv_flow; through a loop the second
    layer's kernel takes the first one's state (one fresh state per loop, not per layer);
    '+flow4': the first layer's kernel also computes the second's qkv (no qkv kernel of its
    own) and the last layer's is 3 stages. A loop's output has the bits of '+norms+stream'
    (fp32, branch scale 1), and greedy decode, native and speculative, gives its tokens."""
    from engine_helpers import pallas_call_names
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.model import (decoder_layer, dense_causal_attend, rope_cos_sin, run_loop,
                                unstack_layers)
    from ouro_jax.params import random_params
    from ouro_jax.projections import parse
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    cfg = PRESETS["tiny-mha"]
    flow, plain = parse("gemv+norms+stream+flow"), parse("gemv+norms+stream")
    big = unstack_layers(random_params(cfg, 1, jnp.float32, 1.0, 0.1), fuse=True)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, cfg.hidden_size))
    cos, sin = rope_cos_sin(jnp.zeros((1,), jnp.int32), cfg.head_dim, cfg.rope_theta,
                            jnp.float32)
    assert pallas_call_names(lambda a: decoder_layer(
        big.layers[0], a, cos, sin, cfg, dense_causal_attend, None, 0, 0, flow)[0], x) == \
        ["gemv_stream_norm", "gemv_flow"]

    h0 = x[:, None, :]
    cos1, sin1 = cos[:, None], sin[:, None]
    loop = lambda proj: (lambda h: run_loop(big, h, cos1, sin1, cfg, dense_causal_attend,
                                            None, 0, proj)[0])
    _same([loop(flow)(h0)], [loop(plain)(h0)])
    eqns = [e for e in jax.make_jaxpr(loop(flow))(h0).jaxpr.eqns
            if e.primitive.name == "pallas_call" and "gemv_flow" in str(e.params)]
    assert len(eqns) == cfg.num_hidden_layers == 2
    assert eqns[1].invars[-1] is eqns[0].outvars[-1]  # the state, threaded
    flow4 = parse("gemv+norms+stream+flow4")
    _same([loop(flow4)(h0)], [loop(plain)(h0)])
    assert pallas_call_names(loop(flow4), h0) == ["gemv_stream_norm", "gemv_flow", "gemv_flow"]
    eqns = [e for e in jax.make_jaxpr(loop(flow4))(h0).jaxpr.eqns
            if e.primitive.name == "pallas_call" and "gemv_flow" in str(e.params)]
    assert [e.invars[-1].aval.shape for e in eqns] == [(state_size(4),), (state_size(3),)]

    params = random_params(cfg, 0, jnp.float32, 0.003, 0.0)
    sp = [SamplingParams(max_tokens=10, ignore_eos=True)]
    out = {}
    for spec in ("gemv+norms+stream", "gemv+norms+stream+flow", "gemv+norms+stream+flow4"):
        llm = Ouro(cfg, params, None, attention="xla", projections=spec, decode_chunk=8)
        out[spec] = (llm.generate([[3, 1, 4]], sp).outputs[0].token_ids,
                     llm.generate([[3, 1, 4]], sp, speculative=SpeculativeConfig(4, 2))
                     .outputs[0].token_ids)
    assert llm.backend == "xla+gemv+norms+stream+flow4"
    assert out["gemv+norms+stream"] == out["gemv+norms+stream+flow"] == \
        out["gemv+norms+stream+flow4"]
    assert out["gemv+norms+stream+flow4"][0] == out["gemv+norms+stream+flow4"][1]


def test_the_engine_asks_for_a_trap_on_a_give_up(monkeypatch):
    """The engine's flow kernels run with trap=True: a handover that gives up stops the
    kernel (an error), never hands on results computed from an incomplete input."""
    from ouro_jax.config import PRESETS
    from ouro_jax.model import rope_cos_sin, run_loop, dense_causal_attend, unstack_layers
    from ouro_jax.params import random_params
    from ouro_jax.projections import parse
    from pallas_kernels import gemv_flow as gf
    seen = []
    real = gf.gemv_flow
    monkeypatch.setattr(gf, "gemv_flow", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    cfg = PRESETS["tiny-mha"]
    big = unstack_layers(random_params(cfg, 1, jnp.float32, 1.0, 0.1), fuse=True)
    cos, sin = rope_cos_sin(jnp.zeros((1,), jnp.int32), cfg.head_dim, cfg.rope_theta,
                            jnp.float32)
    h = jax.random.normal(jax.random.PRNGKey(0), (1, 1, cfg.hidden_size))
    run_loop(big, h, cos[:, None], sin[:, None], cfg, dense_causal_attend, None, 0,
             parse("gemv+norms+stream+flow4"))
    assert len(seen) == cfg.num_hidden_layers and all(kw["trap"] is True for kw in seen)


def test_the_kernels_engine_tiling_is_the_engines():
    """gemv_flow.ENGINE_TILING (what its benchmark and offline compile use) is
    projections.STREAM_TUNING without num_warps: a retuned projection must change both."""
    from ouro_jax.projections import STREAM_TUNING
    from pallas_kernels.gemv_flow import ENGINE_TILING, TILING_KEYS
    assert ENGINE_TILING == {n: {k: t[k] for k in TILING_KEYS}
                             for n, t in STREAM_TUNING.items()}



def test_flow5_runs_the_next_layers_attention_in_the_layer_kernel_and_keeps_the_tokens(
        monkeypatch):
    """'+flow5' with the Pallas attention (interpret mode): in a loop of two one-row layers
    the first layer's attention is the decode kernel's, the first layer's gemv_flow then runs
    the second layer's qkv and attention (5 stages, the caches aliased through it), the
    second's is 3 stages; the loop's output and the caches have the bits of the separate
    kernels with the decode kernel's split merge (last_combine, which '+flow5' turns on; two
    splits of 4 keys, so the merge and its counters run, and come back at zero), and greedy
    decode, native and speculative (k=4 d=2), gives those tokens. Without the Pallas
    attention '+flow5' cannot run: the engine says so."""
    import pallas_kernels.decode as dk
    from engine_helpers import pallas_call_eqns, pallas_call_names
    from ouro_jax.api import Ouro
    from ouro_jax.attention import make_paged_attend
    from ouro_jax.config import PRESETS
    from ouro_jax.kv_cache import init_planes
    from ouro_jax.model import rope_cos_sin, run_loop, unstack_layers
    from ouro_jax.params import random_params
    from ouro_jax.projections import parse
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    monkeypatch.setitem(dk.TUNING, "num_splits", 2)
    monkeypatch.setitem(dk.TUNING, "block_t", 4)
    cfg = PRESETS["tiny-mha"]
    p5, plain = parse("gemv+norms+stream+flow5"), parse("gemv+norms+stream")
    assert p5.flow == 5 and parse(p5.spec) == p5
    big = unstack_layers(random_params(cfg, 1, jnp.float32, 1.0, 0.1), fuse=True)
    pos = jnp.array([[5]], jnp.int32)
    tables = jnp.array([[1, 2, 0, 0]], jnp.int32)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, jnp.float32)
    attend = make_paged_attend(cfg, tables, pos, 4, "pallas", merge_splits=True)
    k0, v0 = init_planes(cfg, 4, 4, jnp.float32)
    k0 = k0 + jax.random.normal(jax.random.PRNGKey(3), k0.shape)  # keys to attend over
    planes = (k0, v0 + 1.0, jnp.zeros((1, cfg.num_key_value_heads), jnp.int32))
    h0 = jax.random.normal(jax.random.PRNGKey(0), (1, 1, cfg.hidden_size))
    loop = lambda proj: (lambda h, st: run_loop(big, h, cos, sin, cfg, attend, st, 1, proj))
    got, want = loop(p5)(h0, planes), loop(plain)(h0, planes)
    _same([got[0], *got[1]], [want[0], *want[1]])
    assert not got[1][2].any()  # the merge counters, back at zero
    assert pallas_call_names(loop(p5), h0, planes) == [
        "gemv_stream_norm", "paged_decode_attention", "gemv_flow", "gemv_flow"]
    flows = [e for e in pallas_call_eqns(loop(p5), h0, planes) if "gemv_flow" in str(e.params)]
    assert [e.invars[-1].aval.shape for e in flows] == [(state_size(5),), (state_size(3),)]
    assert any(v.aval.shape == k0.shape for v in flows[0].outvars)  # the caches, written

    params = random_params(cfg, 0, jnp.float32, 0.003, 0.0)
    sp = [SamplingParams(max_tokens=10, ignore_eos=True)]
    out = {}
    for spec in ("gemv+norms+stream", "gemv+norms+stream+flow5"):
        llm = Ouro(cfg, params, None, attention="pallas", projections=spec, decode_chunk=8)
        out[spec] = (llm.generate([[3, 1, 4]], sp).outputs[0].token_ids,
                     llm.generate([[3, 1, 4]], sp, speculative=SpeculativeConfig(4, 2))
                     .outputs[0].token_ids)
    assert llm.backend == "pallas+gemv+norms+stream+flow5"
    assert out["gemv+norms+stream"] == out["gemv+norms+stream+flow5"]
    assert out["gemv+norms+stream+flow5"][0] == out["gemv+norms+stream+flow5"][1]
    for kw in (dict(attention="xla"), dict(attention="pallas", fused_kv_write=False)):
        with pytest.raises(ValueError, match="'\\+flow5' runs the Pallas decode attention"):
            Ouro(cfg, params, None, projections="gemv+norms+stream+flow5", **kw)
