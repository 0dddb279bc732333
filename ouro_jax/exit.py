"""Choosing a token's logits among the loops (../shared/OURO.md's exit gate): the exit
probabilities and their running sum computed op by op as the reference does, a threshold's
exit step, and ExitSpec, the reference's priority among a fixed step, a threshold and the
probability-weighted mix. The gate's logits come from model.exit_gate_logit."""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from ouro_jax.config import OuroConfig
from ouro_jax.params import OuroParams
from ouro_jax.sampling import as_bool, as_int, as_real


def _default_head(params: OuroParams, h: jax.Array) -> jax.Array:
    from ouro_jax.model import lm_head  # (model imports this module)
    return lm_head(params, h)


def exit_probabilities(gate_logits: jax.Array) -> jax.Array:
    """p_t over loops (axis 0), computed op by op in the gate's dtype like the reference.

    p_t = lambda_t * prod_{j<t}(1 - lambda_j) for t < T-1; the last step takes the remainder.
    """
    # sigmoid in fp32, rounded once: XLA's CPU bf16 logistic is off by an ulp in ~1/3 of
    # inputs, where torch.sigmoid is correctly rounded.
    lam = jax.nn.sigmoid(gate_logits.astype(jnp.float32)).astype(gate_logits.dtype)
    remaining = jnp.ones_like(lam[0])
    probs = []
    n = gate_logits.shape[0]
    for t in range(n):
        if t < n - 1:
            probs.append(lam[t] * remaining)
            remaining = remaining * (1 - lam[t])
        else:
            probs.append(remaining)
    return jnp.stack(probs)


def exit_cdf(probs: jax.Array) -> jax.Array:
    """Cumulative exit probability, accumulated in fp32 and rounded per step to probs.dtype
    (what torch.cumsum does for low-precision inputs)."""
    acc = jnp.cumsum(probs.astype(jnp.float32), axis=0)
    return acc.astype(probs.dtype)


def threshold_exit_step(gate_logits: jax.Array, threshold: float | jax.Array) -> jax.Array:
    """First loop whose cumulative exit probability reaches `threshold`, else the last loop."""
    cdf = exit_cdf(exit_probabilities(gate_logits))
    n = gate_logits.shape[0]
    reached = cdf >= jnp.asarray(threshold, dtype=cdf.dtype)
    reached = reached.at[n - 1].set(True)
    return jnp.argmax(reached, axis=0).astype(jnp.int32)


class ExitSpec(NamedTuple):
    """How logits are chosen among the loops, in the reference's priority order.

    exit_at_step: fixed loop index (wins over everything).
    threshold: per-token early exit on the cumulative gate probability; None means the
        config's early_exit_threshold.
    weighted: mix every loop's logits by the exit probabilities. Only used when no
        exit_at_step is given and no explicit threshold is given.
    """
    exit_at_step: Optional[int] = None
    threshold: Optional[float] = None
    weighted: bool = False

    def mode(self) -> str:
        if self.exit_at_step is not None:
            return "step"
        if self.weighted and self.threshold is None:
            return "weighted"
        return "threshold"

    def validate(self, cfg: OuroConfig, num_loops: Optional[int] = None) -> "ExitSpec":
        """The spec with plain Python values (a numpy or jax scalar is converted: the spec is
        a static argument of compiled programs, so it must hash), each refused by name."""
        n = cfg.total_ut_steps if num_loops is None else num_loops
        step = None if self.exit_at_step is None else as_int(self.exit_at_step, "exit_at_step")
        if step is not None and not 0 <= step < n:
            raise ValueError(f"exit_at_step={step} is outside 0..{n - 1}")
        threshold = None if self.threshold is None else as_real(self.threshold, "exit threshold")
        if threshold is not None and not 0.0 <= threshold <= 1.0:
            raise ValueError(f"exit threshold {threshold} is outside [0, 1]")
        # (a string such as "no" would otherwise read as True)
        return ExitSpec(step, threshold, as_bool(self.weighted, "weighted_exit"))


def select_exit(params: OuroParams, hidden: jax.Array, gate_logits: jax.Array,
                cfg: OuroConfig, spec: ExitSpec = ExitSpec(), head=None):
    """Logits [..., V] and exit step [...] from per-loop states hidden [T, ..., D].
    head(params, h): the LM head (default model.lm_head; ouro_jax.invariant has its own)."""
    to_logits = head or _default_head
    mode = spec.mode()
    n = hidden.shape[0]
    if mode == "step":
        step = jnp.full(hidden.shape[1:-1], spec.exit_at_step, jnp.int32)
        return to_logits(params, hidden[spec.exit_at_step]), step
    if mode == "weighted":
        probs = exit_probabilities(gate_logits)
        logits = sum(probs[t][..., None].astype(jnp.float32)
                     * to_logits(params, hidden[t]).astype(jnp.float32) for t in range(n))
        step = jnp.full(hidden.shape[1:-1], n - 1, jnp.int32)  # every loop contributes
        return logits.astype(hidden.dtype), step
    threshold = cfg.early_exit_threshold if spec.threshold is None else spec.threshold
    step = threshold_exit_step(gate_logits, threshold)
    chosen = jnp.take_along_axis(hidden, step[None, ..., None], axis=0)[0]
    return to_logits(params, chosen), step
