"""How a decoder layer computes its four projections: XLA GEMMs, or the Pallas GEMV for few rows.

`model.decoder_layer` asks a `Projections` object for qkv, o, the gated MLP input
silu(gate) * up, and down. `XLA` (ouro_jax.projection_xla) is the plain einsum path (any
shape, any backend).
`PallasGemv(names, max_rows)` routes the named projections through pallas_kernels.gemv when
the call has at most `max_rows` rows (default 1: batch-1 decode and draft) and falls back to
XLA otherwise (prefill, verification, larger batches), so one program may mix both. On a
machine without a GPU the kernel runs in interpret mode (tests). `projections="auto"` (the
engine's default) picks the GEMV on a GPU: batch-1 decode on the H200 went from 163.7 to
179.2 tok/s with it (benchmarks/results/ab_proj_*_b1_h200.json), since session 7 it picks
'gemv+norms+stream' (210.6 -> 231.9 tok/s), and since session 43 'gemv+norms+stream+inv'
(GPU_DEFAULT).

Parts, measured on the H200 (docs/performance.md; '+norms' and '+stream' together are the
GPU default):
'+gemm[@N]' sends calls of 2..N rows to the skinny Pallas GEMM (pallas_kernels.gemm), and
'+norms' moves the RMSNorms and residual adds around qkv and gate/up into the GEMV prologue
(the layer output is then a deferred `Residual` that the next qkv GEMV adds up), '+pfN'
sets the GEMV's prefetch depth, and '+stream' swaps in the streaming GEMV
(pallas_kernels.gemv_stream: x and the norm prologue once per program, the K loop unrolled)
for one-row calls. '+inv[@LO-HI]' (in GPU_DEFAULT since session 43) sends calls of LO..HI
rows (default 2-64: native and draft decode at batch 2-64, verification up to batch 12 at
k=4) to the batch-invariant mode's kernels (ouro_jax.invariant: the Pallas GEMM at its row
routes, the residual adds and norms in add_norm kernels): on an H100, native decode +6 to
+10% at batch 8-64 (docs/performance.md, "Session 43").

The gated kernel returns silu(gate) * up directly, so XLA no longer fuses the SiLU into the
down projection's prologue (which slowed that GEMM from 7.6 to 12.3 us per call at batch 1 on
the H200, benchmarks/results/kernel_trace_pallas_b1_h200.json vs gemv_session4_h200.json).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from ouro_jax import trace_once
# The XLA base and the deferred residual types live in projection_xla; re-exported here.
from ouro_jax.projection_xla import XLA, Prepared, Residual, _linear  # noqa: F401
from ouro_jax.split_attn import SplitAttn, project_o

# The tables and fits live in projection_tuning; re-exported here, where callers and
# benchmarks.tuning have always found them (the same dict objects).
from ouro_jax.projection_tuning import (  # noqa: F401
    GEMM_MAX_ROWS, GEMM_ROW_LIMIT, GEMM_TUNING, GEMV_MAX_ROWS, GEMV_ROW_LIMIT, GEMV_TUNING,
    INV_ROWS, MGPU_TUNING, NAMES, STREAM_MAX_ROWS, STREAM_TUNING, fit_gemm_tuning,
    fit_mgpu_tuning, fit_stream_tuning, fit_tuning, mgpu_available)


def _next_operand(name: str, next_weight) -> dict:
    """The streaming GEMV's next_w / next_split for `next_weight` = (weight, segments), when
    this projection's STREAM_TUNING asks for an L2 prefetch of it (next_rows > 0)."""
    if next_weight is None or not STREAM_TUNING[name].get("next_rows", 0):
        return {}
    w, segments = next_weight
    return {"next_w": w, "next_split": segments}


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
    # '+flow' (3) / '+flow4' (4) / '+flow5' (5): a one-row layer's o -> gate/up -> down [->
    # the next layer's qkv [-> its attention]] as one gemv_flow kernel; 0: off
    flow: int = 0
    # '+graph': a one-row loop's layers as one CUDA graph of our own (ouro_jax.graph_loop)
    graph: bool = False
    # '+inv[@LO-HI]': calls of LO..HI rows (default INV_ROWS) through the batch-invariant
    # mode's kernels (ouro_jax.invariant: its Pallas GEMM tiles, the residual adds and norms
    # in add_norm kernels); (): off. Those calls' results are not the XLA GEMMs' bits.
    inv_rows: tuple = ()
    # '+stream@N': the streaming GEMV for calls of up to N rows (default STREAM_MAX_ROWS)
    stream_rows: int = STREAM_MAX_ROWS

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
            parts.append("stream" + ("" if self.stream_rows == STREAM_MAX_ROWS
                                     else f"@{self.stream_rows}"))
        if self.mgpu_names:
            parts.append("mgpu" + ("" if self.mgpu_names == NAMES else
                                   ":" + ",".join(self.mgpu_names)))
        if self.prefetch is not None:
            parts.append(f"pf{self.prefetch}")
        if self.flow:
            from ouro_jax.projection_spec import FLOW_NAME
            parts.append(FLOW_NAME[self.flow])
        if self.graph:
            parts.append("graph")
        if self.inv_rows:
            parts.append("inv" + ("" if self.inv_rows == INV_ROWS else
                                  "@%d-%d" % self.inv_rows))
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

    def _inv(self, x) -> bool:
        """Whether a call on x (an array or a Residual) takes the batch-invariant kernels."""
        base = x.resid if isinstance(x, Residual) else x
        if not self.inv_rows or not hasattr(base, "shape"):  # (a Prepared: flow, one row)
            return False
        rows = math.prod(base.shape[:-1])
        return self.inv_rows[0] <= rows <= self.inv_rows[1]

    def _streams(self, x) -> bool:
        return self.stream and math.prod(x.shape[:-1]) <= self.stream_rows

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
        if self.inv_rows:  # (the GEMM's tiles: every projection dim a multiple of 16)
            from ouro_jax.invariant import check_model
            try:
                check_model(cfg)
            except ValueError as e:
                raise ValueError(f"projections '{self.spec}': '+inv' runs calls of "
                                 f"{self.inv_rows[0]}-{self.inv_rows[1]} rows through the "
                                 f"batch-invariant mode's kernels, which refuse this model "
                                 f"({e}); leave out '+inv' or use projections='auto'") from None
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
        if self._inv(x):
            return _inv_kernels().normed(name, x, norm_w, w, eps, gated)
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

    def flows(self, attn, lp) -> bool:
        """Whether this layer's o -> gate/up -> down goes through one gemv_flow kernel."""
        return (self.flow and lp.gate_up_proj is not None and self._streams(attn)
                and not self.mgpu_names
                and all(self._route(n, attn) == "gemv" for n in ("o", "gate_up", "down")))

    def mlp_flow(self, attn, x, lp, eps, state=None, next_lp=None, attention=None):
        """The layer after attention in one kernel (pallas_kernels.gemv_flow: o, then gate/up
        of rms_norm(x + rms_norm(o, input_layernorm_2), post_attention_layernorm), then
        down), the same bits as the three streaming GEMVs at the same tilings. state: the
        previous layer's (Residual.flow / Prepared.flow), or None for a fresh one. Returns
        the layer output as residual() gives it, carrying the state when deferred; with
        '+flow4' and next_lp (the next layer's weights, same loop) a Prepared: the kernel
        also computes that layer's qkv, with '+flow5' and `attention` (its decode attention
        as a flow_attention.AttnStage) that layer's attention too. A handover that gives up
        (gemv_flow.give_ups) stops the kernel (trap=True): an error at the next
        synchronisation, never wrong tokens."""
        from pallas_kernels.gemv_flow import gemv_flow, state_for, state_size
        lead, k = x.shape[:-1], x.shape[-1]
        four = self.flow >= 4 and next_lp is not None and next_lp.qkv_proj is not None
        five = four and self.flow == 5 and attention is not None
        stages = _flow_stages(lp, next_lp if four else None, attention if five else None)
        ys, xs, state, *caches = trace_once.call(
            gemv_flow, attn.reshape(-1, attn.shape[-1]), stages,
            state_for(len(stages)) if state is None or state.shape[0] != state_size(len(stages))
            else state, h=x.reshape(-1, k), eps=eps,
            interpret=jax.default_backend() != "gpu", trap=True,
            num_warps=FLOW_NUM_WARPS)
        if five:
            return Prepared(xs[1].reshape(*lead, k), None, state,
                            ys[4].reshape(*lead, ys[4].shape[-1]), caches[0][0])
        if four:
            return Prepared(xs[1].reshape(*lead, k), ys[3].reshape(*lead, ys[3].shape[-1]),
                            state)
        out = self.residual(xs[0].reshape(*lead, k), ys[2].reshape(*lead, k),
                            lp.post_attention_layernorm_2, eps)
        return out._replace(flow=state) if isinstance(out, Residual) else out

    def residual(self, h, m, w, eps):
        # Deferred when the next layer's qkv GEMV (or, '+inv', add_norm) can take it (same
        # rows); run_loop materializes what is left after the last layer.
        return Residual(h, m, w) if self._fuses("qkv", h) or self._inv(h) else \
            super().residual(h, m, w, eps)

    def materialize(self, x, eps):
        if self._inv(x):
            return _inv_kernels().materialize(x, eps)
        return super().materialize(x, eps)

    def final_norm(self, x, w, eps):
        if self._inv(x):
            return _inv_kernels().final_norm(x, w, eps)
        return super().final_norm(x, w, eps)

    def project(self, name, x, w, next_weight=None):
        if not isinstance(x, SplitAttn) and self._inv(x):
            # (o's and down's split-K partials: the Residual's add_norm sums them)
            return _inv_kernels().project(name, x, w)
        route = self._route(name, x)
        if isinstance(x, SplitAttn):  # o_merge: the streaming o GEMV merges it, else XLA
            y = None
            if name == "o" and route == "gemv" and self._streams(x) and not self._mgpus(name, x):
                y = project_o(x, w, jax.default_backend() != "gpu",
                              _next_operand(name, next_weight))
            if y is not None:
                return y
            x = x.merged()
        if route == "gemv":
            return self._gemv(name, x, w, next_weight=next_weight)
        return self._gemm(name, x, w) if route == "gemm" else _linear(x, w)

    def gated(self, x, w, next_weight=None):
        if self._inv(x):
            return _inv_kernels().gated(x, w)
        route = self._route("gate_up", x)
        if route == "gemv":
            return self._gemv("gate_up", x, w, gated=True, next_weight=next_weight)
        return self._gemm("gate_up", x, w, gated=True) if route == "gemm" else \
            super().gated(x, w)


