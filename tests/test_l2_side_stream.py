"""The side-stream prefetcher's host side (its work list, pallas_kernels.side_prefetch.
schedule, which both of its benchmarks use; the GPU runs need a device), the benchmarks' arm
syntax and benchmarks.stream_probe's wiring."""
import pytest

from benchmarks.l2_side_stream import parse_arm
from pallas_kernels.side_prefetch import schedule


def test_schedule_needs_follow_the_lead():
    # three kernels of 4, 4 and 8 bytes read in order, 2-byte chunks
    work = schedule([4, 4, 8], lead=4, chunk=2)
    assert [(i, off) for i, off, _ in work] == [(0, 0), (0, 2), (1, 0), (1, 2), (2, 0), (2, 2),
                                                (2, 4), (2, 6)]
    # a lead of 4 bytes: while kernel k runs, up to 4 bytes past its end may go
    assert [need for *_, need in work] == [0, 0, 0, 0, 1, 1, 2, 2]
    # a lead of 8 bytes
    assert [need for *_, need in schedule([4, 4, 8], lead=8, chunk=2)] == [0, 0, 0, 0, 0, 0,
                                                                          1, 1]
    # a lead past everything: all chunks at the first kernel's start
    assert {need for *_, need in schedule([4, 4, 8], lead=100, chunk=2)} == {0}


def test_gated_kernels_are_listed_part_by_part():
    # kernel 1 reads its two halves side by side (gate and up rows): chunks alternate
    work = schedule([4, 8], lead=4, chunk=2, segments=[1, 2])
    assert [(i, off) for i, off, _ in work] == [(0, 0), (0, 2), (1, 0), (1, 4), (1, 2), (1, 6)]
    assert [need for *_, need in work] == [0, 0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="2 part"):
        schedule([6], lead=4, chunk=2, segments=[2])


def test_schedule_never_waits_past_its_own_kernel_and_never_goes_back():
    sizes = [6144 * 2048 * 2, 2048 * 2048 * 2, 11264 * 2048 * 2, 2048 * 5632 * 2] * 3
    for lead in (1 << 20, 16 << 20, 48 << 20):
        work = schedule(sizes, lead=lead, chunk=64 << 10, segments=[1, 1, 2, 1] * 3)
        needs = [need for *_, need in work]
        assert all(need <= i for i, _, need in work)
        assert needs == sorted(needs)
        assert len(work) == sum(sizes) // (64 << 10)
        # every kernel after the first has its first `lead` bytes released while the kernel
        # before it runs (a review found a lead counted from a kernel's start released none)
        for i in range(1, len(sizes)):
            early = sum(64 << 10 for j, _, need in work if j == i and need < i)
            assert early == min(lead, sizes[i])


def test_schedule_and_arm_errors():
    with pytest.raises(ValueError, match="multiple of the chunk"):
        schedule([5], lead=4, chunk=2)
    assert parse_arm("base") is None
    assert parse_arm("pf:16:32") == (16 << 20, 32, 64 << 10)
    assert parse_arm("pf:0.5:8:128") == (1 << 19, 8, 128 << 10)
    for bad in ("pf", "pf:16", "pf:x:3", "pf:-1:8", "pre:16:8", "pf:16:0"):
        with pytest.raises(SystemExit, match="arm"):
            parse_arm(bad)


def _probe_inputs():
    import jax.numpy as jnp
    return jnp.ones((128,), jnp.float32), jnp.full((128,), 2.0, jnp.float32)


def test_stream_probe_arms_agree():
    """benchmarks.stream_probe (GPU only to time): on the CPU (interpret mode) every arm that
    runs both kernels gives the serial arm's values, so the side-stream wiring only moves
    work."""
    import jax
    import numpy as np

    from benchmarks import stream_probe
    x, y = _probe_inputs()
    arms = stream_probe.arms(5, interpret=True)
    got = {name: [np.asarray(v) for v in jax.jit(fn)(x, y)] for name, fn in arms.items()}
    for a, b in zip(got["streams"], got["serial"]):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(got["streams_loop"], got["serial_loop"]):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(got["serial"][1], got["one"][1])  # the second kernel ran


def test_stream_probe_names_the_stream_when_lowered_for_cuda():
    """Lowered for 'cuda' (where this jaxlib can), the stream arms carry XLA's stream
    annotation and the others do not."""
    from benchmarks import stream_probe
    x, y = _probe_inputs()
    try:
        from pallas_kernels.offline_compile import lower_for_cuda
        texts = {n: lower_for_cuda(fn, x, y).as_text()
                 for n, fn in stream_probe.arms(5).items()}
    except ModuleNotFoundError as e:  # jax 0.10.2 here lacks the Mosaic GPU lowering's deps
        pytest.skip(f"no 'cuda' lowering on this jaxlib: {e}")
    assert all("_xla_stream_annotation" in texts[n] for n in ("streams", "streams_loop"))
    assert not any("_xla_stream_annotation" in texts[n] for n in ("one", "serial",
                                                                   "serial_loop"))


def test_ev_suffix_marks_evict_first_loads():
    from benchmarks.l2_side_stream import split_ev
    assert split_ev("pf:16:16+ev") == ("pf:16:16", True)
    assert split_ev("base+ev") == ("base", True)
    assert split_ev("base") == ("base", False)
    assert parse_arm(split_ev("pf:16:16:128+ev")[0]) == (16 << 20, 16, 128 << 10)
