"""An eager PyTorch Ouro, written from the math in ../shared/OURO.md, for differential tests.

It is deliberately plain (no fused kernels, no compile) and independent of the JAX code: the
only things shared with `ouro_jax` are the config dataclass and the checkpoint file readers.
Module names follow the Hugging Face checkpoint, so `state_dict()` keys are exactly the HF
weight names, and `OuroForCausalLM.forward` takes the HF call signature (input_ids,
attention_mask, position_ids, past_key_values, use_cache, exit_at_step, exit_threshold,
use_weighted_exit); the differential harness relies only on that interface and on the
`model.norm` / `model.early_exit_gate` submodules being called once per loop.

Numerics, in the model dtype unless stated:
- RMSNorm statistics in fp32, cast back, then `* weight`.
- RoPE inverse frequencies and angles in fp32; cos/sin cast to the activation dtype.
- Attention scores are a matmul in the activation dtype (what an eager torch matmul returns),
  scaled, then softmax in fp32 and cast back before the PV product.
- Exit gate: `nn.Linear` (dot and bias rounded once), sigmoid and the remaining-probability
  products op by op in the model dtype; the cumulative sum accumulated in fp32 and rounded per
  step (what torch.cumsum does for bf16); `cdf >= threshold` with the threshold cast to the
  model dtype (what torch does comparing to a Python float); the last loop is the fallback.
- Weighted exit: sum_t p_t * logits_t accumulated in fp32, cast once (as ouro_jax.model).

KV cache: one (K, V) per (loop, layer), T*L entries, entry index `ut * L + l`; keys after RoPE.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import ml_dtypes
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ouro_jax.config import OuroConfig

# --- layers ------------------------------------------------------------------------------


class OuroRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype):
    """cos, sin [B, S, head_dim] for integer positions [B, S]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class LoopKVCache:
    """Per-(loop, layer) K/V: `keys[ut * L + l]` is [B, KVH, S_past, hd], grown by concat."""

    def __init__(self, num_entries: int):
        self.keys: list[Optional[torch.Tensor]] = [None] * num_entries
        self.values: list[Optional[torch.Tensor]] = [None] * num_entries

    def __len__(self) -> int:
        return len(self.keys)

    def get_seq_length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def update(self, index: int, k: torch.Tensor, v: torch.Tensor):
        if self.keys[index] is not None:
            k = torch.cat([self.keys[index], k], dim=2)
            v = torch.cat([self.values[index], v], dim=2)
        self.keys[index], self.values[index] = k, v
        return k, v


class OuroAttention(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)

    def forward(self, x, cos, sin, mask, cache: Optional[LoopKVCache], cache_index: int):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.nkv, self.hd).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(cache_index, k, v)
        group = self.nh // self.nkv  # query head i reads kv head i // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (self.hd ** -0.5)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        probs = torch.where(mask.any(-1, keepdim=True), probs, 0.0)  # fully masked (padding) rows
        out = torch.matmul(probs.to(q.dtype), v)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.nh * self.hd))


class OuroMLP(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroDecoderLayer(nn.Module):
    """Sandwich norm: h = x + n2(attn(n1(x))); out = h + n4(mlp(n3(h)))."""

    def __init__(self, cfg: OuroConfig):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = OuroAttention(cfg)
        self.mlp = OuroMLP(cfg)
        self.input_layernorm = OuroRMSNorm(cfg.hidden_size, eps)
        self.input_layernorm_2 = OuroRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = OuroRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm_2 = OuroRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, cos, sin, mask, cache, cache_index):
        a = self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, cache_index)
        h = x + self.input_layernorm_2(a)
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class OuroModel(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = OuroRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1)

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        """Returns (per-loop normed hidden states, per-loop gate logits [B, S])."""
        cfg = self.config
        h = self.embed_tokens(input_ids)
        b, s = input_ids.shape
        past = 0 if cache is None else cache.get_seq_length()
        if position_ids is None:
            position_ids = torch.arange(past, past + s).expand(b, s)
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, h.dtype)
        # key j (cache order) is visible to query i iff j <= past + i, and not masked out.
        mask = torch.arange(past + s)[None, :] <= (past + torch.arange(s))[:, None]
        mask = mask[None].expand(b, s, past + s)
        if attention_mask is not None:
            if attention_mask.shape != (b, past + s):
                raise ValueError(f"attention_mask must be [B, past + S] = {[b, past + s]}, "
                                 f"got {list(attention_mask.shape)}")
            mask = mask & attention_mask.bool()[:, None, :]
        mask = mask[:, None]  # [B, 1, S, S_k]
        hidden, gates = [], []
        n_layers = len(self.layers)
        for ut in range(cfg.total_ut_steps):
            for li, layer in enumerate(self.layers):
                h = layer(h, cos, sin, mask, cache, ut * n_layers + li)
            h = self.norm(h)  # model.norm is inside the loop: the next loop's input
            hidden.append(h)
            gates.append(self.early_exit_gate(h)[..., 0])
        return hidden, gates


# --- exit selection ----------------------------------------------------------------------


def exit_probabilities(gate_logits: torch.Tensor) -> torch.Tensor:
    """p [T, ...] from gate logits [T, ...], op by op in their dtype; last loop = remainder."""
    lam = torch.sigmoid(gate_logits)
    remaining = torch.ones_like(lam[0])
    probs = []
    for t in range(lam.shape[0]):
        if t < lam.shape[0] - 1:
            probs.append(lam[t] * remaining)
            remaining = remaining * (1 - lam[t])
        else:
            probs.append(remaining)
    return torch.stack(probs)


