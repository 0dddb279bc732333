"""Host orchestration of one batch: admission, prefill, the decode (or speculative) loop.

The host touches device results only once per chunk: one `jax.device_get` of the chunk's
fixed-size token buffers plus the done flags. Everything else stays on the device.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np

from ouro_jax import engine
from ouro_jax.kv_cache import (PageAllocator, block_table_array, bucket_pages, next_pow2,
                               pages_needed)
from ouro_jax.sampling import SamplingMode, sampling_arrays


def _check_lengths(llm, ids, params):
    """Every kept token within the model's positions. A speculative round's room (its pages)
    is not counted: the draft positions past max_tokens are scratch that is never kept
    (commit stops at max_tokens), and RoPE needs no table, so speculative decoding accepts
    what native decoding does."""
    limit = llm.cfg.max_position_embeddings
    for i, (p, sp) in enumerate(zip(ids, params)):
        need = len(p) + sp.max_tokens
        if need > limit:
            raise ValueError(
                f"prompt {i} is too long: {len(p)} prompt tokens + max_tokens {sp.max_tokens}"
                f" = {need} positions, but the model supports {limit}")


def admit(llm, ids, params, stops, room):
    """Allocates pages and builds the padded device state. Raises before any device work."""
    _check_lengths(llm, ids, params)
    b = len(ids)
    bp = next_pow2(b)
    tokens_needed = [len(p) + sp.max_tokens + room for p, sp in zip(ids, params)]
    total = sum(pages_needed(t, llm.page_size) for t in tokens_needed)
    num_pages = llm.pool_pages(total)
    pages = PageAllocator(num_pages, llm.page_size).allocate(tokens_needed)
    max_pages = bucket_pages(max(len(r) for r in pages), minimum=1)
    planes = llm.planes_for(num_pages)
    n_stop = next_pow2(max(len(s) for s in stops), 1)
    stop_arr = np.full((bp, n_stop), -1, np.int32)
    for i, s in enumerate(stops):
        stop_arr[i, :len(s)] = s
    pad = bp - b
    # Built on the host and sent in one jax.device_put (see prefill for why not jnp).
    state = engine.RowState(
        tokens=np.zeros((bp,), np.int32),
        lengths=np.array([len(p) for p in ids] + [0] * pad, np.int32),
        num_generated=np.zeros((bp,), np.int32),
        max_tokens=np.array([sp.max_tokens for sp in params] + [1] * pad, np.int32),
        done=np.array([False] * b + [True] * pad),
        finish=np.zeros((bp,), np.int32),
        stop_ids=stop_arr,
        sampling=sampling_arrays(params, bp))
    bt, state = jax.device_put((block_table_array(pages, bp, max_pages), state))
    return planes, bt, state


# The xla attention path materialises fp32 scores [rows, heads, chunk, keys] for each prefill
# chunk; at 64 rows x 2k keys a 256-token chunk needs 2.2 GB per buffer. Its chunk is halved
# until one such buffer fits in this budget (the Pallas kernels keep scores on chip).
XLA_PREFILL_SCORES_BYTES = 512 << 20


def prefill_chunk_len(llm, rows: int, longest: int, kv_tokens: int) -> int:
    """Prompt tokens per row per prefill program: a power of two, at least 16 unless the
    engine's prefill_chunk is smaller."""
    chunk = min(next_pow2(longest, 16), llm.prefill_chunk)
    if llm.backend.startswith("xla"):
        while chunk > 16 and rows * llm.cfg.num_attention_heads * chunk * kv_tokens * 4 \
                > XLA_PREFILL_SCORES_BYTES:
            chunk //= 2
    return chunk


def prefill(llm, planes, bt, state, ids, spec, mode, want_lp):
    """Runs all prompt chunks and picks each request's first token (kept on the device)."""
    cfg, progs = llm.cfg, llm.programs
    bp = state.tokens.shape[0]
    longest = max(len(p) for p in ids)
    chunk = prefill_chunk_len(llm, bp, longest, bt.shape[1] * llm.page_size)
    padded = chunk * math.ceil(longest / chunk)
    arr = np.zeros((bp, padded), np.int32)
    for i, p in enumerate(ids):
        arr[i, :len(p)] = p
    # Host values reach the device by jax.device_put only (here, in admit and in
    # sampling_arrays): jnp.int32(x), jnp.zeros, jnp.maximum and even jnp.asarray(ndarray)
    # (a jit of lax.stage) each run an eager XLA program per call. The H200 trace showed one,
    # a 4-byte convert_element_type copy (jnp.zeros' fill value), spanning ~8 ms before
    # prefill (session 9); without eager ops that wait is gone (session-10 trace).
    last_idx, last_h, last_g = jax.device_put((
        np.array([max(len(p) - 1, 0) for p in ids] + [0] * (bp - len(ids)), np.int32),
        np.zeros((cfg.total_ut_steps, bp, cfg.hidden_size), llm.params.dtype),
        np.zeros((cfg.total_ut_steps, bp), llm.params.dtype)))
    static = dict(cfg=cfg, backend=llm.backend)
    for start in range(0, padded, chunk):
        ids_chunk, start_arr = jax.device_put((arr[:, start:start + chunk], np.int32(start)))
        planes, last_h, last_g = progs.call(
            engine.prefill_chunk, static, (1, 6, 7), llm.params, planes, bt, ids_chunk,
            start_arr, last_idx, last_h, last_g)
    static = dict(cfg=cfg, spec=spec, mode=mode, want_logprobs=want_lp, backend=llm.backend)
    state, first = progs.call(engine.prefill_finish, static, (), llm.params, last_h, last_g, state)
    return planes, state, first


