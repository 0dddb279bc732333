"""Writes the demo model folder: weights, tokenizer, held-out sample, metrics and model card.

Every figure is measured on the weights as saved and reloaded (convert.load), so the card,
`demo_metrics.json` and tests/test_demo_model.py all see the same numbers.
"""

from __future__ import annotations

import json
import os
import time

import ml_dtypes
import numpy as np

from convert import demo_corpus, demo_eval
from convert.load import load_checkpoint
from convert.save import save_checkpoint

SEQ = 128            # held-out window length
TEST_WINDOWS = 8     # windows the test recomputes
PROMPT_LEN = 32
TEST_PROMPTS, TEST_NEW = 8, 32  # the acceptance setting the test recomputes
EXIT_EXAMPLE = ("And the LORD spake unto Moses, saying, Speak unto the children of Israel, "
                "that they bring me an offering: of every man that giveth it willingly.")


def heldout_setup(folder: str, tok=None):
    """(tokenizer, held-out windows [N, SEQ+1]) from the files in a demo folder."""
    from tokenizers import Tokenizer
    tok = tok or Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "heldout.json")) as f:
        docs = json.load(f)["chapters"]
    return tok, demo_eval.heldout_windows(demo_corpus.encode_stream(tok, docs), SEQ)


def test_metrics(params, cfg, windows):
    """The figures tests/test_demo_model.py recomputes (small, fast)."""
    loss, _ = demo_eval.heldout_loss(params, cfg, windows[:TEST_WINDOWS])
    prompts = demo_eval.prompts_from_windows(windows, TEST_PROMPTS, PROMPT_LEN)
    acc, _ = demo_eval.acceptance_table(params, cfg, prompts, TEST_NEW, k=4, depths=(2,))
    return {"windows": TEST_WINDOWS, "loss_per_loop": loss, "prompts": TEST_PROMPTS,
            "new_tokens": TEST_NEW, "acceptance_d2_k4": acc[2]["rate"]}


def canonical_command(args) -> str:
    """The command that rebuilds the shipped folder: non-default options only."""
    from convert.train_demo import parse_args
    defaults = vars(parse_args([]))
    extra = "".join(f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                    if k != "out" and v != defaults[k])
    return "nice -n 10 python -m convert.train_demo --out ouro_jax/demo_model" + extra


def finish_folder(args, cfg, params, tok, held_docs, train_seconds, tensors):
    cpu_seconds = time.process_time()  # CPU time of all threads so far: contention-free cost
    out = args.out
    np_dtype = np.dtype(ml_dtypes.bfloat16) if args.dtype == "bf16" else np.dtype(np.float32)
    save_checkpoint({k: v.astype(np_dtype) for k, v in tensors.items()}, cfg, out,
                    extra_config={"torch_dtype": "bfloat16" if args.dtype == "bf16"
                                  else "float32"})
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": demo_corpus.EOT, "eos_token": demo_corpus.EOT,
                   "pad_token": demo_corpus.EOT, "model_max_length": cfg.max_position_embeddings,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=2)
    with open(os.path.join(out, "heldout.json"), "w") as f:
        json.dump({"source": "every 40th KJV chapter (offset 17), never trained on",
                   "chapters": held_docs}, f)
    return evaluate_folder(out, args, train_seconds, cpu_seconds)


