"""benchmarks.decode as a user reruns it: bad values refused by flag name before any device
work, --out handled before the first row, and rows whose figures agree with each other."""

import json
import os

import pytest

from benchmarks import decode
from benchmarks.decode_args import build_parser, check_run

TINY = ["--synthetic", "tiny-mha", "--prompt-len", "8", "--new-tokens", "4", "--repeats", "1",
        "--compile-cache", ""]
DEMO = os.path.join(os.path.dirname(__file__), "..", "ouro_jax", "demo_model")


@pytest.fixture
def no_device_work(monkeypatch):
    """Fails a test that reaches the bandwidth probe or the model build."""
    def boom(*a, **k):
        raise AssertionError("device work started before the arguments were checked")
    monkeypatch.setattr(decode, "copy_bandwidth", boom)
    monkeypatch.setattr(decode, "make_engine", boom)


@pytest.mark.parametrize("extra, flag", [
    (["--batch", "1,,2"], "--batch"), (["--batch", "0"], "--batch"),
    (["--batch", "1,-1"], "--batch"), (["--k", "x"], "--k"), (["--k", "0,-1"], "--k"),
    (["--temperature", "-1"], "--temperature"), (["--temperature", "nan"], "--temperature"),
    (["--repeats", "0"], "--repeats"), (["--warmup", "-1"], "--warmup"),
    (["--new-tokens", "1"], "--new-tokens"), (["--prompt-len", "0"], "--prompt-len"),
    (["--page-size", "0"], "--page-size"), (["--prompt-len", "600"], "max_position_embeddings"),
    (["--k", "2", "--draft-loops", "4"], "draft_loops"),
    (["--k", "2", "--draft-loops", "0"], "draft_loops"),
    (["--sweep-branch-scale", "0.1,x"], "--sweep-branch-scale"),
    (["--projections", "bogus"], "--projections"),
    (["--sweep-branch-scale", "0.1", "--target-acceptance", "80"], "--target-acceptance"),
    (["--batch-invariant", "--projections", "gemv"], "--projections"),
    (["--batch-invariant", "--attention", "xla"], "--attention xla"),
    (["--batch-invariant", "--ragged-kernel", "block_q=2"], "fixes the ragged kernel's block_q"),
    (["--batch-invariant", "--ragged-kernel", "block_t=128,num_splits=2"], "num_splits"),
    (["--batch-invariant", "--l2-next", "o=2"], "--l2-next"),
    (["--invariant-tiling", "o=mm16_n16_k256_w4_s4"], "--batch-invariant"),
    (["--batch-invariant", "--invariant-tiling", "o=bogus"], "'bogus' is not a benchmarks"),
    (["--batch-invariant", "--invariant-tiling", "lm=mm16_n16_k256_w4_s4"], "unknown weight 'lm'"),
    (["--batch-invariant", "--invariant-tiling", "o"], "is not NAME=VARIANT"),
    (["--batch-invariant", "--invariant-tiling", "o=mm16_n16_k256_w4_s4,o=mm16_n16_k256_w4_s4"],
     "given twice"),
])
def test_bad_values_are_refused_by_name_before_device_work(no_device_work, extra, flag):
    with pytest.raises(SystemExit) as e:
        decode.main(TINY + extra)
    assert flag in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("argv", [["--synthetic", "nope"], ["--attention", "bogus"]])
def test_unknown_choices_are_refused_by_the_parser(no_device_work, argv, capsys):
    with pytest.raises(SystemExit) as e:
        decode.main(argv)
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_checkpoint_runs_refuse_the_synthetic_only_flags(no_device_work, tmp_path):
    for extra in (["--branch-scale", "0.1"], ["--seed", "3"], ["--sweep-branch-scale", "0.1"]):
        with pytest.raises(SystemExit, match="synthetic weights"):
            decode.main(["--model", DEMO, "--dtype", "fp32"] + extra)
    with pytest.raises(SystemExit, match="no such folder"):
        decode.main(["--model", str(tmp_path / "missing")])
    args = build_parser("").parse_args(["--model", DEMO, "--batch", "1"])
    check_run(args)  # a plain checkpoint run passes; the synthetic defaults are filled
    assert args.branch_scale == 0.003 and args.batches == [1]


