"""Checkpoint loading: round trips through the PyTorch reference, every supported layout,
bf16 without an fp32 round trip, malformed checkpoints (each error lists the tensors and
nothing loads half-way), and `.bin` pickles that try to run code."""

from __future__ import annotations

import builtins
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import convert.load as load_mod
from convert.diff_harness import jax_forward
from convert.load import CheckpointError, load_checkpoint
from convert.safetensors_io import open_tensors
from convert.save import save_checkpoint
from convert.torch_reference import OuroForCausalLM, load_reference, torch_to_numpy
from ouro_jax import model as M
from ouro_jax.config import TINY_GQA, TINY_MQA_ODD
from ouro_jax.params import GLOBAL_TENSORS, LAYER_TENSORS, random_params_numpy

torch.set_num_threads(1)
BF16 = np.dtype(ml_dtypes.bfloat16)


def tensors_for(cfg, dtype=np.float32, seed=0):
    return {k: v.astype(dtype) for k, v in random_params_numpy(cfg, seed=seed).items()}


def param_views(params, cfg) -> dict[str, np.ndarray]:
    """The loaded pytree back under HF names, for comparisons with the file contents."""
    out = {name: np.asarray(getattr(params, field)) for name, field in GLOBAL_TENSORS.items()}
    for suffix, field in LAYER_TENSORS.items():
        stacked = np.asarray(getattr(params.layers, field))
        for i in range(cfg.num_hidden_layers):
            out[f"model.layers.{i}.{suffix}"] = stacked[i]
    return out


def assert_bits_equal(a: np.ndarray, b: np.ndarray, name=""):
    assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), name


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_reference_round_trip(tmp_path, dtype):
    """The reference writes an HF folder; we load it; logits agree (every loop's too)."""
    cfg = TINY_GQA
    t_dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    ref = OuroForCausalLM.from_numpy(cfg, tensors_for(cfg), t_dt)
    files = ref.save_pretrained(tmp_path)
    assert files == ["model.safetensors"]
    assert set(open_tensors(tmp_path / "model.safetensors")) == set(ref.state_dict())
    ck = load_checkpoint(tmp_path, dtype)
    assert ck.config == cfg
    # its seconds, by phase (read, convert and transfer, the non-finite check)
    assert set(ck.phases) == {"open_s", "backend_s", "convert_s", "put_s", "check_compile_s",
                             "transfer_wait_s", "check_finite_s"}
    assert min(ck.phases.values()) >= 0
    assert sum(ck.phases.values()) == pytest.approx(ck.seconds, rel=1e-6)
    for name, arr in param_views(ck.params, cfg).items():
        assert_bits_equal(arr, torch_to_numpy(ref.state_dict()[name]), name)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 12))
    # fp32 ~1e-6 observed; bf16 within the differential tests' bf16 bound (5e-2 relative).
    # Every loop's logits (exit_at_step): a bf16 threshold exit may pick a different loop for
    # a near-tie token, which test_model_vs_reference covers; here the weights are the point.
    tol = 1e-5 if dtype == "fp32" else 5e-2
    # (full fp32 dots: on a GPU XLA's default fp32 precision is TF32-class, ~5e-3 here)
    with jax.default_matmul_precision("highest"):
        hidden = jax_forward(ck.params, jnp.asarray(ids), cfg).hidden_states
        per_loop = M.loop_logits(ck.params, hidden)
    for step in range(cfg.total_ut_steps):
        ours = per_loop[step]
        theirs = ref(torch.as_tensor(ids), exit_at_step=step).logits.float()
        err = np.abs(np.asarray(ours, np.float32) - theirs.numpy()).max()
        assert err <= tol * theirs.abs().max().item(), (step, err)
    back = load_reference(tmp_path, t_dt)  # and the reference reads its own output back
    for name, t in ref.state_dict().items():
        assert torch.equal(back.state_dict()[name], t), name


def _layout_params(folder, cfg):
    ck = load_checkpoint(folder, "bf16")
    return ck, param_views(ck.params, cfg)


@pytest.mark.parametrize("fmt,shard", [("safetensors", True), ("bin", False), ("bin", True)])
def test_layouts_load_identically(tmp_path, fmt, shard):
    """Sharded safetensors, single and sharded .bin: same bits as single-file safetensors."""
    cfg = TINY_MQA_ODD
    tensors = tensors_for(cfg, BF16)
    save_checkpoint(tensors, cfg, tmp_path / "single")
    names = save_checkpoint(tensors, cfg, tmp_path / "x", fmt=fmt,
                            shard_bytes=4096 if shard else None)
    if shard:
        assert len(names) > 2
        stem = "model.safetensors" if fmt == "safetensors" else "pytorch_model.bin"
        index = json.loads((tmp_path / "x" / f"{stem}.index.json").read_text())
        assert set(index["weight_map"]) == set(tensors)
    else:
        assert names == ["pytorch_model.bin"]
    ck, got = _layout_params(tmp_path / "x", cfg)
    assert ck.files == names
    _, want = _layout_params(tmp_path / "single", cfg)
    for name in tensors:
        assert_bits_equal(got[name], want[name], name)
        assert_bits_equal(got[name], tensors[name], name)