def _chunk_program(llm, speculative, spec, mode, want_lp, state):
    """(program, its static settings, speculative counters or None) for the decode loop."""
    if speculative is None:
        static = dict(buffer=llm.decode_chunk, cfg=llm.cfg, spec=spec, mode=mode,
                      want_logprobs=want_lp, backend=llm.backend)
        return engine.decode_chunk, static, None
    from ouro_jax import speculative as spec_mod
    static = spec_mod.chunk_static(llm, speculative, spec, mode, want_lp)
    if speculative.pipelined:  # (its carry: the counters and the pipeline between fetches)
        from ouro_jax import pipelined
        return (pipelined.pipe_chunk, static,
                pipelined.init_carry(llm.cfg, speculative, mode, state, llm.params.dtype))
    return spec_mod.spec_chunk, static, spec_mod.init_counters(state)


def _append(fetched, first, out):
    """Appends one fetch's tokens (-1 = none) to out = (toks, exits, lps), after each row's
    prefill token when `first` is given; returns the new tokens per request, for streaming.
    `fetched` is None when only the first tokens exist."""
    cols = [] if fetched is None else [np.asarray(x) for x in fetched]
    if first is not None:
        lead = [np.asarray(x)[:, None] for x in first]
        cols = lead if not cols else [np.concatenate(p, axis=1) for p in zip(lead, cols)]
    o_tok, o_exit, o_lp = cols
    keep = o_tok >= 0
    new = []
    for i, (toks, exits, lps) in enumerate(zip(*out)):
        row = o_tok[i][keep[i]].tolist()
        toks.extend(row)
        exits.extend((o_exit[i][keep[i]] + 1).tolist())
        lps.extend(o_lp[i][keep[i]].tolist())
        new.append(row)
    return new


def decode_loop(llm, planes, bt, state, first, program, static, counters, on_chunk, b):
    """Calls the chunk program until every row is done, with one device_get per call.
    Returns planes, (toks, exits, lps), finish reasons, counters, number of fetches.
    program None: every request is complete with its first token; one fetch, no program."""
    out = ([[] for _ in range(b)], [[] for _ in range(b)], [[] for _ in range(b)])
    if program is None:
        f, finish = jax.device_get((first, state.finish))
        new = _append(None, f, out)
        if on_chunk is not None:
            on_chunk(new)
        return planes, out, finish, None, 1
    fetches = 0
    steps = jax.device_put(np.int32(llm.decode_chunk))
    while True:
        if counters is None:
            planes, state, bufs = llm.programs.call(program, static, (1,), llm.params, planes, bt,
                                                    state, steps)
        else:
            planes, state, counters, bufs = llm.programs.call(program, static, (1,), llm.params,
                                                              planes, bt, state, counters)
        # The one device-to-host fetch of the chunk (speculative counters ride along; of a
        # pipelined carry only its counters: the pipeline stays on the device).
        f, fetched, done, finish, host_counters = jax.device_get(
            (first, bufs[:3], state.done, state.finish,
             counters[0] if isinstance(counters, tuple) else counters))
        fetches += 1
        new = _append(fetched, f, out)
        first = None
        if on_chunk is not None:
            on_chunk(new)
        if bool(np.all(done)):
            return planes, out, finish, host_counters, fetches


def run_batch(llm, ids, params, stops, spec, speculative, on_chunk):
    from ouro_jax.api import FINISH_NAMES, GenerationResult, GenerationStats, RequestOutput

    mode = SamplingMode.for_requests(params)
    want_lp = any(p.logprobs for p in params)
    room = 0 if speculative is None else speculative.room(llm.cfg)
    compile0, compiles0 = llm.programs.compile_seconds, llm.programs.compiles
    planes, bt, state = admit(llm, ids, params, stops, room)
    llm.last_block_tables = bt  # kept for inspection (tests compare K/V planes)
    llm._planes = None  # the planes are donated below; never keep a stale reference

    t0 = time.perf_counter()
    planes, state, first = prefill(llm, planes, bt, state, ids, spec, mode, want_lp)
    jax.block_until_ready(state.tokens)
    prefill_s = time.perf_counter() - t0 - (llm.programs.compile_seconds - compile0)

    b = len(ids)
    compile1 = llm.programs.compile_seconds
    t1 = time.perf_counter()
    program, static, counters = _chunk_program(llm, speculative, spec, mode, want_lp, state)
    if all(p.max_tokens == 1 for p in params):
        program, counters = None, None  # no decode step can run: do not compile one
    planes, (toks, exits, lps), finish, counters, fetches = decode_loop(
        llm, planes, bt, state, first, program, static, counters, on_chunk, b)
    decode_s = time.perf_counter() - t1 - (llm.programs.compile_seconds - compile1)
    llm._planes = planes

    spec_stats, per_req = (None, [None] * b)
    if speculative is not None and counters is None:  # no round ran
        from ouro_jax.speculative import SpecCounters
        zeros = np.zeros((b,), np.int64)
        counters = SpecCounters(zeros, zeros, zeros)
    if counters is not None:
        from ouro_jax.speculative import summarize
        spec_stats, per_req = summarize(counters, b, speculative.pipelined)
    outputs = [RequestOutput(i, list(ids[i]), toks[i], llm.decode_text(toks[i]), exits[i],
                             FINISH_NAMES.get(int(finish[i]), "length"),
                             lps[i] if params[i].logprobs else None, per_req[i])
               for i in range(b)]
    gen = sum(len(t) for t in toks)
    stats = GenerationStats(
        prompt_tokens=sum(len(p) for p in ids), generated_tokens=gen, prefill_s=prefill_s,
        decode_s=decode_s, compile_s=llm.programs.compile_seconds - compile0,
        compiles=llm.programs.compiles - compiles0, host_fetches=fetches,
        decode_tokens=gen - b, spec=spec_stats)
    return GenerationResult(outputs, stats)
