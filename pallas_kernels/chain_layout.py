"""Shapes, weight layout, checks and the XLA reference of the persistent GEMV chain
(pallas_kernels/chain_mgpu.py): everything about it that is not the kernel itself."""
from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.gemv_mgpu import SMEM_LIMIT
from pallas_kernels.gemv_mgpu_areg import AROWS  # noqa: F401 - x broadcast to wgmma's M


def chain_shapes(hidden, q_rows, qkv_rows, inter):
    """Per stage (name, output rows N, K, gated); gate/up's weight is [gate; up] [2N, K].
    o reads q, the first q_rows of qkv's outputs."""
    return (("qkv", qkv_rows, hidden, False), ("o", hidden, q_rows, False),
            ("gate_up", inter, hidden, True), ("down", hidden, inter, False))


SHAPES = chain_shapes(2048, 2048, 6144, 5632)  # the 1.4B model's


def shapes_of_config(cfg):
    """chain_shapes of an OuroConfig's layers (fused qkv and gate/up)."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return chain_shapes(cfg.hidden_size, q, q + 2 * kv, cfg.intermediate_size)
Q_ROWS = 2048


def shapes_of(ws):
    """chain_shapes of the four stages' weights [L, rows, K] (qkv, o, gate/up, down)."""
    if len(ws) != 4:
        raise ValueError(f"ws must be (qkv, o, gate_up, down) weights, got {len(ws)}")
    if any(w.ndim != 3 for w in ws):
        raise ValueError(f"weights must be [L, rows, K], got {[w.shape for w in ws]}")
    (n0, h), (h_o, q), (i2, h_gu), (h_d, i) = [w.shape[1:] for w in ws]
    if h_o != h or h_gu != h or h_d != h or i2 != 2 * i or q > n0:
        raise ValueError(f"weights do not chain: qkv {(n0, h)}, o {(h_o, q)}, gate_up "
                         f"{(i2, h_gu)}, down {(h_d, i)} (rows, K)")
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


def smem_bytes(shapes, block_n, block_k, stages, programs, interpret=False, normed=False):
    kmax = max(k for _, _, k, _ in shapes)
    a_tile = AROWS * block_k * 2 if interpret else 0
    table = 4 * table_len(shapes, block_n, block_k, programs)
    # + barriers and alignment; the norm prologue's reductions take ~1.1 KB more
    return (stages * block_n * block_k * 2 + kmax * 2 + AROWS * block_n * 2 + a_tile + table
            + 1024 + (2048 if normed else 0))


def stage_bases(shapes, block_n, block_k):
    """Where each stage's tiles start in tile_weights' per-layer run, and the run's length."""
    bases, t = [], 0
    for _, n, k, gated in shapes:
        bases.append(t)
        t += (2 * n if gated else n) // block_n * (k // block_k)
    return bases, t


