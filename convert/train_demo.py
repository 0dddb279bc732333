"""Train the tiny Ouro demo model that ships in ouro_jax/demo_model/, from scratch.

    nice -n 10 python -m convert.train_demo --out ouro_jax/demo_model

Corpus and tokenizer: convert/demo_corpus.py (King James Bible, public domain).
Model: the Ouro architecture at a tiny shape (T=4 loops, exit gate), fp32, in JAX, with the
forward of ouro_jax.model; the optimiser is a hand-written AdamW. Fixed seeds throughout.

Objective (documented in the model card):
  Stage I (all weights), per token, with CE_t the cross-entropy of loop t's LM head and
  p_t the exit distribution of the gate:
      L1 = sum_t p_t CE_t - beta * H(p)  +  aux * mean_t CE_t
  The first two terms are Ouro's entropy-regularised expected loss (the entropy term is the
  KL to a uniform prior over exit steps, up to a constant); the last one trains every loop's
  head directly, so shallow loops predict well even where the gate puts little mass.
  Stage II (gate only; LM frozen): Ouro's focused gate training, as published. With the
  per-token loss improvement of loop t over loop t-1, I_t = max(0, CE_{t-1} - CE_t)
  (detached), the ideal continuation probability is w_t = sigmoid(k (I_t - gamma)), k = 50,
  gamma = 0.005, and the gate's exit probability lambda_t at loop t is fitted with binary
  cross-entropy -[w_t log(1 - lambda_t) + (1 - w_t) log lambda_t], averaged over t = 2..T
  (loop 1's gate keeps what stage I taught it).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from convert import demo_corpus
from convert.demo_eval import loop_states
from ouro_jax.config import OuroConfig
from ouro_jax.model import exit_probabilities, lm_head
from ouro_jax.params import (GLOBAL_TENSORS, LAYER_TENSORS, LayerParams, OuroParams,
                             global_tensor_shapes, layer_tensor_shapes)


def demo_config(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int,
                intermediate: int) -> OuroConfig:
    return OuroConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hidden // heads, total_ut_steps=4,
                      rope_theta=10_000.0, max_position_embeddings=2048, rms_norm_eps=1e-6,
                      early_exit_threshold=1.0, bos_token_id=demo_corpus.EOT_ID,
                      eos_token_id=demo_corpus.EOT_ID)


def init_params(cfg: OuroConfig, seed: int, branch_init: float) -> OuroParams:
    """Normal init: embeddings N(0,1); projections N(0, fan_in^-1/2); LM head N(0, 0.02);
    pre-norms 1, post-branch norms `branch_init` (small residual updates at the start);
    exit gate zero (lambda = 0.5 everywhere)."""
    key = jax.random.PRNGKey(seed)
    lshapes, gshapes = layer_tensor_shapes(cfg), global_tensor_shapes(cfg)
    layers = {}
    for field in LAYER_TENSORS.values():
        shape = (cfg.num_hidden_layers, *lshapes[field])
        if field.endswith("_2"):
            layers[field] = jnp.full(shape, branch_init, jnp.float32)
        elif field.endswith("layernorm"):
            layers[field] = jnp.ones(shape, jnp.float32)
        else:
            key, sub = jax.random.split(key)
            layers[field] = jax.random.normal(sub, shape) * shape[-1] ** -0.5
    key, k1, k2 = jax.random.split(key, 3)
    return OuroParams(
        embed_tokens=jax.random.normal(k1, gshapes["embed_tokens"]),
        layers=LayerParams(**layers),
        norm=jnp.ones(gshapes["norm"], jnp.float32),
        exit_gate_w=jnp.zeros(gshapes["exit_gate_w"], jnp.float32),
        exit_gate_b=jnp.zeros(gshapes["exit_gate_b"], jnp.float32),
        lm_head=jax.random.normal(k2, gshapes["lm_head"]) * 0.02)


def to_hf(params: OuroParams, cfg: OuroConfig, dtype) -> dict[str, np.ndarray]:
    out = {name: np.asarray(getattr(params, field)).astype(dtype)
           for name, field in GLOBAL_TENSORS.items()}
    for suffix, field in LAYER_TENSORS.items():
        stacked = np.asarray(getattr(params.layers, field))
        for i in range(cfg.num_hidden_layers):
            out[f"model.layers.{i}.{suffix}"] = stacked[i].astype(dtype)
    return out


# --- objectives -----------------------------------------------------------------------------

def _token_ce(params, hidden, targets):
    logits = jax.vmap(lambda h: lm_head(params, h))(hidden).astype(jnp.float32)
    tgt = jnp.take_along_axis(logits, targets[None, ..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - tgt  # [T, B, S]


def stage1_loss(params, batch, cfg, beta, aux):
    hidden, gates = loop_states(params, batch[:, :-1], cfg, cfg.total_ut_steps)
    ce = _token_ce(params, hidden, batch[:, 1:])
    p = exit_probabilities(gates.astype(jnp.float32))
    entropy = -(p * jnp.log(jnp.maximum(p, 1e-12))).sum(0).mean()
    expected = (p * ce).sum(0).mean()
    per_loop = ce.mean(axis=(1, 2))
    loss = expected - beta * entropy + aux * per_loop.mean()
    return loss, {"loss": loss, "expected": expected, "entropy": entropy, "ce": per_loop}


def stage2_loss(gate, params, batch, cfg, k, gamma):
    hidden, _ = loop_states(params, batch[:, :-1], cfg, cfg.total_ut_steps)
    hidden = jax.lax.stop_gradient(hidden)
    ce = jax.lax.stop_gradient(_token_ce(params, hidden, batch[:, 1:]))
    w, b = gate
    logit = jnp.einsum("tbsd,d->tbs", hidden[1:], w[0]) + b[0]  # exit logit of loops 2..T
    improve = jnp.maximum(0.0, ce[:-1] - ce[1:])  # I_t: gain of loop t over loop t-1
    cont = jax.nn.sigmoid(k * (improve - gamma))  # ideal probability of continuing
    bce = -(cont * jax.nn.log_sigmoid(-logit) + (1 - cont) * jax.nn.log_sigmoid(logit))
    lam = jax.nn.sigmoid(logit)
    return bce.mean(), {"bce": bce.mean(), "target_continue": cont.mean(),
                        "gate_exit": lam.mean()}


# --- hand-written AdamW ---------------------------------------------------------------------

def adamw_init(params):
    zeros = jax.tree.map(jnp.zeros_like, params)
    return {"m": zeros, "v": jax.tree.map(jnp.zeros_like, params), "t": jnp.zeros((), jnp.int32)}


def adamw_update(params, grads, state, lr, decay_mask, b1=0.9, b2=0.95, eps=1e-8, wd=0.1,
                 clip=1.0):
    gnorm = jnp.sqrt(sum(jnp.sum(g * g) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, clip / (gnorm + 1e-6))
    grads = jax.tree.map(lambda g: g * scale, grads)
    t = state["t"] + 1
    m = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state["m"], grads)
    v = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state["v"], grads)
    c1, c2 = 1 - b1 ** t, 1 - b2 ** t

    def step(p, m, v, decay):
        upd = (m / c1) / (jnp.sqrt(v / c2) + eps)
        return p - lr * (upd + wd * decay * p)

    new = jax.tree.map(step, params, m, v, decay_mask)
    return new, {"m": m, "v": v, "t": t}, gnorm


def decay_mask_of(params: OuroParams):
    """1.0 where weight decay applies: matrices only (not norms, not the exit gate)."""
    mask = jax.tree.map(lambda p: jnp.float32(p.ndim >= 2), params)
    mask.exit_gate_w = jnp.float32(0.0)
    mask.layers = jax.tree.map(lambda p: jnp.float32(p.ndim >= 3), params.layers)
    return mask


def lr_at(step, total, peak, warmup, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


@functools.partial(jax.jit, static_argnums=(4,), donate_argnums=(0, 1))
def stage1_step(params, opt, batch, hp, cfg, mask):
    grads, stats = jax.grad(stage1_loss, has_aux=True)(params, batch, cfg, hp["beta"], hp["aux"])
    params, opt, gnorm = adamw_update(params, grads, opt, hp["lr"], mask)
    return params, opt, dict(stats, gnorm=gnorm)


@functools.partial(jax.jit, static_argnums=(4,), donate_argnums=(0, 1))
def stage2_step(gate, opt, params, batch, cfg, hp):
    grads, stats = jax.grad(stage2_loss, has_aux=True)(gate, params, batch, cfg, hp["k"],
                                                        hp["gamma"])
    gate, opt, gnorm = adamw_update(gate, grads, opt, hp["lr"], (0.0, 0.0), wd=0.0)
    return gate, opt, dict(stats, gnorm=gnorm)


def sample_batch(rng: np.random.Generator, stream: np.ndarray, batch: int, seq: int):
    starts = rng.integers(0, len(stream) - seq - 1, size=batch)
    return np.stack([stream[s:s + seq + 1] for s in starts])


# --- driver ---------------------------------------------------------------------------------

def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="ouro_jax/demo_model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--steps", type=int, default=1000, help="stage I steps")
    ap.add_argument("--gate-steps", type=int, default=150, help="stage II steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--gate-lr", type=float, default=1e-2)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--beta", type=float, default=0.1, help="entropy weight (stage I)")
    ap.add_argument("--aux", type=float, default=1.0, help="weight of mean_t CE_t (stage I)")
    ap.add_argument("--k", type=float, default=50.0, help="stage II target slope")
    ap.add_argument("--gamma", type=float, default=0.005, help="stage II improvement margin")
    ap.add_argument("--branch-init", type=float, default=0.3)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="dtype of the saved weights (training is fp32)")
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    return ap.parse_args(argv)


def train(args, train_stream: np.ndarray, cfg: OuroConfig, log=print) -> OuroParams:
    params = init_params(cfg, args.seed, args.branch_init)
    opt, mask = adamw_init(params), decay_mask_of(params)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    for step in range(args.steps):
        hp = {"lr": jnp.float32(lr_at(step, args.steps, args.lr, args.warmup)),
              "beta": jnp.float32(args.beta), "aux": jnp.float32(args.aux)}
        batch = jnp.asarray(sample_batch(rng, train_stream, args.batch, args.seq))
        params, opt, st = stage1_step(params, opt, batch, hp, cfg, mask)
        if step % 25 == 0 or step == args.steps - 1:
            ce = " ".join(f"{c:.3f}" for c in np.asarray(st["ce"]))
            log(f"stage I {step:5d} loss {float(st['loss']):.4f} ce/loop [{ce}] "
                f"H(p) {float(st['entropy']):.3f} |g| {float(st['gnorm']):.2f} "
                f"{time.perf_counter() - t0:.0f}s")
    gate = (params.exit_gate_w, params.exit_gate_b)
    gopt = adamw_init(gate)
    for step in range(args.gate_steps):
        hp = {"lr": jnp.float32(lr_at(step, args.gate_steps, args.gate_lr, 10)),
              "k": jnp.float32(args.k), "gamma": jnp.float32(args.gamma)}
        batch = jnp.asarray(sample_batch(rng, train_stream, args.batch, args.seq))
        gate, gopt, st = stage2_step(gate, gopt, params, batch, cfg, hp)
        if step % 25 == 0 or step == args.gate_steps - 1:
            log(f"stage II {step:4d} bce {float(st['bce']):.4f} target-continue "
                f"{float(st['target_continue']):.3f} gate-exit {float(st['gate_exit']):.3f} "
                f"{time.perf_counter() - t0:.0f}s")
    params.exit_gate_w, params.exit_gate_b = gate
    return params


def main(argv=None):
    args = parse_args(argv)
    t_start = time.perf_counter()
    docs = demo_corpus.chapters()
    train_docs, held_docs = demo_corpus.split(docs)
    tok = demo_corpus.train_tokenizer(train_docs, args.vocab)
    train_stream = np.asarray(demo_corpus.encode_stream(tok, train_docs), np.int32)
    cfg = demo_config(tok.get_vocab_size(), args.hidden, args.layers, args.heads,
                      args.kv_heads, args.intermediate)
    print(f"corpus: {len(train_docs)} train / {len(held_docs)} held-out chapters, "
          f"{len(train_stream)} train tokens; {cfg.num_params():,} parameters", flush=True)
    params = train(args, train_stream, cfg, log=lambda s: print(s, flush=True))
    train_seconds = time.perf_counter() - t_start

    from convert.demo_card import finish_folder  # evaluation + card, on the saved weights
    finish_folder(args, cfg, params, tok, held_docs, train_seconds,
                  to_hf(params, cfg, np.float32))


if __name__ == "__main__":
    main()
