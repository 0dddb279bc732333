"""`python -m ouro_jax.generate` as a user runs it (in-process, same code path)."""

import json

from engine_helpers import tiny_checkpoint
from ouro_jax import generate


def _run(capsys, *argv):
    rc = generate.main(["--compile-cache", "", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_output_per_request_plus_stats(capsys, tmp_path):
    folder = tiny_checkpoint("tiny-gqa")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt_ids": [4, 5, 6]}) + "\n")
    rc, out, _ = _run(capsys, "--model", folder, "--prompt-ids", "1,2,3", "--prompts-file",
                      str(prompts), "--max-tokens", "5", "--ignore-eos", "--json", "--logprobs",
                      "--speculative-k", "2", "--draft-loops", "1")
    assert rc == 0
    lines = [json.loads(l) for l in out.strip().splitlines()]
    assert len(lines) == 3
    for req in lines[:2]:
        assert len(req["token_ids"]) == 5 == len(req["exit_depths"]) == len(req["logprobs"])
        assert req["finish_reason"] == "length" and req["text"] is None
    stats = lines[2]["stats"]
    assert stats["generated_tokens"] == 10 and stats["spec"]["rounds"] > 0
    assert stats["compile_s"] >= 0 and stats["decode_tok_s"] > 0
    # where the load went: the checkpoint's read, conversion and check, the tokenizer and the
    # engine's construction, which together are the load (within the timer's own overhead)
    phases = stats["load_phases"]
    assert set(phases) == {"open_s", "backend_s", "convert_s", "put_s", "check_compile_s",
                           "transfer_wait_s", "check_finite_s", "tokenizer_s", "engine_s"}
    assert all(v >= 0 for v in phases.values())
    assert 0.5 * stats["load_s"] <= sum(phases.values()) <= stats["load_s"]


def test_demo_model_streams_text_and_prints_stats(capsys):
    rc, out, err = _run(capsys, "--prompt", "And God said", "--max-tokens", "12")
    assert rc == 0
    assert out.startswith("And God said") and len(out.strip()) > len("And God said")
    assert "stats: prompt tokens" in err and "decode" in err and "compile" in err
    # progress for each program compiled, before the text: "(compiling NAME ... 0.12s)"
    import re
    assert re.search(r"\(compiling prefill_chunk \.\.\. \d+\.\d\ds\)\n", err), err
    assert re.search(r"\(compiling (decode|spec)_chunk \.\.\. \d+\.\d\ds\)\n", err), err


def test_errors_are_clear_and_exit_2(capsys):
    folder = tiny_checkpoint("tiny-gqa")
    cases = [(["--model", folder, "--prompt", "hi"], "no tokenizer.json"),
             (["--model", folder, "--prompt-ids", "1,99999"], "unknown token id"),
             (["--model", folder, "--prompt-ids", "1", "--temperature", "1", "--top-p", "0"],
              "top_p"),
             (["--model", folder, "--prompt-ids", "1", "--temperature", "-1"], "temperature"),
             (["--model", folder, "--prompt-ids", "1", "--speculative-k", "2",
               "--draft-loops", "4"], "draft_loops"),
             (["--model", folder, "--prompt-ids", "1", "--pipelined"],
              "--pipelined: speculative settings, which need --speculative-k N"),
             (["--model", folder, "--prompt-ids", "1", "--speculative-k", "4", "--pipelined"],
              "k must be 1"),
             (["--model", "/nonexistent/dir", "--prompt-ids", "1"], "does not exist"),
             (["--model", folder], "no prompt")]
    for argv, msg in cases:
        rc, out, err = _run(capsys, *argv)
        assert rc == 2 and msg in err, (argv, err)
        assert out == ""


def test_a_failing_compile_closes_its_progress_line(capsys):
    """The progress line of a program whose compile raises ends with 'failed)', so the error
    the CLI prints starts on its own line."""
    from ouro_jax.programs import ProgramCache

    def bad(x):
        raise ValueError("no such program")

    cache = ProgramCache()
    cache.on_compile = generate._compile_progress
    import numpy as np
    import pytest
    with pytest.raises(ValueError, match="no such program"):
        cache.call(bad, {}, (), np.zeros(2, np.float32))
    assert capsys.readouterr().err == "(compiling bad ... failed)\n"


def test_dtype_hint_for_a_bf16_checkpoint_left_at_fp32_on_a_gpu(monkeypatch, tmp_path):
    import types

    import jax
    folder = tmp_path / "ck"
    folder.mkdir()
    gpu = [types.SimpleNamespace(platform="gpu")]
    for stored, platform, want in [("bfloat16", "gpu", True), ("float32", "gpu", False),
                                   ("bfloat16", "cpu", False), (None, "gpu", False)]:
        (folder / "config.json").write_text(json.dumps({"torch_dtype": stored}))
        monkeypatch.setattr(jax, "devices", lambda: [types.SimpleNamespace(platform=platform)])
        assert bool(generate._dtype_hint(str(folder))) == want, (stored, platform)
    monkeypatch.setattr(jax, "devices", lambda: gpu)
    (folder / "config.json").write_text("not json")
    assert generate._dtype_hint(str(folder)) == ""  # the loader reports a bad config, not this
    assert generate._dtype_hint(None) == ""  # the embedded demo model


def test_dtype_hint_only_when_dtype_is_left_to_its_default(capsys, monkeypatch):
    folder = tiny_checkpoint("tiny-gqa")
    monkeypatch.setattr(generate, "_dtype_hint", lambda f: "(note: HINT)")
    base = ["--model", folder, "--prompt-ids", "1,2", "--max-tokens", "2"]
    for extra, shown in [([], True), (["--dtype", "fp32"], False), (["--dtype", "bf16"], False),
                         (["--json"], False)]:
        rc, _, err = _run(capsys, *base, *extra)
        assert rc == 0 and ("(note: HINT)" in err) == shown, (extra, err)


def test_pipelined_matches_native_greedy(capsys):
    """--pipelined (k=1, d=2) prints the native greedy tokens, and its stats count ticks."""
    folder = tiny_checkpoint("tiny-gqa", branch_scale=0.3)
    common = ["--model", folder, "--prompt-ids", "1,2,3", "--max-tokens", "9", "--ignore-eos",
              "--json"]
    rc, native, _ = _run(capsys, *common)
    rc2, piped, _ = _run(capsys, *common, "--speculative-k", "1", "--pipelined")
    assert rc == rc2 == 0
    a, b = (json.loads(out.strip().splitlines()[0]) for out in (native, piped))
    assert a["token_ids"] == b["token_ids"] and len(a["token_ids"]) == 9
    spec = json.loads(piped.strip().splitlines()[-1])["stats"]["spec"]
    assert spec["pipelined"] is True and spec["drafted"] == 8  # one verified draft per token
