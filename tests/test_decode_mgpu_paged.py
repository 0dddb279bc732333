"""The engine's decode attention on Mosaic GPU (pallas_kernels/decode_mgpu_paged.py): CPU
interpret mode against the reference on the fused-write cases the Triton kernel is tested on
(NaN-poisoned stale slots and trash page, RoPE, GQA, padding rows), the refusals, the
lowering for 'cuda' on a CPU machine, the engine end to end, and the 1.4B shape on a GPU.

Skipped where jax has no Mosaic GPU Pallas with GPU interpret mode (jax 0.10.2 in CI)."""

from __future__ import annotations

import pytest

try:
    import jax.experimental.pallas.mosaic_gpu as plgpu
    plgpu.InterpretGPUParams  # noqa: B018 - GPU interpret mode (jax >= 0.11)
except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the jax install
    pytest.skip(f"no Mosaic GPU Pallas with interpret mode: {e}", allow_module_level=True)

import re

import jax
import jax.numpy as jnp
import numpy as np

from engine_helpers import has_gpu
from paged_cases import assert_rope_equal, check, fused_write_case
from pallas_kernels import paged_decode_attention_qkv, paged_decode_attention_reference
from pallas_kernels import decode_mgpu_paged as dp

KV_LENS = [0, 1, 16, 17, 64, 65, 100]  # empty, page and block ends, across them


def _case(group, kv_lens=KV_LENS, hd=64, seed=7, page_size=16):
    rng = np.random.default_rng(seed)
    return fused_write_case(rng, jnp.bfloat16, 2, group, kv_lens, hd=hd, page_size=page_size)


def _rope(kv_lens, hd):
    from ouro_jax.model import rope_cos_sin
    return rope_cos_sin(jnp.asarray(np.maximum(np.asarray(kv_lens) - 1, 0)), hd, 10000.0,
                        jnp.bfloat16)


@pytest.mark.parametrize("group,block,stages", [(1, 64, 2), (2, 64, 1), (3, 128, 2),
                                                (4, 64, 4)])
