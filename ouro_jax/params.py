"""Parameter pytrees.

Weights keep the Hugging Face [out, in] layout, so loading a checkpoint is a plain copy (no
transpose pass over 2.8 GB); the model contracts over the last axis of both operands, which
XLA maps to a transposed GEMM at no cost. Per-layer weights are stacked on a leading layer
axis so one `lax.scan` body serves every layer (small programs, fast compiles).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from ouro_jax.config import OuroConfig


def _register(cls):
    fields = [f.name for f in dataclasses.fields(cls)]  # None-valued fields are empty subtrees
    return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])


@_register
@dataclasses.dataclass
class LayerParams:
    """All decoder layers' weights, stacked: every array has a leading [L] axis."""
    q_proj: jax.Array  # [L, H*hd, D]
    k_proj: jax.Array  # [L, KVH*hd, D]
    v_proj: jax.Array  # [L, KVH*hd, D]
    o_proj: jax.Array  # [L, D, H*hd]
    gate_proj: jax.Array  # [L, I, D]
    up_proj: jax.Array  # [L, I, D]
    down_proj: jax.Array  # [L, D, I]
    input_layernorm: jax.Array  # [L, D]
    input_layernorm_2: jax.Array  # [L, D]
    post_attention_layernorm: jax.Array  # [L, D]
    post_attention_layernorm_2: jax.Array  # [L, D]
    # Engine-only fused forms (see model.fuse_projections); when set, the separate
    # q/k/v and gate/up weights are None. One GEMM instead of three (two) per layer.
    qkv_proj: Optional[jax.Array] = None  # [(H + 2*KVH)*hd, D]
    gate_up_proj: Optional[jax.Array] = None  # [2*I, D]


@_register
@dataclasses.dataclass
class OuroParams:
    embed_tokens: jax.Array  # [V, D]
    layers: LayerParams
    norm: jax.Array  # [D]
    exit_gate_w: jax.Array  # [1, D]
    exit_gate_b: jax.Array  # [1]
    lm_head: jax.Array  # [V, D]
    # Engine-only: the layers in the persistent decode kernel's layout (ouro_jax.persistent,
    # Ouro(persistent_layers=True)); None otherwise.
    persistent: Optional[object] = None

    @property
    def dtype(self):
        return self.embed_tokens.dtype


# HF tensor name suffix within a layer -> LayerParams field; shape as a function of cfg.
LAYER_TENSORS = {
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "mlp.gate_proj.weight": "gate_proj",
    "mlp.up_proj.weight": "up_proj",
    "mlp.down_proj.weight": "down_proj",
    "input_layernorm.weight": "input_layernorm",
    "input_layernorm_2.weight": "input_layernorm_2",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "post_attention_layernorm_2.weight": "post_attention_layernorm_2",
}

# The engine's fused weights and the per-layer weights they concatenate, in order (rows).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}

GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "embed_tokens",
    "model.norm.weight": "norm",
    "model.early_exit_gate.weight": "exit_gate_w",
    "model.early_exit_gate.bias": "exit_gate_b",
    "lm_head.weight": "lm_head",
}


def layer_tensor_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    d, i = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {
        "q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
        "gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i),
        "input_layernorm": (d,), "input_layernorm_2": (d,),
        "post_attention_layernorm": (d,), "post_attention_layernorm_2": (d,),
    }


def global_tensor_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    v, d = cfg.vocab_size, cfg.hidden_size
    return {"embed_tokens": (v, d), "norm": (d,), "exit_gate_w": (1, d), "exit_gate_b": (1,),
            "lm_head": (v, d)}


