"""Shapes, weight layout, checks and the XLA reference of the persistent GEMV chain
(pallas_kernels/chain_mgpu.py): everything about it that is not the kernel itself."""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.gemv_mgpu import SMEM_LIMIT

AROWS = 64  # wgmma's M: x broadcast to 64 rows


def chain_shapes(hidden, q_rows, qkv_rows, inter):
    """Per stage (name, output rows N, K, gated); gate/up's weight is [gate; up] [2N, K].
    o reads q, the first q_rows of qkv's outputs."""
    return (("qkv", qkv_rows, hidden, False), ("o", hidden, q_rows, False),
            ("gate_up", inter, hidden, True), ("down", hidden, inter, False))


SHAPES = chain_shapes(2048, 2048, 6144, 5632)  # the 1.4B model's
Q_ROWS = 2048


def shapes_of(ws, block_n=1, block_k=None):
    """chain_shapes of weights [L, rows, K] or, with block_k, tile_weights' layout."""
    if len(ws) != 4:
        raise ValueError(f"ws must be (qkv, o, gate_up, down) weights, got {len(ws)}")
    dims = []
    for w in ws:
        want = ("[L, rows, K]" if block_k is None else
                "tile_weights' [L, rows / block_n, K / block_k, block_n, block_k]")
        if w.ndim != (3 if block_k is None else 5) or (
                block_k is not None and w.shape[3:] != (block_n, block_k)):
            raise ValueError(f"weights must be {want}, got {w.shape}")
        dims.append((w.shape[1], w.shape[2]) if block_k is None
                    else (w.shape[1] * block_n, w.shape[2] * block_k))
    (n0, h), (h_o, q), (i2, h_gu), (h_d, i) = dims
    if h_o != h or h_gu != h or h_d != h or i2 != 2 * i or q > n0:
        raise ValueError(f"weights do not chain: qkv {dims[0]}, o {dims[1]}, gate_up "
                         f"{dims[2]}, down {dims[3]} (rows, K)")
    return chain_shapes(h, q, n0, i)


def reference_chain(x, ws, norms=None, branch=None, eps=1e-6):
    """The chain in XLA over [L, rows, K] weights: fp32 accumulation, one bf16 rounding per
    output (gemv_reference); returns the last layer's down output. With norms, the engine's
    add_norm prologues (model.rms_norm) on qkv and gate/up, as gemv_chain_mgpu's; returns
    (down output, residual after qkv's prologue, after gate/up's)."""
    from ouro_jax.model import rms_norm
    from pallas_kernels.gemv import gemv_reference
    wq, wo, wgu, wd = ws
    if norms is not None:
        d = jnp.zeros_like(x) if branch is None else branch
        for l in range(wq.shape[0]):
            hq = x + rms_norm(d, norms[0][l], eps)
            y = gemv_reference(rms_norm(hq, norms[1][l], eps), wq[l])
            o = gemv_reference(y[:, :wo.shape[2]], wo[l])
            x = hq + rms_norm(o, norms[2][l], eps)
            y = gemv_reference(rms_norm(x, norms[3][l], eps), wgu[l], gated=True)
            d = gemv_reference(y, wd[l])
        return d, hq, x
    h = x
    for l in range(wq.shape[0]):
        y = gemv_reference(h, wq[l])
        y = gemv_reference(y[:, :wo.shape[2]], wo[l])
        y = gemv_reference(y, wgu[l], gated=True)
        h = gemv_reference(y, wd[l])
    return h


def umax(shapes, block_n, programs):
    """Per stage: the most units (blocks of block_n output rows) one program owns."""
    return [-(-(n // block_n) // programs) for _, n, _, _ in shapes]


def step_tiles(shapes, block_n, programs):
    """The most weight tiles one K step consumes: units x (2 for gate/up)."""
    return max(u * (2 if gated else 1)
               for u, (*_, gated) in zip(umax(shapes, block_n, programs), shapes))


def smem_bytes(shapes, block_n, block_k, stages, interpret=False):
    kmax = max(k for _, _, k, _ in shapes)
    a_tile = AROWS * block_k * 2 if interpret else 0
    return (stages * block_n * block_k * 2 + kmax * 2 + AROWS * block_n * 2 + a_tile
            + 1024)


def tile_weights(ws, block_n, block_k):
    """[L, rows, K] -> [L, rows / block_n, K / block_k, block_n, block_k]: every tile the
    kernel requests is one contiguous block of memory (a layout chosen once, at load)."""
    out = []
    for w in ws:
        n_layers, rows, k = w.shape
        out.append(w.reshape(n_layers, rows // block_n, block_n, k // block_k, block_k)
                   .transpose(0, 1, 3, 2, 4))
    return tuple(out)


def check(x, ws, block_n, block_k, stages, programs, interpret=False):
    """The chain's shapes (chain_shapes), or ValueError naming what is wrong."""
    if block_n % 8 or not 8 <= block_n <= 256 or block_k % 64:
        raise ValueError(f"block_n={block_n} must be a multiple of 8 in 8..256 and "
                         f"block_k={block_k} a multiple of 64")
    shapes = shapes_of(ws, block_n, block_k)
    n_layers = ws[0].shape[0]
    if x.shape != (1, shapes[0][2]) or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [1, {shapes[0][2]}], got {x.dtype} {x.shape}")
    if type(programs) is not int or programs < 1:
        raise ValueError(f"programs must be an int >= 1, got {programs!r}")
    for (name, n, k, gated), w in zip(shapes, ws):
        if k % block_k or n % block_n:
            raise ValueError(f"{name}: block_n={block_n} must divide N={n} and "
                             f"block_k={block_k} K={k}")
        rows = 2 * n if gated else n
        want = (n_layers, rows // block_n, k // block_k, block_n, block_k)
        if w.shape != want or w.dtype != jnp.bfloat16:
            raise ValueError(f"{name} weights must be bf16 {want} (tile_weights of "
                             f"[{n_layers}, {rows}, {k}]), got {w.dtype} {w.shape}")
        if n // block_n < programs:
            raise ValueError(f"{name}: {n // block_n} blocks of {block_n} rows leave some of "
                             f"the {programs} programs without work; lower block_n")
    need = 2 * step_tiles(shapes, block_n, programs)
    if stages < need or stages > 32:  # barrier phases live in one 32-bit mask
        raise ValueError(f"stages={stages} must be in {need}..32 (twice the tiles of one "
                         f"K step, {need // 2} at block_n={block_n}, {programs} programs)")
    smem = smem_bytes(shapes, block_n, block_k, stages, interpret)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{smem} B of shared memory exceeds {SMEM_LIMIT}")
    return shapes
