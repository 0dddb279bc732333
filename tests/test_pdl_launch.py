"""pallas_kernels/pdl_launch: the captured Triton module and grid of a Pallas kernel, the PTX
parsing, the launcher's refusals, the library's build (where a C++ compiler and cuda.h are
present), and on a GPU the launched kernels' bits against JAX's own launch."""
from __future__ import annotations

import functools
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels import pdl_launch, side_launch
from pallas_kernels.gemv_stream import gemv_stream

S = jax.ShapeDtypeStruct
gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")


def _kernel(**kw):
    base = dict(image=b"cubin bytes", name="k", grid=4, threads=128, shared=0, n_params=3,
                n_buffers=2, has_wait=True, has_trigger=False)
    return pdl_launch.Kernel(**{**base, **kw})


def test_capture_gives_one_module_and_the_kernels_grid():
    f = functools.partial(gemv_stream, block_n=4, block_k=512, per_program=4, num_warps=4,
                          pdl="start")
    module, grid = pdl_launch.capture_module(f, S((1, 2048), jnp.bfloat16),
                                             S((6144, 2048), jnp.bfloat16))
    assert isinstance(module, str) and "tt.func" in module and "griddepcontrol.wait" in module
    assert grid == (6144 // (4 * 4), 1, 1)
    # another tiling, another grid: nothing cached across captures
    f2 = functools.partial(gemv_stream, block_n=2, block_k=512, per_program=2, num_warps=4)
    assert pdl_launch.capture_module(f2, S((1, 2048), jnp.bfloat16),
                                     S((6144, 2048), jnp.bfloat16))[1] == (6144 // 4, 1, 1)


def test_capture_refuses_functions_without_or_with_two_pallas_calls():
    x, w = S((1, 2048), jnp.bfloat16), S((2048, 2048), jnp.bfloat16)
    with pytest.raises(ValueError, match="exactly one pallas_call, saw 0"):
        pdl_launch.capture_module(lambda x, w: x @ w.T, x, w)
    two = lambda x, w: gemv_stream(gemv_stream(x, w), w)
    with pytest.raises(ValueError, match="exactly one pallas_call, saw 2"):
        pdl_launch.capture_module(two, x, w)


def test_parse_ptx_reads_the_entry_and_counts_parameters():
    ptx = (".version 8.4\n.target sm_90a\n.visible .entry gemv_stream(\n"
           "\t.param .u64 .ptr .global .align 1 gemv_stream_param_0,\n"
           "\t.param .u64 .ptr .global .align 1 gemv_stream_param_1,\n"
           "\t.param .u64 .ptr .global .align 1 gemv_stream_param_2,\n"
           "\t.param .u64 .ptr .global .align 1 gemv_stream_param_3\n)\n.maxntid 128\n{\n}\n")
    assert pdl_launch.parse_ptx(ptx) == ("gemv_stream", 4)
    with pytest.raises(ValueError, match="one .entry"):
        pdl_launch.parse_ptx(ptx + ptx)


def test_call_refuses_pdl_without_a_wait_and_wrong_operand_counts():
    x = jnp.zeros((1, 8), jnp.bfloat16)
    out = S((1, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="no griddepcontrol.wait"):
        pdl_launch.call(_kernel(has_wait=False), out, x, pdl=True)
    with pytest.raises(ValueError, match="takes 2 operands and results, called with 2 operands"):
        pdl_launch.call(_kernel(), out, x, x, pdl=False)
    with pytest.raises(ValueError, match="takes 2 operands and results, called with 0 operands"):
        pdl_launch.call(_kernel(), out, pdl=False)  # a missing operand is no null pointer


def test_side_call_refuses_pdl_kernels_2d_grids_and_wrong_operand_counts():
    x = jnp.zeros((1, 8), jnp.bfloat16)
    out = S((1, 8), jnp.bfloat16)
    # a kernel on a stream of its own has no kernel ahead of it: no wait, no trigger
    with pytest.raises(ValueError, match="uses PDL"):
        side_launch.side_call(_kernel(has_wait=True), out, x)
    with pytest.raises(ValueError, match="uses PDL"):
        side_launch.side_call(_kernel(has_wait=False, has_trigger=True), out, x)
    with pytest.raises(ValueError, match="1-D grids"):
        side_launch.side_call(_kernel(has_wait=False, grid_yz=(2, 1)), out, x)
    with pytest.raises(ValueError, match="takes 2 operands and results, called with 2 operands"):
        side_launch.side_call(_kernel(has_wait=False), out, x, x)
    with pytest.raises(ValueError, match="static_args 2 for 1 operands"):
        side_launch.side_call(_kernel(has_wait=False), out, x, static_args=2)


def test_ir_buffer_count_reads_the_kernel_signature():
    from pallas_kernels.gemv_stream import gemv_stream_normed
    bf = jnp.bfloat16
    f = lambda x, b, bw, nw, w: gemv_stream_normed(x, nw, w, eps=1e-6, branch=b, branch_w=bw,
                                                    block_n=4, per_program=4)
    module, _ = pdl_launch.capture_module(f, S((1, 2048), bf), S((1, 2048), bf),
                                          S((2048,), bf), S((2048,), bf), S((6144, 2048), bf))
    assert pdl_launch.ir_buffer_count(module) == 7  # five operands, two results
    with pytest.raises(ValueError, match="one tt.func"):
        pdl_launch.ir_buffer_count(module + module)


def test_kernel_ids_follow_the_code():
    assert _kernel().kernel_id == _kernel(name="m", grid=9).kernel_id  # the image alone
    assert _kernel().kernel_id != _kernel(image=b"other").kernel_id
    assert 0 <= _kernel().kernel_id < 2 ** 56


def _can_build():
    try:
        pdl_launch.cuda_include()
        pdl_launch.jaxlib_include()
    except RuntimeError:
        return False
    return shutil.which("g++") is not None or shutil.which("c++") is not None


@pytest.mark.skipif(not _can_build(), reason="needs a C++ compiler, cuda.h and jaxlib's headers")
def test_library_builds_once_and_exports_the_handler(tmp_path):
    import ctypes
    path = pdl_launch.build(tmp_path)
    assert path.exists() and path.parent == tmp_path
    assert pdl_launch.build(tmp_path) == path  # cached: same source, jaxlib and cuda.h
    # the parts the source includes, all in the build's cache key
    import re
    included = re.findall(r'#include "(pdl_launch_[^"]+)"', pdl_launch.SOURCE.read_text())
    assert sorted(included) == sorted(p.name for p in pdl_launch.PARTS)
    assert all(p.exists() for p in pdl_launch.PARTS)
    lib = ctypes.cdll.LoadLibrary(str(path))
    assert lib.OuroPdlLaunch is not None
    assert lib.OuroSideLaunch is not None and lib.OuroSideSync is not None
    pdl_launch.declare(lib)
    assert lib.OuroPdlRegister(7, b"abc", 3, b"k", 4) == 0
    assert lib.OuroPdlRegister(7, b"abc", 3, b"k", 4) == 0  # the same kernel again: fine
    assert lib.OuroPdlRegister(7, b"abd", 3, b"k", 4) == 1  # another image under that id
    assert lib.OuroPdlRegister(7, b"abc", 3, b"k", 5) == 1  # another parameter count
    assert lib.OuroPdlRegister(8, b"abc", 3, b"k", -1) == 2


@pytest.mark.skipif(not _can_build(), reason="needs a C++ compiler, cuda.h and jaxlib's headers")
def test_the_librarys_plan_check_agrees_with_sequence_plan_and_refuses_malformed_plans():
    a = _kernel(n_params=3)
    good = pdl_launch.sequence_plan([(a, [("in", 0), ("out", 0)], True)] * 2, 1, 1)
    assert pdl_launch.check_plan(good, 2)
    assert not pdl_launch.check_plan(good, 1)  # a buffer index past the call's buffers
    assert not pdl_launch.check_plan(np.append(good, 0), 2)  # trailing elements
    assert not pdl_launch.check_plan(good[:-1], 2)  # ends inside a kernel's parameters
    assert not pdl_launch.check_plan(good[:5], 2)  # ends inside a kernel's header
    bad = good.copy()
    bad[0] = -1
    assert not pdl_launch.check_plan(bad, 2)
    bad = good.copy()
    bad[8] = 65  # more parameters than the launcher takes
    assert not pdl_launch.check_plan(bad, 2)
    for i in (2, 3, 4, 5):  # no programs along x, y or z; no threads
        bad = good.copy()
        bad[i] = 0
        assert not pdl_launch.check_plan(bad, 2)
    bad = good.copy()
    bad[3] = 70000  # over CUDA's 65,535 programs along y
    assert not pdl_launch.check_plan(bad, 2)
    assert pdl_launch.check_plan(np.asarray([0], np.int64), 0)


def _has_triton():
    try:
        import triton  # noqa: F401
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError:
        return False
    return True


def _gemv(gated, mode):
    tuning = dict(block_n=2, block_k=512, per_program=4, num_warps=4, pdl=mode)
    return functools.partial(gemv_stream, gated=gated, **tuning)


@pytest.mark.skipif(not _has_triton(), reason="needs the `triton` package (compiles offline)")
@pytest.mark.parametrize("mode", [False, "start", "end"])
def test_compiled_kernel_has_the_wait_and_trigger_its_mode_asks_for(mode):
    kern = pdl_launch.compile_pallas(_gemv(True, mode), S((1, 2048), jnp.bfloat16),
                                     S((4096, 2048), jnp.bfloat16), num_warps=4, num_stages=1)
    assert kern.has_wait == kern.has_trigger == bool(mode)
    assert kern.grid == 2048 // 8 and kern.threads == 128
    assert kern.n_buffers == 3 and kern.n_params >= 3 and kern.name.startswith("gemv_stream")
    assert kern.image[:4] == b"\x7fELF"  # a cubin


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("gated,graph", [(False, False), (True, False), (True, True)])
def test_gpu_launched_gemv_with_and_without_pdl(gated, graph):
    """The launcher's results: every PDL mode bit-equal to the launcher without PDL (same
    math, same Triton), alone and chained back to back (the second launch reads the first's
    output after its wait); and within rounding of JAX's own launch (XLA's Triton may round
    differently)."""
    n, k = 2048, 2048
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (1, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (2 * n if gated else n, k), jnp.float32) * 0.03
         ).astype(jnp.bfloat16)
    outs = {}
    for mode in (False, "start", "end"):
        kern = pdl_launch.compile_pallas(_gemv(gated, mode), S(x.shape, x.dtype),
                                         S(w.shape, w.dtype), num_warps=4, num_stages=1)

        @jax.jit
        def chained(x, w, kern=kern, pdl=bool(mode)):
            y = pdl_launch.call(kern, S((1, n), x.dtype), x, w, pdl=pdl, graph=graph)
            return y, pdl_launch.call(kern, S((1, n), x.dtype), y, w, pdl=pdl, graph=graph)
        outs[mode] = [np.asarray(a) for a in chained(x, w)]
    for mode in ("start", "end"):
        for a, b in zip(outs[mode], outs[False]):
            np.testing.assert_array_equal(a, b)
    f = _gemv(gated, False)
    want1 = np.asarray(jax.jit(f)(x, w), np.float32)
    want2 = np.asarray(jax.jit(f)(jnp.asarray(outs[False][0]), w), np.float32)
    np.testing.assert_allclose(outs[False][0].astype(np.float32), want1, rtol=2e-2, atol=1e-3)
    np.testing.assert_allclose(outs[False][1].astype(np.float32), want2, rtol=2e-2, atol=1e-3)


def test_sequence_plan_layout_and_refusals():
    a = _kernel(n_params=3)
    b = _kernel(image=b"other", name="m", grid=8, n_params=4, n_buffers=3)
    plan = pdl_launch.sequence_plan([(a, [("in", 0), ("out", 0)], True),
                                     (b, [("out", 0), ("in", 1), ("out", 1)], False)], 2, 2)
    assert plan.dtype == np.int64
    assert list(plan) == [2, a.kernel_id, 4, 1, 1, 128, 0, 1, 3, 0, 2, -1,
                          b.kernel_id, 8, 1, 1, 128, 0, 0, 4, 2, 1, 3, -1]
    c = _kernel(image=b"3d", grid=2, grid_yz=(16, 4))  # a 3-D grid: all three sizes
    assert list(pdl_launch.sequence_plan([(c, [("in", 0), ("out", 0)], False)], 1, 1))[2:5] \
        == [2, 16, 4]
    with pytest.raises(ValueError, match="no griddepcontrol.wait"):
        pdl_launch.sequence_plan([(_kernel(has_wait=False), [("in", 0)], True)], 1, 0)
    with pytest.raises(ValueError, match="takes 2 operands and results, given 4"):
        pdl_launch.sequence_plan([(a, [("in", 0)] * 4, False)], 1, 0)
    with pytest.raises(ValueError, match="takes 2 operands and results, given 1"):
        pdl_launch.sequence_plan([(a, [("in", 0)], False)], 1, 0)
    with pytest.raises(ValueError, match="bad parameter"):
        pdl_launch.sequence_plan([(a, [("in", 0), ("out", 2)], False)], 1, 2)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("mode", [False, "start", "end"])
def test_gpu_sequence_equals_separate_launches(mode, graph):
    """A sequence (stream launches, or a CUDA graph of the launcher's own with programmatic
    edges) gives the separate launches' bits; a long chain (40 kernels, each reading the one
    before) too; the graph is recorded once per buffer addresses and replayed after."""
    n = k = 2048
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (1, k), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.float32) * 0.03).astype(jnp.bfloat16)
    kern = pdl_launch.compile_pallas(_gemv(False, mode), S(x.shape, x.dtype),
                                     S(w.shape, w.dtype), num_warps=4, num_stages=1)
    steps = [(kern, [("in", 0), ("in", 1), ("out", 0)], bool(mode)),
             (kern, [("out", 0), ("in", 1), ("out", 1)], bool(mode))]
    pdl_launch.graph_stats(reset=True)
    f = jax.jit(lambda x, w: pdl_launch.sequence(steps, [S((1, n), x.dtype)] * 2, x, w,
                                                 graph=graph))
    y1, y2 = f(x, w)
    one = jax.jit(lambda x, w: pdl_launch.call(kern, S((1, n), x.dtype), x, w, pdl=False))
    np.testing.assert_array_equal(np.asarray(y1), np.asarray(one(x, w)))
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(one(y1, w)))
    # a long chain through 40 results, each kernel reading the one before
    chain = [(kern, [("in", 0), ("in", 1), ("out", 0)], bool(mode))]
    chain += [(kern, [("out", i - 1), ("in", 1), ("out", i)], bool(mode)) for i in range(1, 40)]
    g = jax.jit(lambda x, w: pdl_launch.sequence(chain, [S((1, n), x.dtype)] * 40, x, w,
                                                 graph=graph))
    ys = g(x, w)
    want = [one(x, w)]
    for _ in range(39):
        want.append(one(want[-1], w))
    for got, exp in zip(ys, want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
    again = g(x, w)  # the same program again: its buffers at the same addresses, or new ones
    for got, exp in zip(again, want):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(exp))
    stats = pdl_launch.graph_stats(reset=True)
    if graph:
        assert stats["recorded"] >= 2 and stats["recorded"] + stats["replayed"] == 3
    else:
        assert stats == dict(recorded=0, replayed=0, dropped=0)


