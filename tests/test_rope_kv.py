"""pallas_kernels.rope_kv: RoPE and the K/V write of packed tokens, one token per program
(the batch-invariant mode's attention input). Against the XLA path (model.apply_rope,
kv_cache.write_kv), the trash page, the (base, offset) plane, refusals, and the mode's
attend.qkv against its XLA-write path. Interpret mode on the CPU; the `gpu` test compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu, pallas_call_names
from ouro_jax.model import rope_cos_sin
from pallas_kernels.rope_kv import reference, rope_kv_write


def _operands(n, h, kv, hd, dtype, planes=3, pages=6, page_size=4, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    qkv = jax.random.normal(ks[0], (n, h + 2 * kv, hd), jnp.float32).astype(dtype)
    kc = jax.random.normal(ks[1], (planes, pages, page_size, kv, hd), jnp.float32).astype(dtype)
    vc = jax.random.normal(ks[2], kc.shape, jnp.float32).astype(dtype)
    pos = jnp.arange(n, dtype=jnp.int32) * 3 + 1
    cos, sin = rope_cos_sin(pos, hd, 10000.0, dtype)
    page = 1 + (jnp.arange(n, dtype=jnp.int32) % (pages - 1))
    slot = (jnp.arange(n, dtype=jnp.int32) * 7) % page_size
    # one padding token, aimed at the trash page (0): it must write nothing
    page = page.at[n // 2].set(0)
    return qkv, cos, sin, kc, vc, page, slot


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("h,kv,hd", [(6, 2, 8), (4, 1, 16), (16, 16, 128)])
def test_matches_the_xla_path(dtype, h, kv, hd):
    """bf16: the same bits as model.apply_rope and write_kv on the CPU; fp32 within 1e-6
    (XLA may contract RoPE's product and sum). The trash page is left as it was."""
    n = 7 if hd < 128 else 3
    qkv, cos, sin, kc, vc, page, slot = _operands(n, h, kv, hd, dtype)
    got = rope_kv_write(qkv, cos, sin, kc, vc, (np.int32(1), np.int32(0)), page, slot,
                        n_kv=kv, entry_stride=2, interpret=not has_gpu())
    want = reference(qkv, cos, sin, kc, vc, 2, page, slot, n_kv=kv)
    tol = 0 if dtype == jnp.bfloat16 and not has_gpu() else 1e-6 if dtype == jnp.float32 \
        else 1e-2
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=tol, atol=tol)
    np.testing.assert_array_equal(np.asarray(got[1][:, 0]), np.asarray(kc[:, 0]))  # trash
    np.testing.assert_array_equal(np.asarray(got[1][:2]), np.asarray(kc[:2]))  # other planes


def test_a_token_alone_writes_and_rotates_as_among_others():
    """(Interpret mode runs every program apart: this pins the wrapper's row mapping; the
    `gpu` test checks the compiled kernel.)"""
    qkv, cos, sin, kc, vc, page, slot = _operands(7, 6, 2, 8, jnp.bfloat16)
    q, k2, v2 = rope_kv_write(qkv, cos, sin, kc, vc, 1, page, slot, n_kv=2, interpret=True)
    for i in (0, 4, 6):
        q1, k1, v1 = rope_kv_write(qkv[i:i + 1], cos[i:i + 1], sin[i:i + 1], kc, vc, 1,
                                   page[i:i + 1], slot[i:i + 1], n_kv=2, interpret=True)
        np.testing.assert_array_equal(np.asarray(q1), np.asarray(q[i:i + 1]))
        p, s = int(page[i]), int(slot[i])
        np.testing.assert_array_equal(np.asarray(k1[1, p, s]), np.asarray(k2[1, p, s]))
        np.testing.assert_array_equal(np.asarray(v1[1, p, s]), np.asarray(v2[1, p, s]))


def test_bad_operands_are_refused_by_name():
    qkv, cos, sin, kc, vc, page, slot = _operands(5, 6, 2, 8, jnp.bfloat16)
    call = lambda **kw: rope_kv_write(**dict(dict(qkv=qkv, cos=cos, sin=sin, k_cache=kc,
                                                  v_cache=vc, entry=1, page=page, slot=slot,
                                                  n_kv=2, interpret=True), **kw))
    with pytest.raises(ValueError, match="query heads"):
        call(n_kv=5)
    with pytest.raises(ValueError, match="caches"):
        call(v_cache=vc[:, :, :, :1])
    with pytest.raises(ValueError, match="cos"):
        call(cos=cos[:3])
    with pytest.raises(ValueError, match="slot"):
        call(slot=slot[:2])


def test_the_modes_attend_qkv_equals_its_xla_write_path():
    """make_paged_attend(invariant=True).qkv (one rope_kv_write, then the ragged kernel)
    against the same attend given XLA's RoPE and write: the same output and caches, bit
    for bit, for verification-shaped queries (2 rows x 3 tokens, one past the table)."""
    from ouro_jax.attention import make_paged_attend
    from ouro_jax.config import TINY_GQA
    from ouro_jax.model import apply_rope
    cfg = TINY_GQA
    h, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    b, c, page_size, pages = 2, 3, 4, 5
    planes = 2 * cfg.num_hidden_layers
    _, _, _, kc, vc, _, _ = _operands(1, h, kv, hd, jnp.bfloat16, planes, 1 + b * pages,
                                      page_size)
    qkv = jax.random.normal(jax.random.PRNGKey(5), (b, c, h + 2 * kv, hd)).astype(jnp.bfloat16)
    block_tables = 1 + jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
    positions = jnp.array([[5, 6, 7], [17, 18, 20]], jnp.int32)  # 20: past a 5-page table
    cos, sin = rope_cos_sin(positions, hd, cfg.rope_theta, jnp.bfloat16)
    attend = make_paged_attend(cfg, block_tables, positions, page_size, "pallas",
                               invariant=True)
    loop, layer = np.int32(1), np.int32(1)
    names = pallas_call_names(lambda *a: attend.qkv(*a, loop, layer)[0], qkv, cos, sin, (kc, vc))
    assert names == ["rope_kv_write", "ragged_paged_attention"]
    out, (k1, v1) = attend.qkv(qkv, cos, sin, (kc, vc), loop, layer)
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + kv], qkv[:, :, h + kv:]
    ref, (k2, v2) = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, (kc, vc),
                           loop, layer)
    for a, r in ((out, ref), (k1, k2), (v1, v2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
def test_gpu_tokens_alone_equal_tokens_among_320_at_the_1p4b_shape():
    qkv, cos, sin, kc, vc, page, slot = _operands(320, 16, 16, 128, jnp.bfloat16, planes=2,
                                                  pages=400, page_size=16)
    q, k2, v2 = rope_kv_write(qkv, cos, sin, kc, vc, 1, page, slot, n_kv=16)
    for rows in (slice(0, 1), slice(9, 14), slice(100, 164)):
        q1, k1, v1 = rope_kv_write(qkv[rows], cos[rows], sin[rows], kc, vc, 1, page[rows],
                                   slot[rows], n_kv=16)
        np.testing.assert_array_equal(np.asarray(q1), np.asarray(q[rows]))
        p, s = np.asarray(page[rows]), np.asarray(slot[rows])
        for a, b in ((k1, k2), (v1, v2)):  # the written slots (the trash page: none)
            np.testing.assert_array_equal(np.asarray(a[1, p, s]), np.asarray(b[1, p, s]))
    qr, kr, vr = reference(qkv, cos, sin, kc, vc, 1, page, slot, n_kv=16)
    for g, w in ((q, qr), (k2, kr), (v2, vr)):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   rtol=1e-2, atol=1e-2)
