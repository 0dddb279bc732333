"""The paged engine (prefill chunks + on-device decode loop) against the PyTorch reference."""

import logging

import jax
import numpy as np
import pytest

from convert.torch_reference import load_reference
from engine_helpers import (host_reads, load, ragged_prompts, reference_greedy, tiny_checkpoint,
                            tokens_per_decode_tuning)
from ouro_jax.api import Ouro
from ouro_jax.kv_cache import KVPoolExhausted
from ouro_jax.sampling import SamplingParams


def _engine(folder, **kw):
    cfg, params = load(folder)
    return Ouro(cfg, params, None, **kw)


@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-mqa"])
def test_greedy_matches_reference_full_recompute(preset):
    """Ragged batch, EOS for one row and a stop id for another inside the batch, 32+ tokens,
    prompts spanning several pages and prefill chunks."""
    folder = tiny_checkpoint(preset)
    cfg, params = load(folder)
    ref = load_reference(folder)
    prompts = ragged_prompts(cfg.vocab_size, [5, 37, 1, 20])
    probe = Ouro(cfg, params, None, page_size=4, prefill_chunk=16, decode_chunk=8)
    free = probe.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True)).outputs
    eos = free[1].token_ids[12]  # becomes the model's EOS: row 1 stops early
    stop = free[2].token_ids[20]  # a request-level stop id for row 2
    llm = Ouro(cfg.replace(eos_token_id=eos), params, None, page_size=4, prefill_chunk=16,
               decode_chunk=8)
    sps = [SamplingParams(max_tokens=40, ignore_eos=True), SamplingParams(max_tokens=40),
           SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=(stop,)),
           SamplingParams(max_tokens=33)]
    res = llm.generate(prompts, sps)
    stops = [(), (eos,), (stop,), (eos,)]
    for p, sp, st, out in zip(prompts, sps, stops, res.outputs):
        want = reference_greedy(ref, p, sp.max_tokens, st)
        assert out.token_ids == want
        assert out.finish_reason == ("stop" if want[-1] in st else "length")
        assert len(out.exit_depths) == len(want)
    assert res.outputs[1].finish_reason == "stop" and len(res.outputs[1].token_ids) <= 13
    assert res.outputs[0].finish_reason == "length" and len(res.outputs[0].token_ids) == 40


def test_exit_modes_match_dense_forward():
    """exit_at_step and a low threshold select the same logits as the dense forward."""
    import jax.numpy as jnp

    from ouro_jax.model import ExitSpec, forward_dense

    folder = tiny_checkpoint("tiny-gqa")
    cfg, params = load(folder)
    llm = Ouro(cfg, params, None, page_size=4)
    prompt = ragged_prompts(cfg.vocab_size, [6])[0]
    for kw, spec in [(dict(exit_at_step=1), ExitSpec(exit_at_step=1)),
                     (dict(exit_threshold=0.5), ExitSpec(threshold=0.5))]:
        out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True), **kw).outputs[0]
        seq, depths = list(prompt), []
        for _ in range(12):
            o = forward_dense(params, jnp.asarray([seq]), cfg, spec)
            seq.append(int(jnp.argmax(o.logits[0, -1])))
            depths.append(int(o.exit_steps[0, -1]) + 1)
        assert out.token_ids == seq[len(prompt):]
        assert out.exit_depths == depths


def test_seeded_sampling_reproducible_and_batch_independent():
    folder = tiny_checkpoint("tiny-gqa")
    llm = _engine(folder, page_size=4, decode_chunk=8)
    prompts = ragged_prompts(llm.cfg.vocab_size, [3, 9, 5])
    sps = [SamplingParams(max_tokens=16, temperature=0.9, top_k=20, top_p=0.9, seed=s,
                          ignore_eos=True) for s in (11, 22, 33)]
    a = [o.token_ids for o in llm.generate(prompts, sps).outputs]
    assert a == [o.token_ids for o in llm.generate(prompts, sps).outputs]  # reproducible
    rev = llm.generate(prompts[::-1], sps[::-1]).outputs  # other order
    assert [o.token_ids for o in rev][::-1] == a
    alone = llm.generate([prompts[1]], [sps[1]]).outputs[0]  # batch size 1
    assert alone.token_ids == a[1]
    bigger = llm.generate(prompts + prompts[:2], sps + sps[:2]).outputs  # batch of 5 (bucket 8)
    assert [o.token_ids for o in bigger[:3]] == a
    other_seed = llm.generate([prompts[1]], [SamplingParams(
        max_tokens=16, temperature=0.9, top_k=20, top_p=0.9, seed=23, ignore_eos=True)])
    assert other_seed.outputs[0].token_ids != a[1]


