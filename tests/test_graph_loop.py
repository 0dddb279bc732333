"""Opt-in batch-1 decode loops as CUDA graphs of our own (ouro_jax/graph_loop.py, projections
'+graph'): the spec and engine refusals (CPU), the plan one loop makes with its kernels
compiled for sm_90 by the `triton` package (CPU, where it is installed), and on a GPU the
engine's tokens and caches against the default path."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax import graph_loop
from ouro_jax.projections import parse

gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
has_triton = importlib.util.find_spec("triton") is not None
SPEC = "gemv+norms+stream+graph"


@pytest.mark.parametrize("spec", ["gemv+graph", "gemv:o+norms+stream+graph",
                                  "gemv+norms+stream+flow+graph", "gemv+norms+stream+graph+graph",
                                  "gemv+norms+stream+mgpu+graph"])
def test_the_spec_refuses_graph_without_its_parts(spec):
    with pytest.raises(ValueError):
        parse(spec)


def test_the_spec_round_trips():
    p = parse(SPEC)
    assert p.graph and p.spec == SPEC and parse(p.spec) == p
    assert not parse("gemv+norms+stream").graph


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the CPU refusal")
def test_the_engine_refuses_graph_off_a_gpu():
    from engine_helpers import load, tiny_checkpoint
    from ouro_jax.api import Ouro
    cfg, params = load(tiny_checkpoint("tiny-gqa"), "bf16")
    with pytest.raises(RuntimeError, match="needs a GPU"):
        Ouro(cfg, params, None, attention="pallas", projections=SPEC)
    with pytest.raises(ValueError, match="attention='pallas'"):
        Ouro(cfg, params, None, attention="xla", projections=SPEC)


def _loop_inputs(layers=2, pos=150):
    """A 1.4B-wide model of `layers` layers, a 16-page block table and one position."""
    from ouro_jax.attention import make_paged_attend
    from ouro_jax.config import OuroConfig
    from ouro_jax.kv_cache import init_planes
    from ouro_jax.model import rope_cos_sin, unstack_layers
    from ouro_jax.params import random_params
    cfg = OuroConfig(vocab_size=1024, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                     head_dim=128)
    params = unstack_layers(random_params(cfg, dtype=jnp.bfloat16, branch_scale=0.3), fuse=True)
    planes = init_planes(cfg, 64, 16, jnp.bfloat16)
    k = jax.random.PRNGKey(3)  # cached keys and values to attend over
    planes = tuple(jax.random.normal(jax.random.fold_in(k, i), p.shape, jnp.float32)
                   .astype(p.dtype) for i, p in enumerate(planes))
    positions = jnp.array([[pos]], jnp.int32)
    attend = make_paged_attend(cfg, jnp.arange(16, dtype=jnp.int32)[None], positions, 16,
                               backend="pallas")
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, jnp.bfloat16)
    h = jax.random.normal(jax.random.fold_in(k, 9), (1, 1, 2048), jnp.float32
                          ).astype(jnp.bfloat16)
    return cfg, params, planes, attend, cos, sin, h


@pytest.mark.skipif(not has_triton, reason="needs the `triton` package (compiles offline)")
def test_one_loop_is_five_kernels_a_layer_on_the_callers_buffers():
    """The plan: qkv (plain norm prologue on layer 0, add_norm after), the decode attention
    on its 3-D grid merging its splits, o, gate/up, down; every kernel waits before its
    reads and launches with PDL; the caches and counters are updated in place; the plan
    passes the launcher's own check."""
    from pallas_kernels import pdl_launch
    cfg, params, planes, attend, cos, sin, h = _loop_inputs()
    assert graph_loop.applies(params, h, attend, parse(SPEC))
    assert not graph_loop.applies(params, h, attend, parse("gemv+norms+stream"))
    g = attend.graph_inputs
    cnt = jnp.zeros((1, 16), jnp.int32)
    p, x_r, d_r, caches = graph_loop.build(params, h.reshape(1, -1), cos[:, 0], sin[:, 0], cfg,
                                           g, planes[0], planes[1], cnt, jnp.int32(2))
    names = [k.name for k, _, _ in p.steps]
    assert len(names) == 10
    assert names[0] == "gemv_stream_norm" and names[5] == "gemv_stream_add_norm"
    assert names[1] == names[6] == "paged_decode_attention"
    assert p.steps[1][0].grid_yz[0] == 16 and p.steps[1][0].grid_yz[1] > 1  # KV heads, splits
    assert all(pdl and k.has_wait for k, _, pdl in p.steps)
    assert p.aliases == {0: 0, 1: 1, 2: 2} and [o[1] for o in caches] == [0, 1, 2]
    plan = pdl_launch.sequence_plan(p.steps, len(p.args), len(p.outs))
    assert pdl_launch.check_plan(plan, len(p.args) + len(p.outs))
    # the attention of layer 1 reads layer 1's qkv output and writes the aliased caches
    att_params = p.steps[6][1]
    assert att_params[4] == p.steps[5][1][5]  # q = that layer's qkv result
    assert att_params[5:7] == [("out", 0), ("out", 1)]


