"""Differential harness: a PyTorch Ouro (any module with the HF interface) against our JAX
`forward_dense`, per loop and per exit mode.

The torch side is only used through the Hugging Face interface:
- `model(input_ids=..., use_cache=..., past_key_values=..., exit_at_step=..., exit_threshold=...,
  use_weighted_exit=...)` returns an object with `.logits` and (with a cache) `.past_key_values`;
- the submodules `model.norm` and `model.early_exit_gate` run once per loop, in order, so forward
  hooks on them record every loop's normed hidden state and gate logit.
Our `convert.torch_reference.OuroForCausalLM` satisfies it, and so does the official
`modeling_ouro.py` loaded with `trust_remote_code` -- which runs code shipped in a checkpoint
folder, so it only happens with the explicit `trust_remote_code=True` / `--trust-remote-code`.

    python -m convert.diff_harness --checkpoint DIR --dtype bf16 [--trust-remote-code]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from convert.torch_reference import exit_probabilities, load_reference, threshold_exit_steps
from ouro_jax.config import OuroConfig
from ouro_jax.model import ExitSpec, forward_dense, select_exit

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# One compile per (config, dtype, shape), shared by the dense and incremental comparisons.
jax_forward = jax.jit(forward_dense, static_argnums=(2, 3), static_argnames=("num_loops",))


def load_torch_model(folder, dtype="fp32", trust_remote_code: bool = False) -> torch.nn.Module:
    """Our reference by default; the folder's own modeling code only when explicitly asked."""
    tdtype = TORCH_DTYPES.get(dtype, dtype)
    if not trust_remote_code:
        return load_reference(folder, tdtype)
    from transformers import AutoModelForCausalLM  # optional dependency, opt-in path only

    model = AutoModelForCausalLM.from_pretrained(
        folder, trust_remote_code=True, torch_dtype=tdtype, attn_implementation="eager")
    return model.eval()


def exit_modes(cfg: OuroConfig, thresholds=(None, 0.5)) -> list[tuple[str, dict]]:
    """(name, HF forward kwargs) for every exit mode: each fixed step, thresholds, weighted."""
    modes = [(f"step={k}", {"exit_at_step": k}) for k in range(cfg.total_ut_steps)]
    for q in thresholds:
        modes.append((f"threshold={'default' if q is None else q}",
                      {} if q is None else {"exit_threshold": q}))
    modes.append(("weighted", {"use_weighted_exit": True}))
    return modes


def spec_of(kwargs: dict) -> ExitSpec:
    return ExitSpec(exit_at_step=kwargs.get("exit_at_step"),
                    threshold=kwargs.get("exit_threshold"),
                    weighted=bool(kwargs.get("use_weighted_exit", False)))


@dataclasses.dataclass
class DiffReport:
    errors: dict = dataclasses.field(default_factory=dict)  # item -> max abs error
    scales: dict = dataclasses.field(default_factory=dict)  # item -> max abs of the torch side
    step_mismatches: dict = dataclasses.field(default_factory=dict)  # mode -> tokens
    # mode -> max over mismatched tokens of |reference cdf - threshold| at the earlier of the
    # two chosen loops: a mismatch is only a rounding near-tie when this is tiny.
    step_margins: dict = dataclasses.field(default_factory=dict)

    def add(self, name, ours, theirs, where=None):
        a, b = _f64(ours), _f64(theirs)
        if where is not None:
            where = np.broadcast_to(np.asarray(where)[..., None] if where.ndim < a.ndim
                                    else where, a.shape)
            a, b = a[where], b[where]
        self.errors[name] = float(np.abs(a - b).max()) if a.size else 0.0
        self.scales[name] = float(np.abs(b).max()) if b.size else 0.0

    def relative(self, name) -> float:
        return self.errors[name] / max(self.scales[name], 1e-30)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _f64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().numpy().astype(np.float64)
    return np.asarray(jnp.asarray(x).astype(jnp.float32), dtype=np.float64)


def _threshold_agreement(rep: DiffReport, name: str, ours_steps, ref_probs: torch.Tensor,
                         q: float) -> np.ndarray:
    """Compares exit loops; records mismatches and their margin; returns the agreement mask."""
    if not isinstance(ours_steps, torch.Tensor):
        ours_steps = torch.from_numpy(np.array(ours_steps))
    ours_steps = ours_steps.long()
    ref_steps = threshold_exit_steps(ref_probs, q)
    agree = ours_steps == ref_steps
    rep.step_mismatches[name] = int((~agree).sum())
    margin = 0.0
    if not agree.all():
        cdf = torch.cumsum(ref_probs.float(), dim=0)
        first = torch.minimum(ours_steps, ref_steps)
        at = torch.gather(cdf, 0, first[None])[0]
        margin = float((at - q).abs()[~agree].max())
    rep.step_margins[name] = margin
    return agree.numpy()


class LoopRecorder:
    """Forward hooks collecting each loop's normed hidden state and gate logit."""

    def __init__(self, model: torch.nn.Module):
        self.norm = model.get_submodule("model.norm")
        self.gate = model.get_submodule("model.early_exit_gate")
        self.hidden, self.gates, self._handles = [], [], []

    def __enter__(self):
        self._handles = [
            self.norm.register_forward_hook(lambda m, i, o: self.hidden.append(o.detach())),
            self.gate.register_forward_hook(lambda m, i, o: self.gates.append(o.detach()[..., 0])),
        ]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()


@contextlib.contextmanager
def _attrs_none(model, names):
    """Temporarily clears config-derived exit defaults some implementations keep as attributes
    (the official code reads early_exit_step / early_exit_threshold before its arguments)."""
    saved = {n: getattr(model, n) for n in names if hasattr(model, n)}
    try:
        for n in saved:
            setattr(model, n, None)
        yield
    finally:
        for n, v in saved.items():
            setattr(model, n, v)


