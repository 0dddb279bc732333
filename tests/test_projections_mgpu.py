"""The engine's '+mgpu[:NAME,...]' projections part: the Mosaic GPU GEMV
(pallas_kernels/gemv_mgpu_normed.py) for one-row calls of the named projections.

Spec parsing and tiling fits run everywhere (the availability check is monkeypatched where
it matters); the engine tests need jax >= 0.11 (Mosaic GPU Pallas with GPU interpret mode)
and are skipped on jax 0.10.2 (CI)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from engine_helpers import has_gpu
from ouro_jax import projections
from ouro_jax.projections import NAMES, MGPU_TUNING, PallasGemv, fit_mgpu_tuning, parse

needs_mgpu = pytest.mark.skipif(not projections.mgpu_available(),
                                reason="needs jax >= 0.11 (Mosaic GPU Pallas)")


def test_mgpu_spec_parses_round_trips_and_composes_with_stream(monkeypatch):
    monkeypatch.setattr(projections, "mgpu_available", lambda: True)
    assert parse("gemv+mgpu").mgpu_names == NAMES
    p = parse("gemv+norms+stream+mgpu:down")
    assert p == PallasGemv(NAMES, fuse_norms=True, stream=True, mgpu_names=("down",))
    assert p.spec == "gemv+norms+stream+mgpu:down"
    for spec in ("gemv+mgpu", "gemv+norms+mgpu:qkv,down", "gemv:o,down+mgpu:o", "gemv+pf2+mgpu"):
        assert parse(parse(spec).spec) == parse(spec)
    assert parse("gemv+mgpu:down,qkv").mgpu_names == ("qkv", "down")  # canonical order
    assert parse("gemv+norms+stream").mgpu_names == ()
    assert parse("gemv:o,down+mgpu").mgpu_names == ("o", "down")  # the gemv part's names
    assert parse(parse("gemv:o,down+mgpu").spec) == parse("gemv:o,down+mgpu")
    for bad, msg in (("mgpu", "given once, with a 'gemv' part"),
                     ("gemm+mgpu", "given once, with a 'gemv' part"),
                     ("gemv+mgpu+mgpu:o", "given once"),
                     ("gemv+mgpu@2", "no '@ROWS'"),
                     ("gemv+mgpu:mlp", "unknown projection"),
                     ("gemv+mgpu:", "unknown projection"),
                     ("gemv:qkv+mgpu:down", "must be among the 'gemv' part's")):
        with pytest.raises(ValueError, match=msg):
            parse(bad)


def test_mgpu_spec_on_a_jax_without_mosaic_gpu_names_the_version(monkeypatch):
    monkeypatch.setattr(projections, "mgpu_available", lambda: False)
    with pytest.raises(ValueError, match=r"needs jax >= 0.11"):
        parse("gemv+norms+stream+mgpu:down")
    assert parse("gemv+norms+stream").stream  # the rest is unaffected


def test_mgpu_tuning_fits_the_1p4b_shapes_unchanged_and_shrinks_for_small_models():
    bf = jnp.bfloat16
    shapes = {"qkv": (6144, 2048, True), "o": (2048, 2048, False),
              "gate_up": (5632, 2048, True), "down": (2048, 5632, False)}
    for name, (n_out, k, normed) in shapes.items():
        t = fit_mgpu_tuning(name, MGPU_TUNING[name], n_out, k, bf, normed)
        assert tuple(t.values()) == MGPU_TUNING[name], name
    # a small model: K=128 cannot take 8 splits of >= 64 columns; block_n 128 -> 64
    small = fit_mgpu_tuning("down", (128, 64, 8, 4, False), 64, 128, bf, False)
    assert small == dict(block_n=64, block_k=64, k_splits=2, stages=4, overlap=False)
    for args, msg in ((("down", MGPU_TUNING["down"], 64, 128, jnp.float32, False), "bf16 or fp16"),
                      (("o", MGPU_TUNING["o"], 96, 128, bf, False), "multiple of 64"),
                      (("qkv", MGPU_TUNING["qkv"], 64, 128, bf, True), "multiple of 256"),
                      (("down", MGPU_TUNING["down"], 64, 96, bf, False), "multiple of 64")):
        with pytest.raises(ValueError, match=msg):
            fit_mgpu_tuning(*args)


def test_engine_refuses_a_model_the_mosaic_kernel_cannot_take_before_building(monkeypatch):
    """'+mgpu' on a model whose shapes or dtype the kernel cannot take is refused when the
    engine is constructed, naming the projection and the rule, not at the first compile."""
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    monkeypatch.setattr(projections, "mgpu_available", lambda: True)
    cfg = PRESETS["tiny-mha"]  # hidden 32: no projection output is a multiple of 64
    with pytest.raises(ValueError, match=r"'\+mgpu' \(down\).*32 output features"):
        Ouro(cfg, random_params(cfg, 0, jnp.bfloat16), None, attention="xla",
             projections="gemv+mgpu:down")
    cfg64, params = _model()
    with pytest.raises(ValueError, match=r"\(o\).*bf16 or fp16 weights, not float32"):
        Ouro(cfg64, random_params(cfg64, 0, jnp.float32), None, attention="xla",
             projections="gemv+mgpu:o")
    with pytest.raises(ValueError, match=r"\(qkv\).*K=64 to be a multiple of 256"):
        Ouro(cfg64, params, None, attention="xla", projections="gemv+norms+mgpu:qkv")
    # unfused q/k/v (the engine's --no-fuse) go through the plain kernel: no norm rule
    Ouro(cfg64, params, None, attention="xla", projections="gemv+norms+mgpu:qkv,down",
         fuse_projections=False)


def _model():
    """A bf16 model whose down projection the Mosaic kernel takes (hidden 64 = N, K = 128)."""
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    cfg = dataclasses.replace(PRESETS["tiny-mha"], hidden_size=64, intermediate_size=128,
                              num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                              num_hidden_layers=1)
    return cfg, random_params(cfg, 0, jnp.bfloat16, 0.003, 0.0)


def _tokens(cfg, params, spec, speculative=None):
    from ouro_jax.api import Ouro
    from ouro_jax.sampling import SamplingParams
    llm = Ouro(cfg, params, None, attention="xla", projections=spec, decode_chunk=8)
    sp = [SamplingParams(max_tokens=6, ignore_eos=True)]
    return llm.generate([[3, 1, 4]], sp, speculative=speculative).outputs[0].token_ids


@needs_mgpu
def test_engine_sends_one_row_down_calls_to_the_mosaic_kernel_with_the_same_tokens(monkeypatch):
    """'gemv+norms+mgpu:down' (interpret mode here): every one-row down projection goes
    through gemv_mgpu_plain (calls recorded at trace time), the others through the Triton
    GEMV; greedy tokens, native and speculative (draft one-row, verification on XLA), are
    the XLA path's (bf16, tiny model: the kernels' roundings agree here)."""
    import pallas_kernels.gemv_mgpu_normed as mk
    from ouro_jax.speculative import SpeculativeConfig
    cfg, params = _model()
    calls = []
    real = mk.gemv_mgpu_plain

    def spy(x, w, **kw):
        calls.append((x.shape, w.shape, kw["k_splits"]))
        return real(x, w, **kw)
    monkeypatch.setattr(mk, "gemv_mgpu_plain", spy)
    native = _tokens(cfg, params, "gemv+norms+mgpu:down")
    assert calls and {c[:2] for c in calls} == {((1, 128), (64, 128))}
    assert {c[2] for c in calls} == {2}  # MGPU_TUNING's 8 splits shrunk to fit K=128
    spec = _tokens(cfg, params, "gemv+norms+mgpu:down", SpeculativeConfig(2, 2))
    ref = _tokens(cfg, params, "xla")
    assert native == spec == ref and len(native) == 6


@needs_mgpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_engine_with_mosaic_projections_on_the_gpu():
    """On the GPU, every projection through the Mosaic kernel and down alone: the tokens of
    the engine's default ('gemv+norms+stream') on a tiny bf16 model."""
    from ouro_jax.speculative import SpeculativeConfig
    cfg, params = _model()
    cfg = dataclasses.replace(cfg, hidden_size=256, num_attention_heads=4, head_dim=64)
    from ouro_jax.params import random_params
    params = random_params(cfg, 0, jnp.bfloat16, 0.003, 0.0)
    ref = _tokens(cfg, params, "gemv+norms+stream")
    for spec in ("gemv+norms+stream+mgpu:down", "gemv+norms+mgpu"):
        assert _tokens(cfg, params, spec) == ref, spec
        assert _tokens(cfg, params, spec, SpeculativeConfig(4, 2)) == ref, spec
