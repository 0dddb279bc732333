"""The default engine with the batch-invariant mode's kernels for calls of a band of row
counts ('+inv[@LO-HI]', ouro_jax.projections.PallasGemv.inv_rows) and decode attention of
larger batches through the RoPE/K/V-write and ragged kernels (pallas_kernels.decode.TUNING
"ragged_from", ouro_jax.attention._ragged_decode): the spec, where calls go, the values and
the tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import pallas_call_names


def test_the_inv_spec_parses_round_trips_and_refuses_what_it_cannot_do():
    from ouro_jax.projections import INV_ROWS, parse
    p = parse("gemv+norms+stream+inv")
    assert p.inv_rows == INV_ROWS == (2, 64) and parse(p.spec) == p
    assert p.spec == "gemv+norms+stream+inv"
    q = parse("gemv+norms+stream+inv@8-64")
    assert q.inv_rows == (8, 64) and q.spec.endswith("+inv@8-64") and parse(q.spec) == q
    assert parse("gemv+norms+stream").inv_rows == ()
    for bad in ("inv", "gemv+inv@1-64", "gemv+inv@8", "gemv+inv@9-4", "gemv+inv+inv",
                "gemv+inv@2-513", "gemv+inv@a-b"):
        with pytest.raises(ValueError, match="inv"):
            parse(bad)


def test_an_unknown_engine_option_lists_inv():
    from ouro_jax.engine import forward_block
    with pytest.raises(ValueError, match="inv\\[@LO-HI\\]"):
        forward_block(None, None, None, None, None, None, None, "pallas+invx")


def _loop(rows: int, spec: str, layout: str = "fused"):
    """One loop of tiny-mha's two layers on `rows` rows; layout: 'fused' (qkv and gate/up
    as one weight each, unrolled: the engine's), 'unfused' (unrolled) or 'stacked' (the
    lax.scan body)."""
    from ouro_jax.config import PRESETS
    from ouro_jax.model import dense_causal_attend, rope_cos_sin, run_loop, unstack_layers
    from ouro_jax.params import random_params
    from ouro_jax.projections import parse
    cfg = PRESETS["tiny-mha"]
    big = random_params(cfg, 1, jnp.float32, 1.0, 0.1)
    if layout != "stacked":
        big = unstack_layers(big, fuse=layout == "fused")
    h = jax.random.normal(jax.random.PRNGKey(0), (rows, 1, cfg.hidden_size))
    cos, sin = rope_cos_sin(jnp.zeros((rows, 1), jnp.int32), cfg.head_dim, cfg.rope_theta,
                            jnp.float32)
    proj = parse(spec)
    return (lambda x: run_loop(big, x, cos, sin, cfg, dense_causal_attend, None, 0, proj)[0]), h


@pytest.mark.parametrize("rows,spec,kernels", [
    # one row: the streaming GEMVs as before
    (1, "gemv+norms+stream+inv", ["gemv_stream_norm", "gemv_stream", "gemv_stream_silu_add_norm",
                                  "gemv_stream", "gemv_stream_add_norm", "gemv_stream",
                                  "gemv_stream_silu_add_norm", "gemv_stream"]),
    # 3 rows in the band: the mode's GEMMs, the adds and norms in add_norm kernels
    (3, "gemv+norms+stream+inv", ["norm", "gemm", "gemm", "add_norm", "gemm_silu", "gemm",
                                  "add_norm", "gemm", "gemm", "add_norm", "gemm_silu", "gemm",
                                  "add_norm"]),
    (3, "gemv+norms+stream+inv@4-64", []),  # below the band: XLA, no kernel
    (3, "gemv+norms+stream+inv@2-2", []),  # above it
    (3, "gemv+norms+stream", []),
])
def test_calls_in_the_band_take_the_invariant_kernels_and_no_others_do(rows, spec, kernels):
    fn, h = _loop(rows, spec)
    assert pallas_call_names(fn, h) == kernels


def test_outside_the_band_the_gemm_part_keeps_its_calls():
    """'+gemm' routes 2..64-row calls to the skinny GEMM; '+inv@4-64' takes 4..64 first, so a
    3-row call runs exactly the '+gemm' kernels."""
    fn, h = _loop(3, "gemv+gemm+norms+stream+inv@4-64")
    plain, _ = _loop(3, "gemv+gemm+norms+stream")
    names = pallas_call_names(fn, h)
    assert names and names == pallas_call_names(plain, h) and "add_norm" not in names


@pytest.mark.parametrize("rows,layout", [(2, "fused"), (3, "fused"), (3, "unfused"),
                                         (3, "stacked")])
def test_the_band_computes_what_xla_computes(rows, layout):
    """fp32, tiny-mha, one loop of two layers: on the CPU (interpret mode, fp32 dots) within
    1e-5 of the XLA projections' output (the sums run in another order, so not the bits); on
    a GPU both sides take TF32 tensor-core dots (10-bit mantissas), and 5e-3 (measured on an
    H100: 1.6e-3 at most, session 43)."""
    fn, h = _loop(rows, "gemv+norms+stream+inv", layout)
    ref, _ = _loop(rows, "xla", layout)
    assert {"gemm", "add_norm"} <= set(pallas_call_names(fn, h))  # (the band ran)
    a, b = np.asarray(fn(h)), np.asarray(ref(h))
    assert np.abs(a).max() > 0.1
    tol = 5e-3 if jax.default_backend() == "gpu" else 1e-5
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol)


def test_ragged_from_sends_decode_rows_to_the_ragged_kernel(monkeypatch):
    """decode.TUNING["ragged_from"]=2: batch-3 decode attention is rope_kv_write + the ragged
    kernel (one-row batches keep the decode kernel); unset, from attention.RAGGED_FROM = 64
    sequences up; 0, never."""
    import pallas_kernels.decode as decode
    from ouro_jax.attention import make_paged_attend
    from ouro_jax.config import PRESETS
    cfg = PRESETS["tiny-mha"]
    page, pages, hd = 4, 8, cfg.head_dim
    planes = tuple(jnp.zeros((cfg.num_hidden_layers * 4, pages, page, cfg.num_key_value_heads,
                              hd), jnp.float32) for _ in range(2))

    def names(b, tuning):
        monkeypatch.setattr(decode, "TUNING", tuning)
        tables = jnp.arange(b * 2, dtype=jnp.int32).reshape(b, 2)
        positions = jnp.full((b, 1), 5, jnp.int32)
        attend = make_paged_attend(cfg, tables, positions, page, "pallas")
        heads = cfg.num_attention_heads + 2 * cfg.num_key_value_heads
        qkv = jnp.ones((b, 1, heads, hd), jnp.float32)
        cs = jnp.ones((b, 1, hd), jnp.float32)
        return pallas_call_names(lambda x: attend.qkv(x, cs, cs, planes, 0, 0)[0], qkv)

    assert names(3, {"ragged_from": 2}) == ["rope_kv_write", "ragged_paged_attention"]
    assert names(1, {"ragged_from": 2}) == ["paged_decode_attention"]
    assert names(3, {}) == ["paged_decode_attention"]  # (the default: RAGGED_FROM = 64)
    assert names(64, {}) == ["rope_kv_write", "ragged_paged_attention"]
    assert names(63, {}) == ["paged_decode_attention"]
    assert names(64, {"ragged_from": 0}) == ["paged_decode_attention"]


def test_the_engine_with_both_gives_the_defaults_tokens(monkeypatch):
    """Greedy, tiny-mha in fp32, three prompts: native and speculative (k=4, d=2) tokens with
    '+inv' and ragged_from=2 equal the default's."""
    import pallas_kernels.decode as decode
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    from ouro_jax.sampling import SamplingParams
    from ouro_jax.speculative import SpeculativeConfig
    cfg = PRESETS["tiny-mha"]
    params = random_params(cfg, 0, jnp.float32, 0.003, 0.0)
    sp = [SamplingParams(max_tokens=8, ignore_eos=True)] * 3
    prompts = [[3, 1, 4], [5, 9, 2, 6], [1, 1]]
    runs = []
    for spec, tuning in (("gemv+norms+stream", {}),
                         ("gemv+norms+stream+inv", {"ragged_from": 2})):
        monkeypatch.setattr(decode, "TUNING", tuning)
        llm = Ouro(cfg, params, None, attention="pallas", projections=spec, page_size=4)
        runs.append([[o.token_ids for o in llm.generate(prompts, sp, speculative=s).outputs]
                     for s in (None, SpeculativeConfig(k=4, draft_loops=2))])
    assert llm.backend.endswith("+inv")
    assert runs[0] == runs[1]
    assert runs[1][0] == runs[1][1]


