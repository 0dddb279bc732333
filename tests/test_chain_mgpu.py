"""The persistent Mosaic GPU GEMV chain (pallas_kernels/chain_mgpu.py): the tile-major weight
layout, CPU interpret mode on tiny shapes (one program: the whole chain bit for bit against
XLA; two programs without the handover, which the interpreter lacks: each program's own
ring with uneven units, checked on the first stage), the refusals, the lowering for 'cuda'
on a CPU machine, the add_norm prologues (bit for bit in the interpreter), and the 1.4B
shapes on a GPU.

Skipped where jax has no Mosaic GPU Pallas with GPU interpret mode (jax 0.10.2 in CI)."""

from __future__ import annotations

import pytest

try:
    import jax.experimental.pallas.mosaic_gpu as plgpu
    plgpu.InterpretGPUParams  # noqa: B018 - GPU interpret mode (jax >= 0.11)
except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the jax install
    pytest.skip(f"no Mosaic GPU Pallas with interpret mode: {e}", allow_module_level=True)

import jax
import jax.numpy as jnp
import numpy as np

from engine_helpers import has_gpu
from pallas_kernels import chain_mgpu as cm
from pallas_kernels.gemv import gemv_reference

TINY = cm.chain_shapes(64, 64, 128, 64)  # hidden, q rows, qkv rows, intermediate


def _weights(shapes, n_layers, seed=0):
    key = jax.random.PRNGKey(seed)
    ws = []
    for _, n, k, gated in shapes:
        key, sub = jax.random.split(key)
        scale = k ** -0.5 * (1.3 if gated else 1.0)
        ws.append((jax.random.normal(sub, (n_layers, 2 * n if gated else n, k), jnp.float32)
                   * scale).astype(jnp.bfloat16))
    x = jax.random.normal(key, (1, shapes[0][2]), jnp.float32).astype(jnp.bfloat16)
    return x, tuple(ws)


def _f32(a):
    return np.asarray(a, np.float32)


def test_tile_weights_makes_each_tile_contiguous():
    _, ws = _weights(TINY, 2)
    w = cm.tile_weights(ws, 8, 64)
    bases, total = cm.stage_bases(TINY, 8, 64)
    assert w.shape == (2, total, 8, 64) and bases == [0, 16, 24, 40]
    # gate/up's tile (row block 5, K block 0) of layer 1: its rows 40..47, columns 0..63
    np.testing.assert_array_equal(_f32(w[1, bases[2] + 5]), _f32(ws[2][1, 40:48, 0:64]))
    # down's (row block 3, K block 0): K = 64 is one block
    np.testing.assert_array_equal(_f32(w[0, bases[3] + 3]), _f32(ws[3][0, 24:32, :]))
    assert cm.shapes_of(ws) == TINY


@pytest.mark.parametrize("programs", [1, 2, 3, 16])
def test_tile_table_partitions_each_layer_among_the_programs(programs):
    """Every tile of a layer is requested by exactly one program; each program takes its
    stages in order; the table's rows hold those sequences."""
    shapes = cm.chain_shapes(64, 64, 136, 128)
    seqs = [cm.program_tiles(shapes, 8, 64, programs, p) for p in range(programs)]
    _, total = cm.stage_bases(shapes, 8, 64)
    assert sorted(t for seq in seqs for t in seq) == list(range(total))
    bases, _ = cm.stage_bases(shapes, 8, 64)
    for seq in seqs:
        stage = [max(i for i, b in enumerate(bases) if b <= t) for t in seq]
        assert stage == sorted(stage)
    table = cm.tile_table(shapes, 8, 64, programs)
    assert table.shape[1] % 256 == 0
    for p, seq in enumerate(seqs):
        assert list(table[p, :len(seq)]) == seq


def _norms(n_layers, hidden, seed=5):
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    norms = tuple((1 + 0.1 * jax.random.normal(k, (n_layers, hidden))).astype(jnp.bfloat16)
                  for k in keys[:4])
    branch = jax.random.normal(keys[4], (1, hidden), jnp.float32).astype(jnp.bfloat16)
    return norms, branch


def test_interpret_add_norm_chain_is_bit_identical_to_xla():
    """qkv and gate/up with the engine's add_norm prologues over two layers, a nonzero first
    branch: the last down output and both residual rows are XLA's (model.rms_norm) bits."""
    shapes = cm.chain_shapes(256, 256, 384, 256)  # rows of 256: the strided norm layout
    x, ws = _weights(shapes, 2, seed=2)
    norms, branch = _norms(2, 256)
    outs = cm.gemv_chain_mgpu(x, cm.tile_weights(ws, 64, 64), shapes, norms=norms,
                              branch=branch, block_n=64, block_k=64, stages=16,
                              interpret=True)
    assert len(outs) == 6
    for got, ref in zip(outs[3:], cm.reference_chain(x, ws, norms, branch)):
        np.testing.assert_array_equal(_f32(got), _f32(ref))


