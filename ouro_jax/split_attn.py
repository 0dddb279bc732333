"""A decode attention output still in its flash-decoding splits (opt-in: the decode kernel's
tuning `o_merge=1`, ouro_jax.attention.O_MERGE).

At one row the decode kernel splits each KV head's keys over S programs; by default an XLA
kernel merges their partials (pallas_kernels._common.combine_splits) before the o projection.
With o_merge the attention hands the partials on as a SplitAttn, and the o projection's
streaming GEMV merges them in its prologue (pallas_kernels.gemv_merge): one kernel fewer per
layer application. Anything else that meets a SplitAttn (another projection backend, more
rows, a tiling the merge cannot take) merges it first with the same XLA combine, so the
result never depends on who merged.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax

from ouro_jax import trace_once
from ouro_jax.projection_tuning import STREAM_TUNING, fit_stream_tuning


class SplitAttn(NamedTuple):
    """parts [B, KVH, S, G, hd] fp32 normalised partials and lse [B, KVH, S, G] their
    log-sum-exps, for an attention output of shape lead + (KVH * G * hd,) in out_dtype.
    Made and consumed inside one layer's trace; as a NamedTuple its lead and out_dtype
    would be pytree leaves, so it must not cross a jit, scan or cond boundary."""
    parts: jax.Array
    lse: jax.Array
    lead: tuple
    out_dtype: Any

    @property
    def shape(self) -> tuple:
        _, kvh, _, g, hd = self.parts.shape
        return (*self.lead, kvh * g * hd)

    @property
    def dtype(self):
        return self.out_dtype

    def merged(self) -> jax.Array:
        """The attention output as the default path has it: the XLA combine, rounded."""
        from pallas_kernels._common import combine_splits
        out = combine_splits(self.parts, self.lse, axis=2)
        return out.astype(self.out_dtype).reshape(self.shape)


def merge_tuning(split: SplitAttn, n_out: int) -> dict | None:
    """The o projection's streaming tiling (STREAM_TUNING["o"], fitted to the shape) with
    block_k holding whole KV heads, as gemv_merge needs; None where no such block_k is a
    power of two, or the tiling sets one of gemv_merge.MERGE_EXCLUDES (then the caller
    merges first)."""
    from pallas_kernels.gemv_merge import MERGE_EXCLUDES
    _, kvh, _, g, hd = split.parts.shape
    k = kvh * g * hd
    t = fit_stream_tuning(STREAM_TUNING["o"], n_out, k)
    unit = g * hd
    if unit & (unit - 1) or any(t.get(key) for key in MERGE_EXCLUDES):
        return None
    heads = max(1, t["block_k"] // unit)
    while kvh % heads:
        heads //= 2
    t["block_k"] = heads * unit
    return t


def project_o(split: SplitAttn, w: jax.Array, interpret: bool, next_operand: dict):
    """split's merged output @ w^T through gemv_merge (the merge as the GEMV's prologue), in
    the projection's leading shape; None where merge_tuning finds no tiling."""
    from pallas_kernels.gemv_merge import gemv_stream_merged
    tuning = merge_tuning(split, w.shape[0])
    if tuning is None:
        return None
    y = trace_once.call(gemv_stream_merged, split.parts, split.lse, w, dtype=split.out_dtype,
                        interpret=interpret, **next_operand, **tuning)
    return y.reshape(*split.lead, w.shape[0])