def test_out_must_be_a_file_path(no_device_work, tmp_path):
    with pytest.raises(SystemExit, match="is a folder"):
        decode.main(TINY + ["--out", str(tmp_path)])
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit, match="is a file"):
        decode.main(TINY + ["--out", str(tmp_path / "f" / "x.json")])


def test_defaults_are_the_published_protocol():
    args = build_parser("").parse_args([])
    check_run(args)
    assert (args.synthetic, args.dtype, args.prompt_len, args.new_tokens) == ("1.4b", "bf16", 128, 64)
    assert (args.batches, args.ks, args.temps) == ([1, 8, 32, 64], [0, 2, 4], [0.0, 0.8])
    assert args.branch_scale == 0.003 and args.draft_loops == 2


def test_step_bytes_follow_the_dtype():
    from ouro_jax.config import PRESETS
    cfg = PRESETS["tiny-mha"]
    assert decode.step_bytes(cfg, 1, 100, 4) == 2 * decode.step_bytes(cfg, 1, 100, 2)


def test_a_rerun_starts_its_partial_rows_afresh(tmp_path, monkeypatch):
    """OUT.partial keeps the rows of a run that dies before its record; a rerun's file holds
    its own rows only."""
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: 1e11)

    def dies(*a, **k):
        raise RuntimeError("killed before the record")
    monkeypatch.setattr(decode, "save_record", dies)
    out = tmp_path / "r.json"
    (tmp_path / "r.json.partial").write_text('{"stale": 1}\n')
    with pytest.raises(RuntimeError, match="killed"):
        decode.main(TINY + ["--batch", "1", "--k", "0", "--temperature", "0", "--out", str(out)])
    rows = [json.loads(x) for x in (tmp_path / "r.json.partial").read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1] and "stale" not in rows[0]