def _default_loop(cfg, params, planes, attend, cos, sin, h, proj):
    from ouro_jax.model import run_loop
    return run_loop(params, h, cos, sin, cfg, attend, planes, jnp.int32(1), proj)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("layers", [2, 24])
def test_gpu_a_graph_loop_tracks_the_default_loop_and_caches(layers):
    """One loop: the graph's output against the default path's (the same kernels, compiled by
    another Triton, the attention merging its splits itself). Two layers: within 2% in norm.
    24 layers (rounding differences grow layer by layer): no farther from XLA's einsum path
    than the default path is, give or take half. The K/V writes land in the same rows (two
    layers: within 2% in norm); a second call replays the recorded graph and gives the same
    bits."""
    from pallas_kernels import pdl_launch
    cfg, params, planes, attend, cos, sin, h = _loop_inputs(layers=layers)

    def loop_fn(spec):
        return jax.jit(lambda params, planes, h: _default_loop(cfg, params, planes, attend, cos,
                                                               sin, h, parse(spec)))
    want, want_planes = loop_fn("gemv+norms+stream")(params, planes, h)
    graph = loop_fn(SPEC)
    pdl_launch.graph_stats(reset=True)
    got, got_planes = graph(params, planes, h)
    again, _ = graph(params, planes, h)
    stats = pdl_launch.graph_stats(reset=True)
    assert stats["recorded"] >= 1 and stats["recorded"] + stats["replayed"] == 2
    np.testing.assert_array_equal(np.asarray(again), np.asarray(got))
    err = _rel(got, want)
    if layers == 2:
        assert err <= 2e-2, err
    else:
        xla, _ = loop_fn("xla")(params, planes, h)
        e_graph, e_default = _rel(got, xla), _rel(want, xla)
        assert e_graph <= 1.5 * e_default + 1e-3, (err, e_graph, e_default)
    for orig, a, b in zip(planes, want_planes[:2], got_planes[:2]):
        orig, a, b = (np.asarray(x, np.float32) for x in (orig, a, b))
        written = np.any(a != orig, axis=-1)  # one row per (layer, KV head) in loop 1's planes
        assert 0 < written.sum() <= layers * 16
        np.testing.assert_array_equal(written, np.any(b != orig, axis=-1))
        if layers == 2:  # (elementwise, a few values sit several bf16 steps apart)
            assert _rel(b[written], a[written]) <= 2e-2


