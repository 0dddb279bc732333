"""Exact self-speculative decoding: the whole round is one XLA program.

Draft = the first d loops of the same model, target = all D loops (OURO.md). A round, for
every row at once, starting from the last committed token x_n at position n:

1. Draft (`lax.fori_loop` over offsets 0..k-1, plus offset k): embed the current token, run
   loops 0..d-1 writing their K/V, keep every loop's state; the LM head on loop d-1 gives
   the candidate (argmax, or a seeded draw from the processed draft distribution q).
2. Verify: the k+1 loop-(d-1) states are exactly the target's loop-(d-1) states at positions
   n..n+k, so only loops d..D-1 run, on all k+1 rows in one block (causal among themselves,
   attending to the committed context), writing those loops' K/V. Each (position, loop) is
   computed once. Exit selection then sees all D loops' states, as in plain decoding.
3. Accept, vectorised: greedy keeps the prefix where candidate == target argmax, then the
   correction or bonus; sampling uses rejection sampling (u * q(c) < p(c)), the residual
   max(p - q, 0) on the first rejection, and a bonus draw from p when all pass.
4. Commit into a fixed [B, k+1] buffer, with EOS/stop ids inside the accepted prefix and the
   max_tokens limit applied on the device. Rejected positions roll back by length alone.

`spec_chunk` runs rounds in a `lax.while_loop` until every row is done or the round budget of
one host fetch is spent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ouro_jax import engine
from ouro_jax.config import OuroConfig
from ouro_jax.invariant import head_for, logprobs_for
from ouro_jax.model import select_exit
from ouro_jax.sampling import (PURPOSE_ACCEPT, PURPOSE_BONUS, PURPOSE_DRAFT, PURPOSE_RESIDUAL,
                               as_int, processed_logits, row_keys, sample)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """k draft tokens per round from the first `draft_loops` loops; `rounds_per_fetch` rounds
    run on the device between host fetches (the streaming granularity)."""
    k: int = 4
    draft_loops: int = 2
    target_loops: int | None = None  # must equal total_ut_steps; None means that
    rounds_per_fetch: int = 16
    # the loops in T/d stages, each pass running every stage on its own position, k=1 draft
    # per tick (ouro_jax.pipelined); a "round" is then a tick
    pipelined: bool = False

    def __post_init__(self):
        # numpy integers are normalised to int (this config is part of a program's key)
        for name, low, what in (("k", 1, "speculative k"), ("draft_loops", 1, "draft_loops"),
                                ("rounds_per_fetch", 1, "rounds_per_fetch")):
            value = as_int(getattr(self, name), what)
            if not low <= value < 2**31:  # (a device int32)
                raise ValueError(f"{what} must be an integer >= {low} (and below 2**31), got "
                                 f"{getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        if self.target_loops is not None:
            object.__setattr__(self, "target_loops", as_int(self.target_loops, "target_loops"))
        if not isinstance(self.pipelined, (bool, np.bool_)):
            raise ValueError(f"pipelined must be True or False, got {self.pipelined!r}")
        object.__setattr__(self, "pipelined", bool(self.pipelined))

    def validate(self, cfg: OuroConfig) -> "SpeculativeConfig":
        t = cfg.total_ut_steps
        if self.target_loops is not None and self.target_loops != t:
            raise ValueError(f"target_loops={self.target_loops} must equal the model's "
                             f"total_ut_steps={t} (the target is the full-depth model)")
        if not 1 <= self.draft_loops < t:
            raise ValueError(f"draft_loops={self.draft_loops} must satisfy 1 <= d < {t}")
        if self.pipelined:
            from ouro_jax.pipelined import check
            check(self, cfg)
        return self

    def room(self, cfg: OuroConfig) -> int:
        """KV positions a call may write past a request's last: k + 1 for a round's draft
        and verification; for a pipeline its S = T/d stages (S - 2 are needed: its newest
        position in flight is L + S - 1, ouro_jax.pipelined)."""
        if self.pipelined:
            from ouro_jax.pipelined import stages
            return stages(self, cfg)
        return self.k + 1


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecCounters:
    rounds: jax.Array  # [B] rounds in which the row was active
    drafted: jax.Array  # [B] candidates that could have been committed
    accepted: jax.Array  # [B] candidates accepted


def init_counters(state) -> SpecCounters:
    """Zeros staged from the host (an eager jnp.zeros would run XLA ops per call)."""
    return jax.device_put(SpecCounters(*(np.zeros(state.lengths.shape, np.int32)
                                         for _ in range(3))))


def chunk_static(llm, sc: SpeculativeConfig, spec, mode, want_lp) -> dict:
    return dict(cfg=llm.cfg, sc=sc, spec=spec, mode=mode, want_logprobs=want_lp,
                backend=llm.backend)


def _draft(params, planes, bt, state, *, cfg, sc, mode, backend):
    """Offsets 0..k through loops 0..d-1. Returns planes, states [k+1, d, B, D], gate logits
    [k+1, d, B], candidates [k, B] and the draft's processed log-probs [k, B, V] (sampling)."""
    k, d = sc.k, sc.draft_loops
    b = state.tokens.shape[0]
    hs = jnp.zeros((k + 1, d, b, cfg.hidden_size), params.dtype)
    gs = jnp.zeros((k + 1, d, b), params.dtype)
    cands = jnp.zeros((k, b), jnp.int32)
    qlp = jnp.zeros((k, b, cfg.vocab_size) if mode.sample else (k, b, 1), jnp.float32)
    active = ~state.done  # (rows done before the round; their attention skips its context)

    def step(j, planes, tok):
        pos = state.lengths + j
        h, g, planes = engine.forward_block(params, planes, bt, tok[:, None], pos[:, None], cfg,
                                            range(d), backend, active=active)
        return planes, h[:, :, 0], g[:, :, 0], pos

    def body(j, carry):
        planes, tok, hs, gs, cands, qlp = carry
        planes, h, g, pos = step(j, planes, tok)
        logits = head_for(backend)(params, h[d - 1])
        cand = sample(logits, state.sampling, mode, pos + 1, PURPOSE_DRAFT)
        if mode.sample:
            qlp = qlp.at[j].set(jax.nn.log_softmax(processed_logits(logits, state.sampling, mode)))
        return planes, cand, hs.at[j].set(h), gs.at[j].set(g), cands.at[j].set(cand), qlp

    carry = (planes, state.tokens, hs, gs, cands, qlp)
    planes, tok, hs, gs, cands, qlp = lax.fori_loop(0, k, body, carry)
    planes, h, g, _ = step(k, planes, tok)  # the last offset needs no candidate
    return planes, hs.at[k].set(h), gs.at[k].set(g), cands, qlp


