"""Opt-in batch-1 decode on one persistent Mosaic GPU kernel per loop (session 27; slower:
113.7 against 205.0 tok/s on an H100, docs/performance.md): `Ouro(...,
persistent_layers=True)`, `--persistent-layers` in the CLI and benchmarks.decode.

A one-row decode step (native decode and the speculative draft at batch 1) runs each loop's
L decoder layers as one kernel, pallas_kernels.chain_mgpu with its attention stage: the
weight stream runs through every stage and layer boundary, and the decode attention (RoPE,
the K/V write into the paged planes, the cached positions) runs between qkv and o. After
the kernel, XLA adds the last layer's down branch into the residual and applies the final
norm, as run_loop does. Every other block (prefill chunks, verification, batches above one)
takes the ordinary path.

The kernel reads the projections in a tile-major layout made once when the engine is built
(`pack`): a second copy of the layer weights on the device (2.8 GB for the 1.4B model in
bf16), kept beside the ordinary layout that the other paths read.

Run on a GPU only at the 1.4B shapes (128 programs). The kernel's tiny-shape GPU tests, on
one to three programs, hang (session 27, not diagnosed; tests/test_chain_attention.py).

Numerics: every GEMV accumulates in fp32 and rounds once, as the engine's GEMVs; the
add_norm prologues round as model.rms_norm; the attention sums in another order than the
Triton kernel (within bf16 rounding, tests/test_chain_attention.py). Greedy tokens can
differ from the default path where two logits tie within that rounding.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# block_n, block_k, ring slots, and chain_mgpu's uniform / smem_a forms (process-wide:
# `benchmarks.decode --persistent-tiling`); the attention's K/V block and stages
TILING = dict(block_n=16, block_k=256, stages=12, uniform=False, smem_a=False)
ATTENTION_TILING = dict(block=64, stages=2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PersistentLayers:
    """The layers' weights as the persistent kernel reads them: w [L, tiles, block_n,
    block_k] (chain_layout.tile_weights of qkv, o, gate/up, down); norms: (the branch norm
    before qkv (the previous layer's post_attention_layernorm_2), input_layernorm,
    input_layernorm_2, post_attention_layernorm), each [L, D]; last_norm: the last layer's
    post_attention_layernorm_2 [D] (its down branch is added after the kernel)."""
    w: jax.Array
    norms: tuple
    last_norm: jax.Array
    block_n: int = dataclasses.field(metadata=dict(static=True), default=16)
    block_k: int = dataclasses.field(metadata=dict(static=True), default=256)
    stages: int = dataclasses.field(metadata=dict(static=True), default=12)
    uniform: bool = dataclasses.field(metadata=dict(static=True), default=False)
    smem_a: bool = dataclasses.field(metadata=dict(static=True), default=False)


def check_model(cfg, params) -> None:
    """ValueError naming what the persistent kernel cannot run."""
    lp = params.layers[0] if isinstance(params.layers, (tuple, list)) else None
    if lp is None or lp.qkv_proj is None or lp.gate_up_proj is None:
        raise ValueError("persistent_layers needs per-layer fused weights (fuse_projections)")
    if params.dtype != jnp.bfloat16:
        raise ValueError(f"persistent_layers runs bf16 weights (wgmma), got {params.dtype}")
    if cfg.head_dim not in (64, 128):
        raise ValueError(f"persistent_layers: head_dim={cfg.head_dim} must be 64 or 128")


def pack(cfg, params, tiling=None) -> PersistentLayers:
    """PersistentLayers from the engine's per-layer fused weights (made once)."""
    check_model(cfg, params)
    t = dict(TILING, **(tiling or {}))
    unknown = set(t) - set(TILING)
    if unknown:
        raise ValueError(f"persistent tiling: unknown keys {sorted(unknown)}; "
                         f"known: {sorted(TILING)}")
    try:
        from pallas_kernels.chain_mgpu import tile_weights
    except ImportError as e:  # jax 0.10's Mosaic GPU Pallas needs absl, and lacks pieces
        raise ValueError(f"persistent_layers needs Mosaic GPU Pallas (jax >= 0.11): {e}") \
            from e
    layers = params.layers
    stack = lambda name: jnp.stack([getattr(lp, name) for lp in layers])
    w = tile_weights((stack("qkv_proj"), stack("o_proj"), stack("gate_up_proj"),
                      stack("down_proj")), t["block_n"], t["block_k"])
    post2 = stack("post_attention_layernorm_2")
    norms = (jnp.roll(post2, 1, axis=0), stack("input_layernorm"), stack("input_layernorm_2"),
             stack("post_attention_layernorm"))  # layer 0's branch is zero: its norm unused
    return PersistentLayers(w=w, norms=norms, last_norm=post2[-1], **t)


def applies(params, h, attend) -> bool:
    """Whether this block's loop runs on the persistent kernel: packed weights, one row of
    one position, and an attention that gives the kernel its inputs."""
    return (getattr(params, "persistent", None) is not None and h.shape[:-1] == (1, 1)
            and hasattr(attend, "chain_attention"))


def run_loop(params, h, cos, sin, cfg, attend, state, loop):
    """model.run_loop for one row on the persistent kernel: (normed state, state)."""
    from ouro_jax.model import rms_norm
    from pallas_kernels.chain_mgpu import gemv_chain_mgpu, shapes_of_config
    p = params.persistent
    eps = cfg.rms_norm_eps
    att = attend.chain_attention(cos, sin, state, loop, **ATTENTION_TILING)
    outs = gemv_chain_mgpu(h.reshape(1, -1), p.w, shapes_of_config(cfg), norms=p.norms,
                           eps=eps, attention=att, block_n=p.block_n, block_k=p.block_k,
                           stages=p.stages, uniform=p.uniform, smem_a=p.smem_a,
                           interpret=jax.default_backend() != "gpu")
    down, x, kc, vc = outs[3], outs[5], outs[7], outs[8]
    x = x + rms_norm(down, p.last_norm, eps)  # the last layer's residual, as materialize
    return rms_norm(x, params.norm, eps).reshape(h.shape), (kc, vc, *state[2:])
