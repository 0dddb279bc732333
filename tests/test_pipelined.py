"""Pipelined self-speculation (ouro_jax.pipelined): identity with plain greedy decoding
(XLA and Pallas interpret backends), the K/V it leaves, its sampling distribution, one fetch
per call, the config's refusals, and the decode kernel's plane per row."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import host_reads, load, ragged_prompts, tiny_checkpoint
from ouro_jax.api import Ouro
from ouro_jax.sampling import SamplingParams
from ouro_jax.speculative import SpeculativeConfig

PIPE = SpeculativeConfig(k=1, draft_loops=2, rounds_per_fetch=5, pipelined=True)
PIPE4 = SpeculativeConfig(k=1, draft_loops=1, rounds_per_fetch=5, pipelined=True)  # 4 stages


@pytest.fixture(scope="module")
def greedy_setup():
    """tiny-mqa with an EOS, a stop id and limits that end rows at different ticks."""
    cfg, params = load(tiny_checkpoint("tiny-mqa", branch_scale=0.3))
    prompts = ragged_prompts(cfg.vocab_size, [5, 12, 1, 7], seed=4)
    probe = Ouro(cfg, params, None, page_size=4)
    free = probe.generate(prompts, SamplingParams(max_tokens=30, ignore_eos=True)).outputs
    cfg = cfg.replace(eos_token_id=free[0].token_ids[10])
    sps = [SamplingParams(max_tokens=23),
           SamplingParams(max_tokens=17, ignore_eos=True),
           SamplingParams(max_tokens=30, ignore_eos=True,
                          stop_token_ids=(free[2].token_ids[14],)),
           SamplingParams(max_tokens=9)]
    llm = Ouro(cfg, params, None, page_size=4, decode_chunk=8)
    return llm, prompts, sps, llm.generate(prompts, sps)


def _same(plain, res):
    for a, b in zip(plain.outputs, res.outputs):
        assert b.token_ids == a.token_ids
        assert b.finish_reason == a.finish_reason
        assert b.exit_depths == a.exit_depths


@pytest.mark.parametrize("ticks,d", [(1, 2), (5, 2), (64, 2), (1, 1), (5, 1), (64, 1)])
def test_greedy_pipelined_is_token_identical(greedy_setup, ticks, d):
    """1 tick per fetch (the pipeline carried across every fetch), 5 (fetch boundaries
    mid-generation) and 64 (one fetch); 2 stages of 2 loops and 4 stages of 1."""
    llm, prompts, sps, plain = greedy_setup
    sc = SpeculativeConfig(k=1, draft_loops=d, rounds_per_fetch=ticks, pipelined=True)
    res = llm.generate(prompts, sps, speculative=sc)
    _same(plain, res)
    assert {o.finish_reason for o in res.outputs} == {"stop", "length"}
    s = res.stats.spec
    assert 0 < s["accepted"] < s["drafted"] < s["rounds"]
    # each verified draft commits one token: every token but prefill's came from a tick
    assert s["drafted"] == sum(len(o.token_ids) - 1 for o in res.outputs)
    assert s["tokens_per_round"] == pytest.approx(s["drafted"] / s["rounds"])


@pytest.mark.parametrize("d", [1, 2, 3])
def test_six_loops_in_six_three_and_two_stages(d):
    """A model of T = 6 loops: 6, 3 and 2 stages, greedy tokens and exit depths as plain
    decoding's, at 3 ticks per fetch (crossing fetches mid-pipeline)."""
    cfg, params = load(tiny_checkpoint("tiny-mqa", branch_scale=0.3, total_ut_steps=6))
    assert cfg.total_ut_steps == 6
    prompts = ragged_prompts(cfg.vocab_size, [4, 9, 1], seed=5)
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 7, 15)]
    llm = Ouro(cfg, params, None, page_size=4)
    res = llm.generate(prompts, sps, speculative=SpeculativeConfig(
        k=1, draft_loops=d, rounds_per_fetch=3, pipelined=True))
    _same(llm.generate(prompts, sps), res)
    s = res.stats.spec
    assert s["drafted"] == sum(len(o.token_ids) - 1 for o in res.outputs)
    assert 0 < s["accepted"] < s["drafted"]


@pytest.mark.parametrize("exit_kw", [dict(exit_at_step=1), dict(exit_threshold=0.3),
                                     dict(weighted_exit=True)])
