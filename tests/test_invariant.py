"""Batch-invariant kernels (ouro_jax.invariant, `Ouro(batch_invariant=True)`): in bf16, greedy
speculative output is bit-identical to native greedy (tokens, exit depths and log-probs), and
a request's output does not depend on the batch it shares. The control tests show the
default kernels do not have these properties here, so the main tests can fail. CPU runs the
Pallas kernels in interpret mode; the `gpu` test repeats the main one compiled."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import (has_gpu, host_reads, load, pallas_call_names,
                            primitives_outside_kernels, ragged_prompts, tiny_checkpoint)
from ouro_jax.api import Ouro
from ouro_jax.config import TINY_GQA
from ouro_jax.params import random_params
from ouro_jax.sampling import SamplingParams
from ouro_jax.speculative import SpeculativeConfig

SP = SamplingParams(max_tokens=14, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def bf16_model():
    cfg, params = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3), "bf16")
    # 70 tokens: prefill in more than one chunk size across the tests' batches, and decode
    # attention over more than one 64-key block
    return cfg, params, ragged_prompts(cfg.vocab_size, [5, 70, 3], seed=4)


def _same(a, b) -> list[bool]:
    """Per request: tokens, exit depths, finish reason and log-probs all bit-identical."""
    return [x.token_ids == y.token_ids and x.exit_depths == y.exit_depths
            and x.finish_reason == y.finish_reason
            and np.array_equal(np.array(x.logprobs), np.array(y.logprobs)) for x, y in zip(a, b)]


def _native_and_spec(llm, prompts, ks, **kw):
    native = llm.generate(prompts, SP, **kw).outputs
    return native, [llm.generate(prompts, SP, speculative=SpeculativeConfig(k, d), **kw).outputs
                    for k, d in ks]


def test_bf16_greedy_speculative_is_bit_identical_to_native(bf16_model):
    cfg, params, prompts = bf16_model
    llm = Ouro(cfg, params, None, page_size=4, batch_invariant=True)
    assert llm.backend == "pallas+invariant"  # (RoPE and the K/V write: rope_kv's kernel)
    native, specs = _native_and_spec(llm, prompts, [(4, 2), (2, 1), (3, 3)])
    for spec in specs:
        assert _same(native, spec) == [True] * len(prompts)


def test_bf16_greedy_speculative_is_bit_identical_with_the_xla_kv_write(bf16_model):
    """fused_kv_write=False: RoPE and the K/V write as XLA kernels (elementwise and a
    scatter, so still per row), labelled '+kvxla'; the tokens match rope_kv's path here."""
    cfg, params, prompts = bf16_model
    llm = Ouro(cfg, params, None, page_size=4, batch_invariant=True, fused_kv_write=False)
    assert llm.backend == "pallas+kvxla+invariant"
    native, (spec,) = _native_and_spec(llm, prompts, [(4, 2)])
    assert _same(native, spec) == [True] * len(prompts)
    fused = Ouro(cfg, params, None, page_size=4, batch_invariant=True).generate(prompts, SP)
    assert [o.token_ids for o in fused.outputs] == [o.token_ids for o in native]


def test_the_tests_model_runs_the_split_k_tiling(bf16_model):
    """The mode's o tiling splits K (session 39); at this model's width it still does (3
    splits), so the bit-identity tests above cover the fixed-order sum of the partials."""
    from ouro_jax.invariant import TUNING
    from ouro_jax.projection_tuning import fit_gemm_tuning
    cfg = bf16_model[0]
    width = cfg.num_attention_heads * cfg.head_dim
    assert TUNING["o"]["k_splits"] > 1
    assert fit_gemm_tuning(TUNING["o"], cfg.hidden_size, width)["k_splits"] > 1


