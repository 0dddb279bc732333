"""benchmarks.gemv's own logic on the CPU (it times for real only on a GPU): its argument
checks, the variants it builds, and the tilings it picks from saved runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

def test_gemv_prologue_benchmark_refuses_what_it_cannot_time():
    """--prologue add_norm times XLA, the engine's tiling and streaming tilings only, at the
    rows the streaming kernel takes; anything else is refused before any compile, naming the
    fix. The XLA chain with the prologue is the model's math, rms_norm(x + rms_norm(branch))
    then the projection, with a distinct input per weight (so XLA cannot compute one
    prologue for the whole chain)."""
    from benchmarks import gemv as gb
    from ouro_jax.model import rms_norm

    for argv in (["--prologue", "add_norm"],
                 ["--prologue", "add_norm", "--variants", "dot16_k256_w4_s4"]):
        with pytest.raises(SystemExit, match="--prologue add_norm"):
            gb.main(argv)
    with pytest.raises(SystemExit, match="takes 1..4 rows"):
        gb.main(["--prologue", "add_norm", "--variants", "engine", "--rows", "1,8"])
    pairs = gb.prologue_inputs(1, 256, 3)
    assert len({float(jnp.sum(x)) for x, _ in pairs}) == 3  # distinct inputs
    ws = [jax.random.normal(jax.random.PRNGKey(i), (64, 256), jnp.float32) for i in range(3)]
    nw = jnp.full((256,), gb.NORM_W, jnp.float32)
    got = gb.chain_fn("xla", False, "qkv", "add_norm")([(x.astype(jnp.float32),
                                                         b.astype(jnp.float32))
                                                        for x, b in pairs], ws)
    for i, ((x, b), w) in enumerate(zip(pairs, ws)):
        x, b = x.astype(jnp.float32), b.astype(jnp.float32)
        want = rms_norm(x + rms_norm(b, nw, 1e-6), nw, 1e-6) @ w.T
        np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), rtol=1e-5, atol=1e-5)
    plain = gb.chain_fn("xla", False, "qkv")(pairs[0][0].astype(jnp.float32), ws[:1])[0]
    assert not np.allclose(np.asarray(plain), np.asarray(got[0]))  # the prologue did something


def test_gemv_fixed_rows_times_the_invariant_gemm_only(monkeypatch):
    """--fixed-rows (the batch-invariant mode's GEMM) is refused with other variants; with
    --variants gemm every GEMM tiling, and the mode's own as 'invariant', is built with
    fixed_rows."""
    from benchmarks import gemv as gb
    with pytest.raises(SystemExit, match="--variants gemm"):
        gb.main(["--fixed-rows", "--variants", "stream"])
    seen = []
    monkeypatch.setattr(gb, "gemm", lambda x, w, **kw: seen.append(kw) or x[:, :8])
    for impl in ("invariant", next(iter(gb.GEMM_VARIANTS))):
        gb.chain_fn(impl, False, "o", fixed_rows=True)(jnp.ones((2, 16)), [jnp.ones((8, 16))])
    from ouro_jax.invariant import tiling_for  # (the mode's tiling at 2 rows: a route's)
    assert seen[0] == dict(gated=False, fixed_rows=True, **tiling_for("o", 2))
    assert all(kw["fixed_rows"] for kw in seen) and len(seen) == 2


def test_gemv_fixed_rows_few_row_sweep_runs_split_k(monkeypatch):
    """--variants gemm_few --fixed-rows: XLA, the mode's own tiling and the few-row tilings,
    split-K ones included, each timed (here in interpret mode, one tiny shape and a stub
    timer); gemm_few without --fixed-rows, or a non-GEMM variant with it, is refused."""
    from benchmarks import gemv as gb
    for bad, msg in ((["--variants", "gemm_few"], "add --fixed-rows"),
                     (["--fixed-rows", "--variants", "dot16_k256_w4_s4"], "GEMM_VARIANTS keys"),
                     (["--fixed-rows", "--variants", "gemm_few,mm16_n16_k256_w4_s4"],
                      "not list items")):
        with pytest.raises(SystemExit, match=msg):
            gb.main(bad)
    monkeypatch.setitem(gb.SHAPES, "o", (64, 512, False))
    monkeypatch.setattr(gb, "pipelined_seconds", lambda *a, **k: 1e-6)
    real = gb.gemm
    monkeypatch.setattr(gb, "gemm", lambda x, w, **kw: real(x, w, interpret=True, **{
        **kw, "block_n": 16, "block_k": min(kw["block_k"], 128)}))
    import argparse
    args = argparse.Namespace(variants="gemm_few", fixed_rows=True, shapes="o", rows="1,3",
                              layers=1, prologue="", calls=1, trials=1, device_time=False)
    rows = gb.run(args)
    assert [r["impl"] for r in rows[:2]] == ["xla", "invariant"]
    assert {r["impl"] for r in rows} == {"xla", "invariant", *gb.FEW_ROW_VARIANTS}
    assert all("error" not in r and r["rel_err_vs_xla"] < 1e-2 for r in rows
               if r["impl"] != "xla"), [r for r in rows if "error" in r][:2]


def test_pick_invariant_scores_each_tiling_over_every_row_count(monkeypatch):
    """One tiling per weight at every row count: the pick sums each candidate's time over
    the best candidate's at each row count. Errors, rows off XLA and tilings missing a row
    count are no candidates and do not set the best either; the head follows qkv; a weight
    whose best is the mode's own tiling is named by its GEMM_VARIANTS key, and is no
    candidate where the mode's routes ran other tiles at other row counts."""
    from benchmarks.gemv import pick_invariant
    from ouro_jax import invariant
    from ouro_jax.invariant import TUNING
    shipped_o = invariant.ROUTES["o"]
    monkeypatch.setitem(TUNING, "o", dict(block_m=64, block_n=64, block_k=128, num_warps=4,
                                          num_stages=4, k_splits=4))
    monkeypatch.setitem(invariant.ROUTES, "o", ())

    def r(shape, impl, rows, us, **kw):
        return dict(dict(shape=shape, impl=impl, rows=rows, us=us, fixed_rows=True,
                         rel_err_vs_xla=1e-3), **kw)
    res = [r("qkv", "xla", 1, 1.0), r("qkv", "xla", 320, 1.0),  # XLA is never picked
           r("qkv", "invariant", 1, 40.0), r("qkv", "invariant", 320, 50.0),  # 4 + 1 = 5
           r("qkv", "a", 1, 10.0), r("qkv", "a", 320, 100.0),  # 1 + 2 = 3
           r("qkv", "b", 1, 15.0), r("qkv", "b", 320, 55.0),  # 1.5 + 1.1 = 2.6: picked
           r("qkv", "c", 1, 5.0),  # no 320-row time: out
           # down: f 1 + 1.8 = 2.8 beats g 2 + 1 = 3; h is wrong at one row, so its 320-row
           # time is no best (with it f would score 1 + 18, g 2 + 10, and g would win)
           r("down", "f", 1, 10.0), r("down", "f", 320, 90.0),
           r("down", "g", 1, 20.0), r("down", "g", 320, 50.0),
           r("down", "h", 1, 9.0, rel_err_vs_xla=0.5), r("down", "h", 320, 5.0),
           r("o", "invariant", 1, 10.0), r("o", "invariant", 320, 20.0),
           r("o", "e", 1, 9.0), dict(shape="o", impl="e", rows=320, error="boom",
                                     fixed_rows=True)]
    o_key = "mm64_n64_k128_w4_s4_x4"
    assert TUNING["o"]["k_splits"] == 4 and TUNING["o"]["block_m"] == 64  # (o_key's tiling)
    assert pick_invariant(res) == f"down=f,head=b,o={o_key},qkv=b"
    monkeypatch.setitem(invariant.ROUTES, "o", shipped_o)  # 1 row: a 16-row tile, 320: TUNING
    assert shipped_o and pick_invariant(res) == "down=f,head=b,qkv=b"


def test_pick_fastest_tiling_skips_errors_xla_and_disagreeing_rows(capsys):
    """benchmarks.gemv --pick: the fastest streaming tiling per shape, among rows that ran and
    agree with XLA; XLA and the engine's row are never picked. Session 9's H200 run picks
    what became the default."""
    import os

    from benchmarks.gemv import main, pick_fastest
    rows = [dict(shape="qkv", impl="xla", us=1.0),
            dict(shape="qkv", impl="engine", us=2.0, rel_err_vs_xla=0.0),
            dict(shape="qkv", impl="st4_k512_p4_w4", us=9.0, rel_err_vs_xla=0.02),
            dict(shape="qkv", impl="st2_k512_p8_w4", error="CompileError"),
            dict(shape="qkv", impl="st1_k512_p4_w4", us=12.0, rel_err_vs_xla=0.001),
            dict(shape="o", impl="xla", us=3.0)]
    assert pick_fastest(rows) == "qkv=st1_k512_p4_w4"
    assert pick_fastest(rows[:1]) == ""
    # with --device-time the GPU's kernel time ranks, not the (host-bound) wall clock
    timed = [dict(shape="qkv", impl="st1_k512_p4_w4", us=12.0, device_us=9.0,
                  rel_err_vs_xla=0.001),
             dict(shape="qkv", impl="st4_k512_p4_w4", us=11.0, device_us=9.5,
                  rel_err_vs_xla=0.001)]
    assert pick_fastest(timed) == "qkv=st1_k512_p4_w4"
    assert pick_fastest([{k: v for k, v in r.items() if k != "device_us"} for r in timed]) \
        == "qkv=st4_k512_p4_w4"
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results",
                        "gemv_stream_add_norm_session9_h200.json")
    assert main(["--pick", path]) == 0
    assert capsys.readouterr().out.strip() == "gate_up=st2_k512_p8_w4,qkv=st4_k512_p4_w4"