@pytest.mark.parametrize("sc", [PIPE, PIPE4], ids=["d2", "d1"])
def test_exit_modes_match_plain_decoding(greedy_setup, exit_kw, sc):
    """The last stage's exit selection (a fixed step below the draft's depth, a threshold, the
    weighted mix, whose draft and target logits come from separate LM-head calls)."""
    llm, prompts, sps, _ = greedy_setup
    _same(llm.generate(prompts, sps, **exit_kw),
          llm.generate(prompts, sps, speculative=sc, **exit_kw))


@pytest.mark.parametrize("kw,ragged_from", [(dict(attention="pallas"), None),
                                             (dict(attention="pallas", fused_kv_write=False),
                                              None),
                                             (dict(attention="pallas"), 2)])
def test_pallas_pipelined_is_token_identical(kw, ragged_from, monkeypatch):
    """The decode kernel (interpret mode) reading each row's own plane, with the K/V write
    in the kernel and apart from it; and from `ragged_from` rows (64 by default: batch 32
    and up here) the RoPE/K/V-write kernel and the ragged kernel, each reading it."""
    import pallas_kernels as pk
    if ragged_from is not None:
        monkeypatch.setitem(pk.decode.TUNING, "ragged_from", ragged_from)
    cfg, params = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3))
    prompts = ragged_prompts(cfg.vocab_size, [5, 12, 1], seed=4)
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (13, 7, 10)]
    llm = Ouro(cfg, params, None, page_size=4, decode_chunk=8, **kw)
    res = llm.generate(prompts, sps, speculative=SpeculativeConfig(
        k=1, draft_loops=2, rounds_per_fetch=40, pipelined=True))
    _same(llm.generate(prompts, sps), res)
    assert res.stats.host_fetches == 1


@pytest.mark.parametrize("attention,sc", [("xla", PIPE), ("pallas", PIPE), ("xla", PIPE4)],
                         ids=["xla-d2", "pallas-d2", "xla-d1"])