def test_logprobs_are_raw_log_softmax():
    import jax.numpy as jnp

    from ouro_jax.model import forward_dense

    folder = tiny_checkpoint("tiny-gqa")
    cfg, params = load(folder)
    llm = Ouro(cfg, params, None, page_size=4)
    prompt = [3, 4, 5]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True,
                                                temperature=0.7, seed=3)).outputs[0]
    seq = prompt + out.token_ids
    logits = forward_dense(params, jnp.asarray([seq]), cfg).logits[0]
    lp = jax.nn.log_softmax(logits, axis=-1)
    want = [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    np.testing.assert_allclose(out.logprobs, want, atol=1e-5)


class _CompileLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records = []

    def emit(self, record):
        if "Compiling" in record.getMessage() or "compiling" in record.getMessage():
            self.records.append(record.getMessage())


def test_one_fetch_per_chunk_and_no_recompile(monkeypatch):
    """One host fetch per decode chunk, no recompile for a new batch in the same buckets,
    and no eager device op at all: with JAX's caches cleared, an eager jnp call in the
    request path (jnp.zeros, jnp.int32(x), even jnp.asarray(ndarray)) would compile and
    show up in the log; every device op runs inside the engine's compiled programs, and host
    arrays arrive by jax.device_put (plain and speculative)."""
    from ouro_jax.speculative import SpeculativeConfig

    folder = tiny_checkpoint("tiny-gqa")
    llm = _engine(folder, page_size=4, decode_chunk=4)
    sp = SamplingParams(max_tokens=15, ignore_eos=True)  # first token + 14 decode steps
    spec = SpeculativeConfig(k=2, draft_loops=1)
    llm.generate(ragged_prompts(llm.cfg.vocab_size, [4, 6, 2]), sp)  # warm-up compiles
    llm.generate(ragged_prompts(llm.cfg.vocab_size, [5, 7, 3]), sp, speculative=spec)
    reads = host_reads(monkeypatch)
    jax.clear_caches()
    handler = _CompileLog()
    logging.getLogger("jax").addHandler(handler)
    jax.config.update("jax_log_compiles", True)
    try:
        with jax.transfer_guard_device_to_host("disallow"):
            res = llm.generate(ragged_prompts(llm.cfg.vocab_size, [5, 7, 3], seed=9), sp)
            spec_res = llm.generate(ragged_prompts(llm.cfg.vocab_size, [5, 7, 3], seed=9), sp,
                                    speculative=spec)
    finally:
        jax.config.update("jax_log_compiles", False)
        logging.getLogger("jax").removeHandler(handler)
    assert reads.fetches - spec_res.stats.host_fetches == 4 == res.stats.host_fetches  # 14 / 4
    assert reads.implicit == []  # the guard above does nothing on the CPU backend
    assert res.stats.compiles == 0 == spec_res.stats.compiles and handler.records == []
    assert all(len(o.token_ids) == 15 for o in res.outputs)


def test_bad_inputs_are_clear_errors_and_change_nothing():
    folder = tiny_checkpoint("tiny-gqa")
    cfg, params = load(folder)
    llm = Ouro(cfg, params, None, page_size=4, kv_pool_tokens=64)
    ok = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True)).outputs[0]
    with pytest.raises(ValueError, match="too long"):
        llm.generate([[1] * 500], SamplingParams(max_tokens=20))
    with pytest.raises(KVPoolExhausted, match="KV pool exhausted"):
        llm.generate([[1] * 40, [2] * 40], SamplingParams(max_tokens=20))
    for flag in ("fused_kv_write", "fuse_projections", "unroll_loops", "persistent_layers"):
        with pytest.raises(ValueError, match=f"{flag} must be True or False"):
            Ouro(cfg, params, None, **{flag: "no"})
    assert Ouro(cfg, params, None, attention="pallas", fused_kv_write=False).backend == \
        "pallas+kvxla"
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.1)
    with pytest.raises(ValueError, match="unknown token id"):
        llm.generate([[1, cfg.vocab_size]])
    with pytest.raises(ValueError, match=r"^prompt 1: unknown token id"):  # which one, in a batch
        llm.generate([[1], [1, cfg.vocab_size]])
    with pytest.raises(ValueError, match=r"^prompt 2: empty prompt"):
        llm.generate([[1], [2], []])
    with pytest.raises(ValueError, match="unknown stop token"):
        llm.generate([[1]], SamplingParams(stop_token_ids=(-3,)))
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["some text"])
    with pytest.raises(ValueError, match="exit_at_step"):
        llm.generate([[1]], exit_at_step=cfg.total_ut_steps)
    again = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True)).outputs[0]
    assert again.token_ids == ok.token_ids


