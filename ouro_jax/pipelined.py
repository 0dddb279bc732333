"""Pipelined self-speculation: the draft of the next token and the rest of the current one
share each pass over the weights.

Ouro's draft is the model's first d loops and the target runs all T = 2d loops, so a
token's loops d..T-1 take as many passes as the draft of the next token. A *tick* runs d
passes over the layer stack on 2B rows (B sequences): in pass i, the *lead* row of a
sequence runs loop i at its newest position, and its *trail* row runs loop d + i at the
position before, starting from the states the lead left there one tick earlier. The layers'
weights are read once for both rows; the attention reads each row's own plane (loop) of
the cache (`model.run_loops`' loop_offset, the decode kernel's per-row plane).

For each sequence, before a tick (`lengths` = L; `tokens` = x_L, committed, at position L):
- trail off: the lead runs position L with x_L. The trail row still runs (on stale
  states, writing loops d..T-1 at position L, which the next tick rewrites before anyone
  reads them) and its result is dropped; on the Pallas path it attends over at most 2
  keys (skip_done). Nothing is committed; the lead's loop d-1 state drafts c_{L+1} and its
  d states are held: trail on.
- trail on (L's first d loops held, the draft c_{L+1}): the lead runs position L + 1 with
  c_{L+1} while the trail finishes L. Exit selection over L's T states gives the exact
  x_{L+1}, committed as plain decoding would. If x_{L+1} = c_{L+1}, the lead's work at L + 1
  was exact: it is held and drafts c_{L+2}; else the trail is off, and the lead redoes L + 1
  with x_{L+1} on the next tick.
Sampling accepts c_{L+1} by rejection sampling (speculative._accept with k = 1), so the
output follows the target's distribution. Greedy output is plain greedy decoding's in exact
arithmetic (fp32 tests); in bf16 the 2B-row calls round otherwise than plain decoding's
B-row ones on a GPU, except in the batch-invariant mode, where it is the same bits (test).

Cost: d passes per tick, and a tick commits a token unless the one before rejected its
draft: 1 / (2 - a) tokens per tick at acceptance a. At d = 2, a = 0.857 that is 2.29 passes
(on 2B rows) per token, against plain decoding's 4 and k=4 speculation's ~2.8.

The pipeline (held states, drafts, which trails are on) stays on the device from one host
fetch to the next, with the counters (`init_carry`, `pipe_chunk`); only the counters are
fetched. Positions at or past `lengths` may hold the lead's K/V: a rejected draft's are rewritten
before anything reads them (kv_cache's rollback rule), an accepted one's are the held
position's. When a batch ends, the cache is released with it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ouro_jax import engine
from ouro_jax.invariant import head_for, logprobs_for
from ouro_jax.model import embed, select_exit
from ouro_jax.sampling import PURPOSE_DRAFT, processed_logits, sample
from ouro_jax.speculative import SpecCounters, _accept


def check(sc, cfg) -> None:
    """Refuses what a pipelined round cannot run, by name (before any work is done)."""
    t = cfg.total_ut_steps
    if sc.k != 1:
        raise ValueError(f"pipelined speculation drafts one token per tick: k must be 1, got "
                         f"k={sc.k}")
    if 2 * sc.draft_loops != t:
        raise ValueError(f"pipelined speculation runs the draft's loops beside the rest of the "
                         f"model's, so draft_loops must be half of total_ut_steps={t}; got "
                         f"draft_loops={sc.draft_loops}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pipe:
    """What a tick hands the next one, per sequence (B rows)."""
    on: jax.Array  # [B] bool: position `lengths` has its first d loops held (trail on)
    cand: jax.Array  # [B] int32: the draft for position lengths + 1 (when on)
    h: jax.Array  # [d, B, D]: the held states of position `lengths`
    g: jax.Array  # [d, B]: their exit-gate logits
    qlp: jax.Array  # [B, V] (sampling; else [B, 1]): the draft's processed log-probs


def init_carry(cfg, sc, mode, state, dtype) -> tuple:
    """(SpecCounters, Pipe) before the first fetch: zeros, every trail off, staged from the
    host (eager jnp.zeros would run an XLA program per array)."""
    b, d = state.tokens.shape[0], sc.draft_loops
    v = cfg.vocab_size if mode.sample else 1
    z = lambda shape, dt: np.zeros(shape, dt)
    counters = SpecCounters(*(z((b,), np.int32) for _ in range(3)))
    pipe = Pipe(z((b,), np.bool_), z((b,), np.int32), z((d, b, cfg.hidden_size), dtype),
                z((d, b), dtype), z((b, v), np.float32))
    return jax.device_put((counters, pipe))


def _heads(params, lead_h, hidden, gates, *, cfg, spec, backend):
    """(draft logits [B, V], target logits [B, V], exit steps [B]): one LM-head call on 2B
    rows where the exit spec picks one state per token (the weighted mix needs them all)."""
    head = head_for(backend)
    if spec.mode() == "weighted":
        logits_t, steps = select_exit(params, hidden, gates, cfg, spec, head)
        return head(params, lead_h), logits_t, steps
    chosen, steps = select_exit(params, hidden, gates, cfg, spec, lambda p, x: x)
    b = lead_h.shape[0]
    both = head(params, jnp.concatenate([lead_h, chosen], axis=0))
    return both[:b], both[b:], steps


def _verify(logits_t, pipe, state, *, sc, mode):
    """(the committed token x [B], whether the draft was accepted [B]) for trail rows."""
    if not mode.sample:  # (every row greedy)
        target = jnp.argmax(logits_t, axis=-1).astype(jnp.int32)
        return target, pipe.cand == target
    # _accept at k = 1 (its keys: position L + 1, as a k = 1 round's); it also draws a bonus
    # token at offset 1 from a copy of the logits, which goes unused
    logits2 = jnp.stack([logits_t, logits_t], axis=1)
    a, out = _accept(logits2, pipe.cand[None], pipe.qlp[None], state, sc=sc, mode=mode)
    return out[:, 0], a > 0


def tick(params, planes, bt2, state, pipe: Pipe, counters: SpecCounters, *, cfg, sc, spec,
         mode, want_logprobs, backend):
    """One tick for every sequence (module doc). bt2: the block tables twice ([2B, pages]).
    Returns planes, state, pipe, counters and this tick's (token or -1, exit step, logprob)."""
    d, b = sc.draft_loops, state.tokens.shape[0]
    active = ~state.done
    trail = active & pipe.on
    lengths = state.lengths
    lead_pos = lengths + pipe.on.astype(jnp.int32)
    lead_tok = jnp.where(pipe.on, pipe.cand, state.tokens)
    h_in = jnp.concatenate([embed(params, lead_tok[:, None], params.dtype),
                            pipe.h[d - 1][:, None]], axis=0)  # [2B, 1, D]
    positions = jnp.concatenate([lead_pos, lengths])[:, None]
    offset = jnp.concatenate([jnp.zeros((b,), jnp.int32), jnp.full((b,), d, jnp.int32)])
    hid, gat, planes = engine.forward_block(
        params, planes, bt2, None, positions, cfg, range(d), backend, h=h_in,
        active=jnp.concatenate([active, trail]), loop_offset=offset)
    lead_h, lead_g = hid[:, :b, 0], gat[:, :b, 0]
    hidden = jnp.concatenate([pipe.h, hid[:, b:, 0]], axis=0)  # position L's T states
    gates = jnp.concatenate([pipe.g, gat[:, b:, 0]], axis=0)
    logits_d, logits_t, steps = _heads(params, lead_h[d - 1], hidden, gates, cfg=cfg,
                                       spec=spec, backend=backend)
    x, match = _verify(logits_t, pipe, state, sc=sc, mode=mode)
    # Commit x for trail rows only, with plain decoding's rule (stop ids, max_tokens).
    committed, _ = engine.commit_one(dataclasses.replace(state, done=~trail), x)
    new_state = dataclasses.replace(committed, done=state.done | (committed.done & trail))
    lead_ok = ~pipe.on | match  # the lead's token was exact: hold its states
    cand = sample(logits_d, state.sampling, mode, lead_pos + 1, PURPOSE_DRAFT)
    qlp = (jax.nn.log_softmax(processed_logits(logits_d, state.sampling, mode))
           if mode.sample else pipe.qlp)
    new_pipe = Pipe(lead_ok, cand,
                    jnp.where(lead_ok[None, :, None], lead_h, pipe.h),
                    jnp.where(lead_ok[None, :], lead_g, pipe.g),
                    jnp.where(lead_ok[:, None], qlp, pipe.qlp))
    counters = SpecCounters(counters.rounds + active, counters.drafted + trail,
                            counters.accepted + (trail & match))
    lps = (logprobs_for(backend)(logits_t, x) if want_logprobs
           else jnp.zeros((b,), jnp.float32))
    return planes, new_state, new_pipe, counters, (jnp.where(trail, x, -1), steps, lps)


