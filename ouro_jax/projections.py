"""How a decoder layer computes its four projections: XLA GEMMs, or the Pallas GEMV for few rows.

`model.decoder_layer` asks a `Projections` object for qkv, o, the gated MLP input
silu(gate) * up, and down. `XLA` is the plain einsum path (any shape, any backend).
`PallasGemv(names, max_rows)` routes the named projections through pallas_kernels.gemv when
the call has at most `max_rows` rows (default 1: batch-1 decode and draft) and falls back to
XLA otherwise (prefill, verification, larger batches), so one program may mix both. On a
machine without a GPU the kernel runs in interpret mode (tests). `projections="auto"` (the
engine's default) picks the GEMV on a GPU: batch-1 decode on the H200 went from 163.7 to
179.2 tok/s with it (benchmarks/results/ab_proj_*_b1_h200.json).

The gated kernel returns silu(gate) * up directly, so XLA no longer fuses the SiLU into the
down projection's prologue (which slowed that GEMM from 7.6 to 12.3 us per call at batch 1 on
the H200, benchmarks/results/kernel_trace_pallas_b1_h200.json vs gemv_session4_h200.json).
"""

from __future__ import annotations

import dataclasses
import math

import jax

NAMES = ("qkv", "o", "gate_up", "down")

# Per projection, the GEMV tiling measured fastest at one row on the H200 among those whose
# per-row accumulators also fit 5 rows in registers (benchmarks/results/gemv_session4*_h200.*).
# One tiling per projection for every row count: a row's result then does not depend on how
# many rows share the call ('gemv@5': decode's 1 row and batch-1 verification's k+1 rows get
# bit-identical projections). Bit-identical speculation in bf16 would also need decode and
# verification to share an attention kernel: with Pallas attention they do not (decode vs
# ragged kernel), and on the H200 'gemv@5' matched greedy decode no better than 'gemv'.
GEMV_TUNING = {
    "qkv": dict(use_dot=False, block_n=16, block_k=256, num_warps=8, num_stages=1),
    "o": dict(use_dot=False, block_n=2, block_k=2048, num_warps=4, num_stages=1),
    "gate_up": dict(use_dot=False, block_n=4, block_k=256, num_warps=2, num_stages=1),
    "down": dict(use_dot=False, block_n=4, block_k=512, num_warps=4, num_stages=1),
}
# Calls with more rows go to XLA. Default 1: at 5 rows the kernel is 3-5x slower than XLA
# (qkv 37.4 vs 7.8 us, gemv_engine_session4_h200.json), which took batch-1 speculative k=4
# from ~230 to 209.8 tok/s (decode_session4_greedy_h200.json).
GEMV_MAX_ROWS = 1
# 'gemv@N' takes N up to 5: the tilings above were compiled (offline_compile) and measured
# for 1-5 rows; gate/up uses 254 registers per thread at 5 rows, more would spill.
GEMV_ROW_LIMIT = 5


def fit_tuning(tuning: dict, n_out: int, k: int) -> dict:
    """The tuning with block sizes shrunk (by halving) until they divide this shape: the
    measured tilings are for the 1.4B/2.6B shapes; small test models get smaller tiles."""
    from pallas_kernels.gemv import pow2_divisor
    out = dict(tuning)
    out["block_n"] = pow2_divisor(n_out, tuning["block_n"])
    out["block_k"] = pow2_divisor(k, tuning["block_k"])
    if out["use_dot"] and out["block_n"] < 16:
        out["use_dot"] = False
    return out


def _linear(x, w):
    from ouro_jax.model import linear
    return linear(x, w)


@dataclasses.dataclass(frozen=True)
class XLA:
    """einsum projections (model.linear); the gated MLP input rounds like the reference."""

    def project(self, name: str, x: jax.Array, w: jax.Array) -> jax.Array:
        return _linear(x, w)

    def gated(self, x: jax.Array, w: jax.Array) -> jax.Array:
        from ouro_jax.model import silu
        i = w.shape[0] // 2
        gu = _linear(x, w)
        return silu(gu[..., :i]) * gu[..., i:]


@dataclasses.dataclass(frozen=True)
class PallasGemv(XLA):
    names: tuple = NAMES
    max_rows: int = GEMV_MAX_ROWS

    @property
    def spec(self) -> str:
        """The canonical spec string: parse(p.spec) == p."""
        rows = "" if self.max_rows == GEMV_MAX_ROWS else f"@{self.max_rows}"
        names = "" if self.names == NAMES else ":" + ",".join(self.names)
        return "gemv" + rows + names

    def _use(self, name: str, x: jax.Array) -> bool:
        return name in self.names and math.prod(x.shape[:-1]) <= self.max_rows

    def _gemv(self, name, x, w, gated=False):
        from pallas_kernels.gemv import gemv
        lead = x.shape[:-1]
        interpret = jax.default_backend() != "gpu"
        n_out = w.shape[0] // 2 if gated else w.shape[0]
        y = gemv(x.reshape(-1, x.shape[-1]), w, gated=gated, interpret=interpret,
                 **fit_tuning(GEMV_TUNING[name], n_out, x.shape[-1]))
        return y.reshape(*lead, y.shape[-1])

    def project(self, name, x, w):
        return self._gemv(name, x, w) if self._use(name, x) else _linear(x, w)

    def gated(self, x, w):
        return self._gemv("gate_up", x, w, gated=True) if self._use("gate_up", x) else \
            super().gated(x, w)


def resolve(spec: str) -> str:
    """'auto' -> 'gemv' where the Pallas kernels run natively (a GPU), else 'xla' (on a CPU
    the kernel would run in interpret mode: exact but slow). Other specs pass through."""
    if spec != "auto":
        return spec
    from ouro_jax.attention import resolve_backend
    return "gemv" if resolve_backend("auto") == "pallas" else "xla"


def parse(spec: str):
    """'xla' -> XLA(); 'gemv' -> all four through the GEMV for one-row calls; 'gemv@5' -> for
    calls of up to 5 rows; 'gemv:gate_up,down' (or 'gemv@5:...') -> only those; 'auto' -> see
    resolve."""
    spec = resolve(spec)
    if spec in ("", "xla"):
        return XLA()
    head, sep, names = spec.partition(":")
    kind, at, rows = head.partition("@")
    if kind != "gemv":
        raise ValueError(f"unknown projections {spec!r}: 'xla', 'gemv[@ROWS][:NAME,...]' "
                         f"with NAME in {NAMES}")
    max_rows = GEMV_MAX_ROWS
    if at:
        if not rows.isdigit() or not 1 <= int(rows) <= GEMV_ROW_LIMIT:
            raise ValueError(f"projections {spec!r}: ROWS after '@' must be 1..{GEMV_ROW_LIMIT}")
        max_rows = int(rows)
    if sep and not names:
        raise ValueError(f"unknown projection name(s) [] in {spec!r}: give NAME,... after ':' "
                         f"with NAME in {NAMES}, or leave out the ':'")
    chosen = tuple(n for n in names.split(",") if n) if names else NAMES
    bad = sorted(set(chosen) - set(NAMES))
    if bad or not chosen:
        raise ValueError(f"unknown projection name(s) {bad} in {spec!r}; choose from {NAMES}")
    return PallasGemv(tuple(n for n in NAMES if n in chosen), max_rows)
