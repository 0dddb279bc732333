"""Decode attention fused with the o projection (pallas_kernels.attention_o) against the
engine's unfused path: the decode kernel with the fused K/V write, then x @ w_o^T.

CPU: interpret mode on tiny shapes (NaN in the trash page, stale slots and the new token's
slot, as in test_pallas_kernels), the Triton IR lowered for CUDA at the 1.4B shape, and the
engine end to end. GPU (marked): the compiled kernel against the unfused kernels.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from paged_cases import check, fused_write_case
from test_pdl import triton_ir
from pallas_kernels import attention_o as ao
from pallas_kernels import paged_decode_attention_qkv, paged_decode_attention_reference

gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
KV_LENS = [0, 1, 4, 8, 13, 23]


def case(dtype, kvh, group, n_out=32, seed=7, kv_lens=KV_LENS, hd=16):
    rng = np.random.default_rng(seed)
    (qkv, k, v, bt, lens), (page, slot), (q, k_want, v_want) = fused_write_case(
        rng, dtype, kvh, group, kv_lens, hd=hd, page_size=4)
    w_o = jnp.asarray(rng.standard_normal((n_out, kvh * group * hd)) * 0.1, dtype)
    return (qkv, k, v, jnp.int32(2), bt, lens, page, slot, w_o), (q, k_want, v_want)


def unfused(args, interpret=True, **kw):
    """The engine's three kernels: decode attention with the fused write, then the
    projection of the attention output (rounded to the activation dtype) in fp32."""
    qkv, k, v, entry, bt, lens, page, slot, w_o = args
    attn, kc, vc = paged_decode_attention_qkv(qkv, k, v, entry, bt, lens, page, slot,
                                              trash_page=0, interpret=interpret, **kw)
    flat = attn.reshape(attn.shape[0], -1).astype(jnp.float32)
    y = jnp.einsum("bk,nk->bn", flat, w_o.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return y.astype(qkv.dtype), kc, vc


def fused(args, counters=None, **kw):
    qkv, k, v, entry, bt, lens, page, slot, w_o = args
    tuning = {key: kw.pop(key) for key in list(kw) if key in ao.DEFAULTS}
    if counters is None:
        counters = ao.counters_for(qkv.shape[0], w_o.shape[0], k.shape[3], **tuning)
    kw.setdefault("interpret", True)
    return ao.decode_attention_o(qkv, k, v, entry, bt, lens, page, slot, w_o, counters,
                                 trash_page=0, **tuning, **kw)


def as_f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


@pytest.mark.parametrize("dtype,kvh,group,block_n,w_early,split", [
    (jnp.float32, 2, 1, 8, True, False), (jnp.float32, 2, 4, 16, False, False),
    (jnp.bfloat16, 2, 1, 8, False, False), (jnp.bfloat16, 2, 4, 32, True, False),
    (jnp.float32, 2, 1, 8, True, True), (jnp.float32, 2, 4, 16, False, True),
    (jnp.bfloat16, 2, 1, 4, True, True),
])
def test_matches_the_unfused_kernels(dtype, kvh, group, block_n, w_early, split):
    """y equals the decode kernel (one split: the same key order) + projection to fp32
    rounding, in bf16 bit for bit but for rare one-ulp flips from the projection's other
    summation order (skipping the attention output's bf16 rounding flips ~30%); it matches
    the attention reference times w_o to the kernels' tolerance; the caches hold the new K/V
    exactly as the decode kernel writes them; the padding row (kv_len 0, trash page) gives
    zeros; the counters come back at zero."""
    args, (q, k_want, v_want) = case(dtype, kvh, group)
    y, kc, vc, cnt = fused(args, block_n=block_n, block_t=4, w_early=w_early, split_keys=split)
    # split_keys: R = 32 // block_n key splits per head, merged as the decode kernel merges
    y_ref, kc_ref, vc_ref = unfused(args, block_t=4, num_splits=32 // block_n if split else 1)
    assert y.shape == (len(KV_LENS), 32) and y.dtype == dtype
    assert not np.any(np.asarray(cnt))  # (interpret mode: no handover words move)
    assert cnt.shape == (len(KV_LENS), 32 // block_n + (2 * kvh * ao.WORD_STRIDE if split else 0))
    np.testing.assert_array_equal(as_f32(kc), as_f32(kc_ref))
    np.testing.assert_array_equal(as_f32(vc), as_f32(vc_ref))
    np.testing.assert_array_equal(as_f32(kc), as_f32(k_want))
    assert np.all(as_f32(y[0]) == 0)
    assert_close_to_unfused(y, y_ref, dtype)
    attn = paged_decode_attention_reference(q, k_want, v_want, 2, args[4], args[5])
    want = jnp.einsum("bk,nk->bn", attn.reshape(attn.shape[0], -1).astype(jnp.float32),
                      args[-1].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    check(y, want, dtype)


def assert_close_to_unfused(y, y_ref, dtype):
    y, y_ref = as_f32(y), as_f32(y_ref)
    if dtype == jnp.float32:
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
        return
    np.testing.assert_allclose(y, y_ref, rtol=2 ** -7, atol=1e-6)  # an ulp at most
    assert np.mean(y != y_ref) <= 0.02, np.mean(y != y_ref)


def test_w_early_changes_nothing_but_the_load_order():
    args, _ = case(jnp.bfloat16, 2, 2)
    a = fused(args, block_n=8, block_t=4, w_early=True)[0]
    b = fused(args, block_n=8, block_t=4, w_early=False)[0]
    np.testing.assert_array_equal(as_f32(a), as_f32(b))


def test_rope_matches_the_decode_kernels():
    """rope=(cos, sin): the written key and the output equal the decode kernel's with the same
    rotation (bit for bit for the caches)."""
    from ouro_jax.model import rope_cos_sin
    args, _ = case(jnp.bfloat16, 2, 1)
    cos, sin = rope_cos_sin(jnp.asarray(np.maximum(np.asarray(KV_LENS) - 1, 0)), 16, 1e4,
                            jnp.bfloat16)
    y, kc, vc, _ = fused(args, block_n=8, block_t=4, rope=(cos, sin))
    y_ref, kc_ref, vc_ref = unfused(args, block_t=4, num_splits=1, rope=(cos, sin))
    np.testing.assert_array_equal(as_f32(kc), as_f32(kc_ref))
    np.testing.assert_array_equal(as_f32(vc), as_f32(vc_ref))
    assert_close_to_unfused(y, y_ref, jnp.bfloat16)


def test_every_head_reaches_the_sum():
    """Zeroing one head's columns of w_o changes y by exactly that head's share: a kernel
    whose last program skipped or double-counted a partial would not match."""
    args, _ = case(jnp.float32, 2, 2, seed=3)
    w_o = args[-1]
    y = as_f32(fused(args, block_n=8, block_t=4)[0])
    for head in range(4):
        cols = slice(head * 16, (head + 1) * 16)
        only = fused(args[:-1] + (jnp.zeros_like(w_o).at[:, cols].set(w_o[:, cols]),),
                     block_n=8, block_t=4)[0]
        rest = fused(args[:-1] + (w_o.at[:, cols].set(0),), block_n=8, block_t=4)[0]
        np.testing.assert_allclose(as_f32(only) + as_f32(rest), y, rtol=1e-5, atol=1e-6)
        assert np.abs(as_f32(only)[1:]).max() > 1e-3


def test_bad_input_is_refused():
    args, _ = case(jnp.float32, 2, 1)
    qkv, k, v, entry, bt, lens, page, slot, w_o = args
    good = ao.counters_for(6, 32, 2, block_n=8)
    call = lambda *a, **kw: ao.decode_attention_o(*a, interpret=True, **kw)
    with pytest.raises(ValueError, match="counters must be int32 \\[6, 4\\]"):
        call(qkv, k, v, entry, bt, lens, page, slot, w_o, good[:, :2], block_n=8)
    with pytest.raises(ValueError, match="w_o .* must be \\[N, H \\* hd = 32\\]"):
        call(qkv, k, v, entry, bt, lens, page, slot, w_o[:, :16], good, block_n=8)
    with pytest.raises(ValueError, match="page .* must be \\[6\\]"):
        call(qkv, k, v, entry, bt, lens, page[:2], slot, w_o, good, block_n=8)
    with pytest.raises(ValueError, match="unknown tuning keys \\['num_splits'\\]"):
        call(qkv, k, v, entry, bt, lens, page, slot, w_o, good, num_splits=2)
    with pytest.raises(ValueError, match="up to 32 KV heads / splits; this call has 2 KV heads "
                       "and 64 splits"):
        call(qkv, k, v, entry, bt, lens, page, slot, jnp.zeros((64, 32)),
             ao.counters_for(6, 64, 2, block_n=1, split_keys=True), block_n=1, split_keys=True)
    with pytest.raises(ValueError, match="block_n must be a positive power of two"):
        call(qkv, k, v, entry, bt, lens, page, slot, w_o, good, block_n=12)
    with pytest.raises(ValueError, match="does not hold H \\+ 2 KVH"):
        call(qkv[:, :3], k, v, entry, bt, lens, page, slot, w_o, good, block_n=8)


def test_split_keys_refuses_a_grid_that_may_not_be_resident(monkeypatch):
    """Its programs wait for each other, so a grid larger than what is surely resident at once
    is an error naming the sizes (interpret mode runs it as two calls and needs no such
    limit)."""
    if not has_gpu():  # no GPU: an H200's 132 SMs, two programs per SM at 4 warps
        assert ao.resident_programs(4) == 264 and ao.resident_programs(8) == 132
    args, _ = case(jnp.float32, 2, 1)
    monkeypatch.setattr(ao, "resident_programs", lambda num_warps: 16)
    with pytest.raises(ValueError, match="6 x 2 x 4 = 48 programs at 4 warps, at most 16"):
        fused(args, block_n=8, split_keys=True, interpret=False)
    fused(args, block_n=8, split_keys=True)  # interpret: fine


def test_block_n_shrinks_to_divide_the_output():
    assert ao.config(48, block_n=32)["block_n"] == 16
    assert ao.counters_for(2, 48, 4, block_n=32).shape == (2, 3)
    assert ao.counters_for(2, 48, 4, block_n=32, split_keys=True).shape == (2, 3 + 8 * 32)
    cnt = ao.counters_for(2, 48, 4, block_n=32, split_keys=True).at[1, 3 + 5 * 32].set(7)
    np.testing.assert_array_equal(ao.give_ups(cnt, 48, 4, block_n=32, split_keys=True),
                                  [[0, 0, 0, 0], [0, 7, 0, 0]])
    assert ao.config(48)["block_t"] == 32 and ao.config(48, split_keys=True)["block_t"] == 16


def _ir_1p4b(**tuning):
    S = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    f = lambda qkv, kc, vc, bt, lens, page, slot, w, cnt, cos, sin: ao.decode_attention_o(
        qkv, kc, vc, (jnp.int32(1), 3), bt, lens, page, slot, w, cnt, rope=(cos, sin),
        trash_page=0, entry_stride=24, **tuning)
    i32 = lambda *s: S(s, jnp.int32)
    cnt = ao.counters_for(1, 2048, 16, **tuning)
    (ir,) = triton_ir(f, S((1, 48, 128), bf), S((96, 64, 16, 16, 128), bf),
                      S((96, 64, 16, 16, 128), bf), i32(1, 16), i32(1), i32(1), i32(1),
                      S((2048, 2048), bf), S(cnt.shape, cnt.dtype), S((1, 128), bf),
                      S((1, 128), bf))
    return ir


@pytest.mark.parametrize("w_early", [True, False])
def test_lowers_for_the_gpu_at_the_1p4b_shape(w_early):
    """The Triton IR at the engine's shape: one atomic (the arrival), and the o weight's tile
    load issued before the attention's key loop with w_early, after it without."""
    ir = _ir_1p4b(w_early=w_early)
    assert len(re.findall(r"tt\.atomic_rmw", ir)) == 1
    lines = ir.splitlines()
    assert_last_arrival_test(lines)
    w_load = next(i for i, line in enumerate(lines)
                  if re.search(r"tt\.load .*tensor<128x128x!tt\.ptr<bf16>>", line))
    loop = next(i for i, line in enumerate(lines) if "scf.for" in line)
    assert (w_load < loop) == w_early


def test_split_keys_lowers_to_one_kernel_with_its_handover():
    """split_keys on the GPU is one kernel: the handover's arrival, its give-up count and the
    row block's arrival (three atomics), the acquire-load spin in a loop, and the o weight's
    load still ahead of the key loop. Pinned in the IR because interpret mode runs programs
    in turn and cannot tell: a CTA barrier between the last store and each arrival (the
    release of every warp's stores), split 0's weight COUNTER_STEP - R + 1 (1008 = 1024 - 16
    added to 1), and the last-arrival test against KVH - 1 = 15 (interpret mode passes with
    any test whose last arrival still sums)."""
    ir = _ir_1p4b(split_keys=True)
    atomics = [i for i, line in enumerate(ir.splitlines()) if "tt.atomic_rmw" in line]
    assert len(atomics) == 3
    assert "ld.acquire.gpu.global.b32" in ir and "scf.while" in ir
    lines = ir.splitlines()
    barrier = max(i for i, line in enumerate(lines[:atomics[0]]) if "gpu.barrier" in line)
    assert not any("tt.store" in line for line in lines[barrier:atomics[0]])
    assert "arith.constant 1008 : i32" in ir
    assert_last_arrival_test(lines)
    w_load = next(i for i, line in enumerate(lines)
                  if re.search(r"tt\.load .*tensor<128x128x!tt\.ptr<bf16>>", line))
    assert w_load < next(i for i, line in enumerate(lines) if "scf.for" in line)


def assert_last_arrival_test(lines):
    """The row block's sum is taken by the program whose arrival found KVH - 1 = 15 others
    (barrier before the arrival, the compare right after it)."""
    a = max(i for i, line in enumerate(lines) if "tt.atomic_rmw" in line)
    barrier = max(i for i, line in enumerate(lines[:a]) if "gpu.barrier" in line)
    assert not any("tt.store" in line for line in lines[barrier:a])
    result = lines[a].split("=")[0].strip()
    assert any(re.search(rf"arith\.cmpi eq, {re.escape(result)}, %c15_i32", line)
               for line in lines[a:a + 4])


# ---------------------------------------------------------------- the engine
def test_engine_fuse_o_generates_the_same_tokens(monkeypatch):
    """decode.TUNING fuse_o=1: one-row decode steps (and the draft's) run the fused kernel;
    greedy tokens equal the xla backend's in fp32, plain and speculative, and the counters
    never leak into the planes the engine keeps."""
    from engine_helpers import load, ragged_prompts, tiny_checkpoint, tokens_per_decode_tuning
    from ouro_jax.sampling import SamplingParams
    import pallas_kernels as pk

    folder = tiny_checkpoint("tiny-gqa", branch_scale=0.3)
    cfg, params = load(folder)
    prompts = ragged_prompts(cfg.vocab_size, [6], seed=3)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    calls = []
    kernel = pk.decode_attention_o
    monkeypatch.setattr(pk, "decode_attention_o", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    runs = tokens_per_decode_tuning(monkeypatch, cfg, params, prompts, sp, [
        ("xla", {}), ("pallas", dict(fuse_o=1, block_t=4)),
        ("pallas", dict(fuse_o=1, block_t=4, o_split=1, o_block_n=16))])
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert calls


@pytest.mark.parametrize("argv,msg", [
    (["--decode-kernel", "fuse_o=1", "--attention", "xla"], "fuse_o=1 needs --attention pallas"),
    (["--decode-kernel", "fuse_o=1", "--attention", "pallas", "--kv-write", "xla"],
     "fuse_o=1 needs --attention pallas"),
    (["--decode-kernel", "fuse_o=1", "--attention", "pallas", "--batch", "8"],
     "changes one-row decode only"),
    (["--decode-kernel", "o_split=1", "--attention", "pallas"], "need fuse_o=1"),
    (["--decode-kernel", "fuse_o=1", "--attention", "pallas", "--batch", "1",
      "--prompt-len", "2000"], "runs unsplit only up to 1024 keys"),
])
def test_the_decode_benchmark_refuses_fuse_o_where_it_would_change_nothing(argv, msg):
    from benchmarks.decode import main
    with pytest.raises(SystemExit, match=msg):
        main(argv)


# ---------------------------------------------------------------- the GPU
@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kvh,group,tuning", [
    (16, 1, {}), (16, 1, dict(block_n=64, w_early=False)), (4, 4, {}),
    (16, 1, dict(split_keys=True)), (16, 1, dict(split_keys=True, block_n=256)),
    (4, 4, dict(split_keys=True, block_n=64))])
