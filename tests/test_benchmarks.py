"""The benchmark modules' own arithmetic (they run for real only on a GPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.decode import step_bytes
from benchmarks.kernel_trace import busy_ns, kernel_kind, subtract, summarize
from engine_helpers import pallas_call_eqns
from ouro_jax.config import PRESETS


def test_busy_time_is_the_union_of_kernel_intervals():
    # [0,10) and [5,12) overlap -> 12; [20,25) apart -> 5; [21,22) inside it -> nothing.
    events = [("a", 0, 10), ("b", 5, 7), ("c", 20, 5), ("d", 21, 1)]
    assert busy_ns(events) == 17
    assert busy_ns([]) == 0


def test_trace_summary_per_unit_and_top_kernels():
    events = [("gemm", 0, 30), ("norm", 40, 2), ("gemm", 50, 30), ("norm", 90, 2)]
    s = summarize(events, units=2)
    assert s["kernels"] == 4 and s["kernels_per_unit"] == 2
    assert s["span_ms"] == pytest.approx(92e-6) and s["busy_ms"] == pytest.approx(64e-6)
    assert s["busy_fraction"] == pytest.approx(64 / 92)
    top = s["top"]
    assert [t["name"] for t in top] == ["gemm", "norm"]
    assert top[0]["per_unit"] == 1 and top[0]["mean_us"] == pytest.approx(0.03)
    assert sum(t["share"] for t in top) == pytest.approx(1.0)
    assert "error" in summarize([], units=1)


def test_trace_groups_per_layer_kernels_by_kind():
    """Per-layer fusions get one kernel name each (input_scatter_fusion_8, _47, ...): each is
    small by name, their kind is not. The 'top_kinds' table groups them."""
    events = [("gemm_fusion_dot_483", 0, 20)] + [
        (f"input_scatter_fusion_{i}", 30 + 10 * i, 7) for i in range(6)] + [("fusion.12", 99, 1)]
    s = summarize(events, units=1, top=2)
    assert s["top"][0]["name"] == "gemm_fusion_dot_483"  # by name the scatters are 7 each
    kinds = {t["name"]: t for t in s["top_kinds"]}
    assert kinds["input_scatter_fusion"]["count"] == 6
    assert kinds["input_scatter_fusion"]["total_ms"] == pytest.approx(42e-6)
    assert s["top_kinds"][0]["name"] == "input_scatter_fusion"
    assert kernel_kind("fusion.12") == "fusion" and kernel_kind("paged_decode_attention") == \
        "paged_decode_attention"


def test_trace_subtracts_the_prefill_name_by_name():
    """--minus-prefill: the prefill's own call (max_tokens=1) ran gemm twice at 100 ns and a
    fusion once; the main call ran the same plus two decode units of gemm and attention.
    What is left is the decode's, per unit; a name only the prefill ran is reported."""
    pre = [("gemm", 0, 100), ("gemm", 100, 100), ("fusion_7", 200, 50)]
    main = pre + [("gemm", 300, 30), ("attn", 330, 10), ("gemm", 340, 30), ("attn", 370, 10)]
    d = subtract(main, pre, units=2)
    assert d["kernels_per_unit"] == 2 and d["kernel_sum_per_unit_us"] == pytest.approx(0.04)
    rows = {t["name"]: t for t in d["top"]}
    assert set(rows) == {"gemm", "attn"}
    assert rows["gemm"]["per_unit"] == 1 and rows["gemm"]["mean_us"] == pytest.approx(0.03)
    assert rows["gemm"]["share"] == pytest.approx(0.75)
    assert d["negative"] == [] and d["base_kernels"] == 3
    assert subtract(main[:1], pre, units=1)["negative"] == ["fusion_7", "gemm"]
    kinds = subtract(main + [("attn_2", 400, 10)], pre, units=2)["top_kinds"]
    assert {t["name"]: t["count"] for t in kinds} == {"gemm": 2, "attn": 3}


def test_trace_places_the_longest_memcpys_between_their_kernels():
    events = [("k1", 0, 5), ("MemcpyD2D", 10, 400), ("k2", 420, 5), ("k3", 430, 5),
              ("MemcpyD2D", 440, 3), ("k4", 450, 5)]
    near = summarize(events, units=1)["memcpy_neighbours"]
    assert [m["us"] for m in near] == [pytest.approx(0.4), pytest.approx(0.003)]
    assert near[0]["before"] == ["k1"] and near[0]["after"] == ["k2", "k3", "MemcpyD2D"]
    assert near[1]["before"] == ["MemcpyD2D", "k2", "k3"] and near[1]["after"] == ["k4"]