def _verify(params, planes, bt, state, hs, gs, *, cfg, sc, spec, backend):
    """Loops d..D-1 on the k+1 draft states; exit selection over all D loops.
    Returns planes, logits [B, k+1, V], exit steps [B, k+1]."""
    k, d = sc.k, sc.draft_loops
    positions = state.lengths[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None]
    shallow_h = jnp.transpose(hs, (1, 2, 0, 3))  # [d, B, k+1, D]
    shallow_g = jnp.transpose(gs, (1, 2, 0))
    deep_h, deep_g, planes = engine.forward_block(
        params, planes, bt, None, positions, cfg, range(d, cfg.total_ut_steps), backend,
        h=shallow_h[d - 1], active=~state.done)
    hidden = jnp.concatenate([shallow_h, deep_h], axis=0)
    gates = jnp.concatenate([shallow_g, deep_g], axis=0)
    logits, steps = select_exit(params, hidden, gates, cfg, spec, head_for(backend))
    return planes, logits, steps


def _accept(logits, cands, qlp, state, *, sc, mode):
    """(accepted count a [B], committed tokens [B, k+1]; entries past a are unused)."""
    k = sc.k
    target = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    cands = cands.T  # [B, k]
    if not mode.sample:
        match = cands == target[:, :k]
        a = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1)
        return a, target  # accepted candidates equal the target argmax
    b, _, v = logits.shape
    flat = logits.reshape(b * (k + 1), v)
    rep = jax.tree.map(lambda x: jnp.repeat(x, k + 1, axis=0), state.sampling)
    plp = jax.nn.log_softmax(processed_logits(flat, rep, mode)).reshape(b, k + 1, v)
    qlp = jnp.transpose(qlp, (1, 0, 2))  # [B, k, V]
    p_c = jnp.exp(jnp.take_along_axis(plp[:, :k], cands[..., None], axis=-1)[..., 0])
    q_c = jnp.exp(jnp.take_along_axis(qlp, cands[..., None], axis=-1)[..., 0])
    pos = state.lengths[:, None] + 1 + jnp.arange(k + 1, dtype=jnp.int32)[None]  # token slots
    u = jax.vmap(lambda kk: jax.random.uniform(kk), in_axes=0)(
        row_keys(jnp.repeat(state.sampling.seed, k), pos[:, :k].reshape(-1), PURPOSE_ACCEPT)
    ).reshape(b, k)
    ok = jnp.where(state.sampling.temperature[:, None] > 0, u * q_c < p_c, cands == target[:, :k])
    a = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    # Residual draws for every offset (only the one at a is used), bonus from p at offset k.
    resid = jnp.maximum(jnp.exp(plp[:, :k]) - jnp.exp(qlp), 0.0)
    resid_logits = jnp.where(jnp.sum(resid, -1, keepdims=True) > 0, jnp.log(resid), plp[:, :k])
    keys_r = row_keys(jnp.repeat(state.sampling.seed, k), pos[:, :k].reshape(-1), PURPOSE_RESIDUAL)
    drawn_r = jax.vmap(jax.random.categorical)(keys_r, resid_logits.reshape(b * k, v)).reshape(b, k)
    keys_b = row_keys(state.sampling.seed, pos[:, k], PURPOSE_BONUS)
    drawn_b = jax.vmap(jax.random.categorical)(keys_b, plp[:, k])
    drawn = jnp.concatenate([drawn_r, drawn_b[:, None]], axis=1).astype(jnp.int32)
    j = jnp.arange(k + 1)[None]
    sampled = jnp.where(j < a[:, None], jnp.pad(cands, ((0, 0), (0, 1))), drawn)
    out = jnp.where(state.sampling.temperature[:, None] > 0, sampled, target)
    return a, out