def pipe_chunk(params, planes, bt, state, carry, *, cfg, sc, spec, mode, want_logprobs,
               backend):
    """Up to sc.rounds_per_fetch ticks in one `lax.while_loop`, stopping when every row is
    done. carry: (SpecCounters, Pipe), handed from fetch to fetch (init_carry). Buffers
    [B, rounds_per_fetch], tick r at column r (-1: nothing committed)."""
    b, n = state.tokens.shape[0], sc.rounds_per_fetch
    bt2 = jnp.concatenate([bt, bt], axis=0)
    bufs = (jnp.full((b, n), -1, jnp.int32), jnp.zeros((b, n), jnp.int32),
            jnp.zeros((b, n), jnp.float32))

    def cond(carry):
        r, _, st, *_ = carry
        return (r < n) & ~jnp.all(st.done)

    def body(carry):
        r, planes, st, pipe, ctr, bufs = carry
        planes, st, pipe, ctr, new = tick(params, planes, bt2, st, pipe, ctr, cfg=cfg, sc=sc,
                                          spec=spec, mode=mode, want_logprobs=want_logprobs,
                                          backend=backend)
        bufs = tuple(lax.dynamic_update_slice(buf, x.astype(buf.dtype)[:, None], (0, r))
                     for buf, x in zip(bufs, new))
        return r + 1, planes, st, pipe, ctr, bufs

    counters, pipe = carry
    r, planes, state, pipe, counters, bufs = lax.while_loop(
        cond, body, (jnp.int32(0), planes, state, pipe, counters, bufs))
    return planes, state, (counters, pipe), (*bufs, r)
