"""How a decoder layer computes its four projections: XLA GEMMs, or the Pallas GEMV for few rows.

`model.decoder_layer` asks a `Projections` object for qkv, o, the gated MLP input
silu(gate) * up, and down. `XLA` is the plain einsum path (any shape, any backend).
`PallasGemv(names, max_rows)` routes the named projections through pallas_kernels.gemv when
the call has at most `max_rows` rows (default 1: batch-1 decode and draft) and falls back to
XLA otherwise (prefill, verification, larger batches), so one program may mix both. On a
machine without a GPU the kernel runs in interpret mode (tests). `projections="auto"` (the
engine's default) picks the GEMV on a GPU: batch-1 decode on the H200 went from 163.7 to
179.2 tok/s with it (benchmarks/results/ab_proj_*_b1_h200.json), and since session 7 it picks
'gemv+norms+stream' (GPU_DEFAULT: 210.6 -> 231.9 tok/s).

Parts, measured on the H200 (docs/performance.md; '+norms' and '+stream' together are the
GPU default):
'+gemm[@N]' sends calls of 2..N rows to the skinny Pallas GEMM (pallas_kernels.gemm), and
'+norms' moves the RMSNorms and residual adds around qkv and gate/up into the GEMV prologue
(the layer output is then a deferred `Residual` that the next qkv GEMV adds up), '+pfN'
sets the GEMV's prefetch depth, and '+stream' swaps in the streaming GEMV
(pallas_kernels.gemv_stream: x and the norm prologue once per program, the K loop unrolled)
for one-row calls.

The gated kernel returns silu(gate) * up directly, so XLA no longer fuses the SiLU into the
down projection's prologue (which slowed that GEMM from 7.6 to 12.3 us per call at batch 1 on
the H200, benchmarks/results/kernel_trace_pallas_b1_h200.json vs gemv_session4_h200.json).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax

from ouro_jax import trace_once

# The tables and fits live in projection_tuning; re-exported here, where callers and
# benchmarks.tuning have always found them (the same dict objects).
from ouro_jax.projection_tuning import (  # noqa: F401
    GEMM_MAX_ROWS, GEMM_ROW_LIMIT, GEMM_TUNING, GEMV_MAX_ROWS, GEMV_ROW_LIMIT, GEMV_TUNING,
    MGPU_TUNING, NAMES, STREAM_MAX_ROWS, STREAM_TUNING, fit_gemm_tuning, fit_mgpu_tuning,
    fit_stream_tuning, fit_tuning, mgpu_available)


class Residual(NamedTuple):
    """A residual stream not yet added up: resid + rms_norm(branch, weight). With 'norms' the
    sandwich layer hands this to the next projection, whose GEMV prologue does the add and
    the norms (the layer's small XLA norm and add kernels disappear)."""
    resid: jax.Array
    branch: jax.Array
    weight: jax.Array


def _rms_norm(x, w, eps):
    from ouro_jax.model import rms_norm
    return rms_norm(x, w, eps)


def _linear(x, w):
    from ouro_jax.model import linear
    return linear(x, w)


def _next_operand(name: str, next_weight) -> dict:
    """The streaming GEMV's next_w / next_split for `next_weight` = (weight, segments), when
    this projection's STREAM_TUNING asks for an L2 prefetch of it (next_rows > 0)."""
    if next_weight is None or not STREAM_TUNING[name].get("next_rows", 0):
        return {}
    w, segments = next_weight
    return {"next_w": w, "next_split": segments}


@dataclasses.dataclass(frozen=True)
class XLA:
    """einsum projections (model.linear); the gated MLP input rounds like the reference."""

    def project(self, name: str, x: jax.Array, w: jax.Array, next_weight=None) -> jax.Array:
        """x @ w^T. next_weight: (weight, segments) a later projection reads; only the
        streaming GEMV uses it (an L2 prefetch, STREAM_TUNING's next_rows), never the result."""
        return _linear(x, w)

    def gated(self, x: jax.Array, w: jax.Array, next_weight=None) -> jax.Array:
        from ouro_jax.model import silu
        i = w.shape[0] // 2
        gu = _linear(x, w)
        return silu(gu[..., :i]) * gu[..., i:]

    def materialize(self, x, eps: float) -> jax.Array:
        """The residual stream as an array (a Residual is added up here)."""
        if isinstance(x, Residual):
            return x.resid + _rms_norm(x.branch, x.weight, eps)
        return x

    def normed(self, name: str, x, norm_w, w, eps: float, gated: bool = False,
               next_weight=None):
        """(projection of rms_norm(x, norm_w), x as an array); gated: the gated MLP input;
        next_weight as in project."""
        x = self.materialize(x, eps)
        hx = _rms_norm(x, norm_w, eps)
        return (self.gated(hx, w, next_weight=next_weight) if gated else
                self.project(name, hx, w, next_weight=next_weight)), x

    def residual(self, h, m, w, eps: float):
        """The layer output h + rms_norm(m, w), now (XLA) or deferred (see Residual)."""
        return h + _rms_norm(m, w, eps)


@dataclasses.dataclass(frozen=True)
class PallasGemv(XLA):
    """Routes each projection call by name and row count: to the GEMV (`names`, calls of at
    most `max_rows` rows), else to the skinny GEMM (`gemm_names`, calls of 2 to
    `gemm_max_rows` rows), else to XLA."""
    names: tuple = NAMES
    max_rows: int = GEMV_MAX_ROWS
    gemm_names: tuple = ()
    gemm_max_rows: int = GEMM_MAX_ROWS
    fuse_norms: bool = False
    prefetch: int | None = None  # '+pf<N>': every GEMV's prefetch depth instead of GEMV_TUNING's
    stream: bool = False  # '+stream': the streaming GEMV for calls of up to STREAM_MAX_ROWS rows
    mgpu_names: tuple = ()  # '+mgpu[:NAME,...]': the Mosaic GPU GEMV for their one-row calls

    @property
    def spec(self) -> str:
        """The canonical spec string: parse(p.spec) == p."""
        def part(kind, names, rows, default_rows):
            at = "" if rows == default_rows else f"@{rows}"
            return kind + at + ("" if names == NAMES else ":" + ",".join(names))
        parts = []
        if self.names:
            parts.append(part("gemv", self.names, self.max_rows, GEMV_MAX_ROWS))
        if self.gemm_names:
            parts.append(part("gemm", self.gemm_names, self.gemm_max_rows, GEMM_MAX_ROWS))
        if self.fuse_norms:
            parts.append("norms")
        if self.stream:
            parts.append("stream")
        if self.mgpu_names:
            parts.append("mgpu" + ("" if self.mgpu_names == NAMES else
                                   ":" + ",".join(self.mgpu_names)))
        if self.prefetch is not None:
            parts.append(f"pf{self.prefetch}")
        return "+".join(parts)

    def tuning(self, name: str, n_out: int, k: int) -> dict:
        """The GEMV tiling for projection `name` on an [n_out, k] weight."""
        t = fit_tuning(GEMV_TUNING[name], n_out, k)
        if self.prefetch is not None and not t["use_dot"]:
            t["prefetch"] = self.prefetch
        return t

    def _route(self, name: str, x: jax.Array) -> str:
        rows = math.prod(x.shape[:-1])
        if name in self.names and rows <= self.max_rows:
            return "gemv"
        if name in self.gemm_names and 2 <= rows <= self.gemm_max_rows:
            return "gemm"
        return "xla"

    def _streams(self, x) -> bool:
        return self.stream and math.prod(x.shape[:-1]) <= STREAM_MAX_ROWS

    def _mgpus(self, name, x) -> bool:
        return name in self.mgpu_names and math.prod(x.shape[:-1]) == 1

    def _mgpu_tuning(self, name, n_out, k, dtype, normed):
        return fit_mgpu_tuning(name, MGPU_TUNING[name], n_out, k, dtype, normed)

    def check_model(self, cfg, dtype, fused: bool) -> None:
        """Raises, now, fit_mgpu_tuning's error for a shape or dtype the Mosaic GEMV cannot
        take at all (the engine calls this before compiling anything): each named
        projection's one-row call as model.decoder_layer makes it (fused: qkv and gate/up as
        one weight each). The kernel's own limits for a tiling (shared memory, stages) are
        checked when it is traced."""
        hd, hidden = cfg.head_dim, cfg.hidden_size
        normed = self.fuse_norms
        calls = {"qkv": [((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd,
                          hidden, normed)] if fused else
                 [(cfg.num_attention_heads * hd, hidden, False),
                  (cfg.num_key_value_heads * hd, hidden, False)],
                 "o": [(hidden, cfg.num_attention_heads * hd, False)],
                 "gate_up": [(cfg.intermediate_size, hidden, normed)] if fused else [],
                 "down": [(hidden, cfg.intermediate_size, False)]}
        for name in self.mgpu_names:
            for n_out, k, is_normed in calls[name]:
                self._mgpu_tuning(name, n_out, k, dtype, is_normed)

    def _gemv(self, name, x, w, gated=False, next_weight=None):
        from pallas_kernels.gemv import gemv
        from pallas_kernels.gemv_stream import gemv_stream
        lead, k = x.shape[:-1], x.shape[-1]
        interpret = jax.default_backend() != "gpu"
        n_out = w.shape[0] // 2 if gated else w.shape[0]
        if self._mgpus(name, x):
            from pallas_kernels.gemv_mgpu_normed import gemv_mgpu_plain
            y = trace_once.call(gemv_mgpu_plain, x.reshape(1, k), w, gated=gated,
                                interpret=interpret,
                                **self._mgpu_tuning(name, n_out, k, w.dtype, False))
        elif self._streams(x):
            y = trace_once.call(gemv_stream, x.reshape(-1, k), w, gated=gated,
                                interpret=interpret, **_next_operand(name, next_weight),
                                **fit_stream_tuning(STREAM_TUNING[name], n_out, k))
        else:
            y = trace_once.call(gemv, x.reshape(-1, k), w, gated=gated, interpret=interpret,
                                **self.tuning(name, n_out, k))
        return y.reshape(*lead, y.shape[-1])

    def _gemm(self, name, x, w, gated=False):
        from pallas_kernels.gemm import gemm
        lead = x.shape[:-1]
        interpret = jax.default_backend() != "gpu"
        n_out = w.shape[0] // 2 if gated else w.shape[0]
        y = trace_once.call(gemm, x.reshape(-1, x.shape[-1]), w, gated=gated,
                            interpret=interpret,
                            **fit_gemm_tuning(GEMM_TUNING[name], n_out, x.shape[-1]))
        return y.reshape(*lead, y.shape[-1])

    def _fuses(self, name, x) -> bool:
        return self.fuse_norms and self._route(name, x) == "gemv"

    def normed(self, name, x, norm_w, w, eps, gated=False, next_weight=None):
        from pallas_kernels.gemv import gemv_normed
        from pallas_kernels.gemv_stream import gemv_stream_normed
        resid = x.resid if isinstance(x, Residual) else x
        if not self._fuses(name, resid):
            return super().normed(name, x, norm_w, w, eps, gated, next_weight)
        lead, k = resid.shape[:-1], resid.shape[-1]
        n_out = w.shape[0] // 2 if gated else w.shape[0]
        branch = dict(branch=x.branch.reshape(-1, k), branch_w=x.weight) \
            if isinstance(x, Residual) else {}
        if self._mgpus(name, resid):
            from pallas_kernels.gemv_mgpu_normed import gemv_mgpu_normed
            fn = gemv_mgpu_normed
            tuning = self._mgpu_tuning(name, n_out, k, w.dtype, True)
        elif self._streams(resid):
            fn, tuning = gemv_stream_normed, fit_stream_tuning(STREAM_TUNING[name], n_out, k)
            tuning.update(_next_operand(name, next_weight))
        else:
            fn, tuning = gemv_normed, self.tuning(name, n_out, k)
        y, x_new = trace_once.call(fn, resid.reshape(-1, k), norm_w, w, eps=eps, gated=gated,
                                   interpret=jax.default_backend() != "gpu", **branch,
                                   **tuning)
        return y.reshape(*lead, n_out), x_new.reshape(*lead, k)

    def residual(self, h, m, w, eps):
        # Deferred when the next layer's qkv GEMV can take it (same rows); run_loop
        # materializes what is left after the last layer.
        return Residual(h, m, w) if self._fuses("qkv", h) else super().residual(h, m, w, eps)

    def project(self, name, x, w, next_weight=None):
        route = self._route(name, x)
        if route == "gemv":
            return self._gemv(name, x, w, next_weight=next_weight)
        return self._gemm(name, x, w) if route == "gemm" else _linear(x, w)

    def gated(self, x, w, next_weight=None):
        route = self._route("gate_up", x)
        if route == "gemv":
            return self._gemv("gate_up", x, w, gated=True, next_weight=next_weight)
        return self._gemm("gate_up", x, w, gated=True) if route == "gemm" else \
            super().gated(x, w)


# What 'auto' means on a GPU: one-row projections through the streaming GEMV with the
# RMSNorms and residual adds in its prologues. Batch-1 native greedy on the H200: 'gemv'
# 210.6, 'gemv+stream' 218.9, 'gemv+norms+stream' 231.9 tok/s
# (benchmarks/results/ab_gemv*_b1_session7_h200.json).
GPU_DEFAULT = "gemv+norms+stream"


def resolve(spec: str) -> str:
    """'auto' -> GPU_DEFAULT where the Pallas kernels run natively (a GPU), else 'xla' (on a
    CPU the kernel would run in interpret mode: exact but slow). Other specs pass through."""
    if spec != "auto":
        return spec
    from ouro_jax.attention import resolve_backend
    return GPU_DEFAULT if resolve_backend("auto") == "pallas" else "xla"


_LIMITS = {"gemv": (GEMV_MAX_ROWS, 1, GEMV_ROW_LIMIT), "gemm": (GEMM_MAX_ROWS, 2, GEMM_ROW_LIMIT)}


def _parse_part(spec: str, part: str):
    head, sep, names = part.partition(":")
    kind, at, rows = head.partition("@")
    if kind not in _LIMITS:
        raise ValueError(f"unknown projections {spec!r}: 'xla', or '+'-joined parts "
                         f"'gemv[@ROWS][:NAME,...]' and 'gemm[@ROWS][:NAME,...]' with NAME in "
                         f"{NAMES}")
    default, lo, hi = _LIMITS[kind]
    max_rows = default
    if at:
        if not rows.isdigit() or not lo <= int(rows) <= hi:
            raise ValueError(f"projections {spec!r}: ROWS after '{kind}@' must be {lo}..{hi}")
        max_rows = int(rows)
    if sep and not names:
        raise ValueError(f"unknown projection name(s) [] in {spec!r}: give NAME,... after ':' "
                         f"with NAME in {NAMES}, or leave out the ':'")
    chosen = tuple(n for n in names.split(",") if n) if names else NAMES
    bad = sorted(set(chosen) - set(NAMES))
    if bad or not chosen:
        raise ValueError(f"unknown projection name(s) {bad} in {spec!r}; choose from {NAMES}")
    return kind, tuple(n for n in NAMES if n in chosen), max_rows


def parse(spec: str):
    """'xla' -> XLA(); 'gemv' -> all four through the GEMV for one-row calls; 'gemv@5' -> for
    calls of up to 5 rows; 'gemv:gate_up,down' (or 'gemv@5:...') -> only those; 'gemm[@N]' ->
    calls of 2..N rows (default GEMM_MAX_ROWS) through the skinny GEMM; 'gemv+gemm' -> both;
    '+norms' -> the norm prologue; '+pfN' -> every GEMV loads N chunks ahead (default: each
    projection's GEMV_TUNING); '+stream' -> the streaming GEMV kernel (STREAM_TUNING) for
    GEMV calls of up to STREAM_MAX_ROWS rows (not with '+pfN'); '+mgpu[:NAME,...]' -> the
    Mosaic GPU GEMV (MGPU_TUNING, jax >= 0.11, bf16/fp16) for those projections' one-row GEMV
    calls instead (default: the 'gemv' part's; e.g. 'gemv+norms+stream+mgpu:down');
    'auto' -> see resolve."""
    spec = resolve(spec)
    if spec in ("", "xla"):
        return XLA()
    kw = {}
    parts = spec.split("+")
    fuse_norms = "norms" in parts
    stream = "stream" in parts
    mgpu_parts = [p for p in parts if p.partition(":")[0].partition("@")[0] == "mgpu"]
    kinds = [p.partition(":")[0].partition("@")[0] for p in parts]
    if parts.count("norms") > 1 or (fuse_norms and "gemv" not in kinds):
        raise ValueError(f"projections {spec!r}: 'norms' (RMSNorms and residual adds in the GEMV "
                         f"prologue) is given once, with a 'gemv' part")
    if parts.count("stream") > 1 or (stream and "gemv" not in kinds):
        raise ValueError(f"projections {spec!r}: 'stream' (the streaming GEMV kernel) is given "
                         f"once, with a 'gemv' part")
    pf = [p for p in parts if p.startswith("pf")]
    prefetch = None
    if pf:
        from pallas_kernels.gemv import MAX_PREFETCH
        if len(pf) > 1 or "gemv" not in kinds or not pf[0][2:].isdigit() \
                or int(pf[0][2:]) > MAX_PREFETCH:
            raise ValueError(f"projections {spec!r}: 'pfN' (the GEMV's prefetch depth, N in "
                             f"0..{MAX_PREFETCH}) is given once, with a 'gemv' part")
        prefetch = int(pf[0][2:])
        if stream:
            raise ValueError(f"projections {spec!r}: 'pfN' is the per-block GEMV's prefetch "
                             f"depth; with 'stream' one-row calls take the streaming kernel, "
                             f"which has none (give one of the two)")
    if len(mgpu_parts) > 1 or (mgpu_parts and ("gemv" not in kinds or "@" in mgpu_parts[0])):
        raise ValueError(f"projections {spec!r}: 'mgpu[:NAME,...]' (the Mosaic GPU GEMV for "
                         f"one-row calls; no '@ROWS') is given once, with a 'gemv' part")
    if mgpu_parts and not mgpu_available():
        raise ValueError(f"projections {spec!r}: 'mgpu' needs jax >= 0.11 with Mosaic GPU "
                         f"Pallas (jax.experimental.pallas.mosaic_gpu); this is jax "
                         f"{jax.__version__}")
    for part in (p for p in parts if p not in ("norms", "stream") and p not in mgpu_parts
                 and not p.startswith("pf")):
        kind, names, rows = _parse_part(spec, part)
        if kind in kw:
            raise ValueError(f"projections {spec!r}: '{kind}' given twice")
        kw[kind] = (names, rows)
    gemv_names, gemv_rows = kw.get("gemv", ((), GEMV_MAX_ROWS))
    gemm_names, gemm_rows = kw.get("gemm", ((), GEMM_MAX_ROWS))
    mgpu_names = ()
    if mgpu_parts == ["mgpu"]:  # no names: the gemv part's
        mgpu_names = gemv_names
    elif mgpu_parts:
        _, mgpu_names, _ = _parse_part(spec, mgpu_parts[0].replace("mgpu", "gemv", 1))
        if set(mgpu_names) - set(gemv_names):
            raise ValueError(f"projections {spec!r}: 'mgpu' names {mgpu_names} must be among "
                             f"the 'gemv' part's {gemv_names} (it replaces their one-row "
                             f"kernel)")
    return PallasGemv(gemv_names, gemv_rows, gemm_names, gemm_rows, fuse_norms, prefetch, stream,
                      mgpu_names)