@pytest.mark.parametrize("file_dtype,dtype", [(BF16, "bf16"), (np.float32, "bf16"),
                                              (np.float32, "fp32")])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_engine_layout_is_the_stacked_load_unstacked(tmp_path, fmt, file_dtype, dtype):
    """layout='engine' (what Ouro.load uses) gives, bit for bit and in the same pytree, what
    the stacked load followed by model.unstack_layers gives, fused or not; an unknown
    layout is refused."""
    cfg = TINY_MQA_ODD
    save_checkpoint(tensors_for(cfg, file_dtype), cfg, tmp_path, fmt=fmt)
    stacked = load_checkpoint(tmp_path, dtype).params
    for layout, fuse in (("engine", True), ("engine_unfused", False)):
        got = load_checkpoint(tmp_path, dtype, layout=layout).params
        want = M.unstack_layers(stacked, fuse=fuse)
        assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            assert_bits_equal(np.asarray(a), np.asarray(b), layout)
    with pytest.raises(ValueError, match="unknown layout 'rows'"):
        load_checkpoint(tmp_path, dtype, layout="rows")


@pytest.mark.parametrize("fuse", [True, False])
def test_ouro_load_builds_the_engine_layout_directly(monkeypatch, fuse):
    """Ouro.load never makes the stacked layout (no params_from_hf) and honours
    fuse_projections."""
    from engine_helpers import tiny_checkpoint
    from ouro_jax.api import Ouro

    def stacked(*a, **k):
        raise AssertionError("Ouro.load built the stacked layout")
    monkeypatch.setattr(load_mod, "params_from_hf", stacked)
    llm = Ouro.load(tiny_checkpoint("tiny-gqa"), "fp32", fuse_projections=fuse)
    assert isinstance(llm.params.layers, tuple)
    assert (llm.params.layers[0].qkv_proj is not None) == fuse
    assert (llm.params.layers[0].q_proj is None) == fuse


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_bf16_loads_as_bf16_without_fp32(tmp_path, fmt, monkeypatch):
    cfg = TINY_MQA_ODD
    tensors = tensors_for(cfg, BF16)
    save_checkpoint(tensors, cfg, tmp_path, fmt=fmt)
    seen = []
    real = load_mod.params_from_hf

    def spy(ts, cfg_, dtype, **kw):  # what the loader hands to the stacking step
        seen.extend(np.asarray(v).dtype for v in ts.values())
        return real(ts, cfg_, dtype, **kw)

    monkeypatch.setattr(load_mod, "params_from_hf", spy)
    ck = load_checkpoint(tmp_path, "bf16")
    assert seen and set(seen) == {BF16}, set(seen)  # never widened to fp32 on the way
    leaves = jax.tree_util.tree_leaves(ck.params)
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
    if fmt == "safetensors":  # bit equality with the bytes in the file
        on_disk = open_tensors(tmp_path / "model.safetensors")
        for name, arr in param_views(ck.params, cfg).items():
            assert_bits_equal(arr, np.asarray(on_disk[name]), name)


def test_fp32_file_loads_as_bf16_and_bf16_file_as_fp32(tmp_path):
    cfg = TINY_MQA_ODD
    tensors = tensors_for(cfg)
    save_checkpoint(tensors, cfg, tmp_path)
    got = param_views(load_checkpoint(tmp_path, "bf16").params, cfg)
    for name, arr in tensors.items():
        assert_bits_equal(got[name], arr.astype(BF16), name)  # round-to-nearest-even cast
    save_checkpoint({k: v.astype(BF16) for k, v in tensors.items()}, cfg, tmp_path / "b")
    got = param_views(load_checkpoint(tmp_path / "b", "fp32").params, cfg)
    for name, arr in tensors.items():
        assert_bits_equal(got[name], arr.astype(BF16).astype(np.float32), name)


# --- malformed checkpoints ------------------------------------------------------------------