def test_step_bytes_matches_the_published_roofline():
    # OURO.md: one batch-1 step of the 1.4B model reads about 4 x 2.47 GB + 0.2 GB = 10.1 GB.
    b1 = step_bytes(PRESETS["1.4b"], batch=1, context=160)
    assert 10.0e9 < b1 < 10.3e9
    # K/V grows with batch x context x loops: 64 rows x 160 tokens x 96 planes x 8 KiB.
    b64 = step_bytes(PRESETS["1.4b"], batch=64, context=160)
    assert b64 - b1 == pytest.approx(63 * 160 * 96 * 2 * 16 * 128 * 2, rel=1e-6)


def test_result_record_pins_the_code(tmp_path):
    """Every result names its code twice: git HEAD (+dirty) and a digest of the sources."""
    import json

    from benchmarks.record import save_record, source_digest

    rec = save_record("benchmarks.x", ["--a", "1"], str(tmp_path / "r.json"), rows=[1])
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved == rec and rec["command"] == "python -m benchmarks.x --a 1"
    assert rec["source_sha256"] == source_digest() and len(rec["source_sha256"]) == 16
    assert set(rec["source_sha256"]) <= set("0123456789abcdef")
    assert rec["git_commit"] == "unknown" or len(rec["git_commit"].split("+")[0]) == 40


def test_dirty_is_judged_by_content_not_by_the_index(tmp_path, monkeypatch):
    """A copied tree can carry an index whose stat data still matches edited files (same size,
    same mtime), so `git diff` calls them clean; code_differs hashes the contents. Committed
    symlinks and names git quotes (non-ASCII) read clean when unchanged."""
    import os
    import shutil
    import subprocess

    import benchmarks.record as record

    if shutil.which("git") is None:
        pytest.skip("no git")
    git = lambda *a: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t",
                                     "-c", "core.checkStat=minimal", *a], cwd=tmp_path,
                                    capture_output=True)
    (tmp_path / "ouro_jax").mkdir()
    f = tmp_path / "ouro_jax" / "a.py"
    f.write_text("x = 1\n")
    (tmp_path / "ouro_jax" / "\u00e9t\u00e9.py").write_text("z = 1\n")  # ls-tree quotes it
    os.symlink("a.py", tmp_path / "ouro_jax" / "link.py")
    (tmp_path / "notes.txt").write_text("not code\n")
    old = 1_000_000_000  # (2001: well before the index is written, so not racily clean)
    os.utime(f, (old, old))
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    monkeypatch.setattr(record, "REPO_ROOT", str(tmp_path))
    assert not record.code_differs()
    assert not record.git_commit().endswith("+dirty")
    f.write_text("x = 2\n")  # same size, and the old mtime back: a stale index's view
    os.utime(f, (old, old))
    assert git("diff", "--quiet", "HEAD").returncode == 0  # git sees no change ...
    assert record.code_differs() and record.git_commit().endswith("+dirty")  # ... we do
    f.write_text("x = 1\n")
    (tmp_path / "notes.txt").write_text("changed, but not code\n")
    assert not record.code_differs()
    (tmp_path / "ouro_jax" / "b.py").write_text("y = 1\n")  # a new, untracked module
    assert record.code_differs()


