"""The skinny Pallas GEMM (pallas_kernels/gemm.py) in interpret mode, its routing in
ouro_jax.projections, and the compiled kernel on the GPU (marked)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu, pallas_call_names
from pallas_kernels.gemm import gemm
from pallas_kernels.gemv import gemv_reference

KEY = jax.random.PRNGKey(1)


def _xw(m, k, n, dtype=jnp.float32):
    kx, kw = jax.random.split(KEY)
    x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * k ** -0.5).astype(dtype)
    return x, w


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("m,block_m", [(2, 16), (16, 16), (40, 32), (64, 64), (70, 32)])
def test_gemm_matches_the_model_projection_fp32(m, block_m, gated):
    """Full and ragged row blocks (40 and 70 rows mask the rows their last block lacks)."""
    x, w = _xw(m, 256, 128)
    y = gemm(x, w, gated=gated, interpret=True, block_m=block_m, block_n=32, block_k=64)
    ref = gemv_reference(x, w, gated=gated)
    assert y.shape == ref.shape == (m, 64 if gated else 128)
    # fp32 (IEEE dots in the kernel): only the accumulation order differs from XLA's dot.
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_gemm_bf16_within_one_rounding_and_rows_independent():
    x, w = _xw(40, 512, 64, jnp.bfloat16)
    for gated in (False, True):
        y = gemm(x, w, gated=gated, interpret=True, block_m=16, block_n=16, block_k=128)
        ref = gemv_reference(x, w, gated=gated).astype(jnp.float32)
        err = np.max(np.abs(np.asarray(y, np.float32) - np.asarray(ref)))
        assert err <= 2 ** -7 * float(jnp.max(jnp.abs(ref)))
        # A row's result does not depend on the rows around it (same tiles, same order).
        alone = gemm(x[17:18], w, gated=gated, interpret=True, block_m=16, block_n=16,
                     block_k=128)
        np.testing.assert_array_equal(np.asarray(alone[0]), np.asarray(y[17]))


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("splits", [2, 4])
def test_split_k_matches_the_model_projection_and_keeps_rows_independent(splits, gated):
    """k_splits: fp32 partials added in a fixed order. fp32 within accumulation-order noise
    of XLA; bf16 within one rounding; with a fixed row block a row's bits are the same
    alone, among 40 and 64 rows, and among 70 (the last of three row blocks ragged); the fp32
    bits too, where bf16's rounding could hide a split that depends on the row count."""
    x, w = _xw(70, 512, 128)
    tiling = dict(block_m=32, block_n=32, block_k=64, k_splits=splits, fixed_rows=True,
                  interpret=True)
    y = gemm(x, w, gated=gated, **tiling)
    ref = gemv_reference(x, w, gated=gated)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-5)
    xb, wb = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
    yb = gemm(xb, wb, gated=gated, **tiling)
    assert yb.dtype == jnp.bfloat16 and yb.shape == ref.shape
    refb = gemv_reference(xb, wb, gated=gated).astype(jnp.float32)
    assert float(jnp.max(jnp.abs(yb.astype(jnp.float32) - refb))) <= \
        2 ** -7 * float(jnp.max(jnp.abs(refb)))
    for rows in (slice(17, 18), slice(0, 40), slice(0, 64)):
        for a, whole in ((xb, yb), (x, y)):
            part = gemm(a[rows], w.astype(a.dtype), gated=gated, **tiling)
            np.testing.assert_array_equal(np.asarray(part), np.asarray(whole[rows]))


@pytest.mark.parametrize("m", [1, 33, 40])
def test_ragged_row_block_writes_no_row_past_m(m):
    """The kernel itself, its output pre-filled with a sentinel and longer than M: rows past M
    must keep it (on a GPU they would be other memory), the rows before are the product.
    (Not NaN: the interpreter pads x with NaN, so a row past M would compute NaN too.)
    (gemm() hands the kernel an output of exactly M rows, so this is the only place a mask
    that let one row too many through would show on a CPU.)"""
    import functools

    from pallas_kernels import gemm as gm
    x, w = _xw(m, 128, 64)
    rows_out = 64  # two 32-row blocks' worth
    kernel = functools.partial(gm._kernel, m=m, k=128, block_m=32, block_n=32, block_k=64,
                               gated=False, up_offset=64, k_splits=1)
    y = gm.pl.pallas_call(
        lambda x_ref, w_ref, _, y_ref: kernel(x_ref, w_ref, y_ref),
        out_shape=jax.ShapeDtypeStruct((rows_out, 64), jnp.float32),
        grid=(gm.cdiv(m, 32), 2, 1), input_output_aliases={2: 0}, interpret=True,
    )(x, w, jnp.full((rows_out, 64), 7.0, jnp.float32))
    assert (np.asarray(y[m:]) == 7.0).all()
    np.testing.assert_allclose(np.asarray(y[:m]), np.asarray(gemv_reference(x, w)),
                               rtol=1e-5, atol=1e-5)