def test_interpret_two_programs_uneven_units_first_stage():
    """qkv's 17 row blocks split 9 / 8 over two programs: each program's ring runs the whole
    chain to the end (no hang) and the first stage, which needs no handover, is exact."""
    shapes = cm.chain_shapes(64, 64, 136, 128)
    x, ws = _weights(shapes, 1, seed=3)
    assert cm.umax(shapes, 8, 2) == [9, 4, 8, 4]
    outs = cm.gemv_chain_mgpu(x, cm.tile_weights(ws, 8, 64), shapes, block_n=8, block_k=64,
                              stages=32, programs=2, sync=False, interpret=True)
    np.testing.assert_array_equal(_f32(outs[0]), _f32(gemv_reference(x, ws[0][0])))


@pytest.mark.parametrize("kw,msg", [
    (dict(block_n=12), "multiple of 8"),
    (dict(block_k=96), "multiple of 64"),
    (dict(stages=16), "stages=16 must be in 32..32"),
    (dict(programs=9), "leave some of the 9 programs"),
    (dict(programs=0), "programs must be an int"),
    (dict(diag="fast"), "diag must be"),
    (dict(programs=2, interpret=True), "interpret has no handover"),
    (dict(shapes=cm.chain_shapes(64, 64, 128, 128)), "weights must be bf16"),
    (dict(shapes=(("qkv", 128, 64, False),) * 4), "shapes must be chain_shapes"),
])
def test_refusals(kw, msg):  # duplicates: boilerplate (a table of refusal cases)
    x, ws = _weights(TINY, 1)
    args = dict(shapes=TINY, block_n=8, block_k=64, stages=32, programs=1)
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        cm.gemv_chain_mgpu(x, cm.tile_weights(ws, 8, 64), **args)


def test_refuses_a_ring_longer_than_a_layer():
    """A request runs at most one layer ahead: a program with fewer tiles per layer than
    ring slots is refused (here the second of two programs: 16 of qkv's ... tiles)."""
    shapes = cm.chain_shapes(64, 64, 64, 64)
    x, ws = _weights(shapes, 1)
    fewest = len(cm.program_tiles(shapes, 16, 64, 2, 1))
    with pytest.raises(ValueError, match=f"exceeds the {fewest} tiles per layer"):
        cm.gemv_chain_mgpu(x, cm.tile_weights(ws, 16, 64), shapes, block_n=16, block_k=64,
                           stages=fewest + 1, programs=2, sync=False, interpret=True)


def test_refuses_bad_norms_or_inputs():
    x, ws = _weights(TINY, 1)
    w = cm.tile_weights(ws, 8, 64)
    kw = dict(block_n=8, block_k=64, stages=32, programs=1)
    norms, branch = _norms(1, 64)
    with pytest.raises(ValueError, match="norms must be four bf16"):
        cm.gemv_chain_mgpu(x, w, TINY, norms=norms[:3], **kw)
    with pytest.raises(ValueError, match="branch must be like x"):
        cm.gemv_chain_mgpu(x, w, TINY, norms=norms, branch=branch[:, :32], **kw)
    with pytest.raises(ValueError, match="it needs norms"):
        cm.gemv_chain_mgpu(x, w, TINY, branch=branch, **kw)
    with pytest.raises(ValueError, match="x must be bf16"):
        cm.gemv_chain_mgpu(x.astype(jnp.float32), w, TINY, **kw)
    bad = (ws[0], ws[1], ws[2][:, :8], ws[3])  # gate/up rows no longer twice down's K
    with pytest.raises(ValueError, match="do not chain"):
        cm.shapes_of(bad)


@pytest.mark.parametrize("normed,sync,diag,mmas,kw", [
    (False, True, None, True, {}), (True, True, None, True, {}),
    (False, False, None, True, {}), (False, True, "nomma", False, {}),
    (True, True, None, True, dict(uniform=True, smem_a=True))])