def test_kv_planes_equal_plain_decoding(attention, sc):
    """After whole generations, the K/V of every committed position in every plane (loop,
    layer) equal plain decoding's: each stage's writes land in its own planes (XLA's
    scatter; the decode kernel's fused write), and the work on rejected drafts
    is rewritten."""
    cfg, params = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3))
    prompts = ragged_prompts(cfg.vocab_size, [6, 3], seed=2)
    sps = [SamplingParams(max_tokens=11, ignore_eos=True)] * 2

    def planes_after(speculative):
        llm = Ouro(cfg, params, None, page_size=4, attention=attention)
        out = llm.generate(prompts, sps, speculative=speculative)
        kc, vc = (np.asarray(x) for x in llm._planes)
        tables = np.asarray(llm.last_block_tables)
        per_row = []
        for row, (p, o) in enumerate(zip(prompts, out.outputs)):
            pos = np.arange(len(p) + len(o.token_ids) - 1)  # the last token is never run
            per_row.append((kc[:, tables[row, pos // 4], pos % 4],
                            vc[:, tables[row, pos // 4], pos % 4]))
        return per_row, out.stats.spec

    plain, _ = planes_after(None)
    piped, stats = planes_after(sc)
    assert stats["accepted"] < stats["drafted"]  # some drafts were rejected and redone
    for (k0, v0), (k1, v1) in zip(plain, piped):
        np.testing.assert_allclose(k1, k0, atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(v1, v0, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("d", [2, 1])
def test_pipelined_sampling_preserves_target_distribution(d):
    """Chi-square over the joint of 3 generated tokens (tiny vocab, many seeds) against the
    target's exact probabilities (the speculative test's oracle and statistic)."""
    from test_speculative import _exact_joint

    cfg, params = load(tiny_checkpoint("tiny-mqa", seed=5, vocab_size=6))
    llm = Ouro(cfg, params, None, page_size=4)
    prompt, temp, t = [1, 2, 3], 1.0, 3
    exact = _exact_joint(cfg, params, prompt, temp, t)
    sps = [SamplingParams(max_tokens=t, temperature=temp, seed=s, ignore_eos=True)
           for s in range(4096)]
    sc = SpeculativeConfig(k=1, draft_loops=d, rounds_per_fetch=8, pipelined=True)
    res = llm.generate([prompt] * len(sps), sps, speculative=sc)
    counts: dict = {}
    for o in res.outputs:
        counts[tuple(o.token_ids)] = counts.get(tuple(o.token_ids), 0) + 1
    stat, dof, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for key in sorted(exact, key=exact.get, reverse=True):
        e, o = exact[key] * len(sps), counts.get(key, 0)
        if e >= 5:
            stat, dof = stat + (o - e) ** 2 / e, dof + 1
        else:
            pooled_e, pooled_o = pooled_e + e, pooled_o + o
    stat, dof = stat + (pooled_o - pooled_e) ** 2 / pooled_e, dof + 1
    assert stat < dof + 4.5 * np.sqrt(2 * dof), (stat, dof)
    assert 0 < res.stats.spec["accepted"] < res.stats.spec["drafted"]
    # The draws depend on seed and position only, and the pipeline crosses fetches: the
    # same tokens at 1 and 64 ticks per fetch.
    for ticks in (1, 64):
        again = llm.generate([prompt] * 64, sps[:64], speculative=SpeculativeConfig(
            k=1, draft_loops=d, rounds_per_fetch=ticks, pipelined=True)).outputs
        assert [o.token_ids for o in again] == [o.token_ids for o in res.outputs[:64]]


def test_one_fetch_per_call_and_no_recompile(monkeypatch):
    cfg, params = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3))
    llm = Ouro(cfg, params, None, page_size=4)
    sc = SpeculativeConfig(k=1, draft_loops=2, rounds_per_fetch=64, pipelined=True)
    sp = SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=1)
    llm.generate(ragged_prompts(cfg.vocab_size, [4, 6]), sp, speculative=sc)  # compiles
    reads = host_reads(monkeypatch)
    with jax.transfer_guard_device_to_host("disallow"):
        res = llm.generate(ragged_prompts(cfg.vocab_size, [5, 3], seed=7), sp, speculative=sc)
    assert reads.fetches == 1 and res.stats.host_fetches == 1
    assert reads.implicit == []
    assert res.stats.compiles == 0


def test_a_fetch_is_one_xla_program_without_host_callbacks():
    """The chunk of ticks (4 stages, sampling) lowers to one program whose tick loop is an
    on-device while, with no host transfers or callbacks."""
    import re

    from ouro_jax import model as model_mod
    from ouro_jax import pipelined
    from ouro_jax.batch import admit
    from ouro_jax.sampling import SamplingMode
    from ouro_jax.speculative import chunk_static

    cfg, params = load(tiny_checkpoint("tiny-gqa"))
    llm = Ouro(cfg, params, None, page_size=4)
    sc = SpeculativeConfig(k=1, draft_loops=1, pipelined=True)
    sps = [SamplingParams(max_tokens=8, temperature=0.5)]
    planes, bt, state = admit(llm, [[1, 2]], sps, [[0]], pipelined.stages(sc, cfg))
    mode = SamplingMode(sample=True)
    static = chunk_static(llm, sc, model_mod.ExitSpec(), mode, False)
    hlo = llm.programs.lowered_text(pipelined.pipe_chunk, static, (1,), llm.params, planes, bt,
                                    state, pipelined.init_carry(cfg, sc, mode, state,
                                                                llm.params.dtype))
    hlo = re.sub(r"metadata=\{[^}]*\}", "", hlo)
    assert hlo.count("ENTRY") == 1
    assert re.search(r" while\(%", hlo)
    assert not re.search(r" (outfeed|infeed|send|recv|send-done|recv-done)\(", hlo)
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    assert not [t for t in targets if "callback" in t.lower() or "python" in t.lower()], targets


@pytest.mark.parametrize("fused_kv_write", [True, False])
@pytest.mark.parametrize("sc", [PIPE, PIPE4], ids=["d2", "d1"])
def test_bf16_batch_invariant_pipelined_is_bit_identical_to_native(fused_kv_write, sc):
    """In the batch-invariant mode (the ragged kernel and rope_kv's write, each reading a
    plane per row here), bf16 greedy pipelined output is native's bit for bit: tokens, exit
    depths, finish reasons and log-probs, though its calls run 2B rows against native's B."""
    from test_invariant import SP, _same

    cfg, params = load(tiny_checkpoint("tiny-gqa", branch_scale=0.3), "bf16")
    prompts = ragged_prompts(cfg.vocab_size, [5, 70, 3], seed=4)
    llm = Ouro(cfg, params, None, page_size=4, batch_invariant=True,
               fused_kv_write=fused_kv_write)
    native = llm.generate(prompts, SP).outputs
    res = llm.generate(prompts, SP, speculative=sc)
    assert _same(native, res.outputs) == [True] * len(prompts)
    assert res.stats.spec["accepted"] < res.stats.spec["drafted"]


def test_invalid_pipelined_config():
    cfg, _ = load(tiny_checkpoint("tiny-gqa"))  # total_ut_steps 4
    with pytest.raises(ValueError, match="k must be 1"):
        SpeculativeConfig(k=4, draft_loops=2, pipelined=True).validate(cfg)
    with pytest.raises(ValueError, match="must divide total_ut_steps=4 and be smaller"):
        SpeculativeConfig(k=1, draft_loops=3, pipelined=True).validate(cfg)
    from ouro_jax.pipelined import check
    with pytest.raises(ValueError, match="be smaller"):  # one stage: nothing to pipeline
        check(SpeculativeConfig(k=1, draft_loops=4), cfg)
    SpeculativeConfig(k=1, draft_loops=1, pipelined=True).validate(cfg)  # 4 stages
    with pytest.raises(ValueError, match="pipelined must be True or False"):
        SpeculativeConfig(k=1, draft_loops=2, pipelined="yes")


@pytest.mark.parametrize("fused", [False, True])
def test_decode_kernel_reads_a_plane_per_row(fused):
    """A base of one loop per row: each row attends over (and with the fused write, writes
    into) its own plane, as separate calls with that row's plane would."""
    from paged_cases import fused_write_case, make_case
    from pallas_kernels import paged_decode_attention, paged_decode_attention_qkv

    rng = np.random.default_rng(3)
    loops = jnp.asarray([0, 2, 1, 2], jnp.int32)  # each row's plane (base, stride 1, offset 0)
    if fused:
        (qkv, k, v, bt, lens), (page, slot), _ = fused_write_case(
            rng, jnp.float32, 2, 2, [3, 9, 6, 13], hd=16, page_size=4)
        call = lambda base: paged_decode_attention_qkv(
            qkv, k, v, (base, 0), bt, lens, page, slot, trash_page=0, interpret=True,
            entry_stride=1, block_t=4, num_splits=2)
    else:
        q, k, v, bt, lens = make_case(rng, kv_lens=[3, 9, 6, 13], kvh=2, group=2, hd=16,
                                      page_size=4, dtype=jnp.float32)
        call = lambda base: (paged_decode_attention(
            q, k, v, (base, 0), bt, lens, interpret=True, entry_stride=1, block_t=4,
            num_splits=2),)
    got = call(loops)
    for row in range(4):
        want = call(loops[row])
        np.testing.assert_array_equal(np.asarray(got[0][row]), np.asarray(want[0][row]))
        if fused:  # the row's write went to its plane, and no other plane changed there
            e = int(loops[row])
            for g, w, before in zip(got[1:], want[1:], (k, v)):
                g, w, before = (np.asarray(a[:, page[row], slot[row]]) for a in (g, w, before))
                np.testing.assert_array_equal(g[e], w[e])
                assert not np.isnan(g[e]).any()  # (the slot held NaN before the write)
                others = [p for p in range(g.shape[0]) if p != e]
                np.testing.assert_array_equal(g[others], before[others])
    with pytest.raises(ValueError, match="per-row plane base of shape \\(3,\\)"):
        call(loops[:3])


def test_the_mosaic_decode_kernel_is_refused(monkeypatch):
    """The Mosaic GPU decode kernel (opt-in) reads one plane per call: refused by name."""
    import pallas_kernels as pk
    monkeypatch.setitem(pk.decode.TUNING, "mgpu", 1)
    cfg, params = load(tiny_checkpoint("tiny-gqa"))
    llm = Ouro(cfg, params, None, page_size=4, attention="pallas")
    with pytest.raises(ValueError, match="Mosaic GPU decode kernel"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=4), speculative=PIPE)


def test_kernels_reading_one_plane_refuse_a_per_row_base():
    from pallas_kernels._common import plane_operands

    with pytest.raises(ValueError, match="per-row plane base"):
        plane_operands((jnp.zeros((2,), jnp.int32), 0), 4)
    base, off = plane_operands((jnp.int32(3), 1), 4)
    assert base.shape == off.shape == (1,)


def test_offline_compile_lowers_the_per_row_kernels(monkeypatch):
    """`python -m pallas_kernels.offline_compile --decode-rows` and `--stream-rows` (the
    sm_90 pre-flights of the pipelined pass's kernels) lower each call to one Triton kernel
    at the 1.4B shapes, on a CPU."""
    from engine_helpers import offline_compile_tags
    from pallas_kernels import offline_compile_rows as rows
    tags = offline_compile_tags(monkeypatch, rows.check_decode_rows, rows.check_stream_rows)
    names = [t for t, _, _ in tags]
    assert all(n == 1 for _, n, _ in tags), tags
    assert "decode 2 rows, a plane per row (warps 2)" in names
    assert "ragged 64 rows, a plane per row" in names
    assert "rope_kv_write 64 rows, a plane per row" in names
    assert "stream down 2 row(s) plain" in names and "stream qkv 2 row(s) add_norm" in names
    assert len(names) == 8 + 8