def threshold_exit_steps(probs: torch.Tensor, threshold: float) -> torch.Tensor:
    """First loop with cumulative exit probability >= threshold, else the last loop."""
    cdf = torch.cumsum(probs.float(), dim=0).to(probs.dtype)
    reached = cdf >= torch.tensor(threshold, dtype=cdf.dtype)
    reached[-1] = True
    return torch.argmax(reached.to(torch.int8), dim=0)  # first maximum = first True


@dataclasses.dataclass
class OuroOutput:
    logits: torch.Tensor  # [B, S, V] under the exit mode
    hidden_states: tuple  # per loop, [B, S, D] (normed)
    gate_logits: torch.Tensor  # [T, B, S]
    exit_probs: torch.Tensor  # [T, B, S]
    exit_steps: torch.Tensor  # [B, S]
    past_key_values: Optional[LoopKVCache] = None


class OuroForCausalLM(nn.Module):
    def __init__(self, cfg: OuroConfig):
        super().__init__()
        self.config = cfg
        self.model = OuroModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @torch.no_grad()
    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, exit_at_step=None, exit_threshold=None,
                use_weighted_exit=False) -> OuroOutput:
        cfg = self.config
        n = cfg.total_ut_steps
        if exit_at_step is not None and not 0 <= exit_at_step < n:
            raise ValueError(f"exit_at_step={exit_at_step} is outside 0..{n - 1}")
        if exit_threshold is not None and not 0.0 <= exit_threshold <= 1.0:
            raise ValueError(f"exit threshold {exit_threshold} is outside [0, 1]")
        input_ids = torch.as_tensor(input_ids)
        cache = past_key_values
        if cache is None and use_cache:
            cache = LoopKVCache(n * cfg.num_hidden_layers)
        if cache is not None and len(cache) != n * cfg.num_hidden_layers:
            raise ValueError(f"cache has {len(cache)} entries, expected T*L = "
                             f"{n * cfg.num_hidden_layers}")
        hidden, gates = self.model(input_ids, attention_mask, position_ids, cache)
        gate_logits = torch.stack(gates)
        probs = exit_probabilities(gate_logits)
        b, s = input_ids.shape
        if exit_at_step is not None:  # priority 1: a fixed loop
            steps = torch.full((b, s), exit_at_step, dtype=torch.long)
            logits = self.lm_head(hidden[exit_at_step])
        elif use_weighted_exit and exit_threshold is None:  # mirrors ouro_jax ExitSpec.mode()
            steps = torch.full((b, s), n - 1, dtype=torch.long)
            logits = sum(probs[t][..., None].float() * self.lm_head(hidden[t]).float()
                         for t in range(n)).to(self.dtype)
        else:  # per-token threshold exit, default from the config
            q = cfg.early_exit_threshold if exit_threshold is None else exit_threshold
            steps = threshold_exit_steps(probs, q)
            stacked = torch.stack(hidden)  # [T, B, S, D]
            chosen = torch.gather(stacked, 0, steps[None, ..., None].expand(1, b, s,
                                                                             stacked.shape[-1]))[0]
            logits = self.lm_head(chosen)
        return OuroOutput(logits, tuple(hidden), gate_logits, probs, steps,
                          cache if use_cache or past_key_values is not None else None)

    # --- checkpoints -----------------------------------------------------------------------
    @classmethod
    def from_numpy(cls, cfg: OuroConfig, tensors: dict, dtype=torch.float32) -> "OuroForCausalLM":
        """A model holding the given HF-named numpy tensors (fp32 or ml_dtypes bf16), in dtype."""
        model = cls(cfg)
        state = {name: numpy_to_torch(arr).to(dtype) for name, arr in tensors.items()}
        model.load_state_dict(state, strict=True)
        return model.to(dtype).eval()

    @classmethod
    def from_pretrained(cls, folder, dtype=torch.float32) -> "OuroForCausalLM":
        return load_reference(folder, dtype)

    def save_pretrained(self, folder, fmt="safetensors", shard_bytes=None) -> list[str]:
        return save_reference(self, folder, fmt=fmt, shard_bytes=shard_bytes)


# --- checkpoint I/O ----------------------------------------------------------------------

_BF16 = np.dtype(ml_dtypes.bfloat16)


def numpy_to_torch(arr: np.ndarray) -> torch.Tensor:
    """Bit-exact copy; numpy has no native bf16, so bf16 goes through an int16 view."""
    arr = np.array(arr)  # owns writable memory (checkpoint views are read-only memmaps)
    if arr.dtype == _BF16:
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def torch_to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().copy().view(_BF16)
    return t.numpy().copy()


def load_reference(folder, dtype=torch.float32) -> OuroForCausalLM:
    """Reads an HF Ouro folder with the same readers and checks as convert.load."""
    from convert.load import (CheckpointError, _read_bin, _read_safetensors, _weight_files,
                              validate_tensors)

    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    cfg = OuroConfig.from_json(folder)
    kind, files = _weight_files(folder)
    tensors, meta = (_read_safetensors if kind == "safetensors" else _read_bin)(folder, files)
    validate_tensors(meta, cfg)
    return OuroForCausalLM.from_numpy(cfg, tensors, dtype)


def save_reference(model: OuroForCausalLM, folder, fmt="safetensors",
                   shard_bytes=None) -> list[str]:
    """Writes config.json and the weights (in the model's dtype) under the HF names."""
    from convert.save import save_checkpoint

    tensors = {name: torch_to_numpy(t) for name, t in model.state_dict().items()}
    return save_checkpoint(tensors, model.config, folder, fmt=fmt, shard_bytes=shard_bytes)
