"""The Pallas GEMV (pallas_kernels/gemv.py) in interpret mode, and the projections that use it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels.gemv import gemv, gemv_reference

KEY = jax.random.PRNGKey(0)


def _xw(m, k, n, dtype=jnp.float32):
    kx, kw = jax.random.split(KEY)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(dtype)
    return x, w


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,use_dot,block_n", [(1, True, 16), (5, True, 16), (1, False, 4),
                                                (3, False, 8), (1, False, 1)])
def test_gemv_matches_the_model_projection_fp32(m, use_dot, block_n, gated):
    x, w = _xw(m, 256, 64)
    y = gemv(x, w, gated=gated, interpret=True, use_dot=use_dot, block_n=block_n, block_k=64)
    ref = gemv_reference(x, w, gated=gated)
    assert y.shape == ref.shape == (m, 32 if gated else 64)
    # fp32: only the accumulation order differs from XLA's dot.
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_gemv_bf16_within_one_rounding_of_the_model():
    x, w = _xw(2, 512, 64, jnp.bfloat16)
    for gated in (False, True):
        y = gemv(x, w, gated=gated, interpret=True, use_dot=False, block_n=4, block_k=128)
        ref = gemv_reference(x, w, gated=gated).astype(jnp.float32)
        # bf16 output: a different fp32 accumulation order can flip the last bit (2^-8 rel).
        err = np.max(np.abs(np.asarray(y, np.float32) - np.asarray(ref)))
        assert err <= 2 ** -7 * float(jnp.max(jnp.abs(ref)))


def test_gemv_row_results_do_not_depend_on_the_row_count():
    """Each row sees the same tiles in the same order: one row alone and the same row among
    five give bit-identical projections (decode vs verification rows)."""
    x, w = _xw(5, 256, 64, jnp.bfloat16)
    for kw in (dict(use_dot=True, block_n=16), dict(use_dot=False, block_n=4)):
        many = gemv(x, w, interpret=True, block_k=64, **kw)
        one = gemv(x[2:3], w, interpret=True, block_k=64, **kw)
        np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(many[2]))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_prefetch_is_bit_identical(gated, m):
    """Loading K chunks ahead changes when bytes arrive, not the summation order: every
    depth, up to the chunk count (all loads up front) and past it, gives the same bits."""
    x, w = _xw(m, 256, 64, jnp.bfloat16)
    kw = dict(gated=gated, interpret=True, use_dot=False, block_n=4, block_k=64)  # 4 chunks
    base = np.asarray(gemv(x, w, **kw), np.float32)
    for prefetch in (1, 2, 3, 4):
        np.testing.assert_array_equal(np.asarray(gemv(x, w, prefetch=prefetch, **kw), np.float32),
                                      base, err_msg=f"prefetch={prefetch}")
    one_chunk = dict(kw, block_k=256)
    np.testing.assert_array_equal(np.asarray(gemv(x, w, prefetch=2, **one_chunk), np.float32),
                                  np.asarray(gemv(x, w, **one_chunk), np.float32))


def test_gemv_norm_prologue_with_prefetch_is_bit_identical():
    from pallas_kernels.gemv import gemv_normed
    x, w = _xw(2, 256, 64, jnp.bfloat16)
    b = (x * 3)[::-1]
    nw = jnp.linspace(0.5, 1.5, 256).astype(jnp.bfloat16)
    kw = dict(eps=1e-6, branch=b, branch_w=nw[::-1], gated=True, interpret=True, use_dot=False,
              block_n=4, block_k=64)
    (y0, x0), (y2, x2) = (gemv_normed(x, nw, w, prefetch=p, **kw) for p in (0, 2))
    np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y0, np.float32))
    np.testing.assert_array_equal(np.asarray(x2, np.float32), np.asarray(x0, np.float32))


@pytest.mark.parametrize("bad,msg", [
    (dict(block_n=3), "power of two"), (dict(block_k=48), "power of two"),
    (dict(block_n=128), "must divide"), (dict(use_dot=True, block_n=8), "block_n and block_k >= 16"),
    (dict(use_dot=True, block_n=16, block_k=8), "block_n and block_k >= 16"),
    (dict(num_stages=2, foo=1), "unknown gemv tuning"),
    (dict(use_dot=False, block_n=4, prefetch=5), "prefetch must be an int in 0..4"),
    (dict(use_dot=False, block_n=4, prefetch=-1), "prefetch must be an int"),
    (dict(use_dot=False, block_n=4, prefetch=1.0), "prefetch must be an int"),
    (dict(use_dot=False, block_n=4, prefetch=True), "prefetch must be an int"),
    (dict(use_dot=True, block_n=16, prefetch=1), "prefetch is for the CUDA-core path"),
])
def test_gemv_rejects_bad_tilings(bad, msg):
    x, w = _xw(1, 256, 64)
    with pytest.raises(ValueError, match=msg):
        gemv(x, w, interpret=True, **bad)


def test_gemv_rejects_bad_shapes():
    x, w = _xw(1, 256, 64)
    with pytest.raises(ValueError, match="shape mismatch"):
        gemv(x, w[:, :128], interpret=True)
    with pytest.raises(ValueError, match="1..16 rows"):
        gemv(jnp.zeros((17, 256)), w, interpret=True)
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv(jnp.zeros((9, 256)), w, interpret=True, use_dot=False, block_n=4)
    with pytest.raises(ValueError, match="even row count"):
        gemv(x, w[:63], gated=True, interpret=True)


def test_projection_specs_parse_and_reject_unknown_names(monkeypatch):
    from ouro_jax import attention
    from ouro_jax.projections import INV_ROWS, NAMES, XLA, PallasGemv, parse
    assert parse("xla") == XLA() and parse("gemv") == PallasGemv(NAMES)
    monkeypatch.setattr(attention, "resolve_backend", lambda b: "xla")  # as on a CPU
    assert parse("auto") == XLA()
    monkeypatch.setattr(attention, "resolve_backend", lambda b: "pallas")  # as on a GPU
    assert parse("auto") == PallasGemv(NAMES, fuse_norms=True, stream=True,  # GPU_DEFAULT
                                       inv_rows=INV_ROWS)
    for spec in ("gemv", "gemv@5", "gemv:o", "gemv@3:qkv,down"):
        assert parse(parse(spec).spec) == parse(spec)
    assert parse("gemv@1:down,o,qkv,gate_up").spec == "gemv"  # canonical: one program key
    assert parse("gemv:down,gate_up").names == ("gate_up", "down")
    assert parse("gemv").max_rows == 1 and parse("gemv@5:o") == PallasGemv(("o",), 5)
    for bad in ("cublas", "gemv:qkv,mlp", "gemv:,", "gemv:"):
        with pytest.raises(ValueError, match="unknown projection"):
            parse(bad)
    for bad in ("gemv@0", "gemv@6", "gemv@x:o"):
        with pytest.raises(ValueError, match="ROWS"):
            parse(bad)
    assert parse("gemv+pf2").prefetch == 2 and parse("gemv").prefetch is None
    assert parse(parse("gemv+norms+pf0").spec) == parse("gemv+norms+pf0")
    assert parse("gemv+pf3").tuning("down", 2048, 5632)["prefetch"] == 3
    for bad in ("gemv+pf5", "gemv+pf", "gemv+pfx", "gemm+pf1", "gemv+pf1+pf2"):
        with pytest.raises(ValueError, match="pfN"):
            parse(bad)


def test_gemv_projections_route_few_row_calls_only():
    """Calls of <= max_rows rows go through the kernel, more rows through XLA (jaxpr count)."""
    from engine_helpers import pallas_call_eqns
    from ouro_jax.projections import PallasGemv
    proj = PallasGemv(("o",), max_rows=2)
    x, w = _xw(1, 256, 64)
    assert len(pallas_call_eqns(lambda a: proj.project("o", a[:, None], w), x)) == 1
    assert len(pallas_call_eqns(lambda a: proj.project("o", a, w), jnp.zeros((2, 256)))) == 1
    assert len(pallas_call_eqns(lambda a: proj.project("o", a, w), jnp.zeros((3, 256)))) == 0
    assert len(pallas_call_eqns(lambda a: proj.project("qkv", a, w), x)) == 0


def test_gemv_rows_mode_routes_decode_draft_and_verification(monkeypatch):
    """With 'gemv@5', batch-1 decode (1 row), draft (1 row) and verification (k+1 rows) all go
    through the kernel (row counts recorded at trace time); with the default 'gemv' only the
    one-row calls do. Greedy speculative output still equals greedy decode (bf16, tiny model:
    a sanity check of the engine with the kernel in it, not a rounding test)."""
    from ouro_jax import projections
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    cfg = PRESETS["tiny-mha"]
    llm = Ouro(cfg, random_params(cfg, 3, jnp.bfloat16, 0.003, 0.0), None, attention="xla",
               projections="gemv@5", decode_chunk=8)
    assert llm.backend == "xla+gemv@5"
    rows_seen = set()
    real = projections.PallasGemv._gemv

    def spy(self, name, x, w, gated=False, **kw):
        rows_seen.add((name, x.size // x.shape[-1]))
        return real(self, name, x, w, gated, **kw)
    monkeypatch.setattr(projections.PallasGemv, "_gemv", spy)
    sp = [SamplingParams(max_tokens=12, ignore_eos=True)]
    native = llm.generate([[5, 9, 2, 7]], sp).outputs[0].token_ids
    spec = llm.generate([[5, 9, 2, 7]], sp, speculative=SpeculativeConfig(4, 2)).outputs[0].token_ids
    assert spec == native and len(native) == 12
    assert {(n, r) for n in projections.NAMES for r in (1, 5)} <= rows_seen
    rows_seen.clear()
    one_row = Ouro(cfg, llm.params, None, attention="xla", projections="gemv", decode_chunk=8)
    one_row.generate([[5, 9, 2, 7]], sp, speculative=SpeculativeConfig(4, 2))
    assert {r for _, r in rows_seen} == {1}


def test_gemv_projections_with_unfused_weights():
    """Unfused q/k/v go through the GEMV one by one; unfused gate/up stay on XLA (the gated
    kernel reads a [gate; up] weight). Same greedy tokens as XLA projections in fp32."""
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    from ouro_jax.sampling import SamplingParams

    cfg = PRESETS["tiny-mha"]
    params = random_params(cfg, 0, jnp.float32, 0.003, 0.0)
    sp = [SamplingParams(max_tokens=6, ignore_eos=True)]
    toks = [Ouro(cfg, params, None, attention="xla", projections=p, fuse_projections=False)
            .generate([[3, 1, 4]], sp).outputs[0].token_ids for p in ("xla", "gemv")]
    assert toks[0] == toks[1] and len(toks[0]) == 6


def test_unknown_backend_options_and_bad_projections_are_refused():
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.engine import forward_block
    from ouro_jax.generate import build_parser

    with pytest.raises(ValueError, match="unknown backend option"):
        forward_block(None, None, None, None, None, PRESETS["tiny-mha"], range(1), "xla+unrol")
    with pytest.raises(ValueError, match="unknown projection"):
        Ouro(PRESETS["tiny-mha"], None, None, projections="gemv:mlp")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--projections", "gemv@7"])


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("m", [1, 5])
def test_engine_gemv_tilings_on_the_gpu(name, m):
    """The compiled Triton kernel with the engine's tiling on the 1.4B projection shapes, in
    bf16: within about one bf16 rounding of XLA's projection (GEMV benchmark: <= 4.4e-3)."""
    from benchmarks.gemv import SHAPES
    from ouro_jax.projections import GEMV_TUNING

    n, k, gated = SHAPES[name]
    x, w = _xw(m, k, n, jnp.bfloat16)
    y = gemv(x, w, gated=gated, **GEMV_TUNING[name]).astype(jnp.float32)
    ref = gemv_reference(x, w, gated=gated).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
    assert err <= 8e-3, err
    one = gemv(x[:1], w, gated=gated, **GEMV_TUNING[name])
    np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(y[0].astype(jnp.bfloat16)))


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_gemv_prefetch_on_the_gpu_is_bit_identical(name):
    """The compiled kernels at prefetch depths 0-3 with the engine's tiling: the same bits."""
    from benchmarks.gemv import SHAPES
    from ouro_jax.projections import GEMV_TUNING

    n, k, gated = SHAPES[name]
    x, w = _xw(1, k, n, jnp.bfloat16)
    ys = [np.asarray(gemv(x, w, gated=gated, **dict(GEMV_TUNING[name], prefetch=p)), np.float32)
          for p in range(4)]
    for p in range(1, 4):
        np.testing.assert_array_equal(ys[p], ys[0], err_msg=f"prefetch={p}")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_norm_prologue_matches_the_layer_math(dtype, gated, m):
    """'norms': the GEMV prologue adds the residual and applies both RMSNorms. Same result as
    model.rms_norm + the XLA projection: bit-identical in bf16 on these inputs, fp32 within
    accumulation order; the new residual stream equals x + rms_norm(branch, wb)."""
    from ouro_jax.model import rms_norm
    from pallas_kernels.gemv import gemv_normed
    ks = jax.random.split(jax.random.PRNGKey(m), 5)
    x = jax.random.normal(ks[0], (m, 256)).astype(dtype)
    b = (jax.random.normal(ks[1], (m, 256)) * 3).astype(dtype)
    wb, wx = ((1 + 0.1 * jax.random.normal(kk, (256,))).astype(dtype) for kk in ks[2:4])
    w = (jax.random.normal(ks[4], (128, 256)) * 0.06).astype(dtype)
    kw = dict(gated=gated, interpret=True, use_dot=False, block_n=8, block_k=64)
    y, x_new = gemv_normed(x, wx, w, eps=1e-6, branch=b, branch_w=wb, **kw)
    x_ref = x + rms_norm(b, wb, 1e-6)
    ref = gemv_reference(rms_norm(x_ref, wx, 1e-6), w, gated=gated)
    y2, same = gemv_normed(x, wx, w, eps=1e-6, **kw)
    ref2 = gemv_reference(rms_norm(x, wx, 1e-6), w, gated=gated)
    assert same is x
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == jnp.float32 else dict(rtol=0, atol=0)
    f = lambda a: np.asarray(a, np.float32)
    np.testing.assert_allclose(f(x_new), f(x_ref), **tol)
    np.testing.assert_allclose(f(y), f(ref), **tol)
    np.testing.assert_allclose(f(y2), f(ref2), **tol)