def test_interpret_writes_and_attends_like_the_reference(group, block, stages):
    """Without RoPE: the new key and value land in their slot (which held NaN, so reading it
    back instead of using the new row would poison the output), every other slot is as
    before, the output matches attention over the written cache, and the padding row
    (kv_len 0, trash page) gives zeros."""
    (qkv, k, v, bt, lens), (page, slot), (q, k_want, v_want) = _case(group)
    out, k2, v2 = dp.paged_decode_attention_mgpu(qkv, k, v, jnp.int32(2), bt, lens, page, slot,
                                                 trash_page=0, block=block, stages=stages,
                                                 interpret=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    check(out, paged_decode_attention_reference(q, k_want, v_want, 2, bt, lens), jnp.bfloat16)
    assert np.all(np.asarray(out[0], np.float32) == 0)
    for got, want in ((k2, k_want), (v2, v_want)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("group", [1, 3])
def test_interpret_rope_matches_model_apply_rope(group):
    """rope=(cos, sin): the written key is bit-identical to XLA's apply_rope (every op
    rounded to bf16 in both), and the output is attention of the rotated q over it."""
    from ouro_jax.model import apply_rope
    (qkv, k, v, bt, lens), (page, slot), (q, k_want, v_want) = _case(group, seed=11)
    cos, sin = _rope(KV_LENS, 64)
    out, k2, _ = dp.paged_decode_attention_mgpu(qkv, k, v, jnp.int32(2), bt, lens, page, slot,
                                                rope=(cos, sin), trash_page=0, interpret=True)
    rot = jax.jit(lambda x: apply_rope(x[:, None], cos[:, None], sin[:, None])[:, 0])
    h = q.shape[1]
    q_rot, k_rot = rot(qkv[:, :h]), rot(qkv[:, h:h + 2])
    real = np.asarray(KV_LENS) > 0
    assert_rope_equal(k2[2, page[real], slot[real]], k_rot[real], jnp.bfloat16)
    k_want = k_want.at[2, page[real], slot[real]].set(k_rot[real])
    check(out, paged_decode_attention_reference(q_rot, k_want, v_want, 2, bt, lens),
          jnp.bfloat16)


def test_interpret_agrees_with_the_triton_kernel():
    """The kernel it would replace, on the same case with RoPE: the same caches bit for bit,
    outputs within bf16 rounding of each other (another summation order)."""
    (qkv, k, v, bt, lens), (page, slot), _ = _case(2, seed=3)
    rope = _rope(KV_LENS, 64)
    args = (qkv, k, v, jnp.int32(2), bt, lens, page, slot)
    got = dp.paged_decode_attention_mgpu(*args, rope=rope, trash_page=0, interpret=True)
    want = paged_decode_attention_qkv(*args, rope=rope, trash_page=0, interpret=True)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=2e-2, atol=2e-2)


def test_interpret_padding_row_and_trash_page_none():
    """A row aimed at the trash page with kv_len 1 writes nothing and attends to nothing
    (zeros, as the Triton kernel); with trash_page=None page 0 is an ordinary page and is
    written."""
    (qkv, k, v, bt, lens), (page, slot), _ = _case(1, kv_lens=[1, 6])
    trash = jnp.asarray([0, page[1]], jnp.int32)
    out, k2, _ = dp.paged_decode_attention_mgpu(qkv, k, v, 2, bt, lens, trash, slot,
                                                trash_page=0, interpret=True)
    assert np.all(np.asarray(out[0], np.float32) == 0)
    assert np.isnan(np.asarray(k2[2, 0], np.float32)).all()  # untouched (still NaN)
    _, k3, _ = dp.paged_decode_attention_mgpu(qkv, k, v, 2, bt, lens, trash, slot,
                                              interpret=True)
    np.testing.assert_array_equal(np.asarray(k3[2, 0, slot[0]], np.float32),
                                  np.asarray(qkv[0, 2:4], np.float32))


def test_interpret_plane_pair_is_traced_once():
    """entry=(base, offset) with entry_stride: the plane base * stride + offset, a traced base
    serving every plane with one trace (the engine's traced loop index)."""
    (qkv, k, v, bt, lens), (page, slot), (q, k_want, v_want) = _case(1, kv_lens=[5, 30])
    traces = []

    def f(base, k, v):
        traces.append(1)
        return dp.paged_decode_attention_mgpu(qkv, k, v, (base, np.int32(1)), bt, lens, page,
                                              slot, trash_page=0, entry_stride=1,
                                              interpret=True)
    f = jax.jit(f)
    for base in (1, 0):  # planes 2, then 1
        out, k2, _ = f(jnp.int32(base), k, v)
        if base == 1:
            check(out, paged_decode_attention_reference(q, k_want, v_want, 2, bt, lens),
                  jnp.bfloat16)
            np.testing.assert_array_equal(np.asarray(k2, np.float32),
                                          np.asarray(k_want, np.float32))
    assert len(traces) == 1
    assert not np.isnan(np.asarray(k2[1, page, slot], np.float32)).any()  # plane 1 written


def _bad_call(**change):
    (qkv, k, v, bt, lens), (page, slot), _ = _case(1, kv_lens=[5, 30])
    a = dict(qkv=qkv, k_cache=k, v_cache=v, entry=2, block_tables=bt, kv_lens=lens, page=page,
             slot=slot, interpret=True)
    a.update(change)
    return dp.paged_decode_attention_mgpu(**a)


@pytest.mark.parametrize("change,match", [
    (lambda c: dict(k_cache=c["k"].astype(jnp.float32), v_cache=c["v"].astype(jnp.float32)),
     "16-bit"),
    (lambda c: dict(qkv=c["qkv"][:, :-1]), "H \\+ 2 KVH"),
    (lambda c: dict(v_cache=c["v"][:, :, :, :1]), "alike"),
    (lambda c: dict(page=c["page"][:1]), "page"),
    (lambda c: dict(kv_lens=c["lens"][:1]), "kv_lens"),
    (lambda c: dict(block_tables=c["bt"][:1]), "block_tables"),
    (lambda c: dict(block=96), "block=96"),
    (lambda c: dict(block=320), "block=320"),
    (lambda c: dict(stages=0), "stages=0"),
    (lambda c: dict(stages=9), "stages=9"),
    (lambda c: dict(rope=(c["qkv"][:, 0, :8], c["qkv"][:, 0, :8])), "cos / sin"),
])
def test_refusals_name_the_problem(change, match):
    (qkv, k, v, bt, lens), (page, slot), _ = _case(1, kv_lens=[5, 30])
    c = dict(qkv=qkv, k=k, v=v, bt=bt, lens=lens, page=page)
    with pytest.raises(ValueError, match=match):
        _bad_call(**change(c))


def test_refuses_head_dims_and_page_sizes_it_cannot_tile():
    rng = np.random.default_rng(0)
    (qkv, k, v, bt, lens), (page, slot), _ = fused_write_case(rng, jnp.bfloat16, 2, 1, [5],
                                                              hd=32, page_size=16)
    with pytest.raises(ValueError, match="head_dim=32"):
        dp.paged_decode_attention_mgpu(qkv, k, v, 2, bt, lens, page, slot, interpret=True)
    (qkv, k, v, bt, lens), (page, slot), _ = fused_write_case(rng, jnp.bfloat16, 2, 1, [5],
                                                              hd=64, page_size=4)
    with pytest.raises(ValueError, match="page_size=4"):
        dp.paged_decode_attention_mgpu(qkv, k, v, 2, bt, lens, page, slot, interpret=True)
    with pytest.raises(ValueError, match="shared memory"):  # 2 x 8 x 256 x 128 x 2 B = 1 MB
        _bad_call(block=256, stages=8, k_cache=jnp.zeros((3, 9, 16, 2, 128), jnp.bfloat16),
                  v_cache=jnp.zeros((3, 9, 16, 2, 128), jnp.bfloat16),
                  qkv=jnp.zeros((2, 6, 128), jnp.bfloat16))


def _shapes(bsz, max_pages=128, planes=8):
    s, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    cache = s((planes, 1 + bsz * max_pages, 16, 16, 128), bf)
    i32 = lambda *shape: s(shape, jnp.int32)
    return (s((bsz, 48, 128), bf), cache, cache, i32(bsz, max_pages), i32(bsz), i32(bsz),
            i32(bsz), (s((bsz, 128), bf), s((bsz, 128), bf)))


@pytest.mark.parametrize("bsz,kw", [(1, {}), (1, dict(block=128, stages=2)), (8, {})])
def test_lowers_for_sm90_at_the_1p4b_shape(bsz, kw):
    """The Mosaic GPU lowering on a CPU machine: one kernel with both caches aliased to its
    outputs (updated in place), its K/V pages by TMA."""
    text = dp.lower_for_h200(*_shapes(bsz), **kw).as_text()
    aliases = re.findall(r"output_operand_alias<output_tuple_indices = \[(\d)\]", text)
    assert sorted(aliases) == ["1", "2"], aliases


def _same_or_near_tie(cfg, params, prompts, got, want, ulps: int = 2):
    """Per row: the same greedy tokens, or the first difference at a near-tie, where the
    bf16 dense forward's top two logits after the common prefix are at most `ulps` bf16
    units apart (either kernel's rounding may pick either) and `got` took one of the two."""
    from ouro_jax.model import forward_dense
    for prompt, g, w in zip(prompts, got, want):
        at = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None)
        if at is None:
            assert len(g) == len(w)
            continue
        logits = forward_dense(params, jnp.asarray([prompt + w[:at]]), cfg).logits[0, -1]
        lg = np.asarray(logits, np.float32)
        top = np.argsort(-lg)[:2]
        ulp = 2.0 ** (np.floor(np.log2(abs(lg[top[0]]))) - 7)  # bf16: 8 significant bits
        assert lg[top[0]] - lg[top[1]] <= ulps * ulp and {g[at], w[at]} <= set(top.tolist()), (
            prompt, at, g, w, top, lg[top])


