"""The CLI's persistent compilation cache: a second process loads every program it compiled
the first time. That needs a lowered program that is the same in every process (the cache
keys on it), which trace_once's shared kernel functions must not break."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(cache, attention):
    cmd = [sys.executable, "-m", "ouro_jax.generate", "--compile-cache", str(cache),
           "--prompt", "And God said", "--max-tokens", "6", "--json", "--attention", attention]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=600,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()]
    return lines[0]["token_ids"], lines[-1]["stats"]


@pytest.mark.parametrize("attention", ["xla", "pallas"])  # pallas: interpret mode, shared
def test_a_second_process_compiles_nothing_new(tmp_path, attention):
    cache = tmp_path / "xla_cache"
    tokens, stats = _cli(cache, attention)
    entries = sorted(os.listdir(cache))
    assert entries and stats["compiles"] >= 2  # prefill and decode programs, written
    tokens2, stats2 = _cli(cache, attention)
    assert sorted(os.listdir(cache)) == entries  # every program came from the cache
    assert tokens2 == tokens and stats2["compiles"] == stats["compiles"]
