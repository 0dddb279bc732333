"""The Python API: load a model, generate, read outputs and stats.

    from ouro_jax import Ouro, SamplingParams
    llm = Ouro.load()                                   # the embedded demo model
    res = llm.generate(["Once upon a time"], SamplingParams(max_tokens=32))
    print(res.outputs[0].text, res.stats)

Batches are admitted whole: pages for prompt + max_tokens (+ speculative room) are allocated
before any device work, so an exhausted pool is an error up front. Batch size, prompt length
is bucketed to powers of two (prompts up to the prefill chunk, then whole chunks), the KV pool
and block-table width to quarter-octave steps, so new prompts of the same bucket reuse every
compiled program.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable, Optional, Sequence, Union

import numpy as np

from ouro_jax import engine
from ouro_jax.attention import resolve_backend
from ouro_jax.api_checks import (check_flags, check_invariant, check_layer_kernels, checked_exit,
                                  checked_sizes)
from ouro_jax.config import OuroConfig
from ouro_jax.kv_cache import (KVPoolExhausted, bucket_pages, init_planes, kv_bytes_per_token,
                               next_pow2, pages_needed)
from ouro_jax.params import OuroParams
from ouro_jax.programs import ProgramCache
from ouro_jax.projections import XLA as XLAProjections
from ouro_jax.projections import auto_fit, parse as parse_projections
from ouro_jax.sampling import SamplingParams, as_int
from ouro_jax.speculative import SpeculativeConfig
from ouro_jax.tokenizer import Tokenizer

DEMO_MODEL_DIR = os.path.join(os.path.dirname(__file__), "demo_model")
FINISH_NAMES = {engine.FINISH_STOP: "stop", engine.FINISH_LENGTH: "length"}
Prompt = Union[str, Sequence[int]]


@dataclasses.dataclass
class RequestOutput:
    index: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: Optional[str]
    exit_depths: list[int]  # loops used for each token's logits (1..T)
    finish_reason: str
    logprobs: Optional[list[float]] = None
    spec: Optional[dict] = None  # speculative per-request stats

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float = 0.0
    compiles: int = 0
    host_fetches: int = 0
    # The first token of each request comes from prefill; decode produced the rest.
    decode_tokens: int = 0
    spec: Optional[dict] = None

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def line(self) -> str:
        s = (f"prompt tokens {self.prompt_tokens} | generated {self.generated_tokens} | "
             f"prefill {self.prefill_s:.3f}s | decode {self.decode_s:.3f}s "
             f"({self.decode_tok_s:.1f} tok/s) | compile {self.compile_s:.2f}s")
        if self.spec:
            unit = "tick" if self.spec.get("pipelined") else "round"  # (ouro_jax.pipelined)
            s += (f" | spec {unit}s {self.spec['rounds']} drafted {self.spec['drafted']} "
                  f"accepted {self.spec['accepted']} ({100 * self.spec['acceptance']:.1f}%) "
                  f"tokens/{unit} {self.spec['tokens_per_round']:.2f}")
            if self.spec.get("rounds_run"):  # (a batch waits for its slowest row)
                s += (f" | batch rounds {self.spec['rounds_run']} "
                      f"({100 * self.spec['active_row_fraction']:.1f}% of row-rounds active)")
        return s

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["decode_tok_s"] = self.decode_tok_s
        return d


@dataclasses.dataclass
class GenerationResult:
    outputs: list[RequestOutput]
    stats: GenerationStats


def folder_eos_ids(folder: str, tokenizer: Optional[Tokenizer]) -> list[int]:
    """End-of-sequence ids a checkpoint folder declares besides config.json: generation_config's
    eos_token_id (int or list) and tokenizer_config's eos_token (e.g. <|im_end|> in chat
    variants), so generation stops where the model's authors meant it to."""
    import json

    def read(name):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            try:
                return json.load(f)
            except ValueError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None

    ids = []
    gen = read("generation_config.json")
    if isinstance(gen, dict) and gen.get("eos_token_id") is not None:
        eos = gen["eos_token_id"]
        for e in eos if isinstance(eos, list) else [eos]:
            if isinstance(e, bool) or not isinstance(e, int) or e < 0:
                raise ValueError(f"{folder}/generation_config.json: eos_token_id {e!r} is not "
                                 f"a token id")
            ids.append(e)
    tok_cfg = read("tokenizer_config.json") if tokenizer is not None else None
    if isinstance(tok_cfg, dict):
        raw = tok_cfg.get("eos_token")
        tok = raw.get("content") if isinstance(raw, dict) else raw
        where = f"{folder}/tokenizer_config.json: eos_token {raw!r}"
        if tok is not None and not isinstance(tok, str):
            raise ValueError(f"{where} must be a token string (or {{\"content\": ...}})")
        if tok is not None:  # a declared EOS this folder's tokenizer cannot name would
            tid = tokenizer.token_to_id(tok)  # never stop a request: refuse, not drop
            if tid is None:
                raise ValueError(f"{where} is not a token of tokenizer.json")
            ids.append(tid)
    return ids