def test_invariant_tiling_that_does_not_fit_its_weight_is_refused(monkeypatch):
    """benchmarks.decode --invariant-tiling checks a tiling against the 1.4B weight as it is:
    down's K = 5632 is 22 blocks of 256, which four splits do not divide (no shipped variant
    is that bad, so one is added for the test); the spec's whole parse fails, setting nothing."""
    from benchmarks import gemm_tilings
    from benchmarks.tuning import parse_invariant_tiling
    monkeypatch.setitem(gemm_tilings.GEMM_VARIANTS, "bad_x4", dict(
        block_m=16, block_n=16, block_k=256, num_warps=4, num_stages=4, k_splits=4))
    with pytest.raises(SystemExit, match="bad_x4 does not fit down .*k_splits=4"):
        parse_invariant_tiling("down=bad_x4")
    assert parse_invariant_tiling("o=bad_x4")[0]["o"]["k_splits"] == 4  # o's K = 8 x 256


def test_block_m_bits_probe_refuses_to_run_without_a_gpu(monkeypatch):
    """benchmarks.gemm_block_m_bits compares compiled kernels (interpret mode runs every
    block alike, so a CPU run would say nothing): refused by name off a GPU."""
    import jax

    from benchmarks import gemm_block_m_bits
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(SystemExit, match="run it on a GPU"):
        gemm_block_m_bits.main([])


