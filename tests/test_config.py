"""OuroConfig: reading real HF config.json dicts, rejecting what the engine does not
implement (the message names the field), presets and derived sizes."""

from __future__ import annotations

import json

import pytest

from ouro_jax.config import (OURO_1_4B, OURO_2_6B, PRESETS, TINY_CONFIGS, ConfigError,
                             OuroConfig)


def ouro_1_4b_config_json() -> dict:
    """What the published Ouro-1.4B config.json holds (Qwen2-style keys plus the loop ones)."""
    return {
        "architectures": ["OuroForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig",
                     "AutoModel": "modeling_ouro.OuroModel",
                     "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
        "bos_token_id": 0,
        "eos_token_id": 0,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 5632,
        "layer_types": ["full_attention"] * 24,
        "max_position_embeddings": 65536,
        "max_window_layers": 24,
        "model_type": "ouro",
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "num_key_value_heads": 16,
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "total_ut_steps": 4,
        "early_exit_threshold": 1.0,
        "transformers_version": "4.54.1",
        "use_cache": True,
        "vocab_size": 49152,
    }


def test_real_1_4b_config_matches_preset(tmp_path):
    d = ouro_1_4b_config_json()
    assert OuroConfig.from_hf_dict(d) == OURO_1_4B
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert OuroConfig.from_json(tmp_path) == OURO_1_4B  # folder or file path
    assert OuroConfig.from_json(tmp_path / "config.json") == OURO_1_4B


def test_real_2_6b_config_matches_preset():
    d = ouro_1_4b_config_json()
    d.update(num_hidden_layers=48, max_window_layers=48, layer_types=["full_attention"] * 48,
             eos_token_id=2)
    cfg = OuroConfig.from_hf_dict(d)
    assert cfg == OURO_2_6B.replace(eos_token_id=2)


def test_optional_fields_and_defaults():
    d = ouro_1_4b_config_json()
    for key in ("head_dim", "num_key_value_heads", "total_ut_steps", "early_exit_threshold",
                "layer_types"):
        del d[key]
    d["eos_token_id"] = [2, 0]  # HF allows a list; the first one is canonical
    cfg = OuroConfig.from_hf_dict(d)
    assert cfg.head_dim == 2048 // 16 and cfg.num_key_value_heads == 16
    assert cfg.total_ut_steps == 4 and cfg.early_exit_threshold == 1.0
    assert cfg.eos_token_id == 2
    assert OuroConfig.from_hf_dict(dict(d, early_exit_threshold=0.7)).early_exit_threshold == 0.7


@pytest.mark.parametrize("change,field", [
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"layer_types": ["sliding_attention"] * 24}, "layer_types"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "llama"}, "model_type"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"early_exit_threshold": 1.5}, "early_exit_threshold"),
    ({"num_key_value_heads": 6}, "num_key_value_heads"),
    ({"head_dim": 127}, "head_dim"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"some_new_feature": 1}, "some_new_feature"),
    ({"use_mla": True, "qk_norm": True}, "qk_norm, use_mla"),
    # values that used to load and then give NaN logits (EOS 0 at once) or a traceback
    ({"rope_theta": 0}, "rope_theta"), ({"rope_theta": -10000.0}, "rope_theta"),
    ({"rope_theta": float("nan")}, "rope_theta"), ({"rope_theta": "abc"}, "rope_theta"),
    ({"rms_norm_eps": -1.0}, "rms_norm_eps"), ({"rms_norm_eps": "1e-6"}, "rms_norm_eps"),
    ({"early_exit_threshold": "0.5"}, "early_exit_threshold"),
    ({"total_ut_steps": True}, "total_ut_steps"), ({"vocab_size": True}, "vocab_size"),
    ({"head_dim": 0}, "head_dim"), ({"num_key_value_heads": 0}, "num_key_value_heads"),
    ({"early_exit_step": 0}, "early_exit_step"),
    ({"eos_token_id": None}, "eos_token_id"), ({"eos_token_id": []}, "eos_token_id"),
    ({"hidden_size": "2048", "head_dim": None}, "hidden_size"),
    # the wrong JSON type: a traceback, or a message about another value, before
    ({"layer_types": 5}, "layer_types must be a list"),
    ({"layer_types": "full_attention"}, "layer_types must be a list"),
    ({"attention_bias": "false"}, "attention_bias must be true or false"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false"),
    ({"use_sliding_window": 0}, "use_sliding_window must be true or false"),
])
def test_rejections_name_the_field(change, field):
    d = dict(ouro_1_4b_config_json(), **change)
    with pytest.raises(ConfigError, match=field):
        OuroConfig.from_hf_dict(d)


def test_gqa_divisibility_message():
    d = dict(ouro_1_4b_config_json(), num_key_value_heads=6)
    with pytest.raises(ConfigError) as err:
        OuroConfig.from_hf_dict(d)
    assert "num_attention_heads (16)" in str(err.value)
    assert "num_key_value_heads (6)" in str(err.value)
    assert OuroConfig.from_hf_dict(dict(d, num_key_value_heads=4)).q_per_kv == 4


def test_missing_required_field():
    d = ouro_1_4b_config_json()
    del d["intermediate_size"]
    with pytest.raises(ConfigError, match="intermediate_size"):
        OuroConfig.from_hf_dict(d)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        OuroConfig.from_json(tmp_path)


def test_parameter_counts():
    # OURO.md: about 1.435B and 2.668B parameters.
    assert OURO_1_4B.num_params() == pytest.approx(1.435e9, rel=1e-3)
    assert OURO_2_6B.num_params() == pytest.approx(2.668e9, rel=1e-3)
    assert OURO_1_4B.kv_entries == 96
    # bf16 K/V per token per loop: 2 * 24 layers * 16 heads * 128 * 2 B = 196,608 B
    c = OURO_1_4B
    assert 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2 == 196_608


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hf_dict(name):
    cfg = PRESETS[name]
    assert OuroConfig.from_hf_dict(json.loads(json.dumps(cfg.to_hf_dict()))) == cfg
    hash(cfg)  # usable as a jit static argument


def test_tiny_configs_cover_gqa_and_odd_layers():
    cfgs = TINY_CONFIGS.values()
    assert any(c.num_key_value_heads < c.num_attention_heads for c in cfgs)
    assert any(c.num_key_value_heads == c.num_attention_heads for c in cfgs)
    assert any(c.num_hidden_layers % 2 == 1 for c in cfgs)