def _commit(state, counters: SpecCounters, a, out, logits, steps, *, sc, want_logprobs,
            backend):
    """Commits out[:, :a+1] (truncated by stop ids and max_tokens); returns the new state,
    counters and this round's [B, k+1] buffers (-1 = nothing committed there)."""
    k = sc.k
    active = ~state.done
    remaining = state.max_tokens - state.num_generated
    j = jnp.arange(k + 1, dtype=jnp.int32)[None]
    is_stop = jnp.any(out[..., None] == state.stop_ids[:, None, :], axis=-1)  # [B, k+1]
    stop_at = jnp.min(jnp.where(is_stop & (j <= a[:, None]), j, k + 1), axis=1)
    m = jnp.minimum(jnp.minimum(a + 1, remaining), stop_at + 1)
    m = jnp.where(active, m, 0)
    hit_stop = active & (stop_at < m)
    hit_len = active & ~hit_stop & (state.num_generated + m >= state.max_tokens)
    last = jnp.take_along_axis(out, jnp.maximum(m - 1, 0)[:, None], axis=1)[:, 0]
    finish = jnp.where(hit_stop, engine.FINISH_STOP,
                       jnp.where(hit_len, engine.FINISH_LENGTH, state.finish))
    new_state = dataclasses.replace(
        state, tokens=jnp.where(m > 0, last, state.tokens), lengths=state.lengths + m,
        num_generated=state.num_generated + m, done=state.done | hit_stop | hit_len,
        finish=finish)
    useful = jnp.clip(remaining - 1, 0, k)  # near the limit a row effectively has a smaller k
    counters = SpecCounters(counters.rounds + active, counters.drafted + jnp.where(active, useful, 0),
                            counters.accepted + jnp.where(active, jnp.minimum(a, useful), 0))
    written = j < m[:, None]
    lps = (jax.vmap(logprobs_for(backend), in_axes=(1, 1), out_axes=1)(logits, out)
           if want_logprobs
           else jnp.zeros(out.shape, jnp.float32))
    return new_state, counters, (jnp.where(written, out, -1), steps, lps)


