"""Token selection in fp32: greedy, temperature, top-k, top-p; per-request seeded draws.

Every random draw uses a key derived from (request seed, token position, purpose), never from
a batch-wide key, so a request's tokens depend only on its own seed and position: batch order,
batch size and padding cannot change them.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Collection
from collections.abc import Set as AbstractSet
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

# Purposes keep draws for the same position independent of each other.
PURPOSE_SAMPLE = 0
PURPOSE_DRAFT = 1
PURPOSE_ACCEPT = 2
PURPOSE_RESIDUAL = 3
PURPOSE_BONUS = 4


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings. temperature 0 means greedy."""
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False
    stop_token_ids: Sequence[int] = ()
    logprobs: bool = False

    def __post_init__(self):
        # numpy integers and floats are welcome; values that only look like numbers are not
        # (a float token id or seed would be truncated without a word)
        max_tokens = as_int(self.max_tokens, "max_tokens")
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        temperature = as_real(self.temperature, "temperature")
        # an infinite (or float32-overflowing) temperature flattens every logit to a tie
        if not 0.0 <= temperature <= float(np.finfo(np.float32).max):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        top_p = as_real(self.top_p, "top_p")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        top_k = as_int(self.top_k, "top_k")
        if not 0 <= top_k < 2**31:  # (an int32 on the device; above the vocab it keeps all)
            raise ValueError(f"top_k must be an integer in [0, 2**31), got {self.top_k!r}")
        seed = as_int(self.seed, "seed")
        if not 0 <= seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed!r}")
        for name in ("ignore_eos", "logprobs"):  # "no" or "false" would read as True
            object.__setattr__(self, name, as_bool(getattr(self, name), name))
        stops = self.stop_token_ids
        if hasattr(stops, "__array__"):  # numpy or jax arrays of ids
            stops = np.asarray(stops).reshape(-1).tolist()
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Collection):
            raise ValueError(f"stop_token_ids must be a collection of token ids, got {stops!r}")
        stops = tuple(as_int(t, "stop_token_ids entry") for t in stops)
        if isinstance(self.stop_token_ids, AbstractSet):
            stops = tuple(sorted(stops))  # a set's order is not stable across processes
        for name, value in (("max_tokens", max_tokens), ("temperature", temperature),
                            ("top_p", top_p), ("top_k", top_k), ("seed", seed),
                            ("stop_token_ids", stops)):
            object.__setattr__(self, name, value)


def _scalar(value, kinds: str):
    """A 0-d numpy or jax array of one of the dtype `kinds` as a Python scalar; else value."""
    if hasattr(value, "__array__") and getattr(value, "ndim", None) == 0:
        arr = np.asarray(value)
        if arr.dtype.kind in kinds:
            return arr.item()
    return value


def as_int(value, what: str) -> int:
    """`value` as a Python int when it is an integer (int, numpy or jax integer, not a
    bool); otherwise a ValueError naming `what`."""
    v = _scalar(value, "iu")
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Integral):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(v)


def as_bool(value, what: str) -> bool:
    """`value` as a Python bool when it is a bool (Python, numpy, a 0-d array) or the
    integer 0 or 1; a string such as "no" is a ValueError, not True."""
    v = _scalar(value, "biu")
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, numbers.Integral) and v in (0, 1):
        return bool(v)
    raise ValueError(f"{what} must be True or False, got {value!r}")


def as_real(value, what: str) -> float:
    """`value` as a Python float when it is a real number (not a bool or a string)."""
    v = _scalar(value, "iuf")
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, numbers.Real):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return float(v)


class SamplingArrays(NamedTuple):
    """Device-side per-row sampling parameters [B]."""
    temperature: jax.Array  # f32
    top_k: jax.Array  # i32, 0 = off
    top_p: jax.Array  # f32
    seed: jax.Array  # u32


class SamplingMode(NamedTuple):
    """Static (compile-time) switches so greedy batches compile no sampling code."""
    sample: bool = False
    top_k: bool = False
    top_p: bool = False

    @classmethod
    def for_requests(cls, params: Sequence[SamplingParams]) -> "SamplingMode":
        sample = any(p.temperature > 0 for p in params)
        return cls(sample=sample, top_k=sample and any(p.top_k > 0 for p in params),
                   top_p=sample and any(p.top_p < 1.0 for p in params))


