"""Measurements of a (demo) Ouro model with dense forwards only: held-out loss per loop,
greedy self-speculative draft acceptance, and the exit gate's depth distribution.

Acceptance is an exact simulation of greedy self-speculative decoding (../shared/OURO.md):
the target greedily generates `new_tokens` after each prompt with all T loops; in rounds of
k, the draft (first d loops, LM head on loop d-1, greedy, autoregressive on its own
candidates) proposes k tokens; accepted = length of the prefix that matches the target's
greedy tokens; the round commits accepted + 1 target tokens (the correction, or the bonus
when all k match). acceptance = accepted / drafted.

`acceptance_fast` uses one observation: the draft's i-th candidate only counts when the
candidates before it matched, i.e. when the draft's input equals the target's greedy
sequence, so every counted draft prediction is the d-loop argmax at that position of the
target sequence. One d-loop forward over the target sequence then gives the exact count.
`acceptance_literal` runs the rounds as written (one forward per draft token) and is kept to
check that equivalence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ouro_jax.config import OuroConfig
from ouro_jax.model import (dense_causal_attend, embed, exit_probabilities, lm_head,
                            rope_cos_sin, run_loops, threshold_exit_step)
from ouro_jax.params import OuroParams


# --- forward pieces -------------------------------------------------------------------------

def loop_states(params: OuroParams, ids: jax.Array, cfg: OuroConfig, num_loops: int):
    """hidden [n, B, S, D] and gate logits [n, B, S] of the first num_loops loops."""
    pos = jnp.broadcast_to(jnp.arange(ids.shape[-1], dtype=jnp.int32), ids.shape)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, params.dtype)
    h = embed(params, ids, params.dtype)
    hidden, gates, _ = run_loops(params, h, cos, sin, cfg, dense_causal_attend, None,
                                 range(num_loops))
    return hidden, gates


@functools.partial(jax.jit, static_argnums=(2,))
def per_loop_token_ce(params: OuroParams, tokens: jax.Array, cfg: OuroConfig):
    """tokens [B, S+1] -> CE of every loop's head at every position [T, B, S], and gates."""
    hidden, gates = loop_states(params, tokens[:, :-1], cfg, cfg.total_ut_steps)
    logits = jax.vmap(lambda h: lm_head(params, h))(hidden).astype(jnp.float32)
    logz = jax.nn.logsumexp(logits, axis=-1)
    tgt = jnp.take_along_axis(logits, tokens[None, :, 1:, None], axis=-1)[..., 0]
    return logz - tgt, gates