def test_sum_splits_adds_left_to_right():
    """The partials' order is fixed: ((p0 + p1) + p2) + p3, compiled. With 1 and three
    2^-24: left to right each small term rounds away against 1 (result 1); a pairwise tree
    or a reversed order lets small terms meet first and the result exceeds 1."""
    from pallas_kernels.gemm import sum_splits
    p = [1.0, 2.0 ** -24, 2.0 ** -24, 2.0 ** -24]
    parts = jnp.asarray([p], jnp.float32)
    summed = jax.jit(sum_splits, static_argnums=1)
    assert float(summed(parts, 4)[0, 0]) == 1.0
    assert float(summed(parts[:, ::-1], 4)[0, 0]) > 1.0
    tree = (np.float32(p[0]) + np.float32(p[1])) + (np.float32(p[2]) + np.float32(p[3]))
    assert tree > 1.0  # (so a tree-shaped sum would fail the first check)
    with pytest.raises(ValueError, match="not 3 equal splits"):
        sum_splits(parts, 3)


@pytest.mark.parametrize("bad,msg", [
    (dict(block_n=8), "power of two >= 16"), (dict(block_k=48), "power of two >= 16"),
    (dict(block_n=128), "must divide"), (dict(block_k=512), "must divide"),
    (dict(block_q=16), "unknown gemm tuning"), (dict(block_k=64, k_splits=3), "k_splits=3"),
    (dict(k_splits=0), "k_splits must be an integer"),
    (dict(k_splits=True), "k_splits must be an integer"),
])
def test_gemm_rejects_bad_tilings(bad, msg):
    x, w = _xw(8, 256, 64)
    with pytest.raises(ValueError, match=msg):
        gemm(x, w, interpret=True, **bad)


def test_gemm_rejects_bad_shapes():
    x, w = _xw(8, 256, 64)
    with pytest.raises(ValueError, match="shape mismatch"):
        gemm(x, w[:, :128], interpret=True)
    with pytest.raises(ValueError, match="even row count"):
        gemm(x, w[:47], gated=True, interpret=True, block_n=16)
    with pytest.raises(ValueError, match="at least one row"):
        gemm(jnp.zeros((0, 256)), w, interpret=True)


def test_projection_specs_with_the_gemm():
    from ouro_jax.projections import GEMM_MAX_ROWS, NAMES, PallasGemv, parse
    assert parse("gemm") == PallasGemv((), 1, NAMES, GEMM_MAX_ROWS)
    assert parse("gemv+gemm") == PallasGemv(NAMES, 1, NAMES, GEMM_MAX_ROWS)
    for spec in ("gemm", "gemv+gemm", "gemv@5:o+gemm@192:gate_up,down", "gemm@2:qkv"):
        assert parse(parse(spec).spec) == parse(spec)
    assert parse("gemm+gemv").spec == "gemv+gemm"  # canonical order: one program key
    for bad, msg in (("gemm@1", "ROWS"), ("gemm@513", "ROWS"), ("gemv+gemv", "twice"),
                     ("gemm:mlp", "unknown projection"), ("gemv+cublas", "unknown projections")):
        with pytest.raises(ValueError, match=msg):
            parse(bad)


def test_gemm_projections_route_by_row_count():
    """1 row -> GEMV (when on), 2..gemm_max_rows -> GEMM, more -> XLA (kernel names in the jaxpr)."""
    from ouro_jax.projections import parse
    proj = parse("gemv+gemm@8:o")
    _, w = _xw(1, 256, 64)

    def kernels(rows, name="o"):
        return pallas_call_names(lambda a: proj.project(name, a, w), jnp.zeros((rows, 256)))
    assert [k.startswith("gemv") for k in kernels(1)] == [True]
    assert [k.startswith("gemm") for k in kernels(2)] == [True]
    assert [k.startswith("gemm") for k in kernels(8)] == [True]
    assert kernels(9) == []
    assert kernels(4, "qkv") == []  # qkv is not in the gemm's names: XLA


def test_engine_with_gemm_projections_matches_xla_tokens():
    """Batch-4 greedy decode, native and speculative, with every few-row projection through
    the GEMM (interpret mode): the same tokens as XLA projections in fp32."""
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    cfg = PRESETS["tiny-mha"]
    params = random_params(cfg, 0, jnp.float32, 0.003, 0.0)
    prompts = [[3, 1, 4], [1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7]]
    sp = [SamplingParams(max_tokens=6, ignore_eos=True)] * 4
    out = {}
    for p in ("xla", "gemv+gemm@16"):
        llm = Ouro(cfg, params, None, attention="xla", projections=p, decode_chunk=8)
        out[p] = ([o.token_ids for o in llm.generate(prompts, sp).outputs],
                  [o.token_ids for o in llm.generate(prompts, sp, speculative=SpeculativeConfig(
                      2, 2)).outputs])
    assert out["xla"] == out["gemv+gemm@16"]
    assert out["xla"][0] == out["xla"][1]


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
@pytest.mark.parametrize("m", [8, 64, 70])
def test_engine_gemm_tilings_on_the_gpu(name, m):
    """The compiled kernel with the engine's tiling on the 1.4B shapes in bf16: within about
    one bf16 rounding of XLA's projection, and rows independent of the call's row count."""
    from benchmarks.gemv import SHAPES
    from ouro_jax.projections import GEMM_TUNING

    n, k, gated = SHAPES[name]
    x, w = _xw(m, k, n, jnp.bfloat16)
    y = gemm(x, w, gated=gated, **GEMM_TUNING[name]).astype(jnp.float32)
    ref = gemv_reference(x, w, gated=gated).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
    assert err <= 8e-3, err