def test_a_model_the_gemm_cannot_tile_is_refused_before_anything_is_built():
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    odd = PRESETS["tiny-mha"].replace(hidden_size=40)
    with pytest.raises(ValueError, match="'\\+inv' runs calls of 2-64 rows.*hidden_size = 40"):
        Ouro(odd, random_params(odd, 0, jnp.float32), None, attention="pallas",
             projections="gemv+norms+stream+inv")
    Ouro(odd, random_params(odd, 0, jnp.float32), None, attention="pallas",
         projections="gemv+norms+stream")  # (without '+inv' the same model builds)


def test_auto_drops_inv_for_a_model_the_gemm_cannot_tile(monkeypatch):
    """projections='auto' on a GPU is GPU_DEFAULT, '+inv' included, unless the model's dims
    are not multiples of 16: then the same without '+inv' (an explicit '+inv' is refused)."""
    from ouro_jax import attention
    from ouro_jax.api import Ouro
    from ouro_jax.config import PRESETS
    from ouro_jax.params import random_params
    from ouro_jax.projections import GPU_DEFAULT, INV_ROWS, auto_fit, parse
    monkeypatch.setattr(attention, "resolve_backend", lambda b: "pallas")  # as on a GPU
    assert GPU_DEFAULT.endswith("+inv") and parse("auto").inv_rows == INV_ROWS
    cfg = PRESETS["tiny-mha"]
    assert auto_fit(parse("auto"), cfg) == parse("auto")
    odd = cfg.replace(hidden_size=40)
    assert auto_fit(parse("auto"), odd) == parse("gemv+norms+stream")
    llm = Ouro(odd, random_params(odd, 0, jnp.float32), None, projections="auto")
    assert "inv" not in llm.backend.split("+")