def test_tiling_bits_probe_counts_differing_elements_and_refuses_off_a_gpu(monkeypatch):
    """benchmarks.gemm_tiling_bits: bits compared as integers (a -0.0 against 0.0 counts,
    a NaN against itself does not), fp32 partials too; the same tiling against itself
    differs nowhere at any row count (interpret mode); refused by name off a GPU, and an
    unknown variant before that."""
    import jax
    import jax.numpy as jnp

    from benchmarks import gemm_tiling_bits as gtb
    a = np.array([0.0, 1.0, np.nan, 2.0], np.float32)
    b = np.array([-0.0, 1.0, np.nan, 2.5], np.float32)
    assert gtb.differing(a, b) == 2
    assert gtb.differing(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)) == 2
    t = dict(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2, k_splits=2)
    x = jax.random.normal(jax.random.PRNGKey(0), (20, 64), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.PRNGKey(1), (32, 64), jnp.float32).astype(jnp.bfloat16)
    assert gtb.compare("o", t, t, x, w, False, rows=(20, 5, 1), interpret=True) == \
        {20: 0, 5: 0, 1: 0}
    with pytest.raises(SystemExit, match="unknown shapes or variants: \\['nope'\\]"):
        gtb.main(["--variants", "nope"])
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    with pytest.raises(SystemExit, match="run it on a GPU"):
        gtb.main([])