def spec_round(params, planes, bt, state, counters, *, cfg, sc, spec, mode, want_logprobs,
               backend):
    planes, hs, gs, cands, qlp = _draft(params, planes, bt, state, cfg=cfg, sc=sc, mode=mode,
                                        backend=backend)
    planes, logits, steps = _verify(params, planes, bt, state, hs, gs, cfg=cfg, sc=sc, spec=spec,
                                    backend=backend)
    a, out = _accept(logits, cands, qlp, state, sc=sc, mode=mode)
    state, counters, bufs = _commit(state, counters, a, out, logits, steps, sc=sc,
                                    want_logprobs=want_logprobs, backend=backend)
    return planes, state, counters, bufs


def spec_chunk(params, planes, bt, state, counters, *, cfg, sc, spec, mode, want_logprobs,
               backend):
    """Up to sc.rounds_per_fetch rounds in one `lax.while_loop`; stops when all rows are done.
    Buffers are [B, rounds_per_fetch * (k+1)], round r at columns r*(k+1)..."""
    b, w = state.tokens.shape[0], sc.k + 1
    n = sc.rounds_per_fetch * w
    bufs = (jnp.full((b, n), -1, jnp.int32), jnp.zeros((b, n), jnp.int32),
            jnp.zeros((b, n), jnp.float32))

    def cond(carry):
        r, _, st, *_ = carry
        return (r < sc.rounds_per_fetch) & ~jnp.all(st.done)

    def body(carry):
        r, planes, st, ctr, bufs = carry
        planes, st, ctr, new = spec_round(params, planes, bt, st, ctr, cfg=cfg, sc=sc, spec=spec,
                                          mode=mode, want_logprobs=want_logprobs, backend=backend)
        bufs = tuple(lax.dynamic_update_slice(buf, x.astype(buf.dtype), (0, r * w))
                     for buf, x in zip(bufs, new))
        return r + 1, planes, st, ctr, bufs

    r, planes, state, counters, bufs = lax.while_loop(
        cond, body, (jnp.int32(0), planes, state, counters, bufs))
    return planes, state, counters, (*bufs, r)


def summarize(counters: SpecCounters, b: int, pipelined: bool = False) -> tuple[dict, list[dict]]:
    """Per-call and per-request stats from fetched counters (host numpy). pipelined
    (ouro_jax.pipelined): a round is a tick, and each verified draft commits one token."""
    def stats(rounds, drafted, accepted):
        rounds, drafted, accepted = int(rounds), int(drafted), int(accepted)
        tokens = drafted if pipelined else accepted + rounds
        return {"rounds": rounds, "drafted": drafted, "accepted": accepted,
                "acceptance": accepted / drafted if drafted else 0.0,
                "tokens_per_round": tokens / rounds if rounds else 0.0}
    per = [stats(counters.rounds[i], counters.drafted[i], counters.accepted[i]) for i in range(b)]
    total = stats(sum(p["rounds"] for p in per), sum(p["drafted"] for p in per),
                  sum(p["accepted"] for p in per))
    # The batch runs rounds until its slowest row is done: rounds_run (the most any row was
    # active in) against the rows' active rounds says how much of the batch's work went to
    # rows already finished (ouro_jax.attention.SKIP_DONE).
    run = max((p["rounds"] for p in per), default=0)
    total.update(rounds_run=run,
                 active_row_fraction=total["rounds"] / (b * run) if run else 0.0,
                 pipelined=pipelined)
    return total, per