def test_a_tiny_run_writes_a_consistent_record(tmp_path, monkeypatch):
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: 1e11)
    out = tmp_path / "new" / "r.json"
    assert decode.main(TINY + ["--batch", "1", "--k", "0,2", "--temperature", "0",
                               "--repeats", "2", "--dtype", "fp32", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert not os.path.exists(str(out) + ".partial")  # the record holds the rows
    assert "--compile-cache ''" in rec["command"]
    assert rec["branch_scale"] == 0.003
    native, spec = rec["rows"]
    for row in rec["rows"]:
        assert row["timed_compile_s"] == 0.0 and row["compile_s"] > 0
        assert row["decode_tok_s"] == pytest.approx(row["decode_tokens"] / row["decode_s"])
        assert row["decode_tokens"] == 3  # 4 new tokens, the first is prefill's
        assert row["decode_tok_s_min"] <= row["decode_tok_s"] <= row["decode_tok_s_max"]
    from ouro_jax.config import PRESETS
    assert native["step_bytes"] == decode.step_bytes(PRESETS["tiny-mha"], 1, 8 + 4 / 2, 4)
    assert spec["acceptance"] >= 0 and rec["greedy_token_match"][0]["identical_sequences"] == 1
    # one row: every round it ran was its own
    assert spec["rounds_run"] == spec["rounds"] > 0 and spec["active_row_fraction"] == 1.0
    assert rec["kernel_tuning"]["skip_done"] == 1
    assert rec["table"].splitlines()[0].split()[-1] == "active"  # (the speculative share)
    assert rec["table"].splitlines()[-1].split()[-1] == "100.0%"


def test_a_missing_out_folder_is_made(tmp_path, monkeypatch):
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: 1e11)
    out = tmp_path / "a" / "b" / "r.json"
    assert decode.main(TINY + ["--batch", "1", "--k", "0", "--temperature", "0",
                               "--out", str(out)]) == 0
    assert json.loads(out.read_text())["rows"][0]["batch"] == 1


def test_a_batch_invariant_run_is_labelled_and_matches(tmp_path, monkeypatch):
    """--batch-invariant runs the engine's invariant kernels, says so in the record, and its
    bf16 greedy speculative sequences all equal native ones, with the GEMM tiling and the
    ragged kernel's key block overridden."""
    monkeypatch.setattr(decode, "copy_bandwidth", lambda: 1e11)
    out = tmp_path / "r.json"
    import pallas_kernels as pk
    import pallas_kernels.ragged as ragged
    seen = []  # (block_t in force, the mode's fixed num_splits) at each ragged kernel trace
    real = pk.ragged_paged_attention

    def spy(*a, **kw):
        seen.append((ragged.TUNING.get("block_t"), kw.get("num_splits")))
        return real(*a, **kw)
    monkeypatch.setattr(pk, "ragged_paged_attention", spy)
    from ouro_jax import invariant
    shipped = {k: dict(v) for k, v in invariant.TUNING.items()}
    shipped_routes = dict(invariant.ROUTES)
    tiling = "o=mm16_n16_k128_w4_s4_x4,gate_up=4:mm16_n16_k256_w4_s4_x2/mm16_n32_k256_w4_s4_x2"
    assert decode.main(TINY + ["--batch", "3", "--k", "0,2", "--temperature", "0",
                               "--attention", "pallas", "--batch-invariant",
                               "--invariant-tiling", tiling, "--ragged-kernel", "block_t=16",
                               "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    # the ragged kernel's open settings are taken (and recorded), the mode's own kept
    assert rec["kernel_tuning"]["ragged"] == {"block_t": 16}
    assert seen and set(seen) == {(16, 1)}
    assert ragged.TUNING == {}
    assert rec["backend"] == "pallas+invariant" and rec["dtype"] == "bf16"
    assert rec["greedy_token_match"][0]["identical_sequences"] == 3
    # the record names the mode's whole tiling (the overrides and the shipped rest), the
    # tiny model still splits K for o (fitted: 2 splits of K = 32), and the process gets the
    # shipped tilings back
    from ouro_jax.config import PRESETS
    from ouro_jax.projection_tuning import fit_gemm_tuning
    ran = rec["kernel_tuning"]["invariant"]
    assert ran["o"]["k_splits"] == 4 and ran["gate_up"]["k_splits"] == 2
    assert ran["qkv"] == shipped["qkv"] and set(ran) == set(shipped)
    # the routes that ran: the spec's for gate/up (batch 3 runs 4 rows), none for o (a
    # plain tiling), the shipped ones for the weights the spec does not name
    kept = {k: [list(r) for r in v] for k, v in shipped_routes.items()
            if v and k not in ("o", "gate_up")}
    assert kept and rec["kernel_tuning"]["invariant_routes"] == {**kept, "gate_up": [[4, dict(
        block_m=16, block_n=16, num_warps=4, num_stages=4)]]}
    cfg = PRESETS["tiny-mha"]
    assert fit_gemm_tuning(ran["o"], cfg.hidden_size, cfg.hidden_size)["k_splits"] == 2
    assert invariant.TUNING == shipped and invariant.ROUTES == shipped_routes


def test_decode_kernel_keys_are_refused_where_the_ragged_kernel_runs_decode():
    """From attention.RAGGED_FROM (64) sequences up decode runs the ragged kernel: a
    --decode-kernel key other than ragged_from would change nothing there, so it is refused
    with the way out named; ragged_from=0 (or a smaller batch) lets it through."""
    from benchmarks.decode_args import check_ragged_decode_run
    from benchmarks.tuning import DECODE_TUNING_KEYS, parse_tuning

    def run(*argv):
        args = build_parser("").parse_args(list(argv))
        check_run(args)
        check_ragged_decode_run(args, parse_tuning(args.decode_kernel, DECODE_TUNING_KEYS))
        return args
    with pytest.raises(SystemExit, match="ragged_from=0"):
        run("--batch", "8,64", "--decode-kernel", "num_warps=2")
    with pytest.raises(SystemExit, match="batch \\[16\\]"):
        run("--batch", "8,16", "--decode-kernel", "num_warps=2,ragged_from=16")
    run("--batch", "8,64", "--decode-kernel", "num_warps=2,ragged_from=0")
    run("--batch", "8,32", "--decode-kernel", "num_warps=2")
    run("--batch", "64", "--decode-kernel", "ragged_from=8")
    run("--batch", "32,64", "--decode-kernel", "skip_done=0")  # (the engine's, any kernel)


def test_the_decode_benchmark_leaves_no_tuning_behind_a_refusal(no_device_work):
    """The ragged-decode refusal comes after the overrides are applied: they are cleared."""
    import pallas_kernels.decode as dk
    with pytest.raises(SystemExit, match="ragged_from=0"):
        decode.main(TINY + ["--batch", "64", "--decode-kernel", "num_warps=2"])
    assert dk.TUNING == {}
