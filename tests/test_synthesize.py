"""`python -m convert.synthesize`: random-weight HF checkpoints at presets or custom shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from convert.load import load_checkpoint
from convert.safetensors_io import open_tensors
from convert.synthesize import main, synthesize
from ouro_jax.config import TINY_GQA
from ouro_jax.params import expected_hf_shapes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cli_custom_shape_loads(tmp_path):
    out = tmp_path / "ck"
    cmd = [sys.executable, "-m", "convert.synthesize", "--preset", "tiny-gqa", "--out", str(out),
           "--seed", "3", "--num-hidden-layers", "5", "--hidden-size", "40",
           "--num-attention-heads", "8", "--num-key-value-heads", "4", "--head-dim", "6",
           "--total-ut-steps", "3", "--vocab-size", "77", "--shard-mb", "0.02"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "wrote" in res.stdout
    cfg_json = json.loads((out / "config.json").read_text())
    assert cfg_json["num_hidden_layers"] == 5 and cfg_json["total_ut_steps"] == 3
    assert (out / "model.safetensors.index.json").exists()  # --shard-mb split it
    ck = load_checkpoint(out, "bf16")
    want = TINY_GQA.replace(num_hidden_layers=5, hidden_size=40, num_attention_heads=8,
                            num_key_value_heads=4, head_dim=6, total_ut_steps=3, vocab_size=77)
    assert ck.config == want
    assert len(ck.files) > 1
    assert ck.params.layers.q_proj.shape == (5, 8 * 6, 40)
    assert ck.params.embed_tokens.shape == (77, 40)


def test_seed_determinism_dtype_and_options(tmp_path):
    a = synthesize(str(tmp_path / "a"), "tiny-mqa", seed=7, dtype="bf16", gate_bias=2.5,
                   branch_scale=0.01)
    synthesize(str(tmp_path / "b"), "tiny-mqa", seed=7, dtype="bf16", gate_bias=2.5,
               branch_scale=0.01)
    synthesize(str(tmp_path / "c"), "tiny-mqa", seed=8, dtype="fp32")
    ta = open_tensors(tmp_path / "a" / "model.safetensors")
    tb = open_tensors(tmp_path / "b" / "model.safetensors")
    tc = open_tensors(tmp_path / "c" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in ta.items()} == expected_hf_shapes(a)
    for name in ta:
        assert ta[name].dtype == np.dtype(ml_dtypes.bfloat16)
        assert np.array_equal(ta[name].view(np.uint16), tb[name].view(np.uint16)), name
    assert tc["lm_head.weight"].dtype == np.float32
    # config.json's torch_dtype says what the file holds (the CLI's --dtype hint reads it)
    stored = {n: json.loads((tmp_path / n / "config.json").read_text())["torch_dtype"]
              for n in "ac"}
    assert stored == {"a": "bfloat16", "c": "float32"}
    assert not np.array_equal(ta["lm_head.weight"].astype(np.float32), tc["lm_head.weight"])
    assert np.all(ta["model.early_exit_gate.bias"].astype(np.float32) == 2.5)
    # branch_scale shrinks only the post-branch norms (..._2)
    assert np.abs(ta["model.layers.0.input_layernorm_2.weight"].astype(np.float32)).max() < 0.02
    assert np.abs(ta["model.layers.0.input_layernorm.weight"].astype(np.float32)).min() > 0.5


def test_bin_format(tmp_path):
    synthesize(str(tmp_path), "tiny-mha", fmt="bin")
    assert (tmp_path / "pytorch_model.bin").exists()
    assert load_checkpoint(tmp_path, "fp32").config.num_hidden_layers == 2


@pytest.mark.parametrize("argv,message", [
    (["--preset", "tiny-gqa", "--num-key-value-heads", "4"], "num_key_value_heads"),
    (["--preset", "tiny-gqa", "--head-dim", "7"], "head_dim"),
    (["--branch-scale", "nan"], "branch_scale must be a finite number"),
    (["--gate-bias", "inf"], "gate_bias must be a finite number"),
    (["--shard-mb", "-1"], "shard_mb must be a positive size"),
])
def test_cli_rejects_bad_shapes(tmp_path, capsys, argv, message):
    assert main(argv + ["--out", str(tmp_path / "m")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # nothing written


def test_cli_refuses_an_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["--out", str(tmp_path / "f")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