def test_routes_pick_the_tile_by_rows_and_keep_the_bits(bf16_model, monkeypatch):
    """invariant.ROUTES: a call of at most a route's rows takes its tile (rows, columns,
    warps, stages), the K steps staying TUNING's; larger calls take TUNING. With routes for
    o and gate/up at 4 rows (the native calls of a batch of 3, padded to 4; the k=4
    verification has 20 rows), speculative output is still native's, bit for bit, and both
    tiles ran. A route that sets block_k, or routes out of order, are refused by name."""
    from ouro_jax import invariant
    from pallas_kernels import gemm as gemm_mod
    cfg, params, prompts = bf16_model
    tile = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
    monkeypatch.setitem(invariant.ROUTES, "o", ((4, tile),))
    monkeypatch.setitem(invariant.ROUTES, "gate_up", ((1, dict(tile, block_n=32)), (4, tile)))
    assert invariant.tiling_for("o", 4) == {**invariant.TUNING["o"], **tile}
    assert invariant.tiling_for("o", 5) == invariant.TUNING["o"]
    assert invariant.tiling_for("gate_up", 1)["block_n"] == 32
    assert invariant.tiling_for("gate_up", 2)["block_n"] == 16
    seen = set()
    real = gemm_mod.gemm

    o_shape = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim)

    def spy(x, w, **kw):  # o's calls: its weight's shape, and its partials go out unsummed
        seen.add((x.shape[0], kw["block_m"], tuple(w.shape) == o_shape and kw["partials"]))
        return real(x, w, **kw)
    monkeypatch.setattr(gemm_mod, "gemm", spy)
    llm = Ouro(cfg, params, None, page_size=4, batch_invariant=True)
    native, (spec,) = _native_and_spec(llm, prompts, [(4, 2)])
    assert _same(native, spec) == [True] * len(prompts)
    assert (4, 16, True) in seen and (20, invariant.TUNING["o"]["block_m"], True) in seen
    assert (4, invariant.TUNING["o"]["block_m"], True) not in seen
    for bad in (((4, dict(tile, block_k=32)),), ((8, tile), (4, tile))):
        monkeypatch.setitem(invariant.ROUTES, "o", bad)
        with pytest.raises(ValueError, match=r"ROUTES\['o'\]: routes are"):
            invariant.tiling_for("o", 100)