def row_keys(seed: jax.Array, position: jax.Array, purpose: int) -> jax.Array:
    """One key per row from (seed, position, purpose)."""
    def one(s, p):
        key = jax.random.fold_in(jax.random.PRNGKey(s), p)
        return jax.random.fold_in(key, purpose)
    return jax.vmap(one)(seed.astype(jnp.uint32), position.astype(jnp.int32))


def processed_logits(logits: jax.Array, arrays: SamplingArrays, mode: SamplingMode) -> jax.Array:
    """fp32 logits after temperature, top-k and top-p; filtered entries are -inf.

    Rows with temperature 0 are left unscaled (their argmax is what counts). The others are
    shifted by their largest logit before the division (the same distribution): a tiny
    temperature then sends every logit but the largest towards -inf, where dividing the raw
    logits would overflow several of them to +inf and draw among those ties."""
    x = logits.astype(jnp.float32)
    temp = arrays.temperature[:, None]
    top = jnp.max(x, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)  # (an inf or NaN row: no inf - inf NaNs)
    shifted = (x - top) / jnp.where(temp > 0, temp, 1.0)
    x = jnp.where(temp > 0, shifted, x)
    vocab = x.shape[-1]
    if mode.top_k or mode.top_p:
        sorted_x = jnp.sort(x, axis=-1)[:, ::-1]
    if mode.top_k:
        k = jnp.clip(arrays.top_k, 1, vocab)
        kth = jnp.take_along_axis(sorted_x, (k - 1)[:, None], axis=-1)
        keep = (arrays.top_k[:, None] == 0) | (x >= kth)  # exact ties at the k-th are kept
        x = jnp.where(keep, x, -jnp.inf)
        sorted_x = jnp.where(jnp.arange(vocab)[None] < jnp.where(arrays.top_k == 0, vocab, k)[:, None],
                             sorted_x, -jnp.inf)
    if mode.top_p:
        probs = jax.nn.softmax(sorted_x, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each sorted entry
        # The top entry always stays (as HF's min_tokens_to_keep=1): a top_p that is 0 in
        # fp32 or flushed as a denormal would otherwise filter every token out.
        keep_sorted = (before < arrays.top_p[:, None]) | (jnp.arange(vocab) == 0)[None]
        # Smallest kept logit is the cut-off; ties at the cut-off are kept.
        cutoff = jnp.min(jnp.where(keep_sorted, sorted_x, jnp.inf), axis=-1, keepdims=True)
        x = jnp.where(x >= cutoff, x, -jnp.inf)
    return x


def sample(logits: jax.Array, arrays: SamplingArrays, mode: SamplingMode, positions: jax.Array,
           purpose: int = PURPOSE_SAMPLE) -> jax.Array:
    """Token per row [B]: argmax for greedy rows, a seeded draw from the processed
    distribution for the others. `positions` is the position the new token will occupy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if not mode.sample:
        return greedy
    x = processed_logits(logits, arrays, mode)
    keys = row_keys(arrays.seed, positions, purpose)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, x).astype(jnp.int32)
    return jnp.where(arrays.temperature > 0, drawn, greedy)


def token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """Raw log_softmax of the (unprocessed) logits at the chosen tokens, fp32."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]


def sampling_arrays(params: Sequence[SamplingParams], batch: int) -> SamplingArrays:
    """Host -> device per-row arrays, padded to `batch` with greedy rows."""
    import numpy as np

    pad = batch - len(params)
    col = lambda f, fill, dt: np.array([f(p) for p in params] + [fill] * pad, dt)
    # jax.device_put, not jnp.asarray: the latter runs an eager XLA program per array
    return jax.device_put(SamplingArrays(
        temperature=col(lambda p: p.temperature, 0.0, np.float32),
        top_k=col(lambda p: p.top_k, 0, np.int32),
        top_p=col(lambda p: p.top_p, 1.0, np.float32),
        seed=col(lambda p: p.seed, 0, np.uint32),
    ))