def _malformed(cfg):
    """name -> (tensor dict, substrings the error must contain)."""
    base = tensors_for(cfg)
    missing = dict(base)
    del missing["model.layers.0.mlp.up_proj.weight"], missing["model.early_exit_gate.bias"]
    unexpected = dict(base, **{"model.layers.9.mlp.up_proj.weight": np.zeros((2, 2), np.float32),
                               "model.rotary_emb.inv_freq": np.zeros(4, np.float32)})
    misshapen = dict(base)
    misshapen["model.layers.0.self_attn.k_proj.weight"] = np.zeros((3, cfg.hidden_size),
                                                                   np.float32)
    misshapen["lm_head.weight"] = base["lm_head.weight"][:-1]
    nonfloat = dict(base, **{"model.norm.weight": np.ones(cfg.hidden_size, np.int32)})
    everything = dict(unexpected)
    del everything["model.norm.weight"]
    everything["model.layers.0.self_attn.q_proj.weight"] = np.zeros((1, 1), np.float32)
    return {
        "missing": (missing, ["2 missing", "model.layers.0.mlp.up_proj.weight",
                              "model.early_exit_gate.bias"]),
        "unexpected": (unexpected, ["2 unexpected", "model.layers.9.mlp.up_proj.weight",
                                    "model.rotary_emb.inv_freq"]),
        "misshapen": (misshapen, ["2 misshapen", "model.layers.0.self_attn.k_proj.weight: got "
                                  f"[3, {cfg.hidden_size}], expected [{cfg.num_key_value_heads * cfg.head_dim}, {cfg.hidden_size}]",
                                  "lm_head.weight"]),
        "nonfloat": (nonfloat, ["non-float", "model.norm.weight"]),
        "all-at-once": (everything, ["1 missing", "model.norm.weight", "2 unexpected",
                                     "1 misshapen", "model.layers.0.self_attn.q_proj.weight"]),
    }


@pytest.mark.parametrize("case", ["missing", "unexpected", "misshapen", "nonfloat",
                                  "all-at-once"])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_malformed_checkpoint_errors(tmp_path, monkeypatch, case, fmt):
    cfg = TINY_MQA_ODD
    tensors, expected = _malformed(cfg)[case]
    save_checkpoint(tensors, cfg, tmp_path, fmt=fmt, shard_bytes=8192)

    def must_not_run(*a, **k):  # validation comes before any stacking or device transfer
        raise AssertionError("params were built from a malformed checkpoint")

    monkeypatch.setattr(load_mod, "params_from_hf", must_not_run)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    for text in expected:
        assert text in str(err.value), (text, str(err.value))
    with pytest.raises(CheckpointError) as err2:  # the reference applies the same checks
        load_reference(tmp_path)
    assert str(err2.value) == str(err.value)


def test_shard_problems(tmp_path):
    cfg = TINY_MQA_ODD
    tensors = tensors_for(cfg)
    names = save_checkpoint(tensors, cfg, tmp_path, shard_bytes=8192)
    os.remove(tmp_path / names[-1])
    with pytest.raises(CheckpointError, match=names[-1]):
        load_checkpoint(tmp_path)
    # one tensor stored in two shards
    dup = tmp_path / "dup"
    names = save_checkpoint(tensors, cfg, dup, shard_bytes=8192)
    extra = {"model.norm.weight": tensors["model.norm.weight"],
             "model.extra.marker": tensors["model.norm.weight"]}  # what the index names
    save_checkpoint(extra, cfg, dup / "tmp")
    os.replace(dup / "tmp" / "model.safetensors", dup / "model-extra.safetensors")
    index_path = dup / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["model.extra.marker"] = "model-extra.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model.norm.weight appears in more than one"):
        load_checkpoint(dup)


class Payload:
    """An arbitrary class: unpickling it would run __reduce__'s callable."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (builtins.exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


class PlainObject:
    pass


@pytest.mark.parametrize("payload", ["exec", "class"])
def test_bin_with_code_is_refused(tmp_path, payload):
    cfg = TINY_MQA_ODD
    save_checkpoint(tensors_for(cfg), cfg, tmp_path, fmt="bin")
    marker = tmp_path / "pwned"
    state = {k: torch.from_numpy(v) for k, v in tensors_for(cfg).items()}
    state["model.norm.weight"] = Payload(marker) if payload == "exec" else PlainObject()
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refused to load"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="refused to load"):
        load_reference(tmp_path)
    assert not marker.exists()
    if payload == "exec":  # the payload is live: a plain torch.load would have run it
        torch.load(tmp_path / "pytorch_model.bin", weights_only=False)
        assert marker.read_text() == "pwned"


def test_missing_pieces(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere")
    cfg = TINY_MQA_ODD
    save_checkpoint(tensors_for(cfg), cfg, tmp_path)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="no weights in"):
        load_checkpoint(tmp_path)
    save_checkpoint(tensors_for(cfg), cfg, tmp_path)
    os.remove(tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_checkpoint(tmp_path, "fp16")