def test_kernel_tuning_overrides_reach_the_traced_kernel():
    """--decode-kernel sets the decode kernel's defaults for the process: the traced kernel's
    grid follows num_splits; explicit arguments still win; bad specs are refused."""
    import jax.numpy as jnp

    from benchmarks.tuning import apply_kernel_tuning
    from pallas_kernels import decode as dk

    q = jnp.zeros((2, 2, 16), jnp.bfloat16)
    kc = jnp.zeros((1, 9, 4, 2, 16), jnp.bfloat16)
    bt = jnp.ones((2, 4), jnp.int32)
    lens = jnp.array([9, 16], jnp.int32)

    from pallas_kernels import ragged as rk

    def call_params(fn, **kw):
        (eqn,) = pallas_call_eqns(lambda q: fn(q, **kw), q)
        cp = eqn.params["compiler_params"]
        cp = cp.get("triton", cp) if isinstance(cp, dict) else cp  # jax 0.10 / 0.11 layouts
        return (eqn.params["grid_mapping"].grid, getattr(cp, "num_warps", None),
                getattr(cp, "num_stages", None))

    decode = lambda q, **kw: dk.paged_decode_attention(q, kc, kc, 0, bt, lens, interpret=True,
                                                       block_t=4, **kw)
    cu = jnp.array([0, 1, 2], jnp.int32)
    ragged = lambda q, **kw: rk.ragged_paged_attention(q, kc, kc, 0, bt, lens, cu,
                                                       interpret=True, block_t=4, **kw)
    try:
        assert apply_kernel_tuning("num_splits=3,num_warps=2,num_stages=3", "num_splits=1") == {
            "decode": {"num_splits": 3, "num_warps": 2, "num_stages": 3},
            "ragged": {"num_splits": 1}, "stream": {}, "pdl": (), "mgpu": {},
            "l2_prefetch": {}, "l2_next": {}, "stream_set": {}, "invariant": {}}
        assert call_params(decode) == ((2, 2, 3), 2, 3)
        assert call_params(decode, num_splits=2, num_warps=4) == ((2, 2, 2), 4, 3)
        assert call_params(ragged)[0][2] == 1
        apply_kernel_tuning("", "")
        # the defaults for this shape: a 16-token table in 4-key blocks, one block per split;
        # 2 rows of a bf16 cache: decode.MULTI_ROW_WARPS (2) warps
        assert call_params(decode) == ((2, 2, 4), 2, 2)
        assert call_params(ragged)[0][2] == 2  # the default for this shape
        assert apply_kernel_tuning("last_combine=0", "")["decode"] == {"last_combine": 0}
        assert dk.TUNING == {"last_combine": 0}  # a switch: 0 is a value, not an error
        assert apply_kernel_tuning("fuse_o=1,o_block_n=64,o_w_early=0", "")["decode"] == {
            "fuse_o": 1, "o_block_n": 64, "o_w_early": 0}
        assert apply_kernel_tuning("mgpu=1,mgpu_block=128,mgpu_stages=3", "")["decode"] == {
            "mgpu": 1, "mgpu_block": 128, "mgpu_stages": 3}
        # a count where 0 turns the route off (attention.RAGGED_FROM)
        assert apply_kernel_tuning("ragged_from=0", "")["decode"] == {"ragged_from": 0}
        assert apply_kernel_tuning("ragged_from=8", "")["decode"] == {"ragged_from": 8}
        with pytest.raises(SystemExit, match="ragged_from must be >= 0"):
            apply_kernel_tuning("ragged_from=-1", "")
        # a switch read by the engine whichever kernel attends (attention.SKIP_DONE)
        assert apply_kernel_tuning("skip_done=0", "")["decode"] == {"skip_done": 0}
        from ouro_jax.attention import skip_done
        assert skip_done() is False
        for bad in ("num_splits", "splits=2", "num_warps=two", "block_t=0", "block_t=48",
                    "num_warps=3", "last_combine=2", "last_combine=-1", "o_block_n=48",
                    "o_block_n=64", "fuse_o=1,last_combine=1", "fuse_o=1,o_w_early=2",
                    "mgpu=1,last_combine=1", "mgpu=1,fuse_o=1", "mgpu=1,flow_o=1",
                    "mgpu_block=64", "mgpu=0,mgpu_stages=2", "mgpu=2", "mgpu=1,mgpu_block=96",
                    "skip_done=2"):
            with pytest.raises(SystemExit):
                apply_kernel_tuning(bad, "")
    finally:
        dk.TUNING.clear()
        rk.TUNING.clear()


def test_stream_tiling_override_is_applied_and_restored():
    """--stream-tiling swaps one projection's streaming-GEMV tiling for the run; the next
    call without it restores the shipped table; bad specs are refused."""
    from benchmarks.tuning import apply_kernel_tuning
    from benchmarks.gemv import STREAM_VARIANTS
    from ouro_jax import projections

    shipped = {k: dict(v) for k, v in projections.STREAM_TUNING.items()}
    try:
        t = apply_kernel_tuning("", "", "qkv=st2_k512_p1_w4")
        # the variant's tiling with the shipped load policy, in the engine and in the record
        assert projections.STREAM_TUNING["qkv"] == dict(STREAM_VARIANTS["st2_k512_p1_w4"],
                                                        evict_first=True)
        assert t["stream"] == {"qkv": projections.STREAM_TUNING["qkv"]}
        assert projections.STREAM_TUNING["o"] == shipped["o"]
        apply_kernel_tuning("", "")
        assert projections.STREAM_TUNING == shipped
        for bad in ("qkv", "mlp=st2_k512_p1_w4", "qkv=st9", "down=st2_k1024_p1_w4"):
            with pytest.raises(SystemExit):
                apply_kernel_tuning("", "", bad)
        # a bad spec anywhere changes nothing, not even the valid ones before it
        from pallas_kernels import decode as dk
        with pytest.raises(SystemExit):
            apply_kernel_tuning("num_splits=3", "", "qkv=st9")
        assert dk.TUNING == {} and projections.STREAM_TUNING == shipped
    finally:
        apply_kernel_tuning("", "")
    assert projections.STREAM_TUNING == shipped


