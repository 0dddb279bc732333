"""The projections' base: `XLA`, the plain einsum path (any shape, any backend) that every
projections object falls back to, and the deferred residual streams `Residual` and
`Prepared` that the Pallas paths hand from layer to layer. Split from
ouro_jax.projections, which re-exports these names."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax

from ouro_jax.split_attn import SplitAttn


class Residual(NamedTuple):
    """A residual stream not yet added up: resid + rms_norm(branch, weight). With 'norms' the
    sandwich layer hands this to the next projection, whose GEMV prologue does the add and
    the norms (the layer's small XLA norm and add kernels disappear)."""
    resid: jax.Array
    branch: jax.Array
    weight: jax.Array
    # '+flow': the gemv_flow kernel's counter state, threaded from layer to layer (the kernel
    # leaves it zeroed), so that only a loop's first layer needs a fresh one
    flow: jax.Array | None = None


class Prepared(NamedTuple):
    """'+flow4': a layer's output with the next layer's qkv projection already computed (the
    gemv_flow kernel's fourth stage): x the residual stream (added up), qkv the projection
    of rms_norm(x, the next input_layernorm), flow the kernel's counter state. '+flow5':
    attn, that layer's attention output too (the fifth stage), and caches, the attention's
    (k, v, counters) as the kernel left them (decoder_layer puts them in its state)."""
    x: jax.Array
    qkv: jax.Array | None
    flow: jax.Array
    attn: jax.Array | None = None
    caches: tuple | None = None


def _rms_norm(x, w, eps):
    from ouro_jax.model import rms_norm
    return rms_norm(x, w, eps)


def _linear(x, w):
    from ouro_jax.model import linear
    return linear(x, w)


@dataclasses.dataclass(frozen=True)
class XLA:
    """einsum projections (model.linear); the gated MLP input rounds like the reference."""

    def project(self, name: str, x: jax.Array, w: jax.Array, next_weight=None) -> jax.Array:
        """x @ w^T. next_weight: (weight, segments) a later projection reads; only the
        streaming GEMV uses it (an L2 prefetch, STREAM_TUNING's next_rows), never the result.
        x may be a split_attn.SplitAttn (o_merge), merged here first."""
        return _linear(x.merged() if isinstance(x, SplitAttn) else x, w)

    def gated(self, x: jax.Array, w: jax.Array, next_weight=None) -> jax.Array:
        from ouro_jax.model import silu
        i = w.shape[0] // 2
        gu = _linear(x, w)
        return silu(gu[..., :i]) * gu[..., i:]

    def norm(self, x, w, eps: float) -> jax.Array:
        """model.rms_norm (ouro_jax.invariant sums its squares in a fixed order)."""
        return _rms_norm(x, w, eps)

    def materialize(self, x, eps: float) -> jax.Array:
        """The residual stream as an array (a Residual is added up here)."""
        if isinstance(x, Residual):
            return x.resid + self.norm(x.branch, x.weight, eps)
        return x.x if isinstance(x, Prepared) else x

    def normed(self, name: str, x, norm_w, w, eps: float, gated: bool = False,
               next_weight=None):
        """(projection of rms_norm(x, norm_w), x as an array); gated: the gated MLP input;
        next_weight as in project."""
        x = self.materialize(x, eps)
        hx = self.norm(x, norm_w, eps)
        return (self.gated(hx, w, next_weight=next_weight) if gated else
                self.project(name, hx, w, next_weight=next_weight)), x

    def residual(self, h, m, w, eps: float):
        """The layer output h + rms_norm(m, w), now (XLA) or deferred (see Residual)."""
        return h + self.norm(m, w, eps)

    def final_norm(self, x, w, eps: float) -> jax.Array:
        """rms_norm of the residual stream after a loop's last layer (x may be deferred)."""
        return self.norm(self.materialize(x, eps), w, eps)
