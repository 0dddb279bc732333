"""The start-up and load benchmarks: benchmarks.start_time, load_check, load_time and
load_put, on tiny checkpoints."""

from __future__ import annotations

import pytest


def test_start_time_reports_each_phase_and_the_repeated_request(tmp_path, capsys):
    import json
    from benchmarks.start_time import main as start_main
    out = tmp_path / "start.json"
    assert start_main(["--prompt-len", "5", "--max-tokens", "3", "--speculative-k", "2",
                       "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["phases"]) == {"import_s", "backend_s", "load_s"}
    assert set(rec["load_phases"]) == {"open_s", "backend_s", "convert_s", "put_s",
                                       "check_compile_s", "transfer_wait_s",
                                       "check_finite_s", "tokenizer_s", "engine_s"}
    assert all(v >= 0 for v in rec["phases"].values())
    for run in ("first", "again"):
        assert rec[run]["generated_tokens"] == 3 and rec[run]["spec"]["rounds"] >= 1
    assert rec["first"]["compiles"] >= 2 and rec["again"]["compiles"] == 0  # nothing new
    assert rec["model"] == "embedded demo model" and rec["speculative_k"] == 2


def test_load_check_time_records_first_and_cached_calls(tmp_path):
    import json

    from benchmarks import load_check_time
    out = tmp_path / "lc.json"
    assert load_check_time.main(["--synthetic", "tiny-mha", "--repeats", "2",
                                 "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["command"].startswith("python -m benchmarks.load_check_time")
    assert len(rec["cached_s"]) == 2 and rec["first_s"] > 0 and rec["weights_GB"] > 0
    assert rec["cached_median_s"] in rec["cached_s"]
    with pytest.raises(SystemExit, match="--repeats must be at least 1"):
        load_check_time.main(["--synthetic", "tiny-mha", "--repeats", "0"])


def test_load_time_phases_follow_load_checkpoint_including_the_finite_check():
    from benchmarks.load_time import phases
    from ouro_jax.api import DEMO_MODEL_DIR
    got = phases(DEMO_MODEL_DIR, "bf16")
    assert list(got) == ["open_s", "backend_s", "convert_s", "put_s", "check_compile_s",
                         "transfer_wait_s", "check_finite_s"]
    assert all(v >= 0 for v in got.values())


def test_load_put_times_each_way_in_its_own_process(tmp_path):
    """benchmarks.load_put on a tiny checkpoint: one fresh process per way and repeat, the
    engine way with load_checkpoint's phases, the others with the weights' byte count; an
    unknown way is an error before anything runs."""
    import json
    import os

    from benchmarks.load_put import main
    from engine_helpers import tiny_checkpoint
    folder = tiny_checkpoint("tiny-mha")
    out = tmp_path / "lp.json"
    assert main(["--checkpoint", folder, "--ways", "engine,engine_copy,touch,put_each",
                 "--repeats", "1", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert set(rec["runs"]) == {"engine", "engine_copy", "touch", "put_each"}
    size = os.path.getsize(os.path.join(folder, "model.safetensors"))
    for way in ("touch", "put_each"):
        (run,) = rec["runs"][way]
        assert 0 < run["bytes"] < size and run["seconds"] > 0
    for way in ("engine", "engine_copy"):
        assert {"backend_s", "convert_s", "put_s"} <= set(rec["runs"][way][0]["phases"])
    assert rec["command"].startswith("python -m benchmarks.load_put")
    with pytest.raises(SystemExit, match="unknown ways"):
        main(["--checkpoint", folder, "--ways", "engine,nope"])
