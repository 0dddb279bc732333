"""benchmarks.attention_kernels: the --device-time harness (tiny shapes, interpret mode)."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import attention_kernels as ak


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setattr(ak, "HEADS", 2)
    monkeypatch.setattr(ak, "KV_HEADS", 2)
    monkeypatch.setattr(ak, "HEAD_DIM", 16)
    return ak.make_problem(2, 40, 1, 16, smoke=True)


def test_unrolled_outputs_are_the_calls_on_each_plane(tiny):
    """Call i reads plane i % planes: its output equals the reference on that plane, and the
    planes differ, so a wrong entry would show."""
    p = tiny
    assert p["planes"] == 2
    ref = ak.paged_decode_attention_reference
    outs = ak.unrolled_outputs(ref, 3, False, p["planes"])(p["q"], p["k"], p["v"], p["bt"],
                                                           p["lens"], p["cu"])
    assert len(outs) == 3
    per_plane = [np.asarray(ref(p["q"], p["k"], p["v"], jnp.int32(e), p["bt"], p["lens"]),
                 np.float32) for e in range(2)]
    assert not np.array_equal(per_plane[0], per_plane[1])
    for i, o in enumerate(outs):
        np.testing.assert_array_equal(np.asarray(o, np.float32), per_plane[i % 2])


def test_device_time_runs_one_call_per_plane(tiny, monkeypatch):
    """Two calls on one plane (a constant) have identical operands, which XLA's CSE may merge
    into one kernel; so the device path unrolls at most `planes` calls and divides by that."""
    import benchmarks.timing as timing
    seen = {}
    real = ak.unrolled_outputs

    def spy_unrolled(fn, reps, ragged, planes):
        seen["reps"] = reps
        return real(fn, reps, ragged, planes)

    def fake_device_seconds(f, *args, calls, units):
        seen["units"] = units
        return 6e-6, 7e-6

    monkeypatch.setattr(ak, "unrolled_outputs", spy_unrolled)
    monkeypatch.setattr(timing, "device_seconds", fake_device_seconds)
    t = ak.time_impl(ak.paged_decode_attention_reference, tiny, False, 5, 0.0, True)
    assert t == 6e-6 and seen == {"reps": 2, "units": 2}  # planes = 2 < reps = 5


def test_unrolled_outputs_keep_every_call_on_distinct_planes(tiny):
    """With one call per plane, the compiled program still runs every call (no CSE): twice
    the reference's dot products of one call."""
    import jax
    p = tiny
    args = (p["q"], p["k"], p["v"], p["bt"], p["lens"], p["cu"])
    ref = ak.paged_decode_attention_reference

    def dots(reps):
        f = ak.unrolled_outputs(ref, reps, False, p["planes"])
        return jax.jit(f).lower(*args).compile().as_text().count(" dot(")

    assert dots(1) > 0 and dots(2) == 2 * dots(1)


def test_device_time_rows_are_labelled_and_nan_without_a_gpu(tiny):
    """--device-time's rows say so; on the CPU the trace has no GPU kernels, so the time is
    NaN rather than a made-up figure. The wall-clock path still gives a finite time."""
    import jax
    if jax.default_backend() == "gpu":
        pytest.skip("a CPU check: with a GPU the device time is real")
    dev = ak.bench_point("decode", 2, 40, 16, 1e9, True, [("", {})], device_time=True)
    wall = ak.bench_point("decode", 2, 40, 16, 1e9, True, [("", {})])
    assert [r["timing"] for r in dev] == ["device", "device"]
    assert [r["impl"] for r in dev] == ["xla", "pallas"]
    assert all(math.isnan(r["time_us"]) for r in dev)
    assert dev[1]["rel_err_vs_xla"] < 1e-2  # the kernel still checked against XLA
    assert [r["timing"] for r in wall] == ["wall", "wall"]
    assert all(math.isfinite(r["time_us"]) and r["time_us"] > 0 for r in wall)


def test_main_smoke_device_time_writes_labelled_rows(tmp_path, monkeypatch):
    """The command line end to end (decode table only, tiny shapes): the JSON names its timing
    and holds a row per implementation and point."""
    import json
    for name in ("HEADS", "KV_HEADS", "HEAD_DIM"):  # main() sets them for --smoke; restore
        monkeypatch.setattr(ak, name, getattr(ak, name))
    out = tmp_path / "ak.json"
    ak.main(["--smoke", "--decode-only", "--no-sweep", "--device-time", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["timing"] == "device"
    assert [(r["batch"], r["context"], r["impl"]) for r in res["results"]] == [
        (b, c, impl) for b in (1, 2) for c in (16, 40) for impl in ("xla", "pallas")]
    assert all(r["timing"] == "device" for r in res["results"])


def test_main_smoke_sweep_doubles_the_kernels_own_splits(tmp_path, monkeypatch):
    """The sweep's '[splits x2]' asks for twice the split count the decode kernel would choose
    itself (pallas_kernels.decode.key_tiling), and the ragged sweep runs (one variant each
    here, to keep the test short)."""
    import json
    from pallas_kernels import decode as dk
    for name in ("HEADS", "KV_HEADS", "HEAD_DIM"):
        monkeypatch.setattr(ak, name, getattr(ak, name))
    monkeypatch.setattr(ak, "DECODE_SWEEP", [("[splits x2]", None)])
    monkeypatch.setattr(ak, "RAGGED_SWEEP", [("[stages1]", dict(num_stages=1))])
    # 256 keys: the kernel's own 32-key blocks give 8 splits (one block each); a count made
    # for 64-key blocks at two blocks per split (the sweep's rule before session 45) gives 2
    monkeypatch.setattr(ak, "SMOKE_SWEEP_POINTS", [(2, 256)])
    asked = []
    real = ak.bench_point

    def spy(kind, b, c, page_size, copy_bw, smoke, variants, device_time=False):
        asked.append((kind, b, c, variants))
        return real(kind, b, c, page_size, copy_bw, smoke, variants, device_time)

    monkeypatch.setattr(ak, "bench_point", spy)
    out = tmp_path / "ak.json"
    ak.main(["--smoke", "--decode-only", "--out", str(out)])
    sweep = json.loads(out.read_text())["decode_sweep"]
    assert [(r["kernel"], r["impl"]) for r in sweep] == [
        ("decode", "xla"), ("decode", "pallas[splits x2]"),
        ("verify", "xla"), ("verify", "pallas[stages1]")]
    assert all("error" not in r for r in sweep)
    (_, b, c, variants), = [a for a in asked if a[3][0][0] == "[splits x2]"]
    own = dk.key_tiling(b, 2, 1, ak.DTYPE, -(-c // 16) * 16, True)[1]
    assert (b, c, own) == (2, 256, 8)
    assert variants == [("[splits x2]", {"num_splits": 16})]