def tile_weights(ws, block_n, block_k):
    """[L, rows, K] weights of the four stages -> one [L, T, block_n, block_k] array: per
    layer, each stage's tiles in turn, (row block, K block) in row-major order. Every tile
    the kernel requests is one contiguous block of memory, and one array serves all stages
    (a layout chosen once, at load)."""
    out = []
    for w in ws:
        n_layers, rows, k = w.shape
        if rows % block_n or k % block_k:
            raise ValueError(f"weights {w.shape}: block_n={block_n} must divide the rows and "
                             f"block_k={block_k} K")
        out.append(w.reshape(n_layers, rows // block_n, block_n, k // block_k, block_k)
                   .transpose(0, 1, 3, 2, 4).reshape(n_layers, -1, block_n, block_k))
    return jnp.concatenate(out, axis=1)


def program_tiles(shapes, block_n, block_k, programs, p, uniform=False):
    """Program p's tiles of one layer, in the order it takes them: per stage, K step by K
    step, each step over its units (blocks p, p + P, ...; gate then up for gate/up), as
    indices into tile_weights' per-layer run. uniform: every program takes the most units
    of any (umax), its last real unit repeated (computed, not stored), so that the kernel's
    MMAs need no per-program condition."""
    bases, _ = stage_bases(shapes, block_n, block_k)
    most = umax(shapes, block_n, programs)
    seq = []
    for (_, n, k, gated), base, um in zip(shapes, bases, most):
        nk = k // block_k
        units = list(range(p, n // block_n, programs))
        if uniform:
            units += units[-1:] * (um - len(units))
        for kb in range(nk):
            for rb in units:
                for j in range(2 if gated else 1):
                    seq.append(base + (rb + j * (n // block_n)) * nk + kb)
    return seq


def table_len(shapes, block_n, block_k, programs):
    """The tile table's row length: program 0's tiles per layer (the most, also with
    `uniform`), rounded up to a multiple of 256 (a whole-warpgroup load)."""
    most = len(program_tiles(shapes, block_n, block_k, programs, 0))
    return -(-most // 256) * 256


@functools.lru_cache(maxsize=None)
def tile_table(shapes, block_n, block_k, programs, uniform=False):
    """int32 [programs, table_len]: each program's program_tiles, zero-padded (built once per
    configuration, read-only)."""
    import numpy as np
    table = np.zeros((programs, table_len(shapes, block_n, block_k, programs)), np.int32)
    for p in range(programs):
        seq = program_tiles(shapes, block_n, block_k, programs, p, uniform)
        table[p, :len(seq)] = seq
    table.setflags(write=False)
    return table


def check(x, w, shapes, block_n, block_k, stages, programs, interpret=False, normed=False,
          extra_smem=0):
    """ValueError naming what is wrong with the call, if anything."""
    if block_n % 8 or not 8 <= block_n <= 256 or block_k % 64:
        raise ValueError(f"block_n={block_n} must be a multiple of 8 in 8..256 and "
                         f"block_k={block_k} a multiple of 64")
    if len(shapes) != 4 or shapes != chain_shapes(shapes[0][2], shapes[1][2], shapes[0][1],
                                                  shapes[2][1]):
        raise ValueError(f"shapes must be chain_shapes(...), got {shapes}")
    if x.shape != (1, shapes[0][2]) or x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bf16 [1, {shapes[0][2]}], got {x.dtype} {x.shape}")
    if type(programs) is not int or programs < 1:
        raise ValueError(f"programs must be an int >= 1, got {programs!r}")
    for name, n, k, _ in shapes:
        if k % block_k or n % block_n:
            raise ValueError(f"{name}: block_n={block_n} must divide N={n} and "
                             f"block_k={block_k} K={k}")
        if n // block_n < programs:
            raise ValueError(f"{name}: {n // block_n} blocks of {block_n} rows leave some of "
                             f"the {programs} programs without work; lower block_n")
    _, t = stage_bases(shapes, block_n, block_k)
    if w.ndim != 4 or w.shape[1:] != (t, block_n, block_k) or w.dtype != jnp.bfloat16:
        raise ValueError(f"weights must be bf16 [L, {t}, {block_n}, {block_k}] "
                         f"(tile_weights), got {w.dtype} {w.shape}")
    need = 2 * step_tiles(shapes, block_n, programs)
    if stages < need or stages > 32:  # barrier phases live in one 32-bit mask
        raise ValueError(f"stages={stages} must be in {need}..32 (twice the tiles of one "
                         f"K step, {need // 2} at block_n={block_n}, {programs} programs)")
    fewest = len(program_tiles(shapes, block_n, block_k, programs, programs - 1))
    if fewest < stages:  # a request runs at most one layer ahead
        raise ValueError(f"stages={stages} exceeds the {fewest} tiles per layer of the "
                         f"program with the fewest")
    smem = smem_bytes(shapes, block_n, block_k, stages, programs, interpret, normed) \
        + extra_smem  # (the attention stage's)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{smem} B of shared memory exceeds {SMEM_LIMIT} (stages={stages} ring "
                         f"slots of {block_n}x{block_k}): take fewer stages")