def test_mgpu_tiling_override_is_checked_applied_and_restored():
    """--mgpu-tiling swaps one projection's Mosaic GEMV tiling for the run and the next call
    restores the shipped table; a tiling the kernel refuses or the engine would shrink at
    the 1.4B shape is refused, and a bad spec changes nothing."""
    from benchmarks.tuning import apply_kernel_tuning
    from ouro_jax import projections

    from benchmarks.decode import main as decode_main
    with pytest.raises(SystemExit, match="--mgpu-tiling sets"):  # before anything runs
        decode_main(["--mgpu-tiling", "down=bn64_bk64_ks8_st4", "--batch", "1"])
    if not projections.mgpu_available():
        with pytest.raises(SystemExit, match="jax >= 0.11"):
            apply_kernel_tuning("", "", mgpu_spec="down=bn64_bk64_ks8_st4")
        return
    shipped = dict(projections.MGPU_TUNING)
    try:
        t = apply_kernel_tuning("", "", mgpu_spec="down=bn128_bk128_ks4_st3,qkv=bn64_bk128_ks2_st4_ov")
        assert t["mgpu"] == {"down": (128, 128, 4, 3, False), "qkv": (64, 128, 2, 4, True)}
        assert projections.MGPU_TUNING["down"] == (128, 128, 4, 3, False)
        assert projections.MGPU_TUNING["o"] == shipped["o"]
        apply_kernel_tuning("", "")
        assert projections.MGPU_TUNING == shipped
        for bad in ("down", "mlp=bn64_bk64_ks8_st4", "down=bn64_bk64_ks8",
                    "down=bn0_bk64_ks8_st4", "down=bn64_bk0_ks8_st4",
                    "down=bn64_bk64_ks8_st4,down=bn64_bk128_ks4_st4",
                    "down=bn96_bk64_ks8_st4",  # block_n not a multiple of 64
                    "down=bn64_bk128_ks8_st4",  # 704-column splits are not 128-multiples
                    "gate_up=bn64_bk128_ks1_st6",  # shared memory
                    "o=bn64_bk64_ks8_st1"):  # stages >= 2
            with pytest.raises(SystemExit, match="--mgpu-tiling"):
                apply_kernel_tuning("", "", mgpu_spec=bad)
        with pytest.raises(SystemExit):
            apply_kernel_tuning("", "", mgpu_spec="down=bn128_bk128_ks4_st3,o=bn64_bk64_ks8_st1")
        assert projections.MGPU_TUNING == shipped
    finally:
        apply_kernel_tuning("", "")
    assert projections.MGPU_TUNING == shipped


def test_device_seconds_reads_the_gpu_clock_or_says_it_cannot():
    """benchmarks.timing.device_seconds: NaN without GPU kernels in the trace (a CPU); on a
    GPU, kernel time per unit is positive and within the span (kernels of one stream)."""
    import math

    import jax
    import jax.numpy as jnp
    from benchmarks.timing import device_seconds
    from engine_helpers import has_gpu

    fn = jax.jit(lambda a: [a @ a.T for _ in range(3)])
    kernel, span = device_seconds(fn, jnp.ones((256, 256)), calls=2, units=3)
    if not has_gpu():
        assert math.isnan(kernel) and math.isnan(span)
    else:
        assert 0 < kernel <= span


def test_gemv_scaling_fit_and_cpu_refusal():
    """benchmarks.gemv_scaling's line fit recovers a known fixed cost and bandwidth; on a
    machine without a GPU it says so instead of timing nothing."""
    from benchmarks import gemv_scaling as gsc
    pts = [dict(bytes=b, device_us=1.5 + b / 1e6 / 3.5) for b in (25e6, 50e6, 100e6)]
    fixed, bw = gsc.fit(pts)
    assert abs(fixed - 1.5) < 1e-6 and abs(bw - 3.5) < 1e-6
    if jax.default_backend() != "gpu":
        with pytest.raises(SystemExit, match="GPU"):
            gsc.main(["--shapes", "o"])
    with pytest.raises(SystemExit, match="unknown"):
        gsc.main(["--shapes", "mlp"])