def test_the_engine_generates_the_xla_backends_tokens(monkeypatch):
    """decode TUNING mgpu=1: the engine's decode steps (native and the speculative draft) run
    this kernel, in bf16 at head_dim 64 (interpret mode), and generate the XLA attention
    backend's greedy tokens, plain and speculative, up to near-ties of bf16 rounding; only
    the two KV planes are kept. (On this checkpoint the Triton kernel's rounding flips one
    near-tie of row 3; which way the XLA backend's and this kernel's rounding take row 2's
    near-ties, 2 bf16 units apart, depends on the machine: on this one's CPU (session 46) the
    XLA backend's differs from the dense forward's there.)"""
    import pallas_kernels.decode as decode
    from engine_helpers import load, ragged_prompts, tiny_checkpoint
    from ouro_jax.api import Ouro, SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    cfg, params = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3, head_dim=64), "bf16")
    prompts = ragged_prompts(cfg.vocab_size, [6, 20, 33], seed=3)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    calls = []
    real = dp.paged_decode_attention_mgpu
    monkeypatch.setattr(dp, "paged_decode_attention_mgpu",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = []
    for attention, tuning in (("xla", {}), ("pallas", {"mgpu": 1})):
        monkeypatch.setattr(decode, "TUNING", tuning)
        llm = Ouro(cfg, params, None, page_size=16, attention=attention)
        runs.append([[o.token_ids for o in llm.generate(prompts, sp, speculative=s).outputs]
                     for s in (None, SpeculativeConfig(k=2, draft_loops=2))])
        assert len(llm._planes) == 2
    for got, want in zip(runs[1], runs[0]):
        _same_or_near_tie(cfg, params, prompts, got, want)
    assert calls  # traced in the mgpu run


def test_the_engine_refuses_mgpu_with_the_triton_kernels_modes(monkeypatch):
    import pallas_kernels.decode as decode
    from ouro_jax.attention import make_paged_attend
    from ouro_jax.config import TINY_GQA
    monkeypatch.setattr(decode, "TUNING", {"mgpu": 1, "last_combine": 1})
    tables, pos = np.ones((2, 3), np.int32), np.zeros((2, 1), np.int32)
    with pytest.raises(ValueError, match="mgpu replaces the Triton decode kernel"):
        make_paged_attend(TINY_GQA, tables, pos, 16, "pallas")


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("bsz,kw", [(1, {}), (1, dict(block=128, stages=2)),
                                    (8, dict(block=64, stages=3))])
def test_gpu_matches_the_reference_and_the_triton_kernel_at_the_1p4b_shape(bsz, kw):
    """16 KV heads of 128, pages of 16, lengths across blocks and up to 2,000 positions
    (ring slots reused); the predicated page copies run here only (the interpreter has
    none). The caches as the Triton kernel writes them, the output within bf16 rounding of
    both the reference and the Triton kernel."""
    rng = np.random.default_rng(bsz)
    lens = [1, 200, 2000, 65, 129, 16, 17, 700][:bsz] if bsz > 1 else [200]
    rng_case = fused_write_case(rng, jnp.bfloat16, 16, 1, lens, hd=128, page_size=16)
    (qkv, k, v, bt, kv_lens), (page, slot), (q, k_want, v_want) = rng_case
    rope = _rope(lens, 128)
    args = (qkv, k, v, jnp.int32(2), bt, kv_lens, page, slot)
    got = jax.jit(lambda *a: dp.paged_decode_attention_mgpu(*a, rope=rope, trash_page=0,
                                                            **kw))(*args)
    want = jax.jit(lambda *a: paged_decode_attention_qkv(*a, rope=rope, trash_page=0))(*args)
    for g, w in zip(got[1:], want[1:]):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    np.testing.assert_allclose(np.asarray(got[0], np.float32), np.asarray(want[0], np.float32),
                               rtol=2e-2, atol=2e-2)
    from ouro_jax.model import apply_rope
    h = q.shape[1]
    q_rot = apply_rope(qkv[:, None, :h], rope[0][:, None], rope[1][:, None])[:, 0]
    check(got[0], paged_decode_attention_reference(q_rot, got[1], got[2], 2, bt, kv_lens),
          jnp.bfloat16)


@pytest.mark.parametrize("argv,match", [
    (["--attention", "xla"], "needs --attention pallas"),
    (["--attention", "pallas", "--kv-write", "xla"], "needs --attention pallas"),
    (["--attention", "pallas", "--projections", "gemv+norms+stream+flow5"], "flow5"),
])
def test_the_decode_benchmark_refuses_runs_mgpu_would_not_change(argv, match):
    from benchmarks.decode import main
    with pytest.raises(SystemExit, match=match):
        main(["--decode-kernel", "mgpu=1", "--synthetic", "tiny-gqa", *argv])


def test_the_attention_benchmark_runs_its_arms_in_interpret_mode(tmp_path):
    """benchmarks.attention_paged_mgpu end to end on the CPU (a smoke test of its plumbing:
    the donated caches fed back, every arm's output against the Triton arm's, the written
    K/V rows compared); device times need a GPU."""
    import json as js

    from benchmarks.attention_paged_mgpu import main
    out = tmp_path / "r.json"
    main(["--interpret", "--batch", "2", "--lengths", "150", "--planes", "2", "--calls", "1",
          "--tilings", "64:2", "--out", str(out)])
    rows = js.load(open(out))["rows"]
    assert [r["arm"] for r in rows] == ["triton", "triton_lc", "mgpu_b64_s2"]
    for r in rows:
        assert "error" not in r and r["same_kv_write"], r
        assert r["max_abs_diff_vs_triton"] < 2e-2, r
    assert rows[2]["max_abs_diff_vs_triton"] > 0  # a different kernel: not compared to itself