def expected_hf_shapes(cfg: OuroConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name a complete HF Ouro checkpoint holds, with its shape."""
    out = {name: global_tensor_shapes(cfg)[field] for name, field in GLOBAL_TENSORS.items()}
    lshapes = layer_tensor_shapes(cfg)
    for layer in range(cfg.num_hidden_layers):
        for suffix, field in LAYER_TENSORS.items():
            out[f"model.layers.{layer}.{suffix}"] = lshapes[field]
    return out


def random_params_numpy(cfg: OuroConfig, seed: int = 0, dtype=np.float32,
                        branch_scale: float = 1.0, norm_jitter: float = 0.1) -> dict[str, np.ndarray]:
    """Random weights in HF names (numpy), the source of synthetic checkpoints.

    `branch_scale` multiplies the two post-branch norms (input_layernorm_2 and
    post_attention_layernorm_2). Values well below 1 shrink every residual update, so the
    later loops change the hidden state little and a shallow draft agrees with the full
    depth: the knob that sets speculative acceptance on random weights.
    `norm_jitter` is the spread of norm weights around 1. Use 0 with a small branch_scale:
    model.norm's weight multiplies the state once per loop, so jittered norm weights alone
    make the loops diverge and cap acceptance (HF initialises norm weights to exactly 1).
    """
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in expected_hf_shapes(cfg).items():
        if name.endswith(("norm.weight", "norm_2.weight")):
            scale = branch_scale if name.endswith("_2.weight") else 1.0
            arr = scale * (1.0 + norm_jitter * rng.standard_normal(shape, dtype=np.float32))
        elif name.endswith("early_exit_gate.bias"):
            arr = rng.standard_normal(shape, dtype=np.float32)
        else:
            fan_in = shape[-1]
            std = 1.0 if name.endswith("embed_tokens.weight") else fan_in ** -0.5
            arr = std * rng.standard_normal(shape, dtype=np.float32)
        out[name] = arr.astype(dtype)
    return out


def params_from_hf(tensors: dict[str, np.ndarray], cfg: OuroConfig, dtype,
                   times: Optional[dict] = None) -> OuroParams:
    """Stacks already-validated HF tensors (numpy) into an OuroParams on the default device.
    times: if given, times["put_s"] gets the seconds spent handing arrays to the device."""
    dtype = jnp.dtype(dtype)
    put = _Put(times)
    layers = {}
    for suffix, field in LAYER_TENSORS.items():
        stacked = np.stack([np.asarray(tensors[f"model.layers.{i}.{suffix}"])
                            for i in range(cfg.num_hidden_layers)])
        layers[field] = put(stacked.astype(dtype, copy=False), True)
    glob = {field: put(*_cast(tensors[name], dtype)) for name, field in GLOBAL_TENSORS.items()}
    return OuroParams(layers=LayerParams(**layers), **glob)


def _cast(a, dtype) -> tuple[np.ndarray, bool]:
    """(the tensor in `dtype`, whether that is a new array): a memmap stays a view."""
    src = np.asarray(a)
    out = src.astype(dtype, copy=False)
    return out, out is not src


def _default_device():
    """Where jax.device_put (no device given) puts: a Device, or a platform name when the
    default device is set by name. (Starts the backend if it is new.)"""
    d = jax.config.jax_default_device
    return jax.devices()[0] if d is None else d


def _default_platform() -> str:
    """The platform jax.device_put (no device given) puts on."""
    d = _default_device()
    return d if isinstance(d, str) else d.platform


# Off a CPU, weights go to the device through its pinned host memory, one tensor at a time
# (a copy into a pinned buffer, then a DMA), instead of jax.device_put's pageable path: the
# 1.4B model's 2.87 GB in 0.95-1.11 s against 1.46-1.53 s on one H100 (session 32,
# `benchmarks.load_put --ways put_each,put_pinned`, load_put_pinned_session32_h100.json);
# level on a second H100, whose pageable path was already that fast
# (load_put_pinned_engine_session32_h100.json). The same bytes either way; False: the
# pageable path. A pinned put that fails as it is issued (e.g. pinned memory exhausted)
# warns once and the load goes on through the pageable path (a failure reported later, at
# the load's block_until_ready, is raised). The staged weights are committed to the device
# (device_put with a sharding), the pageable ones not: the same for a one-device engine.
PINNED_STAGING = True


def _pinned_shardings():
    """(pinned host, device) shardings for the default device, or None where it has no
    pinned host memory (a CPU, a backend without memory kinds) or the default device is set
    by platform name only."""
    dev = _default_device()
    if isinstance(dev, str) or dev.platform == "cpu":
        return None
    try:
        kinds = {m.kind for m in dev.addressable_memories()}
    except Exception:  # noqa: BLE001 - a backend without the memories API
        return None
    if "pinned_host" not in kinds:
        return None
    S = jax.sharding.SingleDeviceSharding
    return S(dev, memory_kind="pinned_host"), S(dev)


class _Put:
    """Hands host arrays to the default device so that the result shares no memory with its
    source: on a CPU jax.device_put may keep a view of an aligned input, which for a
    memory-mapped tensor would make the weights change (or fault) when the file is
    rewritten, and for a caller's array when the caller changes it. There, arrays made here
    (casts, concatenations) are handed over as they are and anything else is copied first,
    explicitly. On a GPU the transfer copies into device memory, so that host copy (1.15 GB
    for the 1.4B model in bf16: o, down, the embeddings) would be a second pass over the
    mapped bytes for nothing, and is skipped; with PINNED_STAGING the bytes go through
    pinned host memory. Seconds spent go to times["put_s"]."""

    def __init__(self, times: Optional[dict] = None):
        self.times = times
        self.copy_views = _default_platform() == "cpu"
        self.staging = None if self.copy_views or not PINNED_STAGING else _pinned_shardings()
        if times is not None:
            times.setdefault("put_s", 0.0)

    def __call__(self, x: np.ndarray, made_here: bool) -> jax.Array:
        t = time.perf_counter()
        out = None
        if self.staging is not None:
            pinned, device = self.staging
            try:
                out = jax.device_put(jax.device_put(x, pinned), device)
            except (RuntimeError, ValueError) as e:  # e.g. pinned memory exhausted
                # the pageable path for this and later tensors (if the fault was not the
                # pinned memory's, it raises there again, as itself)
                warnings.warn(f"loading weights through pinned host memory failed ({e}); "
                              f"using jax.device_put's pageable path", RuntimeWarning)
                self.staging = None
        if out is None:
            out = jax.device_put(x if made_here or not self.copy_views else np.array(x))
        if self.times is not None:
            self.times["put_s"] += time.perf_counter() - t
        return out


def engine_params_from_hf(tensors: dict[str, np.ndarray], cfg: OuroConfig, dtype,
                          fuse: bool = True, times: Optional[dict] = None) -> OuroParams:
    """The engine's layout straight from validated HF tensors: one LayerParams per layer
    (what model.unstack_layers makes of stacked weights), with q/k/v and gate/up
    concatenated on the host when `fuse`. Same values as params_from_hf followed by
    unstack_layers, without the stacked copy and the device-side slicing and concatenation
    (1.4B bf16 on a 2-core CPU: 3.80 s -> 0.76 s, benchmarks.load_time; load_checkpoint's
    non-finite check, since session 29, adds 0.9-1.2 s there, load_check_session30_cpu.json).
    times: as params_from_hf's."""
    dtype = jnp.dtype(dtype)
    put = _Put(times)

    layers = []
    for i in range(cfg.num_hidden_layers):
        t = {field: _cast(tensors[f"model.layers.{i}.{suffix}"], dtype)
             for suffix, field in LAYER_TENSORS.items()}
        if fuse:
            for name, parts in FUSED.items():
                t[name] = (np.concatenate([t.pop(n)[0] for n in parts]), True)
        # the fused-away fields stay None, as unstack_layers(fuse=True) leaves them
        layers.append(LayerParams(**(dict.fromkeys(LAYER_TENSORS.values()) |
                                     {k: put(*v) for k, v in t.items()})))
    glob = {field: put(*_cast(tensors[name], dtype)) for name, field in GLOBAL_TENSORS.items()}
    return OuroParams(layers=tuple(layers), **glob)


def random_params(cfg: OuroConfig, seed: int = 0, dtype=jnp.bfloat16,
                  branch_scale: float = 1.0, norm_jitter: float = 0.1) -> OuroParams:
    """Random weights drawn on the device (same recipe as random_params_numpy, other draws):
    a 1.4B-shaped model in a second, for benchmarks that need no checkpoint file."""
    key = jax.random.PRNGKey(seed)
    lshapes, gshapes = layer_tensor_shapes(cfg), global_tensor_shapes(cfg)
    n = cfg.num_hidden_layers

    def draw(i, shape, kind):
        k = jax.random.fold_in(key, i)
        x = jax.random.normal(k, shape, jnp.float32)
        if kind == "norm":
            return (1.0 + norm_jitter * x).astype(dtype)
        if kind == "branch":
            return (branch_scale * (1.0 + norm_jitter * x)).astype(dtype)
        if kind == "embed":
            return x.astype(dtype)
        return (x * shape[-1] ** -0.5).astype(dtype)

    layers = {}
    for i, (field, shape) in enumerate(lshapes.items()):
        kind = ("branch" if field.endswith("_2") else "norm" if "norm" in field else "w")
        layers[field] = draw(i, (n, *shape), kind)
    glob = {field: draw(100 + i, shape, {"embed_tokens": "embed", "norm": "norm",
                                         "exit_gate_b": "embed"}.get(field, "w"))
            for i, (field, shape) in enumerate(gshapes.items())}
    return OuroParams(layers=LayerParams(**layers), **glob)
