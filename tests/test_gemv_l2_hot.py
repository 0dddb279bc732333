"""benchmarks.gemv_l2_hot's host side: its options and the summary it prints (the timing
itself needs the GPU machine's PyTorch + Triton)."""
import pytest

from benchmarks.gemv_l2_hot import parse_args, summarize


def test_options_are_checked():
    args = parse_args(["--projections", "qkv,down"])
    assert args.names == ["qkv", "down"]
    with pytest.raises(SystemExit):
        parse_args(["--projections", "qkv,ffn"])
    with pytest.raises(SystemExit):
        parse_args(["--distinct", "1"])


def test_summary_is_hot_minus_cold_per_projection():
    rows = [dict(projection="qkv", arm="cold", us_per_call=7.5),
            dict(projection="qkv", arm="hot", us_per_call=5.0),
            dict(projection="o", arm="cold", us_per_call=3.4),
            dict(projection="o", arm="hot", us_per_call=3.1),
            dict(projection="o", arm="pfd", us_per_call=33.1),
            dict(projection="o", arm="pfd0", us_per_call=30.5),
            dict(projection="down", arm="cold", us_per_call=6.6)]  # no hot row: left out
    s = summarize(rows)
    assert s["saving_us_per_call"] == {"qkv": 2.5, "o": 0.3}
    assert s["saving_us_per_layer_application"] == 2.8
    # the GEMV's own time after another kernel's prefetch: pfd - pfd0
    assert s["gemv_after_prefetch_us"] == {"o": 2.6}


def test_every_projection_is_whole_prefetch_groups():
    from benchmarks.gemv_l2_hot import CHUNK, LANES
    from benchmarks.pdl_chain import SHAPES
    for n, k, gated in SHAPES.values():
        assert ((2 * n if gated else n) * k * 2) % (CHUNK * LANES) == 0