def test_pallas_backend_matches_xla_end_to_end():
    """The engine wired to the Pallas kernels (interpret mode on CPU; decode's K/V write inside
    the decode kernel, or as an XLA scatter), and with unrolled loops, generates the same
    greedy tokens as the XLA gather path, plain and speculative."""
    from ouro_jax.speculative import SpeculativeConfig

    folder = tiny_checkpoint("tiny-gqa", branch_scale=0.3)
    cfg, params = load(folder)
    prompts = ragged_prompts(cfg.vocab_size, [6, 3], seed=3)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    sc = SpeculativeConfig(k=2, draft_loops=2)
    variants = [dict(attention="xla"), dict(attention="pallas"),
                dict(attention="pallas", fused_kv_write=False),
                dict(attention="xla", unroll_loops=True)]
    for spec in (None, sc):
        outs = [Ouro(cfg, params, None, page_size=4, **v).generate(
            prompts, sp, speculative=spec).outputs for v in variants]
        for other in outs[1:]:
            assert [o.token_ids for o in other] == [o.token_ids for o in outs[0]]


def test_decode_kernel_merging_its_splits_matches_end_to_end(monkeypatch):
    """With last_combine (the decode kernel's last split program merges the partials, its
    counters threaded through the layers with the planes) and 3 splits forced, the engine
    generates the same greedy tokens as with the XLA combine and as the xla backend, plain and
    speculative; the counters never leak into the planes the engine keeps."""
    import pallas_kernels.decode as decode
    from ouro_jax.attention import make_paged_attend

    folder = tiny_checkpoint("tiny-gqa", branch_scale=0.3)
    cfg, params = load(folder)
    prompts = ragged_prompts(cfg.vocab_size, [6, 3], seed=3)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    split = dict(block_t=4, num_splits=3)
    merges = []
    merge = decode._merge_if_last
    monkeypatch.setattr(decode, "_merge_if_last", lambda *a: merges.append(1) or merge(*a))
    runs = tokens_per_decode_tuning(monkeypatch, cfg, params, prompts, sp, [
        ("xla", {}), ("pallas", split), ("pallas", dict(split, last_combine=1))])
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert merges  # traced only in the last run: that run's kernels merged their splits
    tables, pos = np.ones((2, 3), np.int32), np.zeros((2, 1), np.int32)
    attend = make_paged_attend(cfg, tables, pos, 4, "pallas")
    assert hasattr(attend, "wrap")  # still the last_combine tuning from the loop
    monkeypatch.setattr(decode, "TUNING", {})
    attend = make_paged_attend(cfg, tables, pos, 4, "pallas")
    assert not hasattr(attend, "wrap")


