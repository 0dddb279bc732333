"""L2 prefetch in the streaming GEMV (pallas_kernels/l2_prefetch.py, gemv_stream's
l2_prefetch / next_w): the bulk prefetches in the Triton IR lowered for 'cuda' (no GPU
needed), the byte ranges they name, unchanged results, the engine plumbing, the errors. Whether
it pays is a benchmark (`benchmarks.decode --l2-prefetch / --l2-next`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu, pallas_call_eqns
from pallas_kernels import l2_prefetch as l2p
from pallas_kernels.gemv import gemv_reference
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
from pallas_kernels.l2_prefetch import check_nbytes
from test_pdl import triton_ir

S = jax.ShapeDtypeStruct
BF = jnp.bfloat16
PF = re.compile(r"cp\.async\.bulk\.prefetch\.L2\.global \[\$1\], (\d+);")


def prefetch_sizes(ir: str) -> list[int]:
    return [int(m) for m in PF.findall(ir)]


@pytest.mark.parametrize("gated", [False, True])
def test_own_blocks_are_prefetched_once_each(gated):
    """l2_prefetch=N: N bulk prefetches (2N gated: gate and up rows) of one block's bytes;
    more than per_program - 1 is capped there; 0 (the default) emits none."""
    k, n = 256, 64
    shapes = (S((1, k), BF), S((2 * n if gated else n, k), BF))

    def sizes(**kw):
        [ir] = triton_ir(lambda x, w: gemv_stream(x, w, gated=gated, block_n=2, block_k=128,
                                                  per_program=4, **kw), *shapes)
        return prefetch_sizes(ir)
    per = 2 if gated else 1
    assert sizes() == []
    assert sizes(l2_prefetch=2) == [2 * k * 2] * 2 * per
    assert sizes(l2_prefetch=9) == [2 * k * 2] * 3 * per


def test_prefetched_ranges_are_the_blocks_the_program_loads(monkeypatch):
    """The offsets name rows (p + i * programs) * block_n of W (and of the up half), the rows
    block_loader reads for the program's i-th block; next_w's program p gets rows
    [p * rows, (p + 1) * rows) of each segment."""
    seen = []
    monkeypatch.setattr(l2p, "l2_prefetch",
                        lambda ref, off, nbytes, interpret: seen.append((off, nbytes)) or 0)

    class Ref:
        def __init__(self, shape):
            self.shape, self.dtype = shape, np.dtype(np.float16)
    k, block_n, programs, p, n_out = 64, 4, 5, 3, 200
    l2p.prefetch_blocks(Ref((2 * n_out, k)), p, programs, 2, k=k, block_n=block_n, gated=True,
                        up_offset=n_out, interpret=False)
    rows = [(p + i * programs) * block_n for i in (1, 2)]
    assert seen == [((off + r) * k, block_n * k * 2) for r in rows for off in (0, n_out)]
    seen.clear()
    l2p.prefetch_next(Ref((600, 32)), p, 7, 2, interpret=False)
    assert seen == [((s * 300 + p * 7) * 32, 7 * 32 * 2) for s in (0, 1)]


@pytest.mark.parametrize("at", ["start", "end"])
def test_next_weight_prefetch_is_emitted_and_sized(at):
    """next_w with next_rows R: one prefetch of R rows per segment, at the start or the end;
    R is lowered so every program's range stays inside its segment; next_rows 0 or no next_w:
    no extra operand and no prefetch."""
    k = 256
    nxt = S((2 * 96, 128), BF)  # a small [gate; up]: 96 rows per segment

    def run(rows, with_next=True):
        def f(x, w, nw):
            return gemv_stream(x, w, block_n=2, block_k=128, per_program=2,
                               next_w=nw if with_next else None, next_split=2, next_rows=rows,
                               next_at=at)
        [ir] = triton_ir(f, S((1, k), BF), S((64, k), BF), nxt)
        return prefetch_sizes(ir), ir.count("tt.ptr<bf16>")
    # 64 rows / block_n 2 / 2 per program = 16 programs; 96 rows per segment / 16 = 6 at most
    assert run(3)[0] == [3 * 128 * 2] * 2
    assert run(50)[0] == [6 * 128 * 2] * 2
    assert run(0)[0] == [] and run(3, with_next=False)[0] == []
    assert run(0)[1] == run(3, with_next=False)[1] < run(3)[1]  # the operand only when used


def test_normed_kernel_takes_the_next_weight_too():
    k, n = 256, 64
    nw = S((k,), BF)

    def f(x, w, b, wn, nxt):
        return gemv_stream_normed(x, wn, w, eps=1e-6, branch=b, branch_w=wn, gated=True,
                                  block_n=2, block_k=128, per_program=4, l2_prefetch=1,
                                  next_w=nxt, next_rows=1)
    [ir] = triton_ir(f, S((1, k), BF), S((2 * n, k), BF), S((1, k), BF), nw, S((k, n), BF))
    assert prefetch_sizes(ir) == [2 * k * 2] * 2 + [n * 2]


@pytest.mark.parametrize("prologue", ["", "add_norm"])
def test_results_do_not_change(prologue):
    """Interpret mode emits no prefetch; the kernel's operands and math are otherwise the
    same, so the outputs are bit-identical (the GPU test below checks compiled code)."""
    key = jax.random.split(jax.random.PRNGKey(0), 4)
    x = jax.random.normal(key[0], (1, 256)).astype(BF)
    w = jax.random.normal(key[1], (128, 256)).astype(BF)
    b = jax.random.normal(key[2], (1, 256)).astype(BF)
    nxt = jax.random.normal(key[3], (64, 128)).astype(BF)
    kw = dict(interpret=True, block_n=2, block_k=128, per_program=4, gated=True)
    if prologue:
        nw = jnp.full((256,), 0.7, BF)
        run = lambda **t: gemv_stream_normed(x, nw, w, eps=1e-6, branch=b, branch_w=nw,
                                             **kw, **t)
    else:
        run = lambda **t: (gemv_stream(x, w, **kw, **t),)
    base = run()
    for got in (run(l2_prefetch=3), run(next_w=nxt, next_rows=2, next_at="start")):
        for a, g in zip(base, got):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(g, np.float32))


def test_bad_prefetch_settings_are_refused():
    x, w = jnp.zeros((1, 256), BF), jnp.zeros((64, 256), BF)
    for bad, msg in ((dict(l2_prefetch=-1), "l2_prefetch"), (dict(l2_prefetch=1.5), "l2_prefetch"),
                     (dict(next_rows=-2), "next_rows"), (dict(next_at="mid"), "next_at")):
        with pytest.raises(ValueError, match=msg):
            gemv_stream(x, w, interpret=True, **bad)
    with pytest.raises(ValueError, match="next_split"):
        gemv_stream(x, w, interpret=True, next_w=jnp.zeros((63, 256), BF), next_split=2,
                    next_rows=1)
    with pytest.raises(ValueError, match="16 bytes"):
        gemv_stream(x, w, interpret=True, next_w=jnp.zeros((64, 3), BF), next_rows=1)
    for bad in (0, 24, -16, 1 << 30, 16.0):
        with pytest.raises(ValueError, match="multiple of 16"):
            check_nbytes(bad)


def test_engine_passes_the_next_weight_only_when_asked():
    """With STREAM_TUNING's next_rows set, each streaming projection of a layer gets the
    weight the next one reads (o: gate/up, qkv: o, gate/up: down, down: the next layer's qkv)
    as one more operand; greedy tokens (fp32, interpret) are unchanged."""
    from ouro_jax import projections
    from ouro_jax.config import PRESETS
    from ouro_jax.model import run_loop, rope_cos_sin, dense_causal_attend, unstack_layers
    from ouro_jax.params import random_params
    from ouro_jax.projections import parse

    cfg = PRESETS["tiny-mha"]
    params = unstack_layers(random_params(cfg, 0, jnp.float32, 0.003, 0.0), fuse=True)
    cos, sin = rope_cos_sin(jnp.zeros((1,), jnp.int32), cfg.head_dim, cfg.rope_theta,
                            jnp.float32)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, cfg.hidden_size))
    proj = parse("gemv+norms+stream")
    fn = lambda a: run_loop(params, a, cos, sin, cfg, dense_causal_attend, None, 0, proj)[0]
    shipped = {k: dict(v) for k, v in projections.STREAM_TUNING.items()}
    try:
        base_ops = [len(e.invars) for e in pallas_call_eqns(fn, x)]
        base = fn(x)
        for t in projections.STREAM_TUNING.values():
            t.update(next_rows=1, l2_prefetch=1)
        jax.clear_caches()  # the tuning is read at trace time
        ops = [len(e.invars) for e in pallas_call_eqns(fn, x)]
        got = fn(x)
    finally:
        projections.STREAM_TUNING.clear()
        projections.STREAM_TUNING.update(shipped)
        jax.clear_caches()
    assert len(ops) == len(base_ops) == 4 * cfg.num_hidden_layers
    assert [o - b for o, b in zip(ops, base_ops)] == [1] * len(ops)
    np.testing.assert_array_equal(np.asarray(base), np.asarray(got))


def test_benchmark_options_are_checked_applied_and_restored():
    from benchmarks.tuning import apply_kernel_tuning
    from ouro_jax import projections
    shipped = {k: dict(v) for k, v in projections.STREAM_TUNING.items()}
    try:
        t = apply_kernel_tuning("", "", l2_spec="qkv=all,o=1", l2_next_spec="down=3",
                                l2_next_at="start")
        assert t["l2_prefetch"] == {"qkv": -1, "o": 1} and t["l2_next"] == {"down": 3}
        st = projections.STREAM_TUNING
        assert st["qkv"]["l2_prefetch"] == shipped["qkv"]["per_program"] - 1
        assert st["o"]["l2_prefetch"] == 1 and "l2_prefetch" not in st["gate_up"]
        assert st["down"]["next_rows"] == 3 and st["down"]["next_at"] == "start"
        for kw in (dict(l2_spec="mlp=1"), dict(l2_spec="qkv=-1"), dict(l2_spec="qkv=1,qkv=2"),
                   dict(l2_next_spec="o=all"), dict(l2_next_at="middle")):
            with pytest.raises(SystemExit):
                apply_kernel_tuning("", "", **kw)
        apply_kernel_tuning("", "")
        assert projections.STREAM_TUNING == shipped
    finally:
        apply_kernel_tuning("", "")


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "o", "gate_up", "down"])
def test_prefetch_is_bit_identical_on_the_gpu(name):
    """Compiled: the engine's tiling with every own block and a next weight prefetched gives
    the same bits as without (a prefetch moves bytes into L2, never into the program)."""
    from benchmarks.gemv import SHAPES
    from ouro_jax.projections import STREAM_TUNING
    n, k, gated = SHAPES[name]
    key = jax.random.split(jax.random.PRNGKey(1), 3)
    x = jax.random.normal(key[0], (1, k)).astype(BF)
    w = jax.random.normal(key[1], (n, k)).astype(BF)
    nxt = jax.random.normal(key[2], (4096, 2048)).astype(BF)
    t = dict(STREAM_TUNING[name])
    base = np.asarray(gemv_stream(x, w, gated=gated, **t), np.float32)
    for at in ("start", "end"):
        got = gemv_stream(x, w, gated=gated, next_w=nxt, next_split=2, **dict(
            t, l2_prefetch=t["per_program"] - 1, next_rows=2, next_at=at))
        np.testing.assert_array_equal(base, np.asarray(got, np.float32))
    got = gemv_stream(x, w, gated=gated, **dict(t, x_first=True))
    np.testing.assert_array_equal(base, np.asarray(got, np.float32))
    if name in ("qkv", "gate_up"):  # the engine's add_norm call, x' included
        nw = jnp.full((k,), 0.7, BF)
        normed = lambda **o: [np.asarray(v, np.float32) for v in gemv_stream_normed(
            x, nw, w, eps=1e-6, branch=x[:, ::-1], branch_w=nw, gated=gated, **t, **o)]
        for a, g in zip(normed(), normed(x_first=True)):
            np.testing.assert_array_equal(a, g)
    ref = np.asarray(gemv_reference(x, w, gated=gated), np.float32)
    assert np.max(np.abs(base - ref)) <= 8e-3 * np.max(np.abs(ref))


@pytest.mark.parametrize("prologue", ["", "norm", "add_norm"])
def test_x_first_reads_the_input_before_the_weights_same_result(prologue):
    """x_first: in the lowered IR the loads of x (and the branch) precede the first weight
    load; in interpret mode the result is bit-identical to the default order."""
    k, n = 256, 64
    key = jax.random.split(jax.random.PRNGKey(3), 3)
    x = jax.random.normal(key[0], (1, k)).astype(BF)
    w = jax.random.normal(key[1], (n, k)).astype(BF)
    b = jax.random.normal(key[2], (1, k)).astype(BF)
    nw = jnp.full((k,), 0.7, BF)
    kw = dict(block_n=2, block_k=128, per_program=4)

    def f(x, w, b, nw, **t):
        if not prologue:
            return (gemv_stream(x, w, **kw, **t),)
        return gemv_stream_normed(x, nw, w, eps=1e-6, gated=False, **kw, **t,
                                  **(dict(branch=b, branch_w=nw) if prologue == "add_norm"
                                     else {}))
    base = f(x, w, b, nw, interpret=True)
    got = f(x, w, b, nw, interpret=True, x_first=True)
    for a, g in zip(base, got):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(g, np.float32))

    def first_load_shapes(**t):
        [ir] = triton_ir(lambda *a: f(*a, **t), S((1, k), BF), S((n, k), BF), S((1, k), BF),
                         S((k,), BF))
        loads = re.findall(r"tt\.load %\S+ : tensor<([0-9x]+)x!tt\.ptr<bf16>>", ir)
        return loads[0]
    assert first_load_shapes() == "2x128"  # the weight block first, as before
    assert first_load_shapes(x_first=True) == "128"  # an x chunk first
    with pytest.raises(ValueError, match="x_first"):
        gemv_stream(x, w, interpret=True, x_first=1)


def test_stream_set_option():
    from benchmarks.tuning import apply_kernel_tuning
    from ouro_jax import projections
    shipped = {k: dict(v) for k, v in projections.STREAM_TUNING.items()}
    try:
        t = apply_kernel_tuning("", "", stream_set="qkv.x_first=1,gate_up.x_first=0")
        assert t["stream_set"] == {"qkv": {"x_first": True}, "gate_up": {"x_first": False}}
        assert projections.STREAM_TUNING["qkv"]["x_first"] is True
        apply_kernel_tuning("", "", stream_set="o.row2d=1,down.row2d=1")  # (session 30's A/B)
        assert projections.STREAM_TUNING["o"]["row2d"] is True
        assert "row2d" not in projections.STREAM_TUNING["qkv"]
        for bad in ("qkv.x_first=2", "qkv=1", "mlp.x_first=1", "qkv.block_n=1",
                    "qkv.x_first=1,qkv.x_first=0"):
            with pytest.raises(SystemExit):
                apply_kernel_tuning("", "", stream_set=bad)
        apply_kernel_tuning("", "")
        assert projections.STREAM_TUNING == shipped
    finally:
        apply_kernel_tuning("", "")


def test_prefetches_survive_x_first_and_pdl_is_refused_with_it():
    """With x_first the reads of x no longer carry the prefetches' zero; it goes into the last
    store's index instead, so every prefetch is still emitted (a review found them dropped).
    x_first with pdl is refused; a next_w in another dtype than x is not prefetched (its
    kernel would read a cast copy)."""
    k, n = 256, 64
    nxt = S((2 * 96, 128), BF)

    def sizes(next_dtype=BF, **kw):
        def f(x, w, nw):
            return gemv_stream(x, w, block_n=2, block_k=128, per_program=4, next_w=nw,
                               next_split=2, **kw)
        [ir] = triton_ir(f, S((1, k), BF), S((n, k), BF), S(nxt.shape, next_dtype))
        return prefetch_sizes(ir)
    block, rows2 = 2 * k * 2, 2 * 128 * 2
    assert sizes(x_first=True, l2_prefetch=3) == [block] * 3
    assert sorted(sizes(x_first=True, l2_prefetch=1, next_rows=2, next_at="start")) == \
        sorted([block] + [rows2] * 2)
    assert sizes(x_first=True, next_rows=2, next_at="end") == [rows2] * 2
    assert sizes(next_dtype=jnp.float32, next_rows=2) == []
    with pytest.raises(ValueError, match="x_first with pdl"):
        gemv_stream(jnp.zeros((1, k), BF), jnp.zeros((n, k), BF), interpret=True,
                    x_first=True, pdl="end")


def test_next_weight_reaches_the_kernels_without_the_norms_part():
    """'gemv+stream' (norms outside the kernels): the gate/up and qkv calls made through
    XLA.normed still pass the next weight on."""
    from ouro_jax import projections
    from ouro_jax.projections import parse
    proj = parse("gemv+stream")
    x = jnp.zeros((1, 256), jnp.float32)
    nw, w = jnp.ones((256,), jnp.float32), jnp.zeros((2 * 128, 256), jnp.float32)
    nxt = jnp.zeros((256, 128), jnp.float32)
    shipped = dict(projections.STREAM_TUNING["gate_up"])
    try:
        projections.STREAM_TUNING["gate_up"]["next_rows"] = 1
        jax.clear_caches()
        [eqn] = pallas_call_eqns(lambda a: proj.normed("gate_up", a, nw, w, 1e-6, gated=True,
                                                       next_weight=(nxt, 1))[0], x)
    finally:
        projections.STREAM_TUNING["gate_up"] = shipped
        jax.clear_caches()
    assert [v.aval.shape for v in eqn.invars][-1] == nxt.shape


def test_merged_o_prefetches_the_next_weight_too():
    """gemv_merge's kernel (fp32 partials as its first operand) still emits next_w's
    prefetch, sized by the activation dtype, and its own later blocks' (l2_prefetch)."""
    from pallas_kernels.gemv_merge import gemv_stream_merged

    def f(parts, lse, w, nxt):
        return gemv_stream_merged(parts, lse, w, dtype=BF, block_n=2, block_k=128,
                                  per_program=4, l2_prefetch=1, next_w=nxt, next_rows=1,
                                  next_at="start")
    [ir] = triton_ir(f, S((1, 4, 3, 1, 32), jnp.float32), S((1, 4, 3, 1), jnp.float32),
                     S((64, 128), BF), S((2 * 64, 128), BF))
    assert prefetch_sizes(ir) == [2 * 128 * 2] + [128 * 2]