def test_gemv_norm_prologue_rejects_bad_input():
    from pallas_kernels.gemv import gemv_normed
    x, w = _xw(1, 256, 64)
    nw = jnp.ones((256,))
    with pytest.raises(ValueError, match="use_dot=False"):
        gemv_normed(x, nw, w, eps=1e-6, interpret=True, use_dot=True)
    with pytest.raises(ValueError, match="norm weight shape"):
        gemv_normed(x, nw[:128], w, eps=1e-6, interpret=True, use_dot=False, block_n=4)
    with pytest.raises(ValueError, match="together"):
        gemv_normed(x, nw, w, eps=1e-6, branch=x, interpret=True, use_dot=False, block_n=4)


def test_norms_spec_fuses_the_layer_norms_into_the_gemv():
    """With 'gemv+norms' a batch-1 decoder layer runs 5 Pallas kernels: qkv with the input
    norm (no branch on a loop's first layer), attention is XLA here, o, gate/up with the
    residual add and both norms, down; the next layer's qkv takes the deferred residual."""
    from engine_helpers import pallas_call_names
    from ouro_jax.config import PRESETS
    from ouro_jax.model import decoder_layer, dense_causal_attend, rope_cos_sin, unstack_layers
    from ouro_jax.params import random_params
    from ouro_jax.projections import Residual, parse

    cfg = PRESETS["tiny-mha"]
    lp = unstack_layers(random_params(cfg, 0, jnp.float32, 0.003, 0.0), fuse=True).layers[0]
    cos, sin = rope_cos_sin(jnp.zeros((1,), jnp.int32), cfg.head_dim, cfg.rope_theta, jnp.float32)
    x = jax.random.normal(KEY, (1, cfg.hidden_size))

    def names(proj, inp):
        def f(a):
            out, _ = decoder_layer(lp, a, cos, sin, cfg, dense_causal_attend, None, 0, 0, proj)
            return out
        return pallas_call_names(f, inp)
    assert names(parse("gemv+norms"), x) == ["gemv_norm", "gemv", "gemv_silu_add_norm", "gemv"]
    assert names(parse("gemv"), x) == ["gemv", "gemv", "gemv_silu", "gemv"]
    fused = decoder_layer(lp, x, cos, sin, cfg, dense_causal_attend, None, 0, 0,
                          parse("gemv+norms"))[0]
    plain = decoder_layer(lp, x, cos, sin, cfg, dense_causal_attend, None, 0, 0)[0]
    assert isinstance(fused, Residual)
    np.testing.assert_allclose(np.asarray(parse("gemv+norms").materialize(fused, cfg.rms_norm_eps)),
                               np.asarray(plain), rtol=1e-5, atol=1e-5)