def test_lowers_for_cuda_at_the_1p4b_shapes(normed, sync, diag, mmas, kw):
    """The register-A path (which the interpreter replaces) lowers for sm_90 on a CPU, with
    TMA requests, the handover's release add only with the handover, and no MMA in the
    no-math diagnostic."""
    L, bn, bk = 2, 16, 256
    _, total = cm.stage_bases(cm.SHAPES, bn, bk)
    x = jax.ShapeDtypeStruct((1, 2048), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((L, total, bn, bk), jnp.bfloat16)
    norms = tuple(jax.ShapeDtypeStruct((L, 2048), jnp.bfloat16) for _ in range(4))
    text = cm.lower_for_h200(x, w, norms if normed else None, block_n=bn, block_k=bk,
                             stages=16, programs=128, sync=sync, diag=diag, **kw).as_text()
    assert "cp.async.bulk.tensor" in text
    # (the module is bytecode: each inline-asm string appears once, however many sites)
    assert ("red.release.gpu" in text) == sync and "red.release.sys" not in text
    assert ("wgmma.mma_async" in text) == mmas


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
@pytest.mark.parametrize("programs", [1, 2])
@pytest.mark.skip(reason="hangs on the H100 (session 27: two programs ran into a 45 s KILL; "
                         "the 1.4B shapes on 128 programs run): to be diagnosed")
def test_gpu_tiny_chain_with_the_handover(programs):
    """Tiny shapes, one and two programs through the semaphore handover, within two bf16
    steps of XLA."""
    shapes = cm.chain_shapes(64, 64, 128, 128)
    x, ws = _weights(shapes, 2, seed=6)
    outs = jax.jit(lambda x, w: cm.gemv_chain_mgpu(
        x, w, shapes, block_n=32, block_k=64, stages=16, programs=programs))(
        x, cm.tile_weights(ws, 32, 64))
    got, ref = _f32(outs[3]), _f32(cm.reference_chain(x, ws))
    assert np.all(np.abs(got - ref) <= 2 ** -6 * np.maximum(np.abs(ref), 1.0))


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_stages_match_xla_at_the_1p4b_shapes():
    """One layer at the 1.4B shapes on all SMs, through the handover: each stage against
    XLA on the kernel's own stage input. XLA may split K for o and down, so those may
    differ in the last bits (session 26 on an H100: o 834 of 2048 by <= 0.0156, down 7)."""
    x, ws = _weights(cm.SHAPES, 1, seed=1)
    outs = jax.jit(lambda x, w: cm.gemv_chain_mgpu(x, w))(x, cm.tile_weights(ws, 16, 256))
    assert cm.SHAPES == cm.shapes_of(ws)
    yq, yo, ygu, yd = outs
    ins = (x, yq[:, :cm.Q_ROWS], yo, ygu)
    for (name, _, _, gated), w, inp, got in zip(cm.SHAPES, ws, ins, outs):
        ref = _f32(gemv_reference(inp, w[0], gated=gated))
        got = _f32(got)
        assert np.all(np.abs(got - ref) <= 2 ** -6 * np.maximum(np.abs(ref), 1.0)), name


@pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_gpu_add_norm_chain_matches_xla_at_the_1p4b_shapes():
    """Two layers with the add_norm prologues, against XLA's chain: within 2% (norm). Not
    elementwise: XLA's o and down sum in another order on the GPU (1-2 bf16 steps in many
    elements, test_gpu_stages_match_xla_at_the_1p4b_shapes), and the next norm and layer
    carry that on (session 27 on an H100: up to 0.016 at values ~1.2)."""
    x, ws = _weights(cm.SHAPES, 2, seed=4)
    norms, branch = _norms(2, 2048)
    outs = jax.jit(lambda x, w, n, b: cm.gemv_chain_mgpu(x, w, norms=n, branch=b))(
        x, cm.tile_weights(ws, 16, 256), norms, branch)
    for got, ref in zip(outs[3:], cm.reference_chain(x, ws, norms, branch)):
        got, ref = _f32(got), _f32(ref)
        assert np.linalg.norm(got - ref) <= 2e-2 * np.linalg.norm(ref)


def test_benchmark_refuses_unknown_tiling_flags():
    from benchmarks import chain_mgpu as bench
    with pytest.raises(SystemExit, match="unknown flag 'fast'"):
        bench.main(["--tilings", "16:256:12:128:fast"])


def test_uniform_tiles_repeat_the_last_unit():
    """uniform: every program takes umax units per stage (its last real unit again), so all
    tile sequences have one length; the real units come first, in the same order."""
    shapes = cm.chain_shapes(64, 64, 136, 128)
    plain = [cm.program_tiles(shapes, 8, 64, 2, p) for p in range(2)]
    uni = [cm.program_tiles(shapes, 8, 64, 2, p, uniform=True) for p in range(2)]
    assert len(uni[0]) == len(uni[1]) == len(plain[0]) > len(plain[1])
    assert uni[0] == plain[0]  # program 0 already had the most
    assert set(uni[1]) == set(plain[1]) and len(uni[1]) - len(plain[1]) == 1  # qkv: 9 vs 8


def test_interpret_uniform_two_programs_first_stage():
    """uniform=True on two programs with uneven units (sync=False): the ring runs to the
    end and the first stage, stored from the real units only, is exact."""
    shapes = cm.chain_shapes(64, 64, 136, 128)
    x, ws = _weights(shapes, 1, seed=3)
    outs = cm.gemv_chain_mgpu(x, cm.tile_weights(ws, 8, 64), shapes, block_n=8, block_k=64,
                              stages=32, programs=2, sync=False, uniform=True,
                              interpret=True)
    np.testing.assert_array_equal(_f32(outs[0]), _f32(gemv_reference(x, ws[0][0])))
