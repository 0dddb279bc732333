"""The o projection with the decode attention's split merge as its prologue
(pallas_kernels.gemv_merge, `--decode-kernel o_merge=1`): interpret mode on the CPU against
the XLA combine followed by the streaming GEMV, and end to end in the engine."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import (has_gpu, load, ragged_prompts, tiny_checkpoint,
                            tokens_per_decode_tuning)
from ouro_jax.sampling import SamplingParams
from pallas_kernels._common import combine_splits
from pallas_kernels.gemv_merge import gemv_stream_merged
from pallas_kernels.gemv_stream import gemv_stream


def _operands(m, kvh, s, g, hd, n, seed=0, empty=True):
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
    parts = jax.random.normal(k1, (m, kvh, s, g, hd), jnp.float32)
    lse = 3 * jax.random.normal(k2, (m, kvh, s, g), jnp.float32)
    if empty:  # a split that saw no key (its partial is zero, its lse -inf)
        lse = lse.at[0, 0, s - 1].set(-jnp.inf)
        parts = parts.at[0, 0, s - 1].set(0.0)
    w = (0.1 * jax.random.normal(k3, (n, kvh * g * hd), jnp.float32)).astype(jnp.bfloat16)
    return parts, lse, w


@pytest.mark.parametrize("m,kvh,s,g,hd,n,tiling", [
    (1, 4, 3, 1, 32, 64, dict(block_n=2, block_k=64, per_program=2, num_warps=4)),
    (1, 4, 5, 1, 32, 64, dict(block_n=4, block_k=128, per_program=1, num_warps=4)),
    (1, 2, 4, 2, 16, 32, dict(block_n=2, block_k=32, per_program=4, num_warps=4)),  # GQA
    (2, 4, 2, 1, 32, 64, dict(block_n=2, block_k=64, per_program=2, num_warps=4)),  # 2 rows
])
def test_merged_projection_equals_combine_then_gemv(m, kvh, s, g, hd, n, tiling):
    """Bit for bit what the default path computes: the XLA combine, rounded to bf16, then
    the streaming GEMV at the same tiling (in interpret mode both exps are XLA's)."""
    parts, lse, w = _operands(m, kvh, s, g, hd, n)
    x = combine_splits(parts, lse, axis=2).astype(jnp.bfloat16).reshape(m, -1)
    want = gemv_stream(x, w, interpret=True, **tiling)
    got = gemv_stream_merged(parts, lse, w, dtype=jnp.bfloat16, interpret=True, **tiling)
    assert got.dtype == jnp.bfloat16 and got.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_merged_projection_rejects_what_it_cannot_take():
    parts, lse, w = _operands(1, 4, 3, 1, 32, 64)
    t = dict(block_n=2, per_program=2, num_warps=4)
    with pytest.raises(ValueError, match="whole KV heads"):
        gemv_stream_merged(parts, lse, w, dtype=jnp.bfloat16, interpret=True, block_k=16, **t)
    with pytest.raises(ValueError, match="fp32"):
        gemv_stream_merged(parts.astype(jnp.bfloat16), lse, w, dtype=jnp.bfloat16,
                           interpret=True, block_k=64, **t)
    with pytest.raises(ValueError, match=r"lse \[M"):
        gemv_stream_merged(parts, lse[..., None], w, dtype=jnp.bfloat16, interpret=True,
                           block_k=64, **t)
    with pytest.raises(ValueError, match="w must be"):
        gemv_stream_merged(parts, lse, w[:, :64], dtype=jnp.bfloat16, interpret=True,
                           block_k=64, **t)
    with pytest.raises(ValueError, match="takes no row2d"):
        gemv_stream_merged(parts, lse, w, dtype=jnp.bfloat16, interpret=True, block_k=64,
                           row2d=True, **t)


@pytest.mark.parametrize("preset,in_gemv", [("tiny-mha", True), ("tiny-mqa", True),
                                            ("tiny-gqa", False)])
def test_o_merge_matches_end_to_end(monkeypatch, preset, in_gemv):
    """With o_merge (3 splits forced at one row) the decode attention hands its partials to
    the o projection's streaming GEMV, which merges them: the same greedy tokens as the XLA
    combine and the xla backend, plain and speculative (k=2, d=2). The one-row projections
    are the GPU default's (the streaming GEMV). tiny-gqa's group of 3 heads of 8 gives no
    power-of-two block of whole KV heads, so there the XLA combine merges first."""
    import pallas_kernels.gemv_merge as gm
    from ouro_jax import api
    from ouro_jax.projections import GPU_DEFAULT

    folder = tiny_checkpoint(preset, branch_scale=0.3)
    cfg, params = load(folder)
    prompts = ragged_prompts(cfg.vocab_size, [7], seed=5)  # one row: the merged path
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    split = dict(block_t=4, num_splits=3)
    merges = []
    real = gm.merged_rows
    monkeypatch.setattr(gm, "merged_rows", lambda *a, **k: merges.append(1) or real(*a, **k))
    init = api.Ouro.__init__
    monkeypatch.setattr(api.Ouro, "__init__", lambda self, *a, **k: init(
        self, *a, **dict(k, projections=GPU_DEFAULT if k.get("attention") == "pallas"
                         else "xla")))
    runs = tokens_per_decode_tuning(monkeypatch, cfg, params, prompts, sp, [
        ("xla", {}), ("pallas", split), ("pallas", dict(split, o_merge=1))])
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert bool(merges) == in_gemv


def test_merge_tuning_fits_whole_heads_and_declines_what_the_merge_cannot_take(monkeypatch):
    """split_attn.merge_tuning: block_k in whole KV heads (a power of two of them), None for
    a head group that is no power of two or an o tiling with a norm-prologue or PDL option
    (the caller then merges through XLA, as the engine test's tiny-gqa does)."""
    from ouro_jax import split_attn
    from ouro_jax.split_attn import SplitAttn, merge_tuning

    def split(kvh, g, hd):
        return SplitAttn(jnp.zeros((1, kvh, 3, g, hd), jnp.float32),
                         jnp.zeros((1, kvh, 3, g), jnp.float32), (1, 1), jnp.bfloat16)
    assert merge_tuning(split(16, 1, 128), 2048)["block_k"] == 512  # the engine's o tiling
    assert merge_tuning(split(4, 2, 8), 32)["block_k"] % 16 == 0
    assert merge_tuning(split(2, 3, 8), 48) is None
    monkeypatch.setitem(split_attn.STREAM_TUNING, "o",
                        dict(split_attn.STREAM_TUNING["o"], x_first=True))
    assert merge_tuning(split(16, 1, 128), 2048) is None


@pytest.mark.parametrize("argv,msg", [
    (["--decode-kernel", "o_merge=1", "--attention", "xla"], "o_merge=1 needs --attention"),
    (["--decode-kernel", "o_merge=1", "--attention", "pallas", "--batch", "8"],
     "one-row decode only"),
    (["--decode-kernel", "o_merge=1", "--attention", "pallas", "--batch", "1",
      "--projections", "gemv+norms+stream+graph"], "merges in the streaming o GEMV"),
    (["--decode-kernel", "o_merge=1", "--attention", "pallas", "--batch", "1",
      "--projections", "gemv+norms"], "merges in the streaming o GEMV"),
])
def test_the_decode_benchmark_refuses_o_merge_where_it_would_change_nothing(argv, msg):
    from benchmarks.decode import main
    with pytest.raises(SystemExit, match=msg):
        main(argv)


def test_o_merge_is_an_alternative_to_the_kernels_own_merge(monkeypatch):
    import pallas_kernels.decode as decode
    from ouro_jax.attention import make_paged_attend

    cfg, _ = load(tiny_checkpoint("tiny-gqa"))
    tables, pos = np.ones((1, 3), np.int32), np.zeros((1, 1), np.int32)
    monkeypatch.setattr(decode, "TUNING", dict(o_merge=1, last_combine=1))
    with pytest.raises(ValueError, match="o_merge"):
        make_paged_attend(cfg, tables, pos, 4, "pallas")


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("tiling", [
    dict(block_n=2, block_k=512, per_program=2, num_warps=4),  # the engine's o tiling
    dict(block_n=4, block_k=512, per_program=4, num_warps=4),
    dict(block_n=2, block_k=2048, per_program=2, num_warps=8)])
def test_merged_projection_on_the_gpu(tiling):
    """Compiled, at the 1.4B o shape with the engine's 5 batch-1 splits: against the XLA
    combine then the streaming GEMV at the same tiling. The GEMV's sums run in the same order;
    the merge's exp is Triton's, not XLA's, so a merged input may round to the neighbouring
    bf16 value: every output within 2 bf16 steps of the default path's, and the share of
    bit-equal outputs is printed (pytest -s)."""
    parts, lse, w = _operands(1, 16, 5, 1, 128, 2048, seed=3)
    x = combine_splits(parts, lse, axis=2).astype(jnp.bfloat16).reshape(1, -1)
    want = np.asarray(gemv_stream(x, w, **tiling), np.float32)
    got = np.asarray(gemv_stream_merged(parts, lse, w, dtype=jnp.bfloat16, **tiling),
                     np.float32)
    step = np.abs(want) * 2.0 ** -7 + 1e-6  # one bf16 step at each output's size
    assert np.all(np.abs(got - want) <= 2 * step), np.max(np.abs(got - want) / step)
    print(f"merged o {tiling}: {np.mean(got == want):.4f} of outputs bit-equal")
