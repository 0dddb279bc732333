"""Opt-in batch-1 decode on the persistent whole-layer kernel (ouro_jax/persistent.py):
the engine end to end in CPU interpret mode (jax >= 0.11), the weight packing, and the
refusals (these also on jax 0.10)."""

from __future__ import annotations

import numpy as np
import pytest

from engine_helpers import load, ragged_prompts, tiny_checkpoint
from ouro_jax import persistent
from ouro_jax.api import Ouro, SamplingParams

# a tiny model the kernel can tile (rows and K multiples of 64, head_dim 64)
SHAPE = dict(hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=2)
TINY_TILING = dict(block_n=64, block_k=64, stages=16)


def _mosaic():
    try:
        import jax.experimental.pallas.mosaic_gpu as plgpu
        return hasattr(plgpu, "InterpretGPUParams")
    except ImportError:
        return False


needs_mosaic = pytest.mark.skipif(not _mosaic(), reason="no Mosaic GPU Pallas interpret "
                                                         "mode (jax < 0.11)")


def _model(dtype="bf16"):
    return load(tiny_checkpoint("tiny-gqa", branch_scale=0.3, **SHAPE), dtype)


@needs_mosaic
def test_the_engine_generates_the_xla_backends_tokens(monkeypatch):
    """persistent_layers: one-row decode blocks (native decode, the speculative draft) run
    each loop as one kernel and give the XLA backend's greedy tokens, plain and speculative;
    prefill and verification take the ordinary path; only the two planes are kept."""
    from ouro_jax.speculative import SpeculativeConfig
    monkeypatch.setattr(persistent, "TILING", TINY_TILING)
    calls = []
    real = persistent.run_loop
    monkeypatch.setattr(persistent, "run_loop", lambda *a: calls.append(1) or real(*a))
    cfg, params = _model()
    prompts = ragged_prompts(cfg.vocab_size, [6, 20], seed=3)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    runs = []
    for kw in (dict(attention="xla"), dict(attention="pallas", persistent_layers=True)):
        llm = Ouro(cfg, params, None, page_size=16, **kw)
        runs.append([[llm.generate([p], sp, speculative=s).outputs[0].token_ids
                      for p in prompts] for s in (None, SpeculativeConfig(k=2, draft_loops=2))])
        assert len(llm._planes) == 2
    assert runs[1] == runs[0]
    assert calls and "+persistent" in llm.backend


@needs_mosaic
def test_pack_lays_out_the_layers(monkeypatch):
    """The tile-major weights hold each layer's fused projections; the branch norm before
    layer l's qkv is layer l - 1's post_attention_layernorm_2; applies() only to one row."""
    import jax.numpy as jnp

    from ouro_jax.model import unstack_layers
    from pallas_kernels.chain_mgpu import tile_weights
    cfg, params = _model()
    params = unstack_layers(params, fuse=True)
    p = persistent.pack(cfg, params, TINY_TILING)
    lp = params.layers
    want = tile_weights(tuple(jnp.stack([getattr(x, n) for x in lp]) for n in
                              ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")), 64, 64)
    np.testing.assert_array_equal(np.asarray(p.w, np.float32), np.asarray(want, np.float32))
    np.testing.assert_array_equal(np.asarray(p.norms[0][1], np.float32),
                                  np.asarray(lp[0].post_attention_layernorm_2, np.float32))
    np.testing.assert_array_equal(np.asarray(p.last_norm, np.float32),
                                  np.asarray(lp[-1].post_attention_layernorm_2, np.float32))
    attend = type("A", (), {"chain_attention": None})()
    params = params.__class__(**{**params.__dict__, "persistent": p})
    assert persistent.applies(params, jnp.zeros((1, 1, 256)), attend)
    assert not persistent.applies(params, jnp.zeros((2, 1, 256)), attend)
    assert not persistent.applies(params, jnp.zeros((1, 3, 256)), attend)
    assert not persistent.applies(params, jnp.zeros((1, 1, 256)), object())


@pytest.mark.parametrize("dtype,kw,match", [
    ("bf16", dict(attention="xla"), "needs attention='pallas'"),
    ("bf16", dict(attention="pallas", fused_kv_write=False), "fused_kv_write"),
    ("bf16", dict(attention="pallas", fuse_projections=False), "fuse_projections"),
    ("fp32", dict(attention="pallas"), "bf16"),
    ("bf16", dict(attention="pallas", persistent_layers=1), "True or False"),
])
def test_refusals(dtype, kw, match):
    cfg, params = _model(dtype)
    kw.setdefault("persistent_layers", True)
    with pytest.raises(ValueError, match=match):
        Ouro(cfg, params, None, page_size=16, **kw)


def test_refuses_head_dims_it_cannot_tile():
    cfg, params = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3), "bf16")  # head_dim 8
    with pytest.raises(ValueError, match="head_dim=8"):
        Ouro(cfg, params, None, page_size=16, attention="pallas", persistent_layers=True)


@pytest.mark.parametrize("argv,match", [
    (["--persistent-tiling", "uniform=1"], "give both"),
    (["--persistent-layers", "--persistent-tiling", "fast=1"], "KEY=INT"),
    (["--persistent-layers", "--persistent-tiling", "stages=x"], "KEY=INT"),
])
def test_the_decode_benchmark_refuses_bad_persistent_tilings(argv, match):
    from benchmarks.decode import main
    with pytest.raises(SystemExit, match=match):
        main(["--synthetic", "tiny-gqa", *argv])


def test_pack_refuses_unknown_tiling_keys():
    cfg, params = _model()
    from ouro_jax.model import unstack_layers
    with pytest.raises(ValueError, match="unknown keys"):
        persistent.pack(cfg, unstack_layers(params, fuse=True), dict(fast=True))
