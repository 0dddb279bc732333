"""The differential harness takes any torch module with the HF Ouro interface (so the official
modeling_ouro.py can be plugged in), and never runs a checkpoint's own code by default."""

from __future__ import annotations

import inspect
import json
import types

import numpy as np
import torch

from convert import diff_harness as H
from convert.save import save_checkpoint
from convert.torch_reference import OuroForCausalLM
from ouro_jax.config import TINY_MQA_ODD
from ouro_jax.params import params_from_hf, random_params_numpy

torch.set_num_threads(1)


class OfficialStyle(OuroForCausalLM):
    """Mimics the published model's interface quirks: config-derived exit defaults kept as
    attributes and read before the arguments (so weighted exit is only reachable with no
    threshold at all), an output object with only logits and past_key_values, and its own
    cache object passed back in."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.early_exit_step = None
        self.early_exit_threshold = cfg.early_exit_threshold

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=None, exit_at_step=None, exit_threshold=None,
                use_weighted_exit=False, **unused):
        step = exit_at_step if exit_at_step is not None else self.early_exit_step
        q = exit_threshold if exit_threshold is not None else self.early_exit_threshold
        kw = {}
        if step is not None:
            kw["exit_at_step"] = step
        elif q is not None:
            kw["exit_threshold"] = q
        elif use_weighted_exit:
            kw["use_weighted_exit"] = True
        out = super().forward(input_ids, attention_mask, position_ids,
                              past_key_values=past_key_values, use_cache=bool(use_cache), **kw)
        return types.SimpleNamespace(logits=out.logits, past_key_values=out.past_key_values)


def _pair(cls):
    cfg = TINY_MQA_ODD
    tensors = random_params_numpy(cfg, seed=4)
    model = cls(cfg)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()})
    return cfg, tensors, model.eval(), params_from_hf(tensors, cfg, np.float32)


def test_foreign_module_through_the_interface():
    cfg, _, model, params = _pair(OfficialStyle)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9))
    rep = H.compare_dense(model, params, cfg, ids)
    assert {f"logits/{m}" for m, _ in H.exit_modes(cfg)} <= set(rep.errors)
    assert all(rep.relative(k) <= 1e-5 for k in rep.errors), rep.errors
    assert model.early_exit_threshold == cfg.early_exit_threshold  # restored after weighted
    inc = H.compare_incremental(model, params, cfg, ids, prefill=4)
    assert all(inc.relative(k) <= 1e-5 for k in inc.errors), inc.errors


def test_weighted_mode_really_is_weighted():
    """Without clearing the official-style threshold attribute, 'weighted' would silently be
    the threshold exit; the harness must reach the weighted branch."""
    cfg, _, model, _ = _pair(OfficialStyle)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 6))
    weighted, _, _ = H.run_torch(model, ids, use_weighted_exit=True, use_cache=False)
    threshold, _, _ = H.run_torch(model, ids, use_cache=False)
    plain = OuroForCausalLM.forward(model, torch.as_tensor(ids), use_weighted_exit=True)
    assert torch.equal(weighted.logits, plain.logits)
    assert not torch.allclose(weighted.logits, threshold.logits)


def test_remote_code_is_opt_in(tmp_path):
    sig = inspect.signature(H.load_torch_model)
    assert sig.parameters["trust_remote_code"].default is False
    cfg = TINY_MQA_ODD
    save_checkpoint(random_params_numpy(cfg), cfg, tmp_path,
                    extra_config={"auto_map": {"AutoModelForCausalLM":
                                               "modeling_ouro.OuroForCausalLM"}})
    (tmp_path / "modeling_ouro.py").write_text("raise SystemExit('folder code ran')\n")
    model = H.load_torch_model(tmp_path, "bf16")  # the folder's code is never imported
    assert type(model) is OuroForCausalLM and model.dtype == torch.bfloat16


def test_cli_json(tmp_path, capsys):
    cfg = TINY_MQA_ODD
    save_checkpoint(random_params_numpy(cfg), cfg, tmp_path)
    assert H.main(["--checkpoint", str(tmp_path), "--seq", "8", "--prefill", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert max(report["dense"]["errors"].values()) < 1e-4
    assert "cached_vs_dense/logits" in report["incremental"]["errors"]