def test_invariant_tiling_routes_parse_and_keep_the_k_steps():
    """--invariant-tiling NAME=ROWS:VARIANT/.../VARIANT: routes in increasing rows with only
    the tile's rows, columns, warps and stages taken; a route that changes block_k or the K
    split, rows out of order, or a plain variant not last are refused by name."""
    from benchmarks.tuning import parse_invariant_tiling
    from ouro_jax.invariant import TUNING
    tilings, routes = parse_invariant_tiling(
        "o=1:mm16_n64_k128_w4_s4_x4/64:mm64_n64_k128_w4_s4_x4/mm128_n128_k128_w8_s3_x4,"
        "qkv=16:mm16_n64_k128_w4_s4")
    assert routes["o"] == ((1, dict(block_m=16, block_n=64, num_warps=4, num_stages=4)),
                           (64, dict(block_m=64, block_n=64, num_warps=4, num_stages=4)))
    assert tilings["o"]["block_m"] == 128 and tilings["o"]["k_splits"] == 4
    assert tilings["qkv"] == TUNING["qkv"]  # no plain variant: the shipped tiling
    assert parse_invariant_tiling("o=mm64_n64_k128_w4_s4_x4")[1] == {"o": ()}
    for spec, msg in [
            ("o=16:mm16_n64_k128_w4_s4/mm64_n64_k128_w4_s4_x4", "changes the K steps"),
            ("qkv=16:mm16_n64_k128_w4_s4_x4", "changes the K steps"),
            ("o=64:mm16_n64_k128_w4_s4_x4/16:mm16_n32_k128_w4_s4_x4", "increasing positive"),
            ("o=x:mm16_n64_k128_w4_s4_x4", "increasing positive"),
            ("o=mm64_n64_k128_w4_s4_x4/16:mm16_n64_k128_w4_s4_x4", "at most one plain"),
            ("o=16:nope", "'nope' is not a benchmarks.gemv")]:
        with pytest.raises(SystemExit, match=msg):
            parse_invariant_tiling(spec)


def test_pick_routes_opens_a_band_only_where_the_tile_above_is_slow(monkeypatch):
    """benchmarks.gemm_tilings.pick_routes: from the most rows down, a row count keeps the
    tile above it within 3%, else opens a band of its own. Tiles the bits probe saw differ
    (or did not probe), tiles with other K steps, errors and rows off XLA are no
    candidates; TUNING's own tiling ('invariant') needs no probe. (Session 40's o tiling,
    no routes: the runs below are of that mode.)"""
    from benchmarks.gemm_tilings import pick_routes
    from ouro_jax import invariant
    monkeypatch.setitem(invariant.TUNING, "o", dict(block_m=64, block_n=64, block_k=128,
                                                    num_warps=4, num_stages=4, k_splits=4))
    monkeypatch.setitem(invariant.ROUTES, "o", ())
    big, wide, few, bad = ("mm128_n128_k128_w8_s3_x4", "mm64_n128_k128_w4_s4_x4",
                           "mm16_n64_k128_w4_s4_x4", "mm16_n32_k128_w4_s4_x4")

    def r(impl, rows, us, **kw):
        return dict(dict(shape="o", impl=impl, rows=rows, us=us, fixed_rows=True,
                         rel_err_vs_xla=1e-3), **kw)
    res = [r(big, 2048, 100.0), r(wide, 2048, 120.0), r("invariant", 2048, 150.0),
           r(big, 320, 30.0), r(wide, 320, 29.5), r("invariant", 320, 40.0),  # big within 3%
           r(big, 64, 20.0), r(wide, 64, 12.0), r("invariant", 64, 11.0),  # band 64: TUNING's
           r("invariant", 8, 11.0), r(few, 8, 10.9),  # TUNING's within 3%: same band
           r("invariant", 1, 10.0), r(few, 1, 6.0), r(bad, 1, 5.0),  # bad differed: few
           r("mm16_n16_k256_w4_s4", 1, 1.0),  # other K steps
           r(wide, 1, 2.0, error="boom"), r(big, 1, 2.0, rel_err_vs_xla=0.5),
           r("xla", 1, 0.5)]
    bits = [dict(shape="o", variant=v, differing={"320": 0, "1": 0}) for v in (big, wide, few)]
    bits += [dict(shape="o", variant=bad, differing={"320": 3, "1": 0})]
    assert pick_routes(res, bits) == f"o=1:{few}/64:mm64_n64_k128_w4_s4_x4/{big}"
    # with no probe only TUNING's tiling is a candidate: one plain tile, no band
    assert pick_routes(res, []) == "o=mm64_n64_k128_w4_s4_x4"
    assert pick_routes([], bits) == ""
