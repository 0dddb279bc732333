"""pallas_kernels.matvec (fused residual + RMSNorm + projection) and the fused engine path.

CPU: the kernel in interpret mode against the model's own ops, and the engine with
fused_matvec=True against the engine without it (greedy tokens, plain and speculative).
GPU (marked): the compiled Triton kernel at the 1.4B shapes in bf16.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matvec import fused_norm_matvec, fused_norm_matvec_reference, supported


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


gpu = pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU")


def _case(rng, m, k, n, gated, dtype):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    d = jnp.asarray(3 * rng.standard_normal((m, k)), dtype)
    w_in = jnp.asarray(1 + 0.1 * rng.standard_normal(k), dtype)
    w_res = jnp.asarray(0.5 + 0.1 * rng.standard_normal(k), dtype)
    w = jnp.asarray(rng.standard_normal((2 * n if gated else n, k)) / np.sqrt(k), dtype)
    return x, d, w_in, w_res, w


def _check(h, y, h0, y0, dtype):
    assert y.shape == y0.shape and h.shape == h0.shape
    h, y, h0, y0 = (np.asarray(a, np.float64) for a in (h, y, h0, y0))
    assert np.all(np.isfinite(y))
    if dtype == jnp.bfloat16:  # the residual/norm prologue rounds like the model
        np.testing.assert_array_equal(h, h0)
    else:  # fp32: the statistics' summation order differs by an ulp
        np.testing.assert_allclose(h, h0, rtol=1e-6, atol=1e-6)
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: one output rounding apart at most
    assert np.max(np.abs(y - y0)) <= tol * np.max(np.abs(y0))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("m,k,n,gated,res", [(1, 48, 80, False, False), (3, 32, 64, True, True),
                                             (5, 64, 96, False, True), (16, 48, 160, True, False)])
@pytest.mark.parametrize("stats", ["kernel", "xla"])
def test_matvec_interpret(dtype, m, k, n, gated, res, stats):
    x, d, w_in, w_res, w = _case(np.random.default_rng(m + n), m, k, n, gated, dtype)
    kw = dict(eps=1e-6, d=d if res else None, w_res=w_res if res else None, gated=gated)
    h, y = fused_norm_matvec(x, w_in, w, interpret=True, stats=stats, **kw)
    h0, y0 = fused_norm_matvec_reference(x, w_in, w, **kw)
    _check(h, y, h0, y0, dtype)


def test_matvec_rejects_bad_shapes():
    x = jnp.ones((2, 32))
    with pytest.raises(ValueError, match="shape mismatch"):
        fused_norm_matvec(x, jnp.ones(32), jnp.ones((64, 48)), eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match="does not support M=17"):
        fused_norm_matvec(jnp.ones((17, 32)), jnp.ones(32), jnp.ones((64, 32)), eps=1e-6,
                          interpret=True)
    assert supported(16, 2048, 5632) and not supported(64, 2048, 5632)
    assert not supported(1, 40, 64)  # K not divisible by 16


def test_engine_fused_matches_plain(monkeypatch):
    """Greedy tokens with fused_matvec equal the plain engine's (fp32), native and speculative,
    and the fused kernels are really in the decode program."""
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    import pallas_kernels.matvec as mv

    calls = []
    real = mv.fused_norm_matvec
    monkeypatch.setattr(mv, "fused_norm_matvec",
                        lambda x, *a, **kw: calls.append(x.shape) or real(x, *a, **kw))
    cfg = PRESETS["tiny-gqa"]
    params = random_params(cfg, 3, jnp.float32)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [7, 8, 9]]
    sps = [SamplingParams(max_tokens=14, ignore_eos=True), SamplingParams(max_tokens=9)]
    outs = []
    for fm in (False, True):
        llm = Ouro(cfg, params, None, attention="xla", fused_matvec=fm, decode_chunk=5)
        plain = llm.generate(prompts, sps)
        spec = llm.generate(prompts, sps, speculative=SpeculativeConfig(3, 2))
        outs.append([[o.token_ids for o in r.outputs] for r in (plain, spec)])
        # traced into: decode (2 rows), draft (2), verification (2 x 4), prefill (2 x 16 rows
        # is too many: plain path)
        assert bool(calls) == fm and (not fm or {(2, 48), (8, 48)} <= set(calls))
    assert outs[0] == outs[1]
    assert outs[0][0] == outs[0][1]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 5, 8])
@pytest.mark.parametrize("n,gated,res", [(6144, False, False), (5632, True, True),
                                         (6144, False, True)])
@pytest.mark.parametrize("stats", ["kernel", "xla"])
def test_matvec_gpu_1p4b_shapes(m, n, gated, res, stats):
    x, d, w_in, w_res, w = _case(np.random.default_rng(m), m, 2048, n, gated, jnp.bfloat16)
    kw = dict(eps=1e-6, d=d if res else None, w_res=w_res if res else None, gated=gated,
              stats=stats)
    h, y = jax.jit(lambda *a: fused_norm_matvec(*a, **kw))(x, w_in, w)
    kw.pop("stats")
    h0, y0 = jax.jit(lambda *a: fused_norm_matvec_reference(*a, **kw))(x, w_in, w)
    _check(h, y, h0, y0, jnp.bfloat16)