class Ouro:
    """A loaded model plus its KV pool and compiled programs."""

    def __init__(self, cfg: OuroConfig, params: OuroParams, tokenizer: Optional[Tokenizer] = None,
                 *, page_size: int = 16, attention: str = "auto",
                 kv_pool_tokens: Optional[int] = None, prefill_chunk: int = 256,
                 decode_chunk: int = 32, fuse_projections: bool = True,
                 unroll_loops: bool = False, projections: str = "auto",
                 fused_kv_write: bool = True, persistent_layers: bool = False,
                 batch_invariant: bool = False):
        page_size, prefill_chunk, decode_chunk = checked_sizes(
            cfg, page_size, prefill_chunk, decode_chunk, kv_pool_tokens)
        from ouro_jax.model import unstack_layers

        check_flags(fused_kv_write=fused_kv_write, fuse_projections=fuse_projections,
                    unroll_loops=unroll_loops, persistent_layers=persistent_layers,
                    batch_invariant=batch_invariant)
        if batch_invariant:  # ouro_jax.invariant: its own kernels, or a clear refusal
            attention, projections = check_invariant(cfg, attention, projections,
                                                     persistent_layers, fuse_projections)
        proj = parse_projections(projections)  # validated before anything is built
        if projections == "auto":
            proj = auto_fit(proj, cfg)
        # "+unroll": loops unrolled in the program rather than a device while loop;
        # "+gemv...": few-row projections through the Pallas GEMV (ouro_jax.projections), in
        # canonical form so equal settings give equal program keys; "+kvxla": decode's RoPE
        # and K/V write as XLA kernels rather than in the Pallas decode kernel (A/B runs).
        # The fused path needs the pallas backend and the fused qkv weight; where it cannot
        # run, the key says so ("+kvxla"), so results are never labelled with a path not taken.
        resolved = resolve_backend(attention)
        kv_xla = resolved == "pallas" and not (fused_kv_write and fuse_projections)
        check_layer_kernels(projections, attention, proj, resolved, kv_xla, persistent_layers)

        # Per-layer weights (no in-loop slicing copies), q/k/v and gate/up fused.
        self.cfg, self.tokenizer = cfg, tokenizer
        self.params = unstack_layers(params, fuse=fuse_projections)
        if getattr(proj, "mgpu_names", ()) or getattr(proj, "inv_rows", ()):
            # the Mosaic GEMV's shape and dtype rules, '+inv''s GEMM tiles, on the weights
            # as the layers will use them (already unstacked params keep theirs)
            proj.check_model(cfg, params.dtype, self.params.layers[0].qkv_proj is not None)
        self.page_size = page_size
        if persistent_layers:  # batch-1 decode loops as one Mosaic GPU kernel each
            from ouro_jax import persistent
            self.params = dataclasses.replace(self.params,
                                              persistent=persistent.pack(cfg, self.params))
        self.batch_invariant = batch_invariant
        self.backend = (resolved + ("+unroll" if unroll_loops else "")
                        + ("+kvxla" if kv_xla else "")
                        + ("+invariant" if batch_invariant else "")
                        + ("" if proj == XLAProjections() else "+" + proj.spec)
                        + ("+persistent" if persistent_layers else ""))
        self.prefill_chunk = next_pow2(prefill_chunk)
        self.decode_chunk = decode_chunk
        self.fixed_pool_pages = (None if kv_pool_tokens is None
                                 else 1 + pages_needed(kv_pool_tokens, page_size))
        self.programs = ProgramCache()
        self.load_phases: dict = {}  # filled by Ouro.load
        self._planes = None

    @classmethod
    def load(cls, path: Optional[str] = None, dtype="fp32", **kw) -> "Ouro":
        from convert.load import load_checkpoint

        if path is not None and not str(path).strip():
            raise ValueError("empty model path: give a checkpoint folder, or none for the "
                             "embedded demo model")
        folder = DEMO_MODEL_DIR if path is None else path
        # straight into the engine's per-layer layout: no stacked copy to unstack again
        ck = load_checkpoint(folder, dtype, layout="engine" if kw.get("fuse_projections", True)
                             else "engine_unfused")
        t0 = time.perf_counter()
        tok = Tokenizer.from_folder(folder, ck.config)
        extra = sorted(set(folder_eos_ids(folder, tok)) - set(ck.config.eos_token_ids))
        if extra and extra[-1] >= ck.config.vocab_size:
            raise ValueError(f"{folder}: end-of-sequence id {extra[-1]} (generation_config.json "
                             f"or tokenizer_config.json) is not below vocab_size "
                             f"{ck.config.vocab_size}")
        cfg = ck.config.replace(extra_eos_token_ids=ck.config.extra_eos_token_ids + tuple(extra))
        t1 = time.perf_counter()
        llm = cls(cfg, ck.params, tok, **kw)
        # where a load's seconds went (load_checkpoint's phases, then the tokenizer and the
        # engine's construction), for the CLI's --json stats and start-up benchmarks
        llm.load_phases = dict(ck.phases, tokenizer_s=t1 - t0,
                               engine_s=time.perf_counter() - t1)
        return llm

    # --- inputs -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: pass token ids "
                                 "(--prompt-ids) instead of text")
            ids = self.tokenizer.encode(prompt)
        elif hasattr(prompt, "__array__") or (isinstance(prompt, Sequence)
                                              and not isinstance(prompt, bytes)):
            if hasattr(prompt, "__array__"):  # numpy or jax: elements as Python scalars
                prompt = np.asarray(prompt)
                if prompt.ndim != 1:  # (a 0-d array's tolist() is a bare int)
                    raise ValueError(f"a prompt's token ids must be one-dimensional, got an "
                                     f"array of shape {prompt.shape}")
                prompt = prompt.tolist()
            ids = list(prompt)
            if not all(type(t) is int for t in ids):  # the per-id check only when needed
                ids = [as_int(t, "a prompt's token id") for t in ids]
        else:
            raise ValueError(f"a prompt must be text or a sequence of token ids, got {prompt!r}")
        if not ids:
            raise ValueError("empty prompt: give at least one token")
        bad = sorted({t for t in ids if not 0 <= t < self.cfg.vocab_size})
        if bad:
            raise ValueError(f"unknown token id(s) {bad[:10]}: vocab_size is {self.cfg.vocab_size}")
        return ids

    def _encode_nth(self, i: int, prompt, n: int) -> list[int]:
        """encode, whose errors name the prompt when a batch has several."""
        try:
            return self.encode(prompt)
        except ValueError as e:
            if n == 1:
                raise
            raise ValueError(f"prompt {i}: {e}") from None

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        bad = sorted({t for t in p.stop_token_ids if not 0 <= t < self.cfg.vocab_size})
        if bad:
            raise ValueError(f"unknown stop token id(s) {bad}: vocab_size is {self.cfg.vocab_size}")
        ids = list(p.stop_token_ids)
        if not p.ignore_eos:
            ids.extend(self.cfg.eos_token_ids)
        return sorted(set(ids))

    def decode_text(self, ids: Sequence[int]) -> Optional[str]:
        return None if self.tokenizer is None else self.tokenizer.decode(ids)

    # --- generation -------------------------------------------------------------------------
    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 exit_at_step: Optional[int] = None, exit_threshold: Optional[float] = None,
                 weighted_exit: bool = False, speculative=None,
                 on_chunk: Optional[Callable[[list[list[int]]], None]] = None) -> GenerationResult:
        """Generates for a batch. `on_chunk(new_tokens_per_request)` streams each host fetch."""
        from ouro_jax.batch import run_batch

        if hasattr(prompts, "__array__"):  # numpy or jax ids: one prompt, or rows of them
            prompts = np.asarray(prompts).tolist()
        if not isinstance(prompts, (str, Sequence)):
            raise ValueError(f"prompts must be text, token ids or a list of them, got {prompts!r}")
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        if not len(prompts):
            raise ValueError("no prompts given")
        if sampling is None:
            sampling = SamplingParams()
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        bad = [p for p in params if not isinstance(p, SamplingParams)]
        if bad:
            raise ValueError(f"sampling must be a SamplingParams or a list or tuple of them, "
                             f"got {bad[0]!r}")
        spec = checked_exit(self.cfg, exit_at_step, exit_threshold, weighted_exit)
        if on_chunk is not None and not callable(on_chunk):
            raise ValueError(f"on_chunk must be a callable or None, got {on_chunk!r}")
        if speculative is not None:
            if not isinstance(speculative, SpeculativeConfig):
                raise ValueError(f"speculative must be a SpeculativeConfig (e.g. "
                                 f"SpeculativeConfig(k=4, draft_loops=2)) or None, got "
                                 f"{speculative!r}")
            speculative.validate(self.cfg)
        ids = [self._encode_nth(i, p, len(prompts)) for i, p in enumerate(prompts)]
        stops = [self._stop_ids(p) for p in params]
        return run_batch(self, ids, params, stops, spec, speculative, on_chunk)

    # --- KV pool ----------------------------------------------------------------------------
    def _check_pool_fits(self, num_pages: int) -> None:
        """Raises KVPoolExhausted, keeping the current pool, when a pool of `num_pages` pages
        cannot fit in the device memory the allocator may still hand out (devices that report
        no limit, like the CPU, are not checked)."""
        device = next(iter(self.params.embed_tokens.devices()))
        try:
            stats = device.memory_stats()
        except Exception:  # some PJRT plugins do not implement it
            stats = None
        if not stats or "bytes_limit" not in stats:
            return
        per_page = kv_bytes_per_token(self.cfg, self.params.dtype) * self.page_size
        need = num_pages * per_page
        held = 0 if self._planes is None else self._planes[0].shape[1] * per_page
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0) + held
        if need > free:
            gb = 1e9
            fix = ("a smaller kv_pool_tokens (--kv-pool-tokens)" if self.fixed_pool_pages
                   else "fewer or shorter requests, a smaller max_tokens")
            raise KVPoolExhausted(
                f"the KV pool for this batch needs {need / gb:.1f} GB ({num_pages} pages of "
                f"{self.page_size} tokens, {per_page / 1e6:.1f} MB each) but only "
                f"{free / gb:.1f} GB of device memory is free (limit {stats['bytes_limit'] / gb:.1f}"
                f" GB); use {fix}, or let JAX use more of the device "
                f"(XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75)")

    def pool_pages(self, pages_total: int) -> int:
        """Pool size for a batch needing `pages_total` pages: the fixed pool, or a bucket
        holding them plus the trash page."""
        return self.fixed_pool_pages or bucket_pages(pages_total + 1)

    def planes_for(self, num_pages: int):
        """The KV planes, (re)allocated when the pool holds fewer than `num_pages` pages."""
        if self._planes is None or self._planes[0].shape[1] < num_pages:
            self._check_pool_fits(num_pages)
            self._planes = None  # free the old pool before allocating the new one
            try:
                self._planes = init_planes(self.cfg, num_pages, self.page_size, self.params.dtype)
            except Exception as e:  # XLA's allocator reports RESOURCE_EXHAUSTED, untyped
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                size = num_pages * self.page_size * kv_bytes_per_token(self.cfg, self.params.dtype)
                fix = ("a smaller kv_pool_tokens (--kv-pool-tokens)" if self.fixed_pool_pages
                       else "fewer or shorter requests, or a smaller max_tokens")
                raise KVPoolExhausted(
                    f"could not allocate a KV pool of {num_pages} pages of {self.page_size} "
                    f"tokens ({size / 1e9:.1f} GB): the device is out of memory; use {fix}, or "
                    f"let JAX use more of the device (XLA_PYTHON_CLIENT_MEM_FRACTION). "
                    f"XLA said: {str(e).splitlines()[0][:200]}") from e
        return self._planes