def test_matches_the_unfused_kernels_gpu(kvh, group, tuning):
    """The compiled kernel (atomics, CTA barriers) over 20 calls with a fresh qkv each (a
    partial read before its store landed would hold the previous call's values), batch 1
    and 4: y within two bf16 ulps of the decode kernel + projection, counters back at zero,
    caches as the decode kernel writes them; split_keys: no handover gave up (rows whose grid
    would not be resident at once are refused, so they are skipped)."""
    dtype = jnp.bfloat16
    kv_lens = [0, 17, 130, 191]
    args, _ = case(dtype, kvh, group, n_out=2048, seed=9, kv_lens=kv_lens, hd=128)
    qkv, k, v, entry, bt, lens, page, slot, w_o = args
    rng = np.random.default_rng(3)
    n_r = 2048 // ao.config(2048, **tuning)["block_n"]
    for rows in (slice(3, 4), slice(0, 4)):
        if tuning.get("split_keys") and (rows.stop - rows.start) * kvh * n_r > \
                ao.resident_programs(ao.config(2048, **tuning)["num_warps"]):
            continue
        rest = (k, v, entry, bt[rows], lens[rows], page[rows], slot[rows], w_o)
        f = jax.jit(lambda q, c, *a: ao.decode_attention_o(q, *a, c, trash_page=0, **tuning))
        ref = jax.jit(lambda q, *a: unfused((q, *a), interpret=False))
        counters = ao.counters_for(lens[rows].shape[0], 2048, kvh, **tuning)
        for _ in range(20):
            q = jnp.asarray(rng.standard_normal(qkv[rows].shape), dtype)
            y, kc, vc, counters = f(q, counters, *rest)
            y_ref, kc_ref, vc_ref = ref(q, *rest)
            np.testing.assert_allclose(as_f32(y), as_f32(y_ref), rtol=2 ** -6, atol=2e-2)
            assert not np.any(np.asarray(counters[:, :n_r]))
            if tuning.get("split_keys"):
                assert not np.any(np.asarray(ao.give_ups(counters, 2048, kvh, **tuning)))
            np.testing.assert_array_equal(as_f32(kc), as_f32(kc_ref))


