"""Pipelined self-speculation: the draft of the next tokens and the rest of the current one
share each pass over the weights.

Ouro's draft is the model's first d loops, and the target runs all T loops. With d dividing
T, the T loops are S = T / d stages of d loops, and a position can move through them like an
instruction through a CPU pipeline: a *tick* runs d passes over the layer stack on S*B rows
(B sequences), and in pass i the stage-s row of a sequence runs loop s*d + i for the
position at that stage. Each weight is read once per pass for all S*B rows; the attention
reads each row's own plane (loop) of the cache (`model.run_loops`' loop_offset, a plane
base per row in the kernels). Stage 0 takes a new position each tick, with the draft token
that the position before it drafted from its loop d-1 state one tick earlier.

For each sequence, before a tick (`lengths` = L; `tokens` = x_L, committed, at position L),
positions L .. L+v-1 are in flight (v = 0..S-1, the oldest furthest on) and position L + v
enters stage 0: with x_L when v = 0, else with its draft. The positions move one stage on.
- Not full (v < S - 1): nothing is committed; v grows by one.
- Full (v = S - 1): position L leaves the last stage with all T loops. Exit selection gives
  the exact x_{L+1}, committed as plain decoding would. If it equals the draft position
  L + 1 entered with, the pipeline stays full; else every position after L + 1 was computed
  from a wrong token: the pipeline empties, and x_{L+1} enters stage 0 on the next tick.
Stage rows with no position (v < s, or a finished row) run anyway at the entering
position, whose K/V at their loops are rewritten when it reaches them, before anyone reads
them; their outputs are dropped, and on the Pallas path they attend over at most 2 keys
(skip_done).

Sampling accepts the draft by rejection sampling (speculative._accept with k = 1), so the
output follows the target's distribution. Greedy output is plain greedy decoding's in exact
arithmetic (fp32 tests); in bf16 the S*B-row calls round otherwise than plain decoding's
B-row ones on a GPU, except in the batch-invariant mode, where it is the same bits (test).

Cost: d passes per tick on S*B rows; a tick commits a token when the pipeline is full, and
a rejection costs S - 1 ticks of refill: 1 + (1 - a)(S - 1) ticks per token at acceptance a.
At d = 2 (S = 2), a = 0.857: 2.29 passes per token on 2 rows; at d = 1 (S = 4), a = 0.80:
1.6 passes on 4 rows; against plain decoding's 4 passes and k=4 d=2 speculation's ~2.8.

The pipeline (held states, drafts, how many positions are in flight) stays on the device
from one host fetch to the next, with the counters (`init_carry`, `pipe_chunk`); only the
counters are fetched. Positions at or past `lengths` may hold K/V of positions in flight
or of rejected drafts; each is rewritten before anything reads it (kv_cache's rollback
rule). The newest position in flight is L + S - 1, at most S - 2 past plain decoding's last
(L <= prompt + max_tokens - 2 while a row is active); run_batch reserves S, a margin. A write
past a row's pages would go to the trash page and be dropped in any case.
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


def stages(sc, cfg) -> int:
    """S = T / d: the pipeline's stages, d loops each."""
    return cfg.total_ut_steps // sc.draft_loops


def ticks_for(tokens: int, sc, cfg) -> int:
    """Ticks that commit `tokens` tokens however many drafts are rejected (S each at worst,
    the fill included): a tick budget for one host fetch per call (the benchmarks)."""
    return stages(sc, cfg) * tokens