def test_layer_norms_and_adds_run_in_add_norm_kernels(bf16_model):
    """The sandwich layer after attention, as decoder_layer calls the mode's projections:
    o's split-K partials go unsummed (fp32, 3 splits here) into one add_norm kernel with the
    residual add and the next norm; the layer output stays deferred (a Residual) into the
    next qkv's add_norm. No XLA reduction sums a row, and the results equal the unfused
    path's (gemm's own sum, model.rms_norm) bit for bit on the CPU."""
    from ouro_jax.invariant import Invariant, tiling_for
    from ouro_jax.model import rms_norm
    from ouro_jax.projection_tuning import fit_gemm_tuning
    from ouro_jax.projections import Residual
    from pallas_kernels.gemm import gemm, sum_splits
    cfg = bf16_model[0]
    k, width, inter = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
        cfg.intermediate_size
    ks = iter(jax.random.split(jax.random.PRNGKey(7), 12))

    def rnd(*shape, scale=1.0):
        return (jax.random.normal(next(ks), shape, jnp.float32) * scale).astype(jnp.bfloat16)
    x, attn = rnd(5, k), rnd(5, width)
    w_o, w_gu, w_d, w_qkv = rnd(k, width, scale=0.2), rnd(2 * inter, k, scale=0.2), \
        rnd(k, inter, scale=0.2), rnd(width + 2 * 16, k, scale=0.2)
    norms = [1 + rnd(k, scale=0.1) for _ in range(4)]
    proj, eps = Invariant(), cfg.rms_norm_eps

    def tail(x, attn):
        o = proj.project("o", attn, w_o)
        m, h = proj.normed("gate_up", Residual(x, o, norms[0]), norms[1], w_gu, eps, gated=True)
        out = proj.residual(h, proj.project("down", m, w_d), norms[2], eps)
        assert isinstance(out, Residual)
        q, h2 = proj.normed("qkv", out, norms[3], w_qkv, eps)
        return o, q, h2

    assert pallas_call_names(tail, x, attn) == ["gemm", "add_norm", "gemm_silu", "gemm",
                                                "add_norm", "gemm"]
    assert "reduce_sum" not in primitives_outside_kernels(jax.make_jaxpr(tail)(x, attn).jaxpr)
    o, q, h2 = tail(x, attn)
    assert o.dtype == jnp.float32 and o.shape == (5, 3 * k)  # the partials, unsummed
    o_ref = sum_splits(o, 3).astype(jnp.bfloat16)
    h = x + rms_norm(o_ref, norms[0], eps)
    m = proj.gated(rms_norm(h, norms[1], eps), w_gu)
    d = proj.project("down", m, w_d)
    d = d if d.shape[-1] == k else sum_splits(d, d.shape[-1] // k).astype(jnp.bfloat16)
    h2_ref = h + rms_norm(d, norms[2], eps)
    np.testing.assert_array_equal(np.asarray(h2), np.asarray(h2_ref))
    q_ref = gemm(rms_norm(h2_ref, norms[3], eps), w_qkv, interpret=True, fixed_rows=True,
                 **fit_gemm_tuning(tiling_for("qkv", 5), w_qkv.shape[0], k))  # (5 rows' tile)
    np.testing.assert_array_equal(np.asarray(q), np.asarray(q_ref))


def test_bf16_request_output_does_not_depend_on_its_batch(bf16_model):
    cfg, params, prompts = bf16_model
    llm = Ouro(cfg, params, None, page_size=4, batch_invariant=True)
    together = llm.generate(prompts, SP).outputs
    alone = [llm.generate([p], SP).outputs[0] for p in prompts]
    assert _same(together, alone) == [True] * len(prompts)
    # and speculative in another batch: the first request alone, k=4
    spec_alone = llm.generate(prompts[:1], SP, speculative=SpeculativeConfig(4, 2)).outputs
    assert _same(together[:1], spec_alone) == [True]


def test_threshold_exits_pick_the_same_loops(bf16_model):
    """The exit gate's logit is per row too: with a threshold that exits at varied loops,
    speculative exit depths and tokens equal native ones."""
    cfg, params, prompts = bf16_model
    llm = Ouro(cfg, params, None, page_size=4, batch_invariant=True)
    native, (spec,) = _native_and_spec(llm, prompts, [(4, 2)], exit_threshold=0.5)
    depths = {d for out in native for d in out.exit_depths}
    assert len(depths) > 1, depths  # the threshold does pick different loops here
    assert _same(native, spec) == [True] * len(prompts)


def test_one_fetch_per_call_and_no_recompile(bf16_model, monkeypatch):
    """The mode keeps the engine's contract: a speculative call is one host fetch, and a
    second call of the same shapes compiles nothing."""
    cfg, params, prompts = bf16_model
    llm = Ouro(cfg, params, None, page_size=4, batch_invariant=True)
    sc = SpeculativeConfig(k=3, draft_loops=2, rounds_per_fetch=64)
    llm.generate(prompts, SP, speculative=sc)  # compiles
    reads = host_reads(monkeypatch)
    with jax.transfer_guard_device_to_host("disallow"):  # a no-op on CPU; `reads` counts
        res = llm.generate(ragged_prompts(cfg.vocab_size, [5, 70, 3], seed=9), SP,
                           speculative=sc)
    assert reads.fetches == 1 and res.stats.host_fetches == 1 and reads.implicit == []
    assert res.stats.compiles == 0


def test_control_default_kernels_differ_here(bf16_model):
    """Without the mode the same runs round differently (why the mode exists; if this ever
    passes with identical output, the tests above need a harder case)."""
    cfg, params, prompts = bf16_model
    llm = Ouro(cfg, params, None, page_size=4, attention="pallas")
    native, (spec,) = _native_and_spec(llm, prompts, [(4, 2)])
    alone = [llm.generate([p], SP).outputs[0] for p in prompts]
    assert not all(_same(native, spec)) and not all(_same(native, alone))


def test_fp32_matches_the_default_engine(bf16_model):
    """The mode computes the same model: in fp32 its tokens equal the default kernels'."""
    _, _, prompts = bf16_model
    cfg, params = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3))
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    a = Ouro(cfg, params, None, page_size=4, batch_invariant=True).generate(prompts, sp)
    b = Ouro(cfg, params, None, page_size=4).generate(prompts, sp)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