def run_torch(model, ids, **kwargs):
    """(output, hidden [T, B, S, D], gate logits [T, B, S]) of one forward, recorded by hooks."""
    clear = ["early_exit_step"] if "exit_at_step" not in kwargs else []
    if kwargs.get("use_weighted_exit") and kwargs.get("exit_threshold") is None:
        clear.append("early_exit_threshold")
    with torch.no_grad(), LoopRecorder(model) as rec, _attrs_none(model, clear):
        out = model(input_ids=torch.as_tensor(np.asarray(ids)), **kwargs)
    return out, torch.stack(rec.hidden), torch.stack(rec.gates)


def compare_dense(model, params, cfg: OuroConfig, ids, thresholds=(None, 0.5)) -> DiffReport:
    """Hidden states and gate probabilities of every loop, and logits under every exit mode."""
    ids = np.asarray(ids)
    rep = DiffReport()
    jout = jax_forward(params, jnp.asarray(ids), cfg)
    _, hidden, gates = run_torch(model, ids, use_cache=False)
    if hidden.shape[0] != cfg.total_ut_steps:
        raise RuntimeError(f"torch model ran {hidden.shape[0]} loops, expected "
                           f"{cfg.total_ut_steps}")
    tprobs = exit_probabilities(gates)
    for t in range(cfg.total_ut_steps):
        rep.add(f"hidden[{t}]", jout.hidden_states[t], hidden[t])
    rep.add("gate_logits", jout.gate_logits, gates)
    rep.add("gate_probs", jout.exit_probs, tprobs)
    for name, kwargs in exit_modes(cfg, thresholds):
        out, _, _ = run_torch(model, ids, use_cache=False, **kwargs)
        spec = spec_of(kwargs)
        logits, steps = select_exit(params, jout.hidden_states, jout.gate_logits, cfg, spec)
        where = None  # tokens whose chosen loop differs are counted, not diffed
        if spec.mode() == "threshold":
            q = cfg.early_exit_threshold if spec.threshold is None else spec.threshold
            where = _threshold_agreement(rep, name, steps, tprobs, q)
        rep.add(f"logits/{name}", logits, out.logits, where)
    return rep


def compare_incremental(model, params, cfg: OuroConfig, ids, prefill: int) -> DiffReport:
    """The torch model's cached decode (prefill, then one token at a time with its own KV
    cache) against its own dense forward ('cached_vs_dense/...') and ours ('cached_vs_jax/...').
    Logits use the default exit mode (the config's threshold); tokens whose exit loop differs
    are counted in step_mismatches, not diffed."""
    ids = np.asarray(ids)
    seq = ids.shape[1]
    if not 0 < prefill < seq:
        raise ValueError(f"prefill must be in 1..{seq - 1}, got {prefill}")
    dense, dhidden, dgates = run_torch(model, ids, use_cache=False)
    out, hidden, gates = run_torch(model, ids[:, :prefill], use_cache=True)
    pieces = [(out.logits, hidden, gates)]
    cache = out.past_key_values
    for i in range(prefill, seq):
        out, hidden, gates = run_torch(model, ids[:, i:i + 1], use_cache=True,
                                       past_key_values=cache)
        cache = out.past_key_values
        pieces.append((out.logits, hidden, gates))
    logits = torch.cat([p[0] for p in pieces], dim=1)
    hidden = torch.cat([p[1] for p in pieces], dim=2)
    gates = torch.cat([p[2] for p in pieces], dim=2)
    jout = jax_forward(params, jnp.asarray(ids), cfg)
    rep = DiffReport()
    q = cfg.early_exit_threshold
    cached_steps = threshold_exit_steps(exit_probabilities(gates), q)
    for tag, ref_h, ref_g, ref_l, ref_probs in (
            ("cached_vs_dense", dhidden, dgates, dense.logits, exit_probabilities(dgates)),
            ("cached_vs_jax", jout.hidden_states, jout.gate_logits, jout.logits,
             _to_torch(jout.exit_probs, gates.dtype))):
        for t in range(cfg.total_ut_steps):
            rep.add(f"{tag}/hidden[{t}]", hidden[t], ref_h[t])
        rep.add(f"{tag}/gate_logits", gates, ref_g)
        where = _threshold_agreement(rep, tag, cached_steps, ref_probs, q)
        rep.add(f"{tag}/logits", logits, ref_l, where)
    return rep


def _to_torch(x, dtype) -> torch.Tensor:
    """A JAX array as a torch tensor of `dtype` (exact for values of that dtype)."""
    return torch.from_numpy(np.array(jnp.asarray(x).astype(jnp.float32))).to(dtype)


def main(argv=None) -> int:
    from convert.load import load_checkpoint

    p = argparse.ArgumentParser(prog="python -m convert.diff_harness", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="HF Ouro folder")
    p.add_argument("--dtype", default="fp32", choices=sorted(TORCH_DTYPES))
    p.add_argument("--trust-remote-code", action="store_true",
                   help="compare against the folder's own modeling_ouro.py (runs its code!)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--prefill", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    ckpt = load_checkpoint(args.checkpoint, args.dtype)
    model = load_torch_model(args.checkpoint, args.dtype, args.trust_remote_code)
    ids = np.random.default_rng(args.seed).integers(0, ckpt.config.vocab_size,
                                                    (args.batch, args.seq))
    dense = compare_dense(model, ckpt.params, ckpt.config, ids)
    inc = compare_incremental(model, ckpt.params, ckpt.config, ids, args.prefill)
    json.dump({"dense": dense.to_dict(), "incremental": inc.to_dict()}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
