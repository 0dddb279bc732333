"""Device programs of plain (non-speculative) generation: prefill chunks and the decode loop.

Each function here is pure and compiled by `programs.ProgramCache` with the KV planes donated,
so the cache is updated in place. Invariant shared with speculative.py: for every row,
`lengths` positions have final K/V in every loop, and `tokens` holds the last committed
token, which sits at position `lengths` and has not been run through the model yet.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from ouro_jax.attention import make_paged_attend
from ouro_jax.config import OuroConfig
from ouro_jax.invariant import OPTION as INVARIANT
from ouro_jax.invariant import Invariant, head_for, logprobs_for
from ouro_jax.model import ExitSpec, embed, rope_cos_sin, run_loops, select_exit
from ouro_jax.params import OuroParams
from ouro_jax.projection_spec import FLOW_PARTS
from ouro_jax.projections import parse as parse_projections
from ouro_jax.sampling import SamplingArrays, SamplingMode, sample

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RowState:
    """Per-row decode state, all [B] unless noted; lives on the device between calls."""
    tokens: jax.Array  # last committed token (not yet processed)
    lengths: jax.Array  # positions with final K/V
    num_generated: jax.Array
    max_tokens: jax.Array
    done: jax.Array  # bool
    finish: jax.Array  # FINISH_*
    stop_ids: jax.Array  # [B, S] int32, -1 padded
    sampling: SamplingArrays


def forward_block(params: OuroParams, planes, block_tables, ids, positions, cfg: OuroConfig,
                  loops, backend: str, h=None, active=None, loop_offset=None):
    """Runs `loops` over a [B, C] block of tokens at `positions`, writing their K/V.

    `backend` is the attention backend ("xla" | "pallas"), optionally followed by options:
    "+unroll" unrolls the loop range in Python instead of a `fori_loop` (fewer device while
    loops per step, larger programs); "+kvxla" keeps decode's RoPE and K/V write as XLA
    kernels instead of inside the Pallas decode kernel; "+gemv[@N][:names]" and
    "+gemm[@N][:names]" compute few-row projections (and with "+norms" the RMSNorms and
    residual adds around them; "+pfN" sets the GEMV's prefetch depth; "+stream" uses the
    streaming GEMV kernel, "+mgpu[:names]" the Mosaic GPU one, "+flow[4|5]" o -> gate/up ->
    down [-> next qkv [-> its attention]] as one kernel, "+graph" a one-row loop's layers as
    one CUDA graph of our own: ouro_jax.graph_loop) with the Pallas GEMV /
    skinny GEMM, "+inv[@LO-HI]" calls of LO..HI rows through the batch-invariant mode's
    GEMM and add_norm kernels (ouro_jax.projections.parse); "+invariant" every kernel
    batch-invariant (ouro_jax.invariant). `h` overrides the embedding input (verification
    starts from the draft's states). `active` [B] bool (None: all rows): finished rows'
    attention skips their context (ouro_jax.attention.skip_done). `loop_offset` [B] int32:
    row r runs loops[i] + loop_offset[r] (ouro_jax.pipelined; decode rows only)."""
    attention, *options = backend.split("+")
    kernels = [o for o in options
               if o.startswith(("gemv", "gemm", "pf", "mgpu", "inv@", "stream@"))
               or o in ("norms", "stream", "graph", "inv", *FLOW_PARTS)]
    # "+persistent" only labels the programs: the packed weights in params.persistent
    # select the path (ouro_jax.persistent)
    unknown = [o for o in options if o not in ("unroll", "kvxla", "persistent", INVARIANT)
               and o not in kernels]
    if unknown:
        raise ValueError(f"unknown backend option(s) {unknown} in {backend!r}: 'unroll', "
                         f"'kvxla', 'gemv...', 'gemm...', 'norms', 'pfN', 'stream[@N]', 'mgpu...', "
                         f"'flow', 'flow4', 'flow5', 'graph', 'inv[@LO-HI]', '{INVARIANT}'")
    invariant = INVARIANT in options
    if invariant and kernels:
        raise ValueError(f"backend {backend!r}: '{INVARIANT}' chooses every projection "
                         f"kernel itself; drop {kernels}")
    proj = Invariant() if invariant else parse_projections("+".join(kernels) or "xla")
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, params.dtype)
    if h is None:
        h = embed(params, ids, params.dtype)
    # '+flow5' runs the decode attention's body in the flow kernel of one-row layers, which
    # merges the splits itself: there the counters the decode kernel then needs ride with the
    # planes (other batch sizes keep the default combine)
    flow5 = getattr(proj, "flow", 0) == 5 and positions.shape[0] == 1
    _check_flow_o(proj)
    attend = make_paged_attend(cfg, block_tables, positions, planes[0].shape[2], attention,
                               fused_kv_write="kvxla" not in options,
                               merge_splits=True if flow5 else None, invariant=invariant,
                               active=active, row_loops=loop_offset is not None)
    # Some attends carry extra state with the planes (the decode kernel's split counters).
    state = attend.wrap(planes) if hasattr(attend, "wrap") else planes
    hidden, gates, state = run_loops(params, h, cos, sin, cfg, attend, state, loops,
                                     unroll="unroll" in options, proj=proj,
                                     loop_offset=loop_offset)
    return hidden, gates, (attend.unwrap(state) if hasattr(attend, "unwrap") else state)


def _check_flow_o(proj) -> None:
    """The decode kernel's flow_o (attention + o as one kernel) replaces the o projection,
    so the '+flow' projections (which start their kernel with o) would silently never run:
    refused."""
    import pallas_kernels.decode as dk
    if dk.TUNING.get("flow_o") and getattr(proj, "flow", 0):
        raise ValueError("decode kernel tuning flow_o runs the o projection with the "
                         "attention; the '+flow' projections start their kernel with o: "
                         "use one or the other")


def prefill_chunk(params, planes, block_tables, ids, start, last_idx, last_h, last_g, *,
                  cfg: OuroConfig, backend: str):
    """One prefill chunk: ids [B, C] at positions start..start+C-1, all loops.

    Keeps, per row, the per-loop states of the row's last prompt token when it falls in this
    chunk (last_h [T, B, D], last_g [T, B]); the LM head runs only on those."""
    b, c = ids.shape
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    hidden, gates, planes = forward_block(params, planes, block_tables, ids, positions, cfg,
                                          range(cfg.total_ut_steps), backend)
    rel = last_idx - start
    here = (rel >= 0) & (rel < c)
    idx = jnp.clip(rel, 0, c - 1)
    sel_h = jnp.take_along_axis(hidden, idx[None, :, None, None], axis=2)[:, :, 0]
    sel_g = jnp.take_along_axis(gates, idx[None, :, None], axis=2)[:, :, 0]
    last_h = jnp.where(here[None, :, None], sel_h, last_h)
    last_g = jnp.where(here[None, :], sel_g, last_g)
    return planes, last_h, last_g


def choose_tokens(params, hidden, gates, sampling: SamplingArrays, positions, *,
                  cfg: OuroConfig, spec: ExitSpec, mode: SamplingMode, want_logprobs: bool,
                  backend: str):
    """Exit selection + sampling for per-loop states hidden [T, B, D]."""
    logits, steps = select_exit(params, hidden, gates, cfg, spec, head_for(backend))
    tokens = sample(logits, sampling, mode, positions)
    lps = (logprobs_for(backend)(logits, tokens) if want_logprobs
           else jnp.zeros(tokens.shape, jnp.float32))
    return tokens, steps, lps


def commit_one(state: RowState, new_tokens) -> tuple[RowState, jax.Array]:
    """Applies one generated token per active row: lengths, counts, stop conditions."""
    active = ~state.done
    num_generated = state.num_generated + active
    is_stop = jnp.any(new_tokens[:, None] == state.stop_ids, axis=-1)
    at_limit = num_generated >= state.max_tokens
    newly_done = active & (is_stop | at_limit)
    finish = jnp.where(newly_done, jnp.where(is_stop, FINISH_STOP, FINISH_LENGTH), state.finish)
    state = dataclasses.replace(
        state, tokens=jnp.where(active, new_tokens, state.tokens),
        lengths=state.lengths + active, num_generated=num_generated,
        done=state.done | newly_done, finish=finish)
    return state, active


def start_rows(state: RowState, first_tokens) -> RowState:
    """Counts the prefill's token as generated token 1. Its K/V are not written yet, so
    `lengths` stays at the prompt length."""
    lengths = state.lengths
    state, _ = commit_one(state, first_tokens)
    return dataclasses.replace(state, lengths=lengths)


def decode_step(params, planes, block_tables, state: RowState, *, cfg, spec, mode,
                want_logprobs, backend):
    positions = state.lengths[:, None]
    hidden, gates, planes = forward_block(params, planes, block_tables, state.tokens[:, None],
                                          positions, cfg, range(cfg.total_ut_steps), backend,
                                          active=~state.done)
    new, steps, lps = choose_tokens(params, hidden[:, :, 0], gates[:, :, 0], state.sampling,
                                    state.lengths + 1, cfg=cfg, spec=spec, mode=mode,
                                    want_logprobs=want_logprobs, backend=backend)
    state, active = commit_one(state, new)
    return planes, state, (new, steps, lps, active)


def decode_chunk(params, planes, block_tables, state: RowState, num_steps, *, buffer: int,
                 cfg, spec, mode, want_logprobs, backend):
    """Up to min(num_steps, buffer) decode steps in one `lax.while_loop`, stopping early when
    every row is done. Returns fixed [B, buffer] buffers; -1 marks 'no token this step'."""
    b = state.tokens.shape[0]
    out_tok = jnp.full((b, buffer), -1, jnp.int32)
    out_exit = jnp.zeros((b, buffer), jnp.int32)
    out_lp = jnp.zeros((b, buffer), jnp.float32)
    limit = jnp.minimum(num_steps, buffer)

    def cond(carry):
        i, _, st, *_ = carry
        return (i < limit) & ~jnp.all(st.done)

    def body(carry):
        i, planes, st, out_tok, out_exit, out_lp = carry
        planes, st, (new, steps, lps, active) = decode_step(
            params, planes, block_tables, st, cfg=cfg, spec=spec, mode=mode,
            want_logprobs=want_logprobs, backend=backend)
        out_tok = out_tok.at[:, i].set(jnp.where(active, new, -1))
        out_exit = out_exit.at[:, i].set(steps)
        out_lp = out_lp.at[:, i].set(lps)
        return i + 1, planes, st, out_tok, out_exit, out_lp

    carry = (jnp.int32(0), planes, state, out_tok, out_exit, out_lp)
    steps_run, planes, state, out_tok, out_exit, out_lp = lax.while_loop(cond, body, carry)
    return planes, state, (out_tok, out_exit, out_lp, steps_run)


def prefill_finish(params, last_h, last_g, state: RowState, *, cfg, spec, mode, want_logprobs,
                   backend):
    """First generated token of every row from the prompt's last per-loop states."""
    tokens, steps, lps = choose_tokens(params, last_h, last_g, state.sampling, state.lengths,
                                       cfg=cfg, spec=spec, mode=mode, want_logprobs=want_logprobs,
                                       backend=backend)
    return start_rows(state, tokens), (tokens, steps, lps)