def evaluate_folder(out: str, args, train_seconds: float, cpu_seconds: float):
    """Measures the saved folder and writes demo_metrics.json and README.md."""
    t_eval = time.perf_counter()
    loaded = load_checkpoint(out, "fp32")
    p, cfg = loaded.params, loaded.config
    tok, windows = heldout_setup(out)
    print(f"evaluating on {len(windows)} held-out windows of {SEQ} tokens", flush=True)
    loss, expected = demo_eval.heldout_loss(p, cfg, windows)
    prompts = demo_eval.prompts_from_windows(windows, args.eval_prompts, PROMPT_LEN)
    acc, seqs = demo_eval.acceptance_table(p, cfg, prompts, args.new_tokens, k=4)
    exits = demo_eval.exit_depth_stats(p, cfg, windows)
    example = demo_eval.token_exit_depths(p, cfg, tok, EXIT_EXAMPLE, 0.5)
    samples = []
    for prompt in ("And God said", "The LORD is my shepherd", "In the beginning was"):
        ids = np.asarray([[demo_corpus.EOT_ID] + tok.encode(prompt).ids], np.int32)
        gen = demo_eval.greedy_generate(p, cfg, ids, 40)
        samples.append(tok.decode(gen[0, 1:].tolist()))
    metrics = {
        "heldout": {"windows": len(windows), "seq_len": SEQ, "loss_per_loop": loss,
                    "expected_loss_under_gate": expected},
        "acceptance_k4": {str(d): v for d, v in acc.items()},
        "acceptance_setting": {"prompts": args.eval_prompts, "prompt_len": PROMPT_LEN,
                               "new_tokens": args.new_tokens, "k": 4},
        "exit": exits,
        "test": test_metrics(p, cfg, windows),
        "train_seconds": round(train_seconds, 1),
        "train_cpu_seconds": round(cpu_seconds, 1),
        "num_params": cfg.num_params(),
        "command": canonical_command(args),
        "eval_seconds": round(time.perf_counter() - t_eval, 1),
        "args": vars(args),
        "samples": samples,
        "exit_example": example,
    }
    with open(os.path.join(out, "demo_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(card(cfg, metrics, os.path.getsize(os.path.join(out, "model.safetensors"))))
    print(json.dumps({k: metrics[k] for k in ("heldout", "acceptance_k4", "test")}, indent=1))
    return metrics


def card(cfg, m, weight_bytes) -> str:
    a = m["args"]
    loss = m["heldout"]["loss_per_loop"]
    loss_rows = "\n".join(f"| {t + 1} | {v:.4f} | {np.exp(v):.1f} |" for t, v in enumerate(loss))
    acc_rows = "\n".join(f"| {d} | {v['accepted']}/{v['drafted']} | {100 * v['rate']:.1f}% |"
                         for d, v in m["acceptance_k4"].items())
    ex = m["exit"]
    exit_rows = "\n".join(
        f"| {q} | " + " | ".join(f"{100 * f:.1f}%" for f in fr) + " |"
        for q, fr in ex["exit_fraction"].items())
    dep = ex["expected_depth"]
    samples = "\n".join(f"    {s!r}" for s in m["samples"])
    exit_line = "".join(f"{piece}^{step}" for piece, step, _ in m["exit_example"])
    s = m["acceptance_setting"]
    return f"""# ouro_jax demo model (tiny Ouro, trained on the King James Bible)

A tiny model of the Ouro architecture (looped decoder, T={cfg.total_ut_steps} loops, exit gate),
trained from scratch on CPU so that the engine, its notebooks and `python -m ouro_jax.generate`
have a default model whose text, loop-by-loop quality, draft acceptance and exit gate mean
something. It writes pseudo-King-James prose; it knows nothing else.

## Corpus and licence
{demo_corpus.SOURCE}
Documents are the 1,189 chapters (verse texts without references, one verse a line, each
chapter preceded by `<|endoftext|>`). Every 40th chapter (offset 17; 30 chapters, ~31k tokens)
is held out; `heldout.json` carries those chapters. The text is in the public domain, so
the corpus puts no restriction on the weights or the tokenizer; the decoder program (GPL) only
produced the plain text and is not part of anything shipped.

## Shape
hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} query heads /
{cfg.num_key_value_heads} KV heads (GQA), head_dim {cfg.head_dim}, intermediate {cfg.intermediate_size},
vocab {cfg.vocab_size}, max_position_embeddings {cfg.max_position_embeddings}, rope_theta {cfg.rope_theta:g},
{cfg.num_params():,} parameters; weights {a['dtype']} ({weight_bytes / 1e6:.1f} MB).
Tokenizer: byte-level BPE (`tokenizers`), vocab {cfg.vocab_size}; id 0 `<|endoftext|>` is BOS,
EOS and padding (`bos_token_id = eos_token_id = 0`, as in the Ouro checkpoints).

## Training
    {m['command']}
Corpus download and decoding (`apt-get download bible-kjv-text bible-kjv`, sha256-checked),
tokenizer and {a['steps']} + {a['gate_steps']} steps (stage I + stage II) of batch {a['batch']} x {a['seq']} tokens took
{m['train_seconds'] / 60:.1f} min wall time on 2 CPU cores shared with other work (`nice -n 10`), using
{m['train_cpu_seconds'] / 60:.1f} CPU-minutes over all threads (wall time depends on the other load);
the evaluation below took another {m['eval_seconds'] / 60:.1f} min. Seeded (seed {a['seed']}); fp32; hand-written AdamW (b1 0.9, b2 0.95,
weight decay 0.1 on matrices, clip 1.0, lr {a['lr']} with {a['warmup']} warm-up steps and cosine decay to 10%).

Objective, following the Ouro paper as far as it is published:
- Stage I (all weights), per token, with CE_t the loss of loop t's LM head and p_t the exit
  distribution of the gate: `sum_t p_t CE_t - beta * H(p) + aux * mean_t CE_t`,
  beta = {a['beta']}, aux = {a['aux']}. The first two terms are Ouro's entropy-regularised expected loss
  (entropy = KL to a uniform prior over exit steps, up to a constant); the third trains every
  loop's head directly, so shallow loops (the speculative draft) predict well.
- Stage II (exit gate only, LM frozen): Ouro's focused gate training as the paper gives it.
  Per token and loop t = 2..T, the improvement over the previous loop
  I_t = max(0, CE_(t-1) - CE_t) (detached) gives the ideal continuation probability
  w_t = sigmoid(k (I_t - gamma)), k = {a['k']}, gamma = {a['gamma']} (the paper's constants); the gate's exit
  probability lambda_t is fitted to 1 - w_t with binary cross-entropy. Loop 1's gate keeps
  what stage I taught it.

## Held-out loss per loop ({m['heldout']['windows']} windows x {m['heldout']['seq_len']} tokens)
| loop | CE (nats/token) | perplexity |
|---|---|---|
{loss_rows}

Expected loss under the gate's exit distribution: {m['heldout']['expected_loss_under_gate']:.4f}.

## Greedy self-speculative draft acceptance (k = 4)
Draft = the first d loops; target = all {cfg.total_ut_steps}. {s['prompts']} held-out prompts of {s['prompt_len']} tokens,
{s['new_tokens']} greedily generated tokens each; exact simulation with dense forwards
(`convert/demo_eval.py`); acceptance = accepted / drafted.

| d | accepted / drafted | acceptance |
|---|---|---|
{acc_rows}

## Exit gate: depth differs across tokens
Fraction of held-out tokens whose exit step (first loop with cumulative exit probability >= q)
is loop 1..{cfg.total_ut_steps}:

| q | """ + " | ".join(f"loop {t + 1}" for t in range(cfg.total_ut_steps)) + f""" |
|---|""" + "---|" * cfg.total_ut_steps + f"""
{exit_rows}

Expected exit depth sum_t t p_t across tokens: mean {dep['mean']:.2f}, std {dep['std']:.2f},
10th/50th/90th percentile {dep['p10']:.2f} / {dep['p50']:.2f} / {dep['p90']:.2f}.
Per token of one sentence (the loop after `^` is where the token exits at q = 0.5; `python -m convert.demo_eval
"TEXT" [q]` prints this for any text):

    {exit_line}

The shipped config keeps Ouro's `early_exit_threshold = 1.0` (all tokens use the last loop);
pass a threshold to see early exits.

## Greedy samples (all loops)
Each prompt is preceded by `<|endoftext|>` (id 0), as the training windows were; the
engine adds no BOS to a text prompt, so give the ids to reproduce one, e.g. the first:
`python -m ouro_jax.generate --prompt-ids 0,296,385,388 --max-tokens 40`.

{samples}

`demo_metrics.json` holds every figure above, plus the small subset that
`tests/test_demo_model.py` recomputes.
"""


if __name__ == "__main__":
    # Re-measure a folder and rewrite its card (same options as recorded in its metrics):
    #   python -m convert.demo_card ouro_jax/demo_model
    import argparse
    import sys

    folder = sys.argv[1]
    with open(os.path.join(folder, "demo_metrics.json")) as f:
        old = json.load(f)
    evaluate_folder(folder, argparse.Namespace(**dict(old["args"], out=folder)),
                    old["train_seconds"], old.get("train_cpu_seconds", float("nan")))