def test_ab_arms_collects_and_prints_the_arms(tmp_path):
    """benchmarks.ab_arms on session 14 call 1's arms (split back out of its committed file):
    the same lines the call printed, the same collected file; an empty folder is an error."""
    import json
    from pathlib import Path

    from benchmarks import ab_arms
    src = Path(__file__).parent.parent / "benchmarks/results/ab_l2_b1_session14_h200.json"
    arms = json.loads(src.read_text())
    for name, rec in arms.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(rec))
    out = tmp_path / "out" / "all.json"
    out.parent.mkdir()
    ab_arms.main([str(tmp_path), str(out)])
    assert json.loads(out.read_text()) == arms
    got = ab_arms.lines(ab_arms.collect(str(tmp_path)))
    assert got[0] == "both_p1 215.2 215.1 215.3 3961d77b5e94e06f 15.3"
    assert "default_p2 241.3 240.7 241.8 3961d77b5e94e06f 10.5" in got
    with pytest.raises(SystemExit, match="no"):
        ab_arms.collect(str(out.parent / "missing"))


def test_mgpu_pdl_chain_arms_and_arguments():
    """benchmarks.mgpu_pdl_chain (GPU only to run): its arms, the 'last' step per
    projection (K / block_k - 1), and clear errors for bad arguments."""
    from benchmarks import mgpu_pdl_chain as m
    arms = m.arms(["0", "last"])
    assert list(arms) == ["stream", "mgpu", "mgpu_pdl0", "mgpu_pdllast", "mixed_pdl0"]
    assert [a[1] for a in arms["mgpu_pdllast"]] == [7, 7, 15, 10]
    assert arms["mixed_pdl0"] == (("mgpu", 0), "stream", ("mgpu", 0), "stream")
    for bad in (["--steps", "x"], ["--steps", "-1"], ["--layers", "0"]):
        with pytest.raises(SystemExit):
            m.main(bad)
    if jax.default_backend() != "gpu":
        with pytest.raises(SystemExit, match="needs a GPU"):
            m.main(["--layers", "1"])


def test_gemv_timeline_kernel_reads_the_timer_around_the_stream():
    """benchmarks.gemv_timeline (GPU only to run): the kernel lowered for 'cuda' reads
    %globaltimer once before its first weight load and once after its last store of y, and
    %smid; the summary arithmetic is wrap-aware."""
    import numpy as np
    from benchmarks.gemv_timeline import gemv_timed, summarize
    from test_pdl import triton_ir
    S = jax.ShapeDtypeStruct
    [ir] = triton_ir(lambda x, w: gemv_timed(x, w, "o", dict(block_n=2, block_k=512,
                                                               per_program=2, num_warps=4)),
                     S((1, 2048), jnp.bfloat16), S((2048, 2048), jnp.bfloat16))
    lines = ir.splitlines()
    timers = [i for i, line in enumerate(lines) if "globaltimer_lo" in line]
    loads = [i for i, line in enumerate(lines) if "tt.load" in line]
    stores = [i for i, line in enumerate(lines) if "tt.store" in line]
    assert len(timers) == 2 and any("%smid" in line for line in lines)
    assert timers[0] < min(loads) and max(s for s in stores if s < timers[1]) < timers[1]
    # two kernels: the second starts 500 ns after the first ends, across the 32-bit wrap
    first = np.array([[2**32 - 1000, 2**32 - 900, 0], [2**32 - 950, 2**32 - 700, 1]])
    second = np.array([[2**32 - 200, 300, 0], [2**32 - 100, 800, 1]])  # signed like int32
    signed = lambda a: (a % 2**32).astype(np.uint32).view(np.int32)  # as the kernel's int32
    res = summarize([signed(first), signed(second)], ["o", "o"], sms=2)["o"]
    # skip: the first kernel only gives the second its gap
    skipped = summarize([signed(first), signed(second)], ["o", "o"], sms=2, skip=1)["o"]
    assert skipped["gap"] == pytest.approx(0.5) and skipped["span"] == pytest.approx(1.0)
    # medians over the two kernels: ramp 50 and 100 ns, span 300 and 1,000 ns
    assert res["gap"] == pytest.approx(0.5) and res["ramp"] == pytest.approx(0.075)
    assert res["span"] == pytest.approx(0.65) and res["tail"] == pytest.approx(0.0)