def test_engine_passes_the_decode_tuning_to_the_fused_kernel(monkeypatch):
    """fuse_o's tuning comes from the decode kernel's overrides (block_t, num_warps,
    num_stages, o_block_n, o_w_early, o_split), the counters are sized by o_block_n, batches
    above one row keep the decode kernel, so do tables past FUSE_O_MAX_KEYS unless the keys
    are split, and fuse_o with last_combine is refused."""
    import pallas_kernels.decode as decode
    from ouro_jax.attention import _fused_o_tuning, make_paged_attend
    from ouro_jax.config import PRESETS
    cfg = PRESETS["tiny-gqa"]
    monkeypatch.setattr(decode, "TUNING", dict(fuse_o=1, block_t=8, num_splits=3, o_block_n=4,
                                               o_w_early=0, num_warps=2, num_stages=3,
                                               o_split=1))
    assert _fused_o_tuning() == dict(block_t=8, block_n=4, w_early=0, num_warps=2,
                                     num_stages=3, split_keys=1)
    monkeypatch.setattr(decode, "TUNING", dict(fuse_o=1, block_t=8, num_splits=3, o_block_n=4,
                                               o_w_early=0))
    assert _fused_o_tuning() == dict(block_t=8, block_n=4, w_early=0)
    tables, pos = np.ones((1, 3), np.int32), np.zeros((1, 1), np.int32)
    attend = make_paged_attend(cfg, tables, pos, 4, "pallas")
    assert hasattr(attend, "qkv_o")
    assert attend.wrap((1, 2))[2].shape == (1, cfg.hidden_size // 4)
    two = make_paged_attend(cfg, np.ones((2, 3), np.int32), np.zeros((2, 1), np.int32), 4,
                            "pallas")
    assert not hasattr(two, "qkv_o") and hasattr(two, "qkv")
    long = np.ones((1, 1024 // 4 + 1), np.int32)  # past FUSE_O_MAX_KEYS of capacity
    assert not hasattr(make_paged_attend(cfg, long, pos, 4, "pallas"), "qkv_o")
    monkeypatch.setattr(decode, "TUNING", dict(fuse_o=1, o_split=1))
    assert hasattr(make_paged_attend(cfg, long, pos, 4, "pallas"), "qkv_o")
    monkeypatch.setattr(decode, "TUNING", dict(fuse_o=1, last_combine=1))
    with pytest.raises(ValueError, match="fuse_o and last_combine are alternatives"):
        make_paged_attend(cfg, tables, pos, 4, "pallas")
