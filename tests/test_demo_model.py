"""The shipped demo model (ouro_jax/demo_model): loads, gives its recorded figures, and
behaves like a looped model should (loss falls with depth, the draft is accepted, the exit
gate picks different depths for different tokens)."""

import json
import os

import numpy as np
import pytest

from convert import demo_card, demo_corpus, demo_eval
from convert.load import load_checkpoint

FOLDER = os.path.join(os.path.dirname(__file__), "..", "ouro_jax", "demo_model")


@pytest.fixture(scope="module")
def demo():
    loaded = load_checkpoint(FOLDER, "fp32")
    tok, windows = demo_card.heldout_setup(FOLDER)
    with open(os.path.join(FOLDER, "demo_metrics.json")) as f:
        metrics = json.load(f)
    return loaded, tok, windows, metrics


def test_folder_layout_and_size():
    names = set(os.listdir(FOLDER))
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md"} <= names
    total = sum(os.path.getsize(os.path.join(FOLDER, n)) for n in names)
    assert total < 8_000_000
    with open(os.path.join(FOLDER, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["total_ut_steps"] == 4
    assert cfg["bos_token_id"] == cfg["eos_token_id"] == demo_corpus.EOT_ID


def test_tokenizer_round_trip(demo):
    _, tok, _, _ = demo
    assert tok.token_to_id(demo_corpus.EOT) == demo_corpus.EOT_ID
    for text in ("In the beginning God created the heaven and the earth.\n",
                 "Zebedee's 12 sons; café, naïve — ünïcödé & tabs\t!"):
        assert tok.decode(tok.encode(text).ids) == text


def test_recorded_heldout_loss_and_depth(demo):
    loaded, _, windows, metrics = demo
    rec = metrics["test"]
    loss, _ = demo_eval.heldout_loss(loaded.params, loaded.config, windows[:rec["windows"]])
    np.testing.assert_allclose(loss, rec["loss_per_loop"], rtol=2e-4)
    full = metrics["heldout"]["loss_per_loop"]
    assert full[-1] < full[0] - 0.02  # loop 4 beats loop 1 on the whole held-out set
    assert loss[-1] < loss[0]


def test_draft_acceptance_d2_k4(demo):
    loaded, _, windows, metrics = demo
    rec = metrics["test"]
    prompts = demo_eval.prompts_from_windows(windows, rec["prompts"], demo_card.PROMPT_LEN)
    table, seqs = demo_eval.acceptance_table(loaded.params, loaded.config, prompts,
                                             rec["new_tokens"], k=4, depths=(2,))
    rate = table[2]["rate"]
    assert rate >= 0.6
    assert abs(rate - rec["acceptance_d2_k4"]) < 0.02
    assert metrics["acceptance_k4"]["2"]["rate"] >= 0.6
    # the one-forward count equals the literal round-by-round draft (two rows suffice)
    fast = demo_eval.acceptance_fast(loaded.params, loaded.config, seqs[:2],
                                     demo_card.PROMPT_LEN, 2, 4)
    literal = demo_eval.acceptance_literal(loaded.params, loaded.config, seqs[:2],
                                           demo_card.PROMPT_LEN, 2, 4)
    assert fast == literal


def test_engine_speculative_acceptance_on_the_demo_model(demo):
    """The engine's own rounds accept the draft as often as demo_eval's simulation says
    (greedy, k=4, d=2, the recorded prompts). Exact speculative decoding hides a broken
    draft (its candidates are rejected, the tokens stay right); this catches the lost speedup.
    The counts differ a little: the engine drafts fewer candidates near max_tokens."""
    from ouro_jax.api import Ouro, SamplingParams
    from ouro_jax.speculative import SpeculativeConfig

    loaded, _, windows, metrics = demo
    rec = metrics["test"]
    prompts = demo_eval.prompts_from_windows(windows, rec["prompts"], demo_card.PROMPT_LEN)
    llm = Ouro(loaded.config, loaded.params, None)
    res = llm.generate([[int(t) for t in p] for p in prompts],
                       SamplingParams(max_tokens=rec["new_tokens"], ignore_eos=True),
                       speculative=SpeculativeConfig(4, 2))
    spec = res.stats.spec
    assert spec["drafted"] >= len(prompts) * (rec["new_tokens"] - 8)
    assert spec["acceptance"] >= 0.6, spec
    assert abs(spec["acceptance"] - rec["acceptance_d2_k4"]) < 0.05, spec


def test_exit_gate_depth_differs_across_tokens(demo):
    loaded, _, windows, _ = demo
    stats = demo_eval.exit_depth_stats(loaded.params, loaded.config, windows[:4],
                                       thresholds=(0.5,))
    frac = stats["exit_fraction"]["0.5"]
    assert sum(f > 0.02 for f in frac) >= 2, frac  # at least two depths in real use
    assert stats["expected_depth"]["std"] > 0.05


def test_card_samples_come_from_the_engine_with_the_bos_ids(demo):
    """The card's first greedy sample is what the engine (the CLI's path) gives for the ids
    the card names: BOS then the prompt (the engine adds no BOS to a text prompt)."""
    import ast
    from ouro_jax.api import Ouro, SamplingParams

    loaded, tok, _, _ = demo
    with open(os.path.join(FOLDER, "README.md")) as f:
        card = f.read()
    assert "--prompt-ids 0,296,385,388 --max-tokens 40" in card
    sample = ast.literal_eval(card.split("## Greedy samples")[1].split("\n    ")[1].split("\n")[0])
    ids = [demo_corpus.EOT_ID] + tok.encode("And God said").ids
    assert ids == [0, 296, 385, 388]
    res = Ouro(loaded.config, loaded.params, None).generate([ids], SamplingParams(max_tokens=40))
    assert tok.decode(ids[1:] + list(res.outputs[0].token_ids)) == sample