@gpu
@pytest.mark.gpu
def test_gpu_the_engine_with_graph_loops_tracks_the_default_tokens():
    """Batch-1 greedy decode, 1.4B width, 4 layers: the '+graph' engine's tokens against the
    default's (the same math, another Triton's rounding: at least 90% agree, and the first
    four exactly)."""
    from engine_helpers import ragged_prompts
    from ouro_jax.api import Ouro, SamplingParams
    from ouro_jax.config import OuroConfig
    from ouro_jax.params import random_params
    cfg = OuroConfig(vocab_size=4096, hidden_size=2048, intermediate_size=5632,
                     num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
                     head_dim=128)
    params = random_params(cfg, dtype=jnp.bfloat16, branch_scale=0.003, norm_jitter=0.0)
    prompt = ragged_prompts(cfg.vocab_size, [40], seed=1)[0]
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    toks = []
    for spec in ("gemv+norms+stream", SPEC):
        llm = Ouro(cfg, params, None, attention="pallas", projections=spec)
        toks.append(llm.generate([prompt], sp).outputs[0].token_ids)
    assert "+graph" in llm.backend
    same = np.mean(np.asarray(toks[0]) == np.asarray(toks[1]))
    assert toks[0][:4] == toks[1][:4] and same >= 0.9, (toks, same)


@pytest.mark.skipif(not has_triton or jax.default_backend() == "gpu",
                    reason="needs the `triton` package; lowers for cuda on a CPU")
@pytest.mark.parametrize("k", [0, 4])
def test_the_engines_programs_lower_with_graph_loops_for_cuda(monkeypatch, k):
    """The 1.4B engine's batch-1 decode program (and the speculative one, whose draft is one
    row) lowered for cuda on this CPU with '+graph': each loops' layers go through one graph
    call (one call site in the loop's fori_loop; the draft's loops too), and no Pallas
    kernel of the graphed layers is left for XLA to launch in native decode."""
    import argparse
    import functools
    from benchmarks import lower_time
    from pallas_kernels.offline_compile import sm90_device_info
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr("ouro_jax.projections.GPU_DEFAULT", SPEC)
    args = argparse.Namespace(preset="1.4b", dtype="bf16", batch=1, k=k, draft_loops=2,
                              prompt_len=128, new_tokens=64, platform="cuda")
    with sm90_device_info():
        llm, progs = lower_time.build(args)
        assert llm.backend.endswith("+graph")
        name, fn, static, donate, call_args = progs[-1]
        text = jax.jit(functools.partial(fn, **static), donate_argnums=donate).trace(
            *call_args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("ouro_pdl_sequence_graph") == (1 if k == 0 else 2)
    if k == 0:
        assert "gemv_stream" not in text and "paged_decode_attention" not in text


def test_the_benchmarks_graph_pdl_switch_sets_the_graphed_gemvs_trigger():
    """benchmarks' --graph-pdl end: every graphed GEMV triggers once its last weight block is
    requested (gemv_stream pdl="end"); the reset restores the shipped "start"; a bad value
    is refused and changes nothing."""
    from benchmarks.tuning import apply_kernel_tuning
    try:
        t = apply_kernel_tuning("", "", graph_pdl="end")
        assert graph_loop.KERNEL_PDL == "end" and t["graph_pdl"] == "end"
        assert graph_loop._stream_tuning("qkv", 6144, 2048)["pdl"] == "end"
        with pytest.raises(SystemExit, match="--graph-pdl"):
            apply_kernel_tuning("", "", graph_pdl="middle")
        assert graph_loop.KERNEL_PDL == "end"
    finally:
        assert "graph_pdl" not in apply_kernel_tuning("", "")
    assert graph_loop.KERNEL_PDL == "start"
    assert graph_loop._stream_tuning("down", 2048, 5632)["pdl"] == "start"


def test_graph_pdl_without_graph_projections_is_refused():
    """--graph-pdl end on the default projections would record a default run under its name."""
    from benchmarks import decode
    with pytest.raises(SystemExit, match="--graph-pdl sets the '\\+graph' loops"):
        decode.main(["--graph-pdl", "end", "--synthetic", "tiny-gqa", "--batch", "1"])
