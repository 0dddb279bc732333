"""Ouro model configuration: a frozen, hashable dataclass usable as a jit static argument.

`OuroConfig.from_hf_dict` reads a Hugging Face `config.json` and rejects every feature the
engine does not implement, naming the field, so a checkpoint is never run with silently
different math.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import Any

# Keys of HF Ouro configs that carry no model math (bookkeeping, generation defaults,
# tokenizer ids handled elsewhere). Anything not listed here or in the handled fields is
# rejected as unknown, so new upstream features cannot slip through unnoticed.
_IGNORED_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype",
    "use_cache", "initializer_range", "pad_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "_name_or_path", "tokenizer_class",
    "attention_dropout", "hidden_dropout", "decoder_sparse_step", "max_window_layers",
    "bos_token_id", "eos_token_id", "tie_word_embeddings", "use_sliding_window",
    "sliding_window", "rope_scaling", "hidden_act", "attention_bias", "mlp_bias",
    "layer_types", "head_dim", "num_key_value_heads", "early_exit_step",
})


class ConfigError(ValueError):
    """A checkpoint config asks for something this engine does not implement."""


@dataclasses.dataclass(frozen=True)
class OuroConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    total_ut_steps: int = 4
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 65536
    rms_norm_eps: float = 1e-6
    early_exit_threshold: float = 1.0
    bos_token_id: int = 0
    eos_token_id: int = 0
    # Further end-of-sequence ids (HF allows eos_token_id to be a list; every id stops).
    extra_eos_token_ids: tuple = ()
    tie_word_embeddings: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "total_ut_steps",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        # a string or bool would fail deep in the model; rope_theta <= 0 gives NaN or inf
        # rotary frequencies, a negative eps NaN norms
        for name, ok, rule in (("rope_theta", lambda v: v > 0, "> 0"),
                               ("rms_norm_eps", lambda v: v >= 0, ">= 0"),
                               ("early_exit_threshold", lambda v: 0 <= v <= 1, "in [0, 1]")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value) or not ok(value):
                raise ConfigError(f"{name} must be a finite number {rule}, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.tie_word_embeddings:
            raise ConfigError("tie_word_embeddings=true is not supported: Ouro has an untied lm_head")
        for eos in self.eos_token_ids:  # an id outside the vocabulary could never stop a request
            if isinstance(eos, bool) or not isinstance(eos, numbers.Integral):
                raise ConfigError(f"eos_token_id must be an integer token id, got {eos!r}")
            if not 0 <= eos < self.vocab_size:
                raise ConfigError(f"eos_token_id {int(eos)} is not a token id below vocab_size "
                                  f"{self.vocab_size}")
        object.__setattr__(self, "eos_token_id", int(self.eos_token_id))
        object.__setattr__(self, "extra_eos_token_ids",
                           tuple(int(e) for e in self.extra_eos_token_ids))

    # --- derived sizes -------------------------------------------------------------------
    @property
    def num_loops(self) -> int:
        return self.total_ut_steps

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def kv_entries(self) -> int:
        """K/V planes per token: one per (loop, layer), entry index ut * L + l."""
        return self.total_ut_steps * self.num_hidden_layers

    def num_params(self) -> int:
        h, i, l, v = (self.hidden_size, self.intermediate_size, self.num_hidden_layers,
                      self.vocab_size)
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 4 * h
        return 2 * v * h + l * per_layer + h + h + 1

    # --- (de)serialisation ---------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "OuroConfig":
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, got {type(d).__name__}")
        _reject_unsupported(d)
        unknown = sorted(k for k in d if k not in _IGNORED_KEYS and k not in _FIELD_NAMES)
        if unknown:
            raise ConfigError(f"unsupported config field(s): {', '.join(unknown)}")
        try:
            kwargs = dict(
                vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing required field {e.args[0]!r}") from None
        # absent (or null) means the HF default; a given 0 is an error, not "absent"
        kv, hd = d.get("num_key_value_heads"), d.get("head_dim")
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"] if kv is None else kv
        if hd is None:
            heads, hidden = kwargs["num_attention_heads"], kwargs["hidden_size"]
            fine = all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                       for v in (heads, hidden))
            hd = hidden // heads if fine else 1  # (a bad size is named below)
        kwargs["head_dim"] = hd
        if d.get("early_exit_step") is not None:
            raise ConfigError(
                f"early_exit_step={d['early_exit_step']!r} is not supported (the reference "
                f"reads it to pick the loop whose logits it uses): set it to null and pass "
                f"exit_at_step / --exit-at-step instead")
        for name in ("total_ut_steps", "rope_theta", "max_position_embeddings", "rms_norm_eps",
                     "early_exit_threshold", "bos_token_id", "tie_word_embeddings"):
            if d.get(name) is not None:
                kwargs[name] = d[name]
        eos = d.get("eos_token_id", 0)  # absent: Ouro's own id, 0
        if isinstance(eos, list):  # HF allows a list: the first is canonical, all of them stop
            kwargs["extra_eos_token_ids"] = tuple(eos[1:])
            eos = eos[0] if eos else None
        if eos is None:  # given as null or []: not silently id 0
            raise ConfigError(f"eos_token_id is {d['eos_token_id']!r} in config.json, where "
                              f"this engine reads the end-of-sequence id: set it there "
                              f"(Ouro's is 0)")
        kwargs["eos_token_id"] = eos
        return cls(**kwargs)

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "OuroConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"no config.json at {path}")
        with open(path) as f:
            try:
                d = json.load(f)
            except ValueError as e:
                raise ConfigError(f"{path} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)

    @property
    def eos_token_ids(self) -> tuple:
        return (self.eos_token_id, *self.extra_eos_token_ids)

    def to_hf_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        extra = d.pop("extra_eos_token_ids")
        if extra:
            d["eos_token_id"] = [self.eos_token_id, *extra]
        d.update(
            architectures=["OuroForCausalLM"], model_type="ouro", hidden_act="silu",
            rope_scaling=None, use_sliding_window=False, sliding_window=None,
            attention_bias=False, torch_dtype="bfloat16",
        )
        return d

    def replace(self, **kw) -> "OuroConfig":
        return dataclasses.replace(self, **kw)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(OuroConfig))


def _reject_unsupported(d: dict[str, Any]) -> None:
    # JSON booleans only: a string such as "false" would read as true below
    for key in ("attention_bias", "mlp_bias", "tie_word_embeddings", "use_sliding_window"):
        if d.get(key) is not None and not isinstance(d[key], bool):
            raise ConfigError(f"{key} must be true or false, got {d[key]!r}")
    layer_types = d.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list)
                                    or not all(isinstance(t, str) for t in layer_types)):
        raise ConfigError(f"layer_types must be a list of strings, got {layer_types!r}")
    if d.get("rope_scaling") not in (None, {}):
        raise ConfigError(f"rope_scaling={d['rope_scaling']!r} is not supported (only null)")
    if d.get("use_sliding_window") or (d.get("sliding_window") not in (None, 0)
                                        and d.get("use_sliding_window") is not False):
        raise ConfigError(
            f"sliding window attention is not supported (sliding_window="
            f"{d.get('sliding_window')!r}, use_sliding_window={d.get('use_sliding_window')!r})")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"layer_types other than full_attention are not supported: "
                          f"{sorted(set(layer_types))}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not supported (only silu)")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ConfigError(f"{key}=true is not supported (Ouro projections have no bias)")
    if d.get("model_type") not in (None, "ouro"):
        raise ConfigError(f"model_type={d['model_type']!r} is not an Ouro model")


# --- presets ---------------------------------------------------------------------------
OURO_1_4B = OuroConfig(vocab_size=49152, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                       head_dim=128)
OURO_2_6B = OURO_1_4B.replace(num_hidden_layers=48)

# Tiny configs for tests: GQA, MHA, an odd layer count, a non-default loop count.
TINY_MHA = OuroConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                      max_position_embeddings=512)
TINY_GQA = OuroConfig(vocab_size=101, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=512, rope_theta=10_000.0)
TINY_MQA_ODD = OuroConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=1,
                          head_dim=16, max_position_embeddings=512, total_ut_steps=4)

PRESETS = {"1.4b": OURO_1_4B, "2.6b": OURO_2_6B, "tiny-mha": TINY_MHA, "tiny-gqa": TINY_GQA,
           "tiny-mqa": TINY_MQA_ODD}
TINY_CONFIGS = {"tiny-mha": TINY_MHA, "tiny-gqa": TINY_GQA, "tiny-mqa": TINY_MQA_ODD}