def test_gemm_fixed_rows_gives_every_row_the_same_bits():
    """Compiled on a GPU (interpret mode elsewhere, where it cannot tell tile shapes apart):
    full and masked (ragged) row blocks, 1 to 320 rows."""
    from pallas_kernels.gemm import gemm
    kx, kw = jax.random.split(jax.random.PRNGKey(3))
    x = jax.random.normal(kx, (320, 256), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (128, 256), jnp.float32) * 0.1).astype(jnp.bfloat16)
    tiling = dict(block_m=64, block_n=32, block_k=64, interpret=not has_gpu(), fixed_rows=True)
    for gated in (False, True):
        full = np.asarray(gemm(x, w, gated=gated, **tiling))
        for rows in (slice(0, 1), slice(7, 15), slice(3, 43), slice(0, 64), slice(1, 321)):
            part = gemm(x[rows], w, gated=gated, **tiling)
            np.testing.assert_array_equal(np.asarray(part), full[rows])


def test_row_sum_and_logprobs_are_per_row_and_close_to_xla():
    from ouro_jax.invariant import invariant_token_logprobs, row_sum
    from ouro_jax.sampling import token_logprobs
    x = jax.random.normal(jax.random.PRNGKey(5), (9, 2050), jnp.float32) * 4
    np.testing.assert_allclose(np.asarray(row_sum(x)), np.asarray(x.sum(-1)), rtol=1e-5,
                               atol=1e-3)
    assert [float(row_sum(x[i:i + 1])[0]) for i in range(9)] == np.asarray(row_sum(x)).tolist()
    tok = jnp.arange(9, dtype=jnp.int32) * 200
    lp = np.asarray(invariant_token_logprobs(x, tok))
    np.testing.assert_allclose(lp, np.asarray(token_logprobs(x, tok)), rtol=1e-6, atol=1e-5)
    assert [float(invariant_token_logprobs(x[i:i + 1], tok[i:i + 1])[0])
            for i in range(9)] == lp.tolist()


def _one_vs_block(tune: dict) -> bool:
    """Whether each of a verification block's 5 query rows equals the same query run alone
    (one per sequence), bit for bit, under the ragged kernel's `tune`. The 512-key tables
    let the default tuning split the keys, at boundaries cut from each tile's last key (so
    the second sequence's alone and block splits differ); queries 61-63 see a key block of
    64-65 that is fully masked for them in the block and absent alone."""
    from pallas_kernels import ragged_paged_attention
    kvh, hd, group, page, b, c = 2, 16, 2, 4, 2, 5
    key = jax.random.split(jax.random.PRNGKey(0), 3)
    shape = (1, 256, page, kvh, hd)
    kc = jax.random.normal(key[0], shape, jnp.float32).astype(jnp.bfloat16)
    vc = jax.random.normal(key[1], shape, jnp.float32).astype(jnp.bfloat16)
    q = jax.random.normal(key[2], (b, c, kvh * group, hd), jnp.float32).astype(jnp.bfloat16)
    bt = jnp.arange(256, dtype=jnp.int32).reshape(b, 128)
    kv_lens = jnp.array([66, 259], jnp.int32)  # the block's last query sits at kv_len - 1
    tune = dict(tune, interpret=not has_gpu())
    block = ragged_paged_attention(q.reshape(b * c, kvh * group, hd), kc, vc, jnp.int32(0),
                                   bt, kv_lens, jnp.arange(b + 1, dtype=jnp.int32) * c, **tune)
    block = np.asarray(block).reshape(b, c, kvh * group, hd)
    return all(np.array_equal(np.asarray(ragged_paged_attention(
        q[:, i], kc, vc, jnp.int32(0), bt, kv_lens - (c - 1 - i),
        jnp.arange(b + 1, dtype=jnp.int32), **tune)), block[:, i]) for i in range(c))


