"""[attention, o] as one gemv_flow (decode TUNING flow_o=1, ouro_jax.attention.FLOW_O): the
engine's tokens, the flow's bits against the engine's separate kernels (benchmarks.flow_layer's
ao arms), and the refusals. The kernel itself (gemv_flow with an attention stage) is tested in
test_flow_attention.py / test_gemv_flow.py."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gemv_flow import state_for
from test_flow_attention import _layer_case, _same


@pytest.mark.parametrize("o_tiling", [None, (8, 1), (4, 2)])
def test_attention_and_o_in_one_flow_give_the_separate_kernels_bits(o_tiling):
    """flow_layer's ao arm (per layer gate/up, down, qkv, then [attention, next o] as one
    gemv_flow) gives the engine's kernels' attention output, residual and caches (with the
    split merge in the attention kernel) at small shapes over two layers, at the engine's o
    tiling, at one-block programs and at 4-row blocks two per program; its state comes back
    at zero."""
    from benchmarks import flow_layer as fl
    ws, attn, h, t, new = _layer_case()
    fx = new()[1]
    ref = fl.separate(ws, attn, h, new()[0], fx, t, True, True)
    out, h2, caches, state = fl.attn_o(ws, attn, h, new()[0], state_for(2), fx, t, o_tiling,
                                       (), True)
    for got, want in zip((out, h2, *caches), (ref[0], ref[1], *ref[2]), strict=True):
        _same(got, want)
    assert not np.asarray(state).any()


def test_engine_flow_o_generates_the_same_tokens(monkeypatch):
    """decode.TUNING flow_o=1: one-row decode steps (and the draft's) run [attention, o] as
    one gemv_flow; greedy tokens equal the xla backend's in fp32, plain and speculative, at
    the default o tiling and at another, and the flow's state never leaks into the planes
    the engine keeps."""
    from engine_helpers import load, ragged_prompts, tiny_checkpoint, tokens_per_decode_tuning
    from ouro_jax.sampling import SamplingParams
    import pallas_kernels.gemv_flow as gf

    folder = tiny_checkpoint("tiny-gqa", branch_scale=0.3)
    cfg, params = load(folder)
    prompts = ragged_prompts(cfg.vocab_size, [6], seed=3)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    calls = []
    kernel = gf.gemv_flow
    monkeypatch.setattr(gf, "gemv_flow", lambda *a, **k: calls.append(len(a[1])) or
                        kernel(*a, **k))
    runs = tokens_per_decode_tuning(monkeypatch, cfg, params, prompts, sp, [
        ("xla", {}), ("pallas", dict(flow_o=1, block_t=4)),
        ("pallas", dict(flow_o=1, block_t=4, num_splits=2, flow_o_block_n=2,
                        flow_o_per_program=2))])
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert calls and set(calls) == {2}


def test_flow_o_tiling_comes_from_the_decode_tuning(monkeypatch):
    """The o stage's tiling: FLOW_O_TILING over the streaming GEMV's o tiling, the decode
    kernel's flow_o_block_n / flow_o_per_program winning, fitted to the shape; flow_o with
    fuse_o is refused."""
    import pallas_kernels.decode as decode
    from engine_helpers import load, tiny_checkpoint
    from ouro_jax.attention import _flow_o_tiling, make_paged_attend
    w = jnp.zeros((2048, 2048), jnp.bfloat16)
    monkeypatch.setattr(decode, "TUNING", dict(flow_o=1))
    assert _flow_o_tiling(w) == dict(block_n=8, block_k=512, per_program=1)
    monkeypatch.setattr(decode, "TUNING", dict(flow_o=1, flow_o_block_n=16,
                                               flow_o_per_program=2))
    assert _flow_o_tiling(w) == dict(block_n=16, block_k=512, per_program=2)
    assert _flow_o_tiling(jnp.zeros((64, 128)))["block_n"] == 16
    monkeypatch.setattr(decode, "TUNING", dict(flow_o=1, fuse_o=1))
    cfg = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3))[0]
    with pytest.raises(ValueError, match="flow_o and fuse_o are alternatives"):
        make_paged_attend(cfg, jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                          4, backend="pallas")


@pytest.mark.parametrize("argv,msg", [
    (["--decode-kernel", "flow_o=1", "--attention", "xla"], "flow_o=1 needs --attention pallas"),
    (["--decode-kernel", "flow_o=1", "--attention", "pallas", "--kv-write", "xla"],
     "flow_o=1 needs --attention pallas"),
    (["--decode-kernel", "flow_o=1", "--attention", "pallas", "--batch", "8"],
     "changes one-row decode only"),
    (["--decode-kernel", "flow_o_block_n=8", "--attention", "pallas"], "need flow_o=1"),
    (["--decode-kernel", "flow_o=1,fuse_o=1", "--attention", "pallas"],
     "takes neither fuse_o nor pdl"),
    (["--decode-kernel", "flow_o=1,pdl=1", "--attention", "pallas", "--batch", "1"],
     "takes neither fuse_o nor pdl"),
    (["--decode-kernel", "flow_o=1", "--attention", "pallas", "--batch", "1",
      "--projections", "gemv+norms+stream+flow4"], "would never run"),
])
def test_the_decode_benchmark_refuses_flow_o_where_it_would_change_nothing(argv, msg):
    from benchmarks.decode import main
    with pytest.raises(SystemExit, match=msg):
        main(argv)


def test_the_o_stage_waits_for_the_attention_and_the_diagnostic_does_not():
    """Lowered for 'cuda' (Triton IR), [attention, o]: one spin (the o stage's, on the
    attention's count) with its trap; in o's region the weight tile's load comes before
    it (requested while the attention runs) and x's after. With diag_no_wait no spin is left
    (the diagnostic's wrong results come from exactly that), and a non-bool is refused."""
    from pallas_kernels.flow_attention import AttnStage
    from pallas_kernels.gemv_flow import Stage, gemv_flow
    from test_gemv_flow import _regions
    from test_pdl import triton_ir
    s, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    k, kvh, hd = 128, 2, 64
    kc = s((3, 8, 16, kvh, hd), bf)

    def lowered(**kw):
        def f(x, w_o, kc_, vc_, bt, lens, page, slot, cnt, cos, sin, st):
            stages = [AttnStage(kc_, vc_, jnp.int32(1), bt, lens, page, slot, cnt,
                                rope=(cos, sin), trash_page=0, block_t=16, num_splits=2),
                      Stage(w_o, tiling=dict(block_n=8, block_k=64, per_program=1), name="o")]
            return gemv_flow(x, stages, st, trap=True, **kw)
        [ir] = triton_ir(f, s((1, 3 * k), bf), s((k, k), bf), kc, kc, s((1, 8), i32),
                         s((1,), i32), s((1,), i32), s((1,), i32), s((1, kvh), i32),
                         s((1, hd), bf), s((1, hd), bf), s((state_for(2).shape[0],), i32))
        return ir

    ir = lowered()
    assert ir.count("W_LOOP:") == 1 and "trap;" in ir
    *stages, _stray = _regions(ir)
    o = stages[1]
    spin = next(i for i, ln in enumerate(o) if "W_LOOP" in ln)
    w_load = lambda ln: re.search(r"tt\.load .*tensor<8x64x!tt\.ptr", ln)
    x_load = lambda ln: re.search(r"tt\.load .*tensor<64x!tt\.ptr", ln)
    assert any(w_load(ln) for ln in o[:spin]) and not any(x_load(ln) for ln in o[:spin])
    assert any(x_load(ln) for ln in o[spin:])
    assert "W_LOOP:" not in lowered(diag_no_wait=True)
    with pytest.raises(ValueError, match="diag_no_wait must be a bool"):
        lowered(diag_no_wait=1)


def test_flow_o_with_the_flow_projections_is_refused(monkeypatch):
    """flow_o replaces the o projection, which the '+flow' projections' kernel starts with:
    the engine refuses the pair instead of silently never running the flow projections."""
    import pallas_kernels.decode as decode
    from ouro_jax.engine import _check_flow_o
    from ouro_jax.projections import parse as parse_projections
    monkeypatch.setattr(decode, "TUNING", dict(flow_o=1))
    with pytest.raises(ValueError, match="use one or the other"):
        _check_flow_o(parse_projections("gemv+norms+stream+flow4"))
    _check_flow_o(parse_projections("gemv+norms+stream"))
    monkeypatch.setattr(decode, "TUNING", {})
    _check_flow_o(parse_projections("gemv+norms+stream+flow4"))

