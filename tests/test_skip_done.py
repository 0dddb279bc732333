"""Finished rows skip their context in the Pallas attention (ouro_jax.attention.skip_done):
the kernels get kv_len min(len, C + 1) for rows not active, the active rows' outputs do not
change, the discarded ones stay finite, and the engine's tokens are the same with and
without it, native and speculative, when rows finish at different times."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk


def _planes(cfg, pages, page):
    rng = np.random.default_rng(0)
    shape = (cfg.num_hidden_layers * cfg.total_ut_steps, pages, page, cfg.num_key_value_heads,
             cfg.head_dim)
    return tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))


def _spy_kv_lens(monkeypatch, record):
    """Wraps the decode and ragged kernels so that record(kv_lens) sees each call's kv_lens
    (a traced value inside jit: record may use jax.debug.callback)."""
    for name in ("paged_decode_attention_qkv", "ragged_paged_attention"):
        real = getattr(pk, name)

        def spy(*args, _real=real, **kw):
            record(kw["kv_lens"] if "kv_lens" in kw else args[5])
            return _real(*args, **kw)
        monkeypatch.setattr(pk, name, spy)


@pytest.mark.parametrize("c, ragged_from", [(1, 64), (1, 2), (5, 64)],
                         ids=["decode kernel", "ragged decode", "verification"])
def test_finished_rows_attend_over_at_most_c_plus_one_keys(monkeypatch, c, ragged_from):
    import pallas_kernels.decode as decode
    from ouro_jax.attention import make_paged_attend
    from ouro_jax.config import PRESETS
    cfg = PRESETS["tiny-mha"]
    page, b = 4, 3
    planes = _planes(cfg, b * 4, page)
    tables = jnp.arange(b * 4, dtype=jnp.int32).reshape(b, 4)
    last = jnp.array([9, 12, 14], jnp.int32)  # each row's last query position
    positions = last[:, None] - (c - 1) + jnp.arange(c, dtype=jnp.int32)[None]
    active = jnp.array([True, False, True])
    rng = np.random.default_rng(1)
    heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
    qkv = jnp.asarray(rng.standard_normal((b, c, heads, cfg.head_dim)), jnp.float32)
    cs = jnp.asarray(rng.standard_normal((b, c, cfg.head_dim)), jnp.float32)
    seen = []
    _spy_kv_lens(monkeypatch, lambda lens: seen.append(np.asarray(lens)))

    def run(tuning, act):
        monkeypatch.setattr(decode, "TUNING", dict(tuning, ragged_from=ragged_from))
        seen.clear()
        attend = make_paged_attend(cfg, tables, positions, page, "pallas", active=act)
        if c == 1:
            out = attend.qkv(qkv, cs, cs, planes, 1, 0)[0]
        else:
            q, k, v = jnp.split(qkv, [cfg.num_attention_heads,
                                      cfg.num_attention_heads + cfg.num_key_value_heads], axis=2)
            out = attend(q, k, v, planes, 1, 0)[0]
        (lens,) = seen
        return np.asarray(out), lens

    full, full_lens = run({}, None)
    skip, skip_lens = run({}, active)
    off, off_lens = run({"skip_done": 0}, active)
    np.testing.assert_array_equal(full_lens, [10, 13, 15])
    np.testing.assert_array_equal(off_lens, full_lens)
    np.testing.assert_array_equal(skip_lens, [10, c + 1, 15])
    np.testing.assert_array_equal(skip[[0, 2]], full[[0, 2]])  # the active rows: same bits
    np.testing.assert_array_equal(off, full)
    assert np.all(np.isfinite(skip[1]))
    assert not np.allclose(skip[1], full[1])  # (the spy saw the kernels that ran)


def test_the_engine_gives_the_same_tokens_with_and_without_it(monkeypatch):
    """Greedy, tiny-mha in fp32, three prompts whose rows finish after 3, 11 and 6 tokens:
    native and speculative (k=4, d=2) tokens with skip_done on (the default) equal those
    with it off, on the decode kernel and on the ragged decode route (ragged_from=2), and
    speculative equals native; with it on the kernels read fewer keys in all (the engine
    passes `active` from native steps, the draft and the verification)."""
    import jax
    import pallas_kernels.decode as decode
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig
    cfg = PRESETS["tiny-mha"]
    params = random_params(cfg, 0, jnp.float32, 0.003, 0.0)
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 11, 6)]
    prompts = [[3, 1, 4], [5, 9, 2, 6], [1, 1]]
    keys = []  # sum of kv_lens per kernel call, as the device ran them
    _spy_kv_lens(monkeypatch, lambda lens: jax.debug.callback(
        lambda x: keys.append(int(np.sum(x))), lens))
    runs, read = {}, {}
    for route in ({}, {"ragged_from": 2}):
        for skip in (0, 1):
            monkeypatch.setattr(decode, "TUNING", dict(route, skip_done=skip))
            llm = Ouro(cfg, params, None, attention="pallas", projections="gemv+norms+stream",
                       page_size=4)
            keys.clear()
            res = [llm.generate(prompts, sp, speculative=s)
                   for s in (None, SpeculativeConfig(k=4, draft_loops=2))]
            jax.effects_barrier()
            at = (str(route), skip)
            runs[at], read[at] = [[o.token_ids for o in r.outputs] for r in res], sum(keys)
            spec = res[1].stats.spec  # rows finished while others ran on
            assert spec["rounds_run"] >= 2 and spec["active_row_fraction"] < 1.0
    for route in ("{}", "{'ragged_from': 2}"):
        off, on = runs[(route, 0)], runs[(route, 1)]
        assert [len(t) for t in off[0]] == [3, 11, 6]
        assert on == off and off[0] == off[1]
        assert read[(route, 1)] < read[(route, 0)]


def test_summarize_counts_the_rounds_the_batch_ran_and_its_active_rows():
    """Rows active in 3, 5 and 2 rounds: the batch ran 5 rounds, 10 of 15 row-rounds active."""
    from ouro_jax.speculative import SpecCounters, summarize
    counters = SpecCounters(np.array([3, 5, 2]), np.array([12, 20, 8]), np.array([9, 15, 8]))
    total, per = summarize(counters, 3)
    assert total["rounds"] == 10 and total["rounds_run"] == 5
    assert total["active_row_fraction"] == pytest.approx(10 / 15)
    assert total["tokens_per_round"] == pytest.approx((32 + 10) / 10)
    assert [p["rounds"] for p in per] == [3, 5, 2]
    empty, _ = summarize(SpecCounters(*(np.zeros(2, int),) * 3), 2)
    assert empty["rounds_run"] == 0 and empty["active_row_fraction"] == 0.0


def test_one_row_keeps_its_context(monkeypatch):
    """Batch 1 never runs a finished row (its loops stop first), so its programs keep the
    full kv_len whatever `active` says: the batch-1 decode programs are unchanged."""
    import pallas_kernels.decode as decode
    from ouro_jax.attention import make_paged_attend
    from ouro_jax.config import PRESETS
    cfg = PRESETS["tiny-mha"]
    monkeypatch.setattr(decode, "TUNING", {})
    seen = []
    _spy_kv_lens(monkeypatch, lambda lens: seen.append(np.asarray(lens)))
    planes = _planes(cfg, 4, 4)
    attend = make_paged_attend(cfg, jnp.arange(4, dtype=jnp.int32)[None], jnp.array([[9]]), 4,
                               "pallas", active=jnp.array([False]))
    heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
    attend.qkv(jnp.ones((1, 1, heads, cfg.head_dim)), jnp.ones((1, 1, cfg.head_dim)),
               jnp.ones((1, 1, cfg.head_dim)), planes, 0, 0)
    np.testing.assert_array_equal(seen[0], [10])


def test_the_stats_line_names_the_batch_rounds():
    from ouro_jax.api import GenerationStats
    from ouro_jax.speculative import SpecCounters, summarize
    spec, _ = summarize(SpecCounters(np.array([3, 5]), np.array([12, 20]), np.array([9, 15])), 2)
    stats = GenerationStats(prompt_tokens=4, generated_tokens=34, prefill_s=0.1, decode_s=1.0,
                            compile_s=0.0, compiles=0, host_fetches=1, decode_tokens=32,
                            spec=spec)
    assert "| batch rounds 5 (80.0% of row-rounds active)" in stats.line()
