"""The side-stream weight prefetcher's kernels (pallas_kernels/side_prefetch.py) and the
progress word gemv_stream stores for it, lowered for 'cuda' on the CPU (no GPU needed; what
they buy is benchmarks.side_prefetch_jax's question, on a GPU): the PTX each holds, the
operands they check, and the host tables."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import side_prefetch as sp
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
from engine_helpers import has_gpu
from test_pdl import triton_ir

S = jax.ShapeDtypeStruct
I32 = jnp.int32
BF = jnp.bfloat16


def prefetcher_ir(groups=10, **kw):
    t = S((groups, sp.LANES), I32)
    [ir] = triton_ir(lambda lo, hi, need, word, base: sp.side_prefetch(
        lo, hi, need, word, base, chunk=65536, programs=4, **kw), t, t, t, S((2,), I32),
        S((1,), I32))
    return ir


def test_prefetcher_spins_on_the_word_and_prefetches_each_lane():
    ir = prefetcher_ir()
    assert ir.count("ld.relaxed.gpu.global.b32") == 2  # once before the loop, once in the spin
    # the first value read, less base, goes out with the prefetches' zeros (the overlap check)
    assert "tt.store" in ir
    assert ir.count("cp.async.bulk.prefetch.L2.global") == 1
    assert "scf.while" in ir  # the bounded spin
    assert ir.count("pure = false") == 3  # none of the asm may be hoisted or merged
    # the prefetch is elementwise over a group's 32 chunk addresses
    pf = next(line for line in ir.splitlines() if "cp.async.bulk.prefetch" in line)
    assert "tensor<32xi32>" in pf


def test_prefetcher_checks_its_operands():
    t = jnp.zeros((3, sp.LANES), I32)
    w, b = jnp.zeros((2,), I32), jnp.zeros((1,), I32)
    with pytest.raises(ValueError, match="need must be int32"):
        sp.side_prefetch(t, t, jnp.zeros((3, 16), I32), w, b, chunk=64, programs=1)
    with pytest.raises(ValueError, match="word must be int32 \\[2\\]"):
        sp.side_prefetch(t, t, t, b, b, chunk=64, programs=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        sp.side_prefetch(t, t, t, w, b, chunk=65, programs=1)


@pytest.mark.parametrize("prologue", ["", "add_norm"])
def test_gemv_stores_progress_from_program_zero(prologue):
    k, n = 256, 64
    kw = dict(block_n=2, block_k=128, per_program=4)
    prog = (S((2,), I32), S((1,), I32))

    def ir(with_progress):
        extra = prog if with_progress else ()

        def f(x, w, b, nw, *pr):
            p = dict(progress=tuple(pr)) if pr else {}
            if not prologue:
                return gemv_stream(x, w, **kw, **p)
            return gemv_stream_normed(x, nw, w, eps=1e-6, branch=b, branch_w=nw, **kw, **p)
        [out] = triton_ir(f, S((1, k), BF), S((n, k), BF), S((1, k), BF), S((k,), BF), *extra)
        return out
    base, got = ir(False), ir(True)
    # (word, seq, offset): the offset is added to the index before the store
    [with_offset] = triton_ir(lambda x, w, *pr: gemv_stream(x, w, **kw, progress=(*pr, 7)),
                              S((1, k), BF), S((n, k), BF), *prog)
    assert "arith.constant 7 : i32" in with_offset
    assert "st.relaxed.gpu.global.b32" not in base
    assert got.count("st.relaxed.gpu.global.b32") == 1
    assert "setp.eq.s32" in got  # predicated on the program id: program 0 stores
    # the weight loads are the same
    # plus the word's two halves and the index
    assert base.count("tt.load") + 3 == got.count("tt.load")


def test_gemv_progress_is_refused_in_interpret_mode_and_when_malformed():
    x, w = jnp.zeros((1, 256), BF), jnp.zeros((64, 256), BF)
    good = (jnp.zeros((2,), I32), jnp.zeros((1,), I32))
    with pytest.raises(ValueError, match="GPU only"):
        gemv_stream(x, w, interpret=True, progress=good)
    with pytest.raises(ValueError, match="progress must be"):
        triton_ir(lambda x, w: gemv_stream(x, w, progress=(good[0],)), x, w)
    with pytest.raises(ValueError, match="progress must be"):
        triton_ir(lambda x, w: gemv_stream(x, w, progress=(good[1], good[0])), x, w)
    with pytest.raises(ValueError, match="progress must be"):
        triton_ir(lambda x, w: gemv_stream(x, w, progress=(*good, 1.5)), x, w)
    with pytest.raises(ValueError, match="row2d"):  # its reshape would take the operands
        triton_ir(lambda x, w: gemv_stream(x, w, row2d=True, progress=good), x, w)


def test_split_address_and_chunk_tables():
    assert sp.split_address(0x1234_5678_9ABC_DEF0) == (np.int32(np.uint32(0x9ABCDEF0)
                                                                .view(np.int32)), 0x12345678)

    class Arr:  # stands in for a device array: only its address is read
        def __init__(self, addr):
            self.addr = addr

        def unsafe_buffer_pointer(self):
            return self.addr
    arrays = [Arr(0x7F00_0000_0000), Arr(0x7F00_1000_0000)]
    work = [(0, 0, 0), (0, 65536, 0), (1, 0, 1)]
    lo, hi, need = sp.chunk_tables(arrays, work)
    assert lo.shape == hi.shape == need.shape == (1, sp.LANES)
    addr = (np.asarray(hi).view(np.uint32).astype(np.uint64) << np.uint64(32)) | \
        np.asarray(lo).view(np.uint32).astype(np.uint64)
    assert [int(a) for a in addr[0, :3]] == [0x7F00_0000_0000, 0x7F00_0001_0000,
                                             0x7F00_1000_0000]
    assert set(int(a) for a in addr[0, 3:]) == {0x7F00_1000_0000}  # padding: the last chunk
    assert list(np.asarray(need)[0, :3]) == [0, 0, 1]


def test_jax_chain_benchmark_lowers_with_the_prefetcher_on_stream_one():
    """benchmarks.side_prefetch_jax (GPU only to run), one layer and one loop lowered for
    'cuda': base runs the four GEMVs and nothing stores; pf adds the prefetcher and four
    progress stores (indices 0-3 after the call's base); the chunk tables list every weight
    byte once, in whole groups."""
    from benchmarks import side_prefetch_jax as b
    from benchmarks.pdl_jax_chain import make_weights
    layers = make_weights(1)
    x = jnp.zeros((1, 2048), BF)
    word, base = jnp.zeros((2,), I32), jnp.zeros((1,), I32)
    pf = (4 << 20, 8, 64 << 10)
    tab = b.tables(layers, 1, pf)
    lo, hi, need = tab
    total = sum(w.size * 2 for name, w in layers[0].items() if "_" not in name or
                name == "gate_up")
    assert lo.shape[1] == sp.LANES and lo.size >= total // (64 << 10) > lo.size - sp.LANES
    assert int(need.max()) == 3 and int(need.min()) == 0

    assert b.parse_jax_arm("pf:4:8") == ("xla", pf, False)
    assert b.parse_jax_arm("ffi-pf:4:8+ev") == ("ffi", pf, True)
    assert b.parse_jax_arm("stores+ev") == ("stores", None, True)
    with pytest.raises(SystemExit, match="ffi-"):
        b.parse_jax_arm("ffi-base")

    def kernels(arm, t, steps=1):
        f = b.chain_fn(1, arm, steps)
        return triton_ir(lambda *a: f(*a), x, layers, word, base, *t)
    plain = kernels("base", b.tables(layers, 1, None))
    assert len(plain) == 4 and not any("st.relaxed.gpu" in ir for ir in plain)
    assert not any("evict_first" in ir for ir in plain)
    got = kernels("pf:4:8", tab)
    assert len(got) == 5
    assert sum("st.relaxed.gpu" in ir for ir in got) == 4
    assert sum("cp.async.bulk.prefetch" in ir for ir in got) == 1
    # in a fori_loop (the decode loop's shape), with evict-first weight loads: the same kernels
    looped = kernels("pf:4:8+ev", tab, steps=3)
    assert len(looped) == 5 and sum("evict_first" in ir for ir in looped) == 4


def test_jax_chain_benchmark_puts_the_prefetcher_on_stream_one():
    """Where this jaxlib lowers for 'cuda' in full: the prefetcher's call carries XLA's
    stream annotation (its own test, so that a jaxlib without that lowering reports a skip)."""
    from benchmarks import side_prefetch_jax as b
    from benchmarks.pdl_jax_chain import make_weights
    layers = make_weights(1)
    x = jnp.zeros((1, 2048), BF)
    word, base = jnp.zeros((2,), I32), jnp.zeros((1,), I32)
    tab = b.tables(layers, 1, (4 << 20, 8, 64 << 10))
    try:
        from pallas_kernels.offline_compile import lower_for_cuda
        text = lower_for_cuda(b.chain_fn(1, "pf:4:8"), x, layers, word, base, *tab).as_text()
    except ModuleNotFoundError as e:  # jax 0.10.2 here lacks the Mosaic GPU lowering's deps
        pytest.skip(f"no 'cuda' lowering on this jaxlib: {e}")
    assert "_xla_stream_annotation" in text


def test_jax_chain_benchmark_launches_the_ffi_prefetcher_inside_the_loop():
    """The 'ffi' arms (jax 0.11.2 and the `triton` package: the prefetcher is compiled to a
    cubin offline and lowered for 'cuda'): one side launch per loop iteration, inside the
    while loop, ahead of the chain, and no stream annotation."""
    pytest.importorskip("triton")
    from benchmarks import side_prefetch_jax as b
    from benchmarks.pdl_jax_chain import make_weights
    try:
        from pallas_kernels.offline_compile import lower_for_cuda
        layers = make_weights(1)
        x = jnp.zeros((1, 2048), BF)
        word, base = jnp.zeros((2,), I32), jnp.zeros((1,), I32)
        pf = (4 << 20, 8, 64 << 10)
        tab = b.tables(layers, 1, pf)
        side = b.compile_side(pf, *tab, word, base)
        text = lower_for_cuda(b.chain_fn(1, "ffi-pf:4:8", 3, side), x, layers, word, base,
                              *tab).as_text()
    except ModuleNotFoundError:  # jax 0.10.2 here lacks the Mosaic GPU lowering's deps
        pytest.skip("this jaxlib does not lower for 'cuda' on the CPU")
    assert not side.has_wait and side.n_buffers == 7 and side.grid == 8
    assert text.count("ouro_side_launch") == 1 and "while" in text
    assert "_xla_stream_annotation" not in text
    # the chain's inputs pass a barrier with the launch's results: XLA cannot move the
    # launch behind the chain
    assert "optimization_barrier" in text


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
def test_gpu_side_launched_prefetcher_leaves_the_chain_unchanged():
    """On the GPU: the chain with the prefetcher launched beside it by side_call, three
    iterations of a fori_loop, gives the chain's bits without it, and returns."""
    from benchmarks import side_prefetch_jax as b
    from benchmarks.pdl_jax_chain import make_weights
    layers = make_weights(2)
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 2048), jnp.float32).astype(BF)
    word_buf = jnp.full((1,), -1, I32)
    word = jnp.asarray(sp.split_address(word_buf.unsafe_buffer_pointer()), I32)
    pf = (4 << 20, 4, 64 << 10)
    tab = b.tables(layers, 1, pf)
    base = jnp.zeros((1,), I32)
    side = b.compile_side(pf, *tab, word, base)
    want = b.chain_fn(1, "base", 3)(x, layers, word, base, *b.tables(layers, 1, None))
    for k in range(2):
        got = b.chain_fn(1, "ffi-pf:4:4+ev", 3, side)(x, layers, word, base + 1000 * k, *tab)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    from pallas_kernels.side_launch import side_sync
    side_sync()  # the side kernels have ended before the word they read is freed
    del word_buf