# What 'auto' means on a GPU: one-row projections through the streaming GEMV with the
# RMSNorms and residual adds in its prologues (batch-1 native greedy on the H200: 'gemv'
# 210.6, 'gemv+stream' 218.9, 'gemv+norms+stream' 231.9 tok/s,
# benchmarks/results/ab_gemv*_b1_session7_h200.json), and since session 43 calls of 2-64
# rows through the batch-invariant mode's kernels ('+inv': on one H100, native 1,248.3 ->
# 1,333.2 tok/s at batch 8, 4,048.8 -> 4,427.1 at 32, 6,381.9 -> 6,960.9 at 64,
# benchmarks/results/decode_{base,inv}_session43_h100.json).
GPU_DEFAULT = "gemv+norms+stream+inv"

def _inv_kernels():
    """The batch-invariant mode's projections ('+inv'; imported late: invariant imports this
    module)."""
    from ouro_jax.invariant import Invariant
    return Invariant()


# The spec strings ('auto', 'gemv+norms+stream', ...) are read in projection_spec; re-exported
# here, where callers have always found them (imported last: it builds these classes).
from ouro_jax.projection_spec import (_LIMITS, _parse_part, auto_fit, parse,  # noqa: E402,F401
                                      resolve)
# The gemv_flow stages' tilings live in projection_flow; re-exported for their callers.
from ouro_jax.projection_flow import FLOW_NUM_WARPS, _flow_stages, flow_tiling  # noqa: E402,F401