def test_kv_planes_are_donated_without_warnings():
    """The KV pool is donated into every program (updated in place, the old buffers are
    consumed), no donation or other warning is raised, plain or speculative, and the compiled
    programs hold no copy of a plane."""
    import warnings

    from ouro_jax.speculative import SpeculativeConfig

    for attention in ("xla", "pallas"):  # pallas: the decode kernel's aliased K/V outputs
        llm = _engine(tiny_checkpoint("tiny-gqa"), page_size=4, attention=attention)
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5))
        for spec in (None, SpeculativeConfig(2, 1)):
            old = llm._planes[0]
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5), speculative=spec)
            assert old.is_deleted()
        # ... and no compiled program copies a plane (a copy costs a pass over the whole pool
        # per call). Only the xla backend is checked here: on the CPU the pallas kernels run
        # in interpret mode, whose lowering copies the aliased planes (6 copies in the decode
        # program), which is not the GPU program; benchmarks.hlo_copies checks that one.
        if attention == "xla":
            from benchmarks.hlo_copies import plane_copies
            rows = plane_copies(llm)
            assert {r["program"] for r in rows} >= {"prefill_chunk", "decode_chunk",
                                                    "spec_chunk"}
            assert [r for r in rows if r["plane_copies"]] == []


def test_eos_lists_numpy_prompts_and_first_token_only_requests(tmp_path):
    import json

    from convert.synthesize import synthesize

    folder = str(tmp_path / "m")
    synthesize(folder, "tiny-gqa", dtype="fp32")
    probe = Ouro.load(folder)
    free = probe.generate(np.array([3, 4, 5]), SamplingParams(max_tokens=12, ignore_eos=True))
    second_eos = free.outputs[0].token_ids[6]
    with open(f"{folder}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [0, second_eos]}, f)
    llm = Ouro.load(folder)  # generation_config's extra EOS id stops generation too
    out = llm.generate([np.int64(3), np.int64(4), np.int64(5)], SamplingParams(max_tokens=12))
    assert out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].token_ids[-1] in (0, second_eos) and len(out.outputs[0].token_ids) <= 7
    fresh = Ouro.load(folder)
    one = fresh.generate([[7, 8]], SamplingParams(max_tokens=1))
    assert len(one.outputs[0].token_ids) == 1 and one.stats.host_fetches == 1
    assert fresh.programs.compiles == 2  # prefill chunk + first token; no decode program


def test_pool_larger_than_device_memory_is_a_clear_error(monkeypatch):
    """A pool the device cannot hold is refused before allocation, naming the sizes; the
    current pool stays and the engine still works (memory_stats faked: the CPU reports none)."""
    folder = tiny_checkpoint("tiny-gqa")
    cfg, params = load(folder)
    llm = Ouro(cfg, params, None, page_size=4)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    ok = llm.generate([[1, 2, 3]], sp).outputs[0]
    pool = llm._planes
    device = type(next(iter(llm.params.embed_tokens.devices())))
    held = 2 * pool[0].nbytes
    # Free besides the current pool: the size of that pool plus 1 KB.
    monkeypatch.setattr(device, "memory_stats", lambda self: {
        "bytes_limit": 10 * held, "bytes_in_use": 9 * held - 1000}, raising=False)
    with pytest.raises(KVPoolExhausted, match=r"needs .* GB .* only .* GB of device memory is "
                                              r"free.*fewer or shorter requests"):
        llm.generate([[1] * 60] * 8, SamplingParams(max_tokens=60))
    assert llm._planes is pool
    # a fixed pool (kv_pool_tokens) too large for the device names that setting instead
    llm.fixed_pool_pages = 8 * pool[0].shape[1]
    with pytest.raises(KVPoolExhausted, match=r"device memory is free.*use a smaller "
                                              r"kv_pool_tokens"):
        llm.generate([[1, 2, 3]], sp)
    llm.fixed_pool_pages = None
    assert llm._planes is pool
    assert llm.generate([[1, 2, 3]], sp).outputs[0].token_ids == ok.token_ids
    # The boundary: free = limit - in_use + the current pool (freed before reallocating).
    from ouro_jax.kv_cache import kv_bytes_per_token

    per_page = kv_bytes_per_token(cfg, llm.params.dtype) * llm.page_size
    need = 3 * pool[0].shape[1] * per_page  # a pool three times the current one
    for in_use, fits in [(held + 10**9 - need, True), (held + 10**9 - need + 1, False)]:
        monkeypatch.setattr(device, "memory_stats", lambda self, u=in_use: {
            "bytes_limit": 10**9, "bytes_in_use": u}, raising=False)
        if fits:
            llm._check_pool_fits(3 * pool[0].shape[1])
        else:
            with pytest.raises(KVPoolExhausted):
                llm._check_pool_fits(3 * pool[0].shape[1])
    monkeypatch.setattr(device, "memory_stats", lambda self: None, raising=False)
    llm._check_pool_fits(10**9)  # no statistics (the CPU): not checked