def check(sc, cfg) -> None:
    """Refuses what a pipelined round cannot run, by name (before any work is done)."""
    t = cfg.total_ut_steps
    if sc.k != 1:
        raise ValueError(f"pipelined speculation drafts one token per tick: k must be 1, got "
                         f"k={sc.k}")
    if t % sc.draft_loops or sc.draft_loops >= t:
        raise ValueError(f"pipelined speculation cuts the model's loops into stages of the "
                         f"draft's depth, at least two, so draft_loops must divide "
                         f"total_ut_steps={t} and be smaller; got draft_loops={sc.draft_loops}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Pipe:
    """What a tick hands the next one, per sequence (B rows). The arrays with a leading
    stage axis [S, ...] describe the position that computes at stage s in the next tick
    (s >= 1; slot 0 is unused, stage 0 takes the entering token)."""
    v: jax.Array  # [B] int32: positions in flight (0..S-1), at stages 1..v next tick
    next_tok: jax.Array  # [B] int32: the draft entering stage 0 next tick (when v > 0)
    next_qlp: jax.Array  # [B, V] (sampling; else [B, 1]): its processed log-probs
    h: jax.Array  # [S, B, D]: stage s's input, the loop s*d - 1 state
    hist: jax.Array  # [S, T, B, D]: the states of loops 0..s*d - 1 (the exit needs all T)
    ghist: jax.Array  # [S, T, B]: their exit-gate logits
    tok: jax.Array  # [S, B] int32: the token the position at stage s entered with
    qlp: jax.Array  # [S, B, V or 1]: that token's draft log-probs (sampling)


def init_carry(cfg, sc, mode, state, dtype) -> tuple:
    """(SpecCounters, Pipe) before the first fetch: zeros, nothing in flight, staged from
    the host (eager jnp.zeros would run an XLA program per array)."""
    b, s, t = state.tokens.shape[0], stages(sc, cfg), cfg.total_ut_steps
    v, d = cfg.vocab_size if mode.sample else 1, cfg.hidden_size
    z = np.zeros
    counters = SpecCounters(*(z((b,), np.int32) for _ in range(3)))
    pipe = Pipe(z((b,), np.int32), z((b,), np.int32), z((b, v), np.float32),
                z((s, b, d), dtype), z((s, t, b, d), dtype), z((s, t, b), dtype),
                z((s, b), np.int32), z((s, b, v), np.float32))
    return jax.device_put((counters, pipe))


def _heads(params, draft_h, hidden, gates, *, cfg, spec, backend):
    """(draft logits [B, V], target logits [B, V], exit steps [B]): one LM-head call on 2B
    rows where the exit spec picks one state per token (the weighted mix needs them all)."""
    head = head_for(backend)
    if spec.mode() == "weighted":
        logits_t, steps = select_exit(params, hidden, gates, cfg, spec, head)
        return head(params, draft_h), logits_t, steps
    chosen, steps = select_exit(params, hidden, gates, cfg, spec, lambda p, x: x)
    b = draft_h.shape[0]
    both = head(params, jnp.concatenate([draft_h, chosen], axis=0))
    return both[:b], both[b:], steps


def _verify(logits_t, cand, qlp, state, *, sc, mode):
    """(the committed token x [B], whether the draft `cand` was accepted [B])."""
    if not mode.sample:  # (every row greedy)
        target = jnp.argmax(logits_t, axis=-1).astype(jnp.int32)
        return target, cand == target
    # _accept at k = 1 (its keys: position L + 1, as a k = 1 round's); it also draws a bonus
    # token at offset 1 from a copy of the logits, which goes unused
    logits2 = jnp.stack([logits_t, logits_t], axis=1)
    a, out = _accept(logits2, cand[None], qlp[None], state, sc=sc, mode=mode)
    return out[:, 0], a > 0


def _passes(params, planes, bt_s, state, pipe, tok0, *, cfg, sc, backend):
    """The tick's d passes on S*B rows (stage-major). Returns planes, the entering position
    [B], and the new loops' states [S, d, B, D] and gate logits [S, d, B]."""
    s_n, d, b = stages(sc, cfg), sc.draft_loops, state.tokens.shape[0]
    stage = jnp.arange(s_n, dtype=jnp.int32)[:, None]  # [S, 1]
    pos0 = state.lengths + pipe.v
    valid = ~state.done[None] & (stage <= pipe.v[None])  # [S, B]
    # A stage with nothing to compute runs at the entering position, whose K/V at that
    # stage's loops are rewritten when it gets there, before anything reads them.
    positions = jnp.where(valid, pos0[None] - stage, pos0[None]).reshape(-1, 1)
    h_in = jnp.concatenate([embed(params, tok0[None], params.dtype), pipe.h[1:]], axis=0)
    hid, gat, planes = engine.forward_block(
        params, planes, bt_s, None, positions, cfg, range(d), backend,
        h=h_in.reshape(s_n * b, 1, -1), active=valid.reshape(-1),
        loop_offset=jnp.repeat(jnp.arange(s_n, dtype=jnp.int32) * d, b))
    new_h = jnp.moveaxis(hid[:, :, 0].reshape(d, s_n, b, -1), 0, 1)
    new_g = jnp.moveaxis(gat[:, :, 0].reshape(d, s_n, b), 0, 1)
    return planes, pos0, new_h, new_g


def _histories(pipe, new_h, new_g, d: int):
    """Each stage's loop states with this tick's d loops in place: [S, T, B, D], [S, T, B]."""
    s_n, t = pipe.hist.shape[:2]
    loop = jnp.arange(t)
    here = (loop // d)[None, :] == jnp.arange(s_n)[:, None]  # [S, T]: stage s's loops
    hist = jnp.where(here[..., None, None], new_h[:, loop % d], pipe.hist)
    ghist = jnp.where(here[..., None], new_g[:, loop % d], pipe.ghist)
    return hist, ghist


def tick(params, planes, bt_s, state, pipe: Pipe, counters: SpecCounters, *, cfg, sc, spec,
         mode, want_logprobs, backend):
    """One tick for every sequence (module doc). bt_s: the block tables S times
    ([S*B, pages]). Returns planes, state, pipe, counters and this tick's (token or -1,
    exit step, logprob)."""
    s_n, d = stages(sc, cfg), sc.draft_loops
    active = ~state.done
    tok0 = jnp.where(pipe.v == 0, state.tokens, pipe.next_tok)
    planes, pos0, new_h, new_g = _passes(params, planes, bt_s, state, pipe, tok0, cfg=cfg,
                                         sc=sc, backend=backend)
    hist, ghist = _histories(pipe, new_h, new_g, d)
    logits_d, logits_t, steps = _heads(params, new_h[0, d - 1], hist[s_n - 1],
                                       ghist[s_n - 1], cfg=cfg, spec=spec, backend=backend)
    # the tokens the positions at each stage entered with (and their draft log-probs)
    toks = jnp.concatenate([tok0[None], pipe.tok[1:]], axis=0)
    qlps = jnp.concatenate([pipe.next_qlp[None], pipe.qlp[1:]], axis=0)
    full = active & (pipe.v == s_n - 1)  # the position at stage S-1 is done: x_{L+1}
    x, match = _verify(logits_t, toks[s_n - 2], qlps[s_n - 2], state, sc=sc, mode=mode)
    # Commit x where the pipeline was full, with plain decoding's rule (stop ids, max_tokens).
    committed, _ = engine.commit_one(dataclasses.replace(state, done=~full), x)
    new_state = dataclasses.replace(committed, done=state.done | (committed.done & full))
    # On: every position in flight moves one stage on, and a draft enters next tick. A
    # rejected draft empties the pipeline; the next tick enters x_{L+1} itself.
    on = ~full | match
    cand = sample(logits_d, state.sampling, mode, pos0 + 1, PURPOSE_DRAFT)
    qlp = (jax.nn.log_softmax(processed_logits(logits_d, state.sampling, mode))
           if mode.sample else pipe.next_qlp)
    shift = lambda a: jnp.roll(a, 1, axis=0)  # stage s -> s + 1 (slot 0 unused)
    new_pipe = Pipe(jnp.where(on, jnp.minimum(pipe.v + 1, s_n - 1), 0), cand, qlp,
                    shift(new_h[:, d - 1]), shift(hist), shift(ghist), shift(toks),
                    shift(qlps))
    counters = SpecCounters(counters.rounds + active, counters.drafted + full,
                            counters.accepted + (full & match))
    lps = (logprobs_for(backend)(logits_t, x) if want_logprobs
           else jnp.zeros(x.shape, jnp.float32))
    return planes, new_state, new_pipe, counters, (jnp.where(full, x, -1), steps, lps)


def pipe_chunk(params, planes, bt, state, carry, *, cfg, sc, spec, mode, want_logprobs,
               backend):
    """Up to sc.rounds_per_fetch ticks in one `lax.while_loop`, stopping when every row is
    done. carry: (SpecCounters, Pipe), handed from fetch to fetch (init_carry). Buffers
    [B, rounds_per_fetch], tick r at column r (-1: nothing committed)."""
    b, n = state.tokens.shape[0], sc.rounds_per_fetch
    bt_s = jnp.tile(bt, (stages(sc, cfg), 1))
    bufs = (jnp.full((b, n), -1, jnp.int32), jnp.zeros((b, n), jnp.int32),
            jnp.zeros((b, n), jnp.float32))

    def cond(carry):
        r, _, st, *_ = carry
        return (r < n) & ~jnp.all(st.done)

    def body(carry):
        r, planes, st, pipe, ctr, bufs = carry
        planes, st, pipe, ctr, new = tick(params, planes, bt_s, st, pipe, ctr, cfg=cfg, sc=sc,
                                          spec=spec, mode=mode, want_logprobs=want_logprobs,
                                          backend=backend)
        bufs = tuple(lax.dynamic_update_slice(buf, x.astype(buf.dtype)[:, None], (0, r))
                     for buf, x in zip(bufs, new))
        return r + 1, planes, st, pipe, ctr, bufs

    counters, pipe = carry
    r, planes, state, pipe, counters, bufs = lax.while_loop(
        cond, body, (jnp.int32(0), planes, state, pipe, counters, bufs))
    return planes, state, (counters, pipe), (*bufs, r)