def test_the_pdl_benchmarks_refuse_bad_arguments_before_any_gpu_work():
    from benchmarks import pdl_chain, pdl_jax_chain
    with pytest.raises(SystemExit, match="unknown arm"):
        pdl_chain.main(["--arms", "plain,bogus"])
    with pytest.raises(SystemExit, match="unknown projection 'qkvx'"):
        pdl_chain.main(["--tiling", "qkvx=4:4:4"])
    with pytest.raises(SystemExit, match="not a multiple"):
        pdl_chain.main(["--tiling", "o=3:1:4"])
    with pytest.raises(SystemExit, match="block_n:per_program:num_warps"):
        pdl_chain.main(["--tiling", "o=4"])
    assert pdl_chain.parse_tiling("down=1:2:4")["down"] == (1, 2, 4)
    with pytest.raises(SystemExit, match="unknown arm"):
        pdl_jax_chain.main(["--arms", "xla,bogus"])


def test_sequence_refuses_bad_aliases_before_building_anything():
    a = _kernel(n_params=3)
    x = jax.ShapeDtypeStruct((1, 8), jnp.bfloat16)
    steps = [(a, [("in", 0), ("out", 0)], False)]
    with pytest.raises(ValueError, match="outside 1 operands and 1 results"):
        pdl_launch.sequence(steps, [x], x, aliases={0: 1})
    with pytest.raises(ValueError, match="differ"):
        pdl_launch.sequence(steps, [jax.ShapeDtypeStruct((1, 8), jnp.float32)], x,
                            aliases={0: 0})
    with pytest.raises(ValueError, match="at most one operand"):
        pdl_launch.sequence(steps + [(a, [("in", 1), ("out", 0)], False)], [x], x, x,
                            aliases={0: 0, 1: 0})