def test_engine_tokens_with_fused_norms():
    """Greedy decode, native and speculative (batch 1: decode and draft through the fused
    prologues, verification on XLA), fp32: the same tokens as XLA projections."""
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    cfg = PRESETS["tiny-mha"]
    params = random_params(cfg, 0, jnp.float32, 0.003, 0.0)
    sp = [SamplingParams(max_tokens=10, ignore_eos=True)]
    out = {}
    for p in ("xla", "gemv+norms"):
        llm = Ouro(cfg, params, None, attention="xla", projections=p, decode_chunk=8)
        out[p] = (llm.generate([[3, 1, 4]], sp).outputs[0].token_ids,
                  llm.generate([[3, 1, 4]], sp, speculative=SpeculativeConfig(4, 2))
                  .outputs[0].token_ids)
    assert llm.backend == "xla+gemv+norms"
    assert out["xla"] == out["gemv+norms"] and out["xla"][0] == out["xla"][1]


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "gate_up"])
@pytest.mark.parametrize("branch", [False, True])
def test_engine_gemv_norm_prologue_on_the_gpu(name, branch):
    """The compiled prologue kernels on the 1.4B shapes in bf16, against the layer math."""
    from benchmarks.gemv import SHAPES
    from ouro_jax.model import rms_norm
    from ouro_jax.projections import GEMV_TUNING
    from pallas_kernels.gemv import gemv_normed

    n, k, gated = SHAPES[name]
    x, w = _xw(1, k, n, jnp.bfloat16)
    b = (x[:, ::-1] * 3).astype(jnp.bfloat16)
    nw = (1 + 0.1 * jnp.cos(jnp.arange(k))).astype(jnp.bfloat16)
    extra = dict(branch=b, branch_w=nw[::-1]) if branch else {}
    y, x_new = gemv_normed(x, nw, w, eps=1e-6, gated=gated, **extra, **GEMV_TUNING[name])
    x_ref = x + rms_norm(b, nw[::-1], 1e-6) if branch else x
    ref = gemv_reference(rms_norm(x_ref, nw, 1e-6), w, gated=gated).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(x_new.astype(jnp.float32) - x_ref.astype(jnp.float32)))) <= \
        2 ** -7 * float(jnp.max(jnp.abs(x_ref.astype(jnp.float32))))
    err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
    assert err <= 8e-3, err