def test_xla_prefill_chunk_keeps_scores_within_budget():
    """The xla path shrinks its prefill chunk for large rows x keys (64 x 2k at the 1.4B shape
    would need 2.2 GB of fp32 scores per buffer at 256 tokens); Pallas keeps the chunk."""
    from ouro_jax.batch import XLA_PREFILL_SCORES_BYTES, prefill_chunk_len
    from ouro_jax.config import PRESETS

    class Fake:
        cfg, prefill_chunk, page_size = PRESETS["1.4b"], 256, 16

    llm = Fake()
    llm.backend = "xla"
    chunk = prefill_chunk_len(llm, 64, 2048, 2096)
    assert chunk == 32 and 64 * 16 * chunk * 2096 * 4 <= XLA_PREFILL_SCORES_BYTES
    assert prefill_chunk_len(llm, 1, 100, 128) == 128  # small problems: next pow2 of the prompt
    assert prefill_chunk_len(llm, 1024, 8192, 1 << 20) == 16  # never below 16
    llm.backend = "pallas"
    assert prefill_chunk_len(llm, 64, 2048, 2096) == 256


def test_every_kv_write_of_a_generate_call_has_unique_indices(monkeypatch):
    """write_kv promises XLA unique scatter indices (plain stores instead of atomics on the
    GPU), and the pallas decode kernel's in-place K/V stores need the same (two rows on one
    slot would race). Check both on every write of real runs: prefill with padded chunks, a padding
    row (batch 3 -> bucket 4), rows stopping at different max_tokens, plain decode and the
    speculative draft and verification. A host callback sees each write's indices."""
    from ouro_jax import attention, kv_cache
    from ouro_jax.speculative import SpeculativeConfig

    seen = []

    def check(page, slot, num_pages):
        kept = [(int(p), int(s)) for p, s in zip(page.ravel(), slot.ravel())
                if p != kv_cache.TRASH_PAGE]
        seen.append(len(kept))
        assert len(kept) == len(set(kept)), f"duplicate K/V write indices: {sorted(kept)}"
        assert all(0 < p < num_pages for p, _ in kept)

    def checked_write(planes, entry, page, slot, k, v):
        jax.debug.callback(check, page, slot, planes[0].shape[1])
        return kv_cache.write_kv(planes, entry, page, slot, k, v)

    import pallas_kernels

    traced_fused = []

    def checked_fused(qkv, kc, vc, entry, tables, lens, page, slot, **kw):  # pallas decode
        traced_fused.append(qkv.shape)
        jax.debug.callback(check, page, slot, kc.shape[1])
        return fused(qkv, kc, vc, entry, tables, lens, page, slot, **kw)

    fused = pallas_kernels.paged_decode_attention_qkv
    monkeypatch.setattr(attention, "write_kv", checked_write)
    monkeypatch.setattr(pallas_kernels, "paged_decode_attention_qkv", checked_fused)
    folder = tiny_checkpoint("tiny-gqa", branch_scale=0.3)
    cfg, params = load(folder)
    prompts = ragged_prompts(cfg.vocab_size, [7, 2, 5], seed=5)
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (5, 2, 7)]
    for backend in ("xla", "pallas"):
        llm = Ouro(cfg, params, None, page_size=4, attention=backend, prefill_chunk=4)
        for spec in (None, SpeculativeConfig(k=3, draft_loops=2)):
            before = len(seen)
            llm.generate(prompts, sps, speculative=spec)
            assert len(seen) > before and sum(seen[before:]) > 0
    assert traced_fused  # the pallas decode steps went through the fused kernel