def heldout_windows(stream: list[int] | np.ndarray, seq_len: int, max_windows: int | None = None):
    """Non-overlapping [N, seq_len+1] windows (targets overlap inputs by one) of a token stream."""
    a = np.asarray(stream, dtype=np.int32)
    n = (len(a) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    return np.stack([a[i * seq_len: i * seq_len + seq_len + 1] for i in range(n)])


def heldout_loss(params: OuroParams, cfg: OuroConfig, windows: np.ndarray, batch: int = 16):
    """Mean held-out CE (nats/token) per loop, and of the gate's expected loss sum_t p_t CE_t."""
    sums = np.zeros(cfg.total_ut_steps, np.float64)
    expected, count = 0.0, 0
    for i in range(0, len(windows), batch):
        ce, gates = per_loop_token_ce(params, jnp.asarray(windows[i:i + batch]), cfg)
        p = exit_probabilities(gates.astype(jnp.float32))
        sums += np.asarray(ce.sum(axis=(1, 2)), np.float64)
        expected += float((p * ce).sum())
        count += ce.shape[1] * ce.shape[2]
    return [float(s / count) for s in sums], expected / count


# --- greedy target generation and draft acceptance ------------------------------------------

@functools.partial(jax.jit, static_argnums=(3, 4))
def _argmax_at(params, ids, pos, cfg, num_loops):
    """Greedy token of loop num_loops-1 at position pos[b] of each row of ids [B, S]."""
    hidden, _ = loop_states(params, ids, cfg, num_loops)
    h = jnp.take_along_axis(hidden[-1], pos[:, None, None], axis=1)[:, 0]
    return jnp.argmax(lm_head(params, h).astype(jnp.float32), axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _argmax_all(params, ids, cfg, num_loops):
    hidden, _ = loop_states(params, ids, cfg, num_loops)
    return jnp.argmax(lm_head(params, hidden[-1]).astype(jnp.float32), -1).astype(jnp.int32)


def greedy_generate(params, cfg, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """prompts [B, P] -> [B, P + new_tokens], greedy with all loops (dense, fixed shape)."""
    b, p = prompts.shape
    ids = np.zeros((b, p + new_tokens), np.int32)
    ids[:, :p] = prompts
    for n in range(p, p + new_tokens):
        pos = jnp.full((b,), n - 1, jnp.int32)
        ids[:, n] = np.asarray(_argmax_at(params, jnp.asarray(ids), pos, cfg,
                                          cfg.total_ut_steps))
    return ids


def _rounds(match: np.ndarray, k: int) -> tuple[int, int]:
    """(accepted, drafted) over the speculative rounds of one row; match[j] says whether the
    draft's prediction for generated token j (given the target's prefix) is the target's."""
    n, acc, drafted = 0, 0, 0
    total = len(match)
    while n < total:
        a = 0
        while a < k and n + a < total and match[n + a]:
            a += 1
        acc += a
        drafted += k
        n += a + 1
    return acc, drafted


def acceptance_fast(params, cfg, seqs: np.ndarray, prompt_len: int, d: int, k: int):
    """Exact greedy acceptance from one d-loop forward over target sequences [B, P+N]."""
    pred = np.asarray(_argmax_all(params, jnp.asarray(seqs), cfg, d))  # pred[:, j] -> token j+1
    acc = drafted = 0
    for row, seq in zip(pred, seqs):
        match = row[prompt_len - 1:-1] == seq[prompt_len:]
        a, t = _rounds(match, k)
        acc, drafted = acc + a, drafted + t
    return acc, drafted


def acceptance_literal(params, cfg, seqs: np.ndarray, prompt_len: int, d: int, k: int):
    """The rounds as the engine runs them: the draft feeds on its own candidates."""
    b, total = seqs.shape
    acc = drafted = 0
    for r in range(b):
        n = prompt_len
        while n < total:
            ids = np.zeros((1, total + k), np.int32)
            ids[0, :n] = seqs[r, :n]
            cands = []
            for i in range(k):
                pos = jnp.asarray([n - 1 + i], jnp.int32)
                c = int(_argmax_at(params, jnp.asarray(ids), pos, cfg, d)[0])
                ids[0, n + i] = c
                cands.append(c)
            target = seqs[r, n:n + k]
            a = 0
            while a < len(target) and cands[a] == target[a]:
                a += 1
            acc += a
            drafted += k
            n += a + 1
    return acc, drafted


def prompts_from_windows(windows: np.ndarray, num: int, prompt_len: int) -> np.ndarray:
    """Prompts: the first prompt_len tokens of evenly spaced held-out windows."""
    idx = np.linspace(0, len(windows) - 1, num).round().astype(int)
    return windows[idx, :prompt_len].astype(np.int32)


def acceptance_table(params, cfg, prompts: np.ndarray, new_tokens: int, k: int = 4,
                     depths=(1, 2, 3)):
    seqs = greedy_generate(params, cfg, prompts, new_tokens)
    out = {}
    for d in depths:
        a, t = acceptance_fast(params, cfg, seqs, prompts.shape[1], d, k)
        out[d] = {"accepted": a, "drafted": t, "rate": a / t}
    return out, seqs


# --- exit depth statistics -----------------------------------------------------------------

def exit_depth_stats(params, cfg, windows: np.ndarray, thresholds=(0.3, 0.5, 0.7, 0.9),
                     batch: int = 16):
    """Per threshold q: fraction of held-out tokens exiting after loop 1..T; plus the spread
    of the gate's expected exit depth sum_t t*p_t across tokens."""
    steps = {q: [] for q in thresholds}
    depth = []
    for i in range(0, len(windows), batch):
        _, gates = per_loop_token_ce(params, jnp.asarray(windows[i:i + batch]), cfg)
        gates = gates.astype(jnp.float32)
        for q in thresholds:
            steps[q].append(np.asarray(threshold_exit_step(gates, q)).ravel())
        p = np.asarray(exit_probabilities(gates))
        depth.append((p * np.arange(1, p.shape[0] + 1)[:, None, None]).sum(0).ravel())
    t = cfg.total_ut_steps
    out = {"exit_fraction": {}}
    for q in thresholds:
        s = np.concatenate(steps[q])
        out["exit_fraction"][str(q)] = [float((s == j).mean()) for j in range(t)]
    dep = np.concatenate(depth)
    out["expected_depth"] = {"mean": float(dep.mean()), "std": float(dep.std()),
                             "p10": float(np.percentile(dep, 10)),
                             "p50": float(np.percentile(dep, 50)),
                             "p90": float(np.percentile(dep, 90))}
    return out


def token_exit_depths(params, cfg, tok, text: str, threshold: float = 0.5):
    """[(token text, exit loop 1..T, expected depth)] for each token of `text` (BOS first)."""
    ids = np.asarray([[cfg.bos_token_id] + tok.encode(text).ids], np.int32)
    _, gates = loop_states(params, jnp.asarray(ids), cfg, cfg.total_ut_steps)
    gates = gates.astype(jnp.float32)
    steps = np.asarray(threshold_exit_step(gates, threshold))[0]
    p = np.asarray(exit_probabilities(gates))[:, 0]
    depth = (p * np.arange(1, p.shape[0] + 1)[:, None]).sum(0)
    return [(tok.decode([int(i)]), int(s) + 1, float(e))
            for i, s, e in zip(ids[0, 1:], steps[1:], depth[1:])]


if __name__ == "__main__":
    # Notebook-free look at the exit gate: per-token exit depth of a text.
    #   python -m convert.demo_eval "And the LORD spake unto Moses, saying" [threshold]
    import os
    import sys

    from tokenizers import Tokenizer

    from convert.load import load_checkpoint

    folder = os.path.join(os.path.dirname(__file__), "..", "ouro_jax", "demo_model")
    text = sys.argv[1] if len(sys.argv) > 1 else "And the LORD spake unto Moses, saying,"
    q = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    ck = load_checkpoint(folder, "fp32")
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    for piece, step, depth in token_exit_depths(ck.params, ck.config, tok, text, q):
        print(f"{piece!r:>16}  exits after loop {step}  (expected depth {depth:.2f})")
