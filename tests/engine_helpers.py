"""Shared helpers for engine tests: cached tiny checkpoints and reference greedy decoding."""

from __future__ import annotations

import functools
import os
import tempfile

import numpy as np

from convert.load import load_checkpoint
from convert.synthesize import synthesize

_ROOT = tempfile.mkdtemp(prefix="ouro_engine_tests_")


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(preset: str = "tiny-gqa", seed: int = 0, branch_scale: float = 1.0,
                    **overrides) -> str:
    folder = os.path.join(_ROOT, f"{preset}-{seed}-{branch_scale}-" +
                          "-".join(f"{k}{v}" for k, v in sorted(overrides.items())))
    synthesize(folder, preset, seed=seed, dtype="fp32", branch_scale=branch_scale, **overrides)
    return folder


def load(folder: str, dtype="fp32"):
    ck = load_checkpoint(folder, dtype)
    return ck.config, ck.params


def reference_greedy(model, prompt, max_tokens, stop_ids=()):
    """No-cache greedy decoding with the PyTorch reference: full recompute every token."""
    import torch

    seq = list(prompt)
    out = []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([seq])).logits[0, -1]
            tok = int(torch.argmax(logits))
            out.append(tok)
            seq.append(tok)
            if tok in stop_ids:
                break
    return out


def ragged_prompts(vocab: int, lengths, seed: int = 1):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, vocab, n)] for n in lengths]


def pallas_call_eqns(fn, *args) -> list:
    """The pallas_call equations in fn(*args)'s jaxpr, recursing into sub-jaxprs (pjit,
    loops; open or closed), in trace order."""
    import jax

    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                found.append(eqn)
            for value in eqn.params.values():
                for x in (value if isinstance(value, (tuple, list)) else (value,)):
                    sub = x if hasattr(x, "eqns") else getattr(x, "jaxpr", None)
                    if hasattr(sub, "eqns"):
                        walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def primitives_outside_kernels(jaxpr) -> set:
    """The primitive names of a jaxpr and its sub-jaxprs, pallas_calls' bodies left out."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        if eqn.primitive.name == "pallas_call":
            continue
        for value in eqn.params.values():
            for v in (value if isinstance(value, (tuple, list)) else (value,)):
                sub = v if hasattr(v, "eqns") else getattr(v, "jaxpr", None)
                if hasattr(sub, "eqns"):
                    out |= primitives_outside_kernels(sub)
    return out


def has_gpu() -> bool:
    """Whether JAX sees a CUDA GPU (the `gpu`-marked tests skip without one)."""
    import jax

    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pallas_call_names(fn, *args) -> list:
    """The kernel names of fn(*args)'s pallas_calls in trace order (the params key differs
    between JAX versions: 'name' or 'name_and_src_info')."""
    out = []
    for e in pallas_call_eqns(fn, *args):
        info = e.params.get("name_and_src_info", e.params.get("name", ""))
        out.append(str(getattr(info, "name", info)).split()[0])
    return out


def tokens_per_decode_tuning(monkeypatch, cfg, params, prompts, sp, arms) -> list:
    """For each (attention backend, pallas_kernels.decode.TUNING) arm, a fresh engine's token
    ids, plain and speculative (k=2, d=2); each engine must keep only its two KV planes (a
    kernel's extra state, e.g. counters, never leaks into them)."""
    import pallas_kernels.decode as decode
    from ouro_jax.api import Ouro
    from ouro_jax.speculative import SpeculativeConfig
    runs = []
    for attention, tuning in arms:
        monkeypatch.setattr(decode, "TUNING", tuning)
        llm = Ouro(cfg, params, None, page_size=4, attention=attention)
        runs.append([[o.token_ids for o in llm.generate(prompts, sp, speculative=s).outputs]
                     for s in (None, SpeculativeConfig(k=2, draft_loops=2))])
        assert len(llm._planes) == 2
    return runs


class HostReads:
    """Counts device-to-host reads while installed (host_reads(monkeypatch)).

    jax.transfer_guard_device_to_host("disallow") is a no-op on the CPU backend (its arrays are
    already host memory; np.asarray reads them through the buffer protocol), so on CI it
    cannot catch an implicit sync. This counts them instead: `fetches` are jax.device_get
    calls, `implicit` lists the reads outside one (np.asarray / np.array on a jax.Array,
    int(), float(), bool(), .tolist(), str(), .item()), each with the caller's line."""

    def __init__(self):
        self.fetches = 0
        self.implicit: list[str] = []
        self._inside = 0

    def _note(self, what: str):
        if not self._inside:
            import traceback
            # the innermost frame outside jax, numpy and this helper: the code that read
            frame = [f for f in traceback.extract_stack()
                     if not any(s in f.filename for s in ("/jax/", "/numpy/", "engine_helpers"))][-1]
            self.implicit.append(f"{what} at {frame.filename}:{frame.lineno}")


def host_reads(monkeypatch) -> HostReads:
    import jax
    from jax._src.array import ArrayImpl

    reads = HostReads()
    real_get, real_value = jax.device_get, ArrayImpl._value
    real_asarray, real_array = np.asarray, np.array

    def device_get(x):
        reads.fetches += 1
        reads._inside += 1
        try:
            return real_get(x)
        finally:
            reads._inside -= 1

    def value(self):
        reads._note("ArrayImpl._value")
        return real_value.fget(self)

    def wrap(real, name):
        def f(a, *args, **kwargs):
            if isinstance(a, jax.Array):
                reads._note(name)
            return real(a, *args, **kwargs)
        return f

    monkeypatch.setattr(jax, "device_get", device_get)
    monkeypatch.setattr(ArrayImpl, "_value", property(value))
    monkeypatch.setattr(np, "asarray", wrap(real_asarray, "np.asarray"))
    monkeypatch.setattr(np, "array", wrap(real_array, "np.array"))
    return reads


def offline_compile_tags(monkeypatch, *checks) -> list:
    """Runs pallas_kernels.offline_compile check functions on this CPU, lowering for sm_90
    without Triton's compile: [(tag, kernels captured for it, compile_captured's keywords)]."""
    from jax._src.pallas.triton import pallas_call_registration as reg
    from pallas_kernels import offline_compile as oc
    tags = []

    def record(tag, **kw):
        tags.append((tag, len(oc._captured), kw))
        oc._captured.clear()
    monkeypatch.setattr(oc, "compile_captured", record)
    monkeypatch.setattr(reg.lowering, "lower_jaxpr_to_triton_module", oc._hook)
    with oc.sm90_device_info():
        for check in checks:
            check()
    return tags