def test_ragged_attention_one_query_equals_its_row_among_k_plus_1():
    """At the mode's tuning, a decode query gets the bits its row gets when the k+1 queries
    of a verification share the tile; at the default tuning (splits chosen by the table,
    cut by each tile's own last key) it does not."""
    from ouro_jax.invariant import ragged_tuning
    cfg = TINY_GQA.replace(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    assert _one_vs_block(ragged_tuning(cfg))
    assert not _one_vs_block({})


def test_bad_settings_are_refused_by_name(bf16_model):
    cfg, params, _ = bf16_model
    cases = [(dict(attention="xla"), "attention='xla'"),
             (dict(projections="gemv"), "projections='gemv'"),
             (dict(persistent_layers=True), "persistent_layers"),
             (dict(fuse_projections=False), "fuse_projections=True"),
             (dict(batch_invariant="yes"), "batch_invariant must be True or False")]
    for kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            Ouro(cfg, params, None, **{"batch_invariant": True, **kw})
    odd = TINY_GQA.replace(hidden_size=40)
    with pytest.raises(ValueError, match="hidden_size = 40"):
        Ouro(odd, random_params(odd, 0, jnp.float32), None, batch_invariant=True)
    odd = TINY_GQA.replace(head_dim=24)  # (every projection still a multiple of 16)
    with pytest.raises(ValueError, match="head_dim = 24"):
        Ouro(odd, random_params(odd, 0, jnp.float32), None, batch_invariant=True)


def test_backend_string_refuses_invariant_with_other_kernels():
    from ouro_jax import engine
    with pytest.raises(ValueError, match="'invariant' chooses every projection kernel"):
        engine.forward_block(None, None, None, None, None, TINY_GQA, range(1),
                             "pallas+invariant+gemv")


def test_cli_flag(capsys):
    from ouro_jax import generate
    argv = ["--compile-cache", "", "--prompt-ids", "0,296,385,388", "--max-tokens", "8",
            "--json", "--logprobs", "--dtype", "bf16", "--batch-invariant"]
    outs = []
    for extra in ([], ["--speculative-k", "4"]):
        assert generate.main(argv + extra) == 0
        outs.append(json.loads(capsys.readouterr().out.splitlines()[0]))
    assert outs[0]["token_ids"] == outs[1]["token_ids"]
    assert outs[0]["logprobs"] == outs[1]["logprobs"]


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
def test_gpu_bf16_1p4b_width_speculative_is_bit_identical():
    """Compiled, at the 1.4B shape's width (two layers, random bf16 weights): batch 8, native
    against k=4 d=2 and k=2 d=1, and three requests alone against their batch."""
    from ouro_jax.config import OURO_1_4B
    cfg = OURO_1_4B.replace(num_hidden_layers=2)
    params = random_params(cfg, 0, jnp.bfloat16, 0.003)
    prompts = ragged_prompts(cfg.vocab_size, [5, 70, 3, 9, 30, 1, 17, 8], seed=5)
    sp = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=True)
    llm = Ouro(cfg, params, None, batch_invariant=True)
    native = llm.generate(prompts, sp).outputs
    for k, d in ((4, 2), (2, 1)):
        spec = llm.generate(prompts, sp, speculative=SpeculativeConfig(k, d)).outputs
        assert _same(native, spec) == [True] * len(prompts)
    alone = [llm.generate([p], sp).outputs[0] for p in prompts[:3]]
    assert _same(native[:3], alone) == [True] * 3


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
def test_gpu_routes_keep_the_bits():
    """Compiled, at the 1.4B shapes: every shipped route tile (invariant.ROUTES) gives each
    row the bits TUNING's tiling gives it, at 384, 320, 64, 5 and 1 rows; o's and down's
    split-K partials compared unsummed (benchmarks.gemm_tiling_bits.compare), the others
    in bf16 as the mode uses them."""
    from benchmarks.gemm_tiling_bits import compare
    from benchmarks.gemv import SHAPES
    from ouro_jax.config import OURO_1_4B
    from ouro_jax.invariant import ROUTES, TUNING
    shapes = dict(SHAPES, head=(OURO_1_4B.vocab_size, OURO_1_4B.hidden_size, False))
    routed = {name: r for name, r in ROUTES.items() if r}
    if not routed:
        pytest.skip("no route is shipped (invariant.ROUTES is empty)")
    for name, routes in routed.items():
        n, k, gated = shapes[name]
        kx, kw = jax.random.split(jax.random.PRNGKey(3))
        x = jax.random.normal(kx, (384, k), jnp.float32).astype(jnp.bfloat16)
        w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        for _, tile in routes:
            got = compare(name, {**TUNING[name], **tile}, TUNING[name], x, w, gated)
            assert got == {m: 0 for m in got}, (name, tile, got)
