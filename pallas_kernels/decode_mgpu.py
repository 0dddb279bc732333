"""One-row decode attention on Mosaic GPU, one program per head, no splits and no combine
kernel (prototype, jax >= 0.11, session 26; not in the engine).

Why: at batch 1 the engine's decode attention costs ~4.4 us per layer application plus
1.3 us for the XLA kernel that merges its splits (docs/performance.md), for ~1.5 MB of K/V:
a latency chain, not bandwidth. With one split per head the Triton kernel was slower
(session 14), because one program then walks the whole context with dependent loads. Here
one program per head requests all of its K and V blocks by TMA up front (`stages` blocks
deep), so the context arrives in a few large bulk copies, and the math runs on wgmma: q
broadcast to 64 rows is the register A operand against K blocks (the transposed B
operand), an online softmax runs on the [64, block] scores in registers (row 0 is the
answer), and P (fp32, rounded to the cache dtype as the engine's kernels do for p @ v)
is the A operand against V blocks. It is also the attention stage the persistent GEMV chain
(pallas_kernels/chain_mgpu.py) would run (docs/kernels.md).

The cache here is contiguous per layer, k and v [capacity, heads, head_dim], the new
token's K/V already written and RoPE already applied (the engine's pages and its fused
RoPE + K/V write are not modelled yet); `length` (int32, traced) is the number of valid
positions, clipped to [0, capacity] (0 gives zeros, as the engine's kernels do). Rows past
`length` may hold anything (the engine's tests fill stale slots with NaN): their scores
are masked, and the last block's V rows past it are zeroed in SMEM before P @ V (p = 0
times NaN would still be NaN). Scores are q . k * head_dim ** -0.5 in fp32; the output is
(sum_j p_j v_j) / (sum_j p_j) rounded to the query dtype.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

from pallas_kernels.attend_head_mgpu import pv_step, scores_step
from pallas_kernels.gemv_mgpu import SMEM_LIMIT, w_tile_transforms
from pallas_kernels.gemv_mgpu_areg import AROWS, broadcast_a, register_a_layouts

LEN_LANES = 128  # `length` travels as a [1, 128] int32 row (a whole-warpgroup load)


def reference_decode(q, k, v, length):
    """XLA: q [1, H * D], k / v [N, H, D] -> [1, H * D]; fp32 scores and softmax, p rounded
    to the cache dtype for p @ v, the sum normalised in fp32, rounded to q's dtype; length
    0 gives zeros."""
    n, h, d = k.shape
    qh = q.reshape(h, d).astype(jnp.float32)
    s = jnp.einsum("hd,nhd->hn", qh, k.astype(jnp.float32)) * d ** -0.5
    valid = jnp.arange(n) < length
    s = jnp.where(valid[None], s, -jnp.inf)
    v = jnp.where(valid[:, None, None], v, jnp.zeros_like(v))  # stale rows may hold NaN
    m = s.max(axis=1, keepdims=True)
    p = jnp.exp(s - m)
    o = jnp.einsum("hn,nhd->hd", p.astype(v.dtype).astype(jnp.float32), v.astype(jnp.float32))
    out = (o / p.sum(axis=1, keepdims=True)).astype(q.dtype).reshape(1, h * d)
    return jnp.where(length > 0, out, jnp.zeros_like(out))


def smem_bytes(block, head_dim, stages, interpret=False):
    tiles = 2 * stages * block * head_dim * 2
    a = (AROWS * head_dim + AROWS * block) * 2 if interpret else 0
    return tiles + AROWS * head_dim * 2 + LEN_LANES * 4 + a + 1024


def check(q, k, v, block, stages, interpret=False):
    if k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must be [capacity, heads, head_dim] alike, got {k.shape}, "
                         f"{v.shape}")
    n, h, d = k.shape
    if q.shape != (1, h * d):
        raise ValueError(f"q must be [1, heads * head_dim] = [1, {h * d}], got {q.shape}")
    if q.dtype != k.dtype or k.dtype != v.dtype or q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"q, k and v must share a 16-bit dtype, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}")
    if d not in (64, 128):  # 256 would need ~320 registers per thread (two fp32 [64, d])
        raise ValueError(f"head_dim={d} must be 64 or 128")
    if block % 64 or block > 256 or n % block:
        raise ValueError(f"block={block} must be a multiple of 64 up to 256 dividing the "
                         f"capacity {n}")
    if stages < 1 or stages > 16:
        raise ValueError(f"stages={stages} must be in 1..16")
    if smem_bytes(block, d, stages, interpret) > SMEM_LIMIT:
        raise ValueError(f"{smem_bytes(block, d, stages, interpret)} B of shared memory "
                         f"exceeds {SMEM_LIMIT}")


@functools.lru_cache(maxsize=None)
def _build(n, heads, d, dtype, block, stages, interpret):
    dt = jnp.dtype(dtype)
    S = stages
    transforms = w_tile_transforms(d, dt)
    a_layout, col_layout = register_a_layouts()
    scale = d ** -0.5

    def body(q_g, k_g, v_g, len_g, o_g, k_smem, v_smem, kbar, vbar, len_smem, o_smem,
             *a_smem):
        h = lax.axis_index("h")
        len_smem[...] = plgpu.load(len_g.at[0])
        plgpu.commit_smem()
        length = jnp.clip(len_smem[0], 0, n)  # (traced: clipped to the cache, not refused)
        steps = (length + block - 1) // block

        def issue(j):  # K and V block j into slot j % S
            @pl.when(j < steps)
            def _():
                rows = pl.ds(j * block, block)
                plgpu.copy_gmem_to_smem(k_g.at[rows, h], k_smem.at[j % S], kbar.at[j % S])
                plgpu.copy_gmem_to_smem(v_g.at[rows, h], v_smem.at[j % S], vbar.at[j % S])

        for j0 in range(S):
            issue(j0)
        qh = plgpu.load(q_g.at[0, pl.ds(h * d, d)], layout=col_layout, optimized=False)
        qa = broadcast_a(qh, a_layout)
        if a_smem:  # the interpreter's wgmma takes its A operand from SMEM only
            a_smem[0][...] = qa
            plgpu.commit_smem()
            qa = a_smem[0]
        m = plgpu.layout_cast(jnp.full((AROWS,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
        l = plgpu.layout_cast(jnp.zeros((AROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.zeros((AROWS, d), jnp.float32), plgpu.Layout.WGMMA)

        def kv_step(j, carry):
            acc, m, l = carry
            slot = j % S
            plgpu.barrier_wait(kbar.at[slot])
            pos = plgpu.broadcasted_iota(jnp.int32, (AROWS, block), 1,
                                         layout=plgpu.Layout.WGMMA) + j * block
            p16, m_new, l, acc = scores_step(qa, k_smem.at[slot], block, scale, m, l, acc,
                                             pos, length, dt, a_smem[1] if a_smem else None)
            plgpu.barrier_wait(vbar.at[slot])

            @pl.when((j + 1) * block > length)
            def _():  # the last block's rows past `length`: zeros, so that p = 0 times a
                # stale row (NaN in the engine's caches) cannot poison the sum
                tile = v_smem.at[slot]
                vt = plgpu.load(tile, layout=plgpu.Layout.WGMMA, optimized=False)
                rows = plgpu.broadcasted_iota(jnp.int32, (block, d), 0,
                                              layout=plgpu.Layout.WGMMA) + j * block
                tile[...] = jnp.where(rows < length, vt, jnp.zeros_like(vt))
                plgpu.commit_smem()

            acc = pv_step(acc, p16, v_smem.at[slot], bool(a_smem))
            issue(j + S)  # so slot j % S is free for block j + S
            return acc, m_new, l

        acc, m, l = lax.fori_loop(0, steps, kv_step, (acc, m, l))
        l = jnp.where(l > 0, l, 1.0)  # length 0: no block ran, acc is 0, the output zeros
        o_smem[...] = (acc / lax.broadcast_in_dim(l, acc.shape, [0])).astype(dt)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(0, 1)], o_g.at[pl.ds(0, 1), pl.ds(h * d, d)])
        plgpu.wait_smem_to_gmem(0)

    body.__name__ = "decode_attention_mgpu"
    scratch = [plgpu.SMEM((S, block, d), dt, transforms=transforms),
               plgpu.SMEM((S, block, d), dt, transforms=transforms),
               plgpu.Barrier(num_arrivals=1, num_barriers=S),
               plgpu.Barrier(num_arrivals=1, num_barriers=S),
               plgpu.SMEM((LEN_LANES,), jnp.int32), plgpu.SMEM((AROWS, d), dt)]
    if interpret:
        scratch += [plgpu.SMEM((AROWS, d), dt, transforms=transforms),
                    plgpu.SMEM((AROWS, block), dt, transforms=w_tile_transforms(block, dt))]
    return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((1, heads * d), dt),
                        scratch_types=scratch, grid=(heads,), grid_names=("h",),
                        interpret=interpret)


def decode_attention_mgpu(q, k, v, length, *, block=128, stages=2, interpret=False):
    """q [1, heads * head_dim] against k / v [capacity, heads, head_dim] (MHA), positions
    < length (an int32 scalar, may be traced); -> [1, heads * head_dim]. block: positions
    per K/V block (a multiple of 64 up to 256 dividing the capacity); stages: K/V blocks in
    flight. interpret: the CPU simulation (its wgmma takes A from SMEM, so q and P are
    staged there)."""
    check(q, k, v, block, stages, bool(interpret))
    n, heads, d = k.shape
    if interpret is True:
        interpret = plgpu.InterpretGPUParams()
    lanes = jnp.full((1, LEN_LANES), length, jnp.int32)
    return _build(n, heads, d, jnp.dtype(q.dtype), block, stages, interpret or None)(
        q, k, v, lanes)
