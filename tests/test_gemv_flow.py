"""The ticket-ordered GEMV chain (pallas_kernels/gemv_flow.py): the same bits as the separate
streaming GEMVs it replaces, its state threaded through calls, a wait that is not met counted
as a give-up, the wait's place in the lowered kernel (after the first weight requests), and
its errors, the benchmark's two arms. On the CPU programs run in index order (interpret
mode); the GPU test runs the real grid with its spinning waits. The engine's use of it:
tests/test_projections_flow.py."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from engine_helpers import has_gpu
from pallas_kernels.flow_sync import WORD, misses, state_size
from pallas_kernels.gemv_flow import Stage, gemv_flow, give_ups, mlp_stages, state_for
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed

TILING = dict(o=dict(block_n=2, block_k=64, per_program=2),
              gate_up=dict(block_n=2, block_k=64, per_program=3),
              down=dict(block_n=1, block_k=64, per_program=4),
              qkv=dict(block_n=4, block_k=64, per_program=2))


def _case(k, inter, dtype, seed=0):
    rng = np.random.default_rng(seed)
    a = lambda *s, scale=1.0: jnp.asarray(rng.standard_normal(s) * scale, dtype)
    u = lambda: jnp.asarray(rng.uniform(0.5, 1.5, k), dtype)
    return dict(attn=a(1, k), h=a(1, k), w_o=a(k, k, scale=k ** -0.5), w_post=u(), w_pre=u(),
                w_gu=a(2 * inter, k, scale=k ** -0.5), w_down=a(k, inter, scale=inter ** -0.5),
                w_post2=u(), w_in=u(), w_qkv=a(3 * k, k, scale=k ** -0.5))


def _stages(c, qkv: bool, tiling=TILING):
    nxt = (c["w_post2"], c["w_in"], c["w_qkv"]) if qkv else None
    return mlp_stages(c["w_o"], c["w_post"], c["w_pre"], c["w_gu"], c["w_down"],
                      next_qkv=nxt, tiling=tiling)


def _separate(c, qkv: bool, tiling=TILING, interpret=True):
    """The engine's kernels one by one: o, gate/up (add_norm), down[, qkv (add_norm)]."""
    o = gemv_stream(c["attn"], c["w_o"], interpret=interpret, **tiling["o"])
    y, x1 = gemv_stream_normed(c["h"], c["w_pre"], c["w_gu"], eps=1e-6, branch=o,
                               branch_w=c["w_post"], gated=True, interpret=interpret,
                               **tiling["gate_up"])
    d = gemv_stream(y, c["w_down"], interpret=interpret, **tiling["down"])
    if not qkv:
        return [o, y, d], [x1]
    q, x2 = gemv_stream_normed(x1, c["w_in"], c["w_qkv"], eps=1e-6, branch=d,
                               branch_w=c["w_post2"], interpret=interpret, **tiling["qkv"])
    return [o, y, d, q], [x1, x2]


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


@pytest.mark.parametrize("dtype,qkv,order", [
    (jnp.float32, False, "ticket"), (jnp.bfloat16, True, "ticket"),
    (jnp.float32, True, "program_id"), (jnp.bfloat16, True, "guess")])
def test_matches_the_separate_kernels_bit_for_bit(dtype, qkv, order):
    c = _case(128, 192, dtype)
    stages = _stages(c, qkv)
    ys, xs, state = gemv_flow(c["attn"], stages, state_for(len(stages)), h=c["h"],
                              interpret=True, order=order)
    want_ys, want_xs = _separate(c, qkv)
    _same(ys, want_ys)
    _same(xs, want_xs)
    assert not np.asarray(state).any()  # ready for the next call, no give-up


def test_the_state_threads_through_calls_under_jit():
    c = _case(128, 192, jnp.float32)
    f = jax.jit(lambda a, h, st: gemv_flow(a, _stages(c, True), st, h=h, interpret=True,
                                           l2_prefetch=2, backoff=100),
                donate_argnums=2)
    state = state_for(4)
    for seed in range(2):  # a new input each call: a stale read would show
        c2 = _case(128, 192, jnp.float32, seed=seed + 5)
        c = dict(c, attn=c2["attn"], h=c2["h"])
        ys, xs, state = f(c["attn"], c["h"], state)
        want_ys, want_xs = _separate(c, True)
        _same(ys + xs, want_ys + want_xs)
        assert not np.asarray(state).any()


def test_a_wait_that_is_not_met_is_counted():
    """A stage whose input count stays short (the state starts one below for the o stage)
    makes every gate/up program give up once: the kernel reads the counter it waits on."""
    c = _case(128, 192, jnp.float32)
    stages = _stages(c, False)
    ys, _, state = gemv_flow(c["attn"], stages, state_for(3).at[WORD].set(-1),
                             h=c["h"], interpret=True)
    gate_up_programs = 192 // 2 // 3
    assert int(give_ups(state)) == gate_up_programs
    _same(ys[:1], _separate(c, False)[0][:1])  # o itself waits for nothing


def _regions(ir: str) -> list[list[str]]:
    """The kernel's top-level `pl.when` regions of the printed Triton IR, in order (each an
    `scf.if` at the function's indent whose body sits in its else branch)."""
    out, cur = [], None
    for ln in ir.splitlines():
        if ln.startswith("    scf.if"):
            cur = []
        elif ln == "    }" and cur is not None:
            out.append(cur)
            cur = None
        elif cur is not None:
            cur.append(ln)
    return out


def _chain_ir(**options) -> str:
    """The Triton IR (lowered for 'cuda' on this CPU) of the 3-stage chain at small bf16
    shapes (K 256, I 384; TILING at block_k 128, gate/up at 2 blocks per program)."""
    from test_pdl import triton_ir
    s = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    k, inter = 256, 384
    tiling = {n: dict(v, block_k=128) for n, v in TILING.items()}
    tiling["gate_up"]["per_program"] = 2
    [ir] = triton_ir(lambda a, h, wo, wp, wm, wg, wd, st: gemv_flow(
        a, mlp_stages(wo, wp, wm, wg, wd, tiling=tiling), st, h=h, **options),
        s((1, k), bf), s((1, k), bf), s((k, k), bf), s((k,), bf), s((k,), bf),
        s((2 * inter, k), bf), s((k, inter), bf), s((state_size(3),), jnp.int32))
    return ir


@pytest.mark.parametrize("spin", ["thread0", "all"])
def test_each_stage_waits_after_its_weight_requests_and_counts_after_its_stores(spin):
    """Lowered for 'cuda' (Triton IR, no GPU needed), per stage region: a waiting stage's
    last load before its spin is a weight tile (the first block is in flight while it waits)
    and its first load after it the input; every stage's stores all come before a CTA barrier
    that comes before its done count (the release), with no store in between; the last stage
    then resets the state (thread 0's relaxed stores); the ticket atomic precedes every load
    and a ticket past the grid is counted. order="ticket": one region per stage (the default
    "guess" runs the same stage code, in branches by program index, and falls back to this)."""
    ir = _chain_ir(spin=spin, order="ticket")
    lines = ir.splitlines()
    first_load = next(i for i, ln in enumerate(lines) if "tt.load" in ln)
    assert "tt.atomic_rmw add" in "\n".join(lines[:first_load])  # the ticket
    *stages, stray = _regions(ir)  # the stray-ticket check comes last
    assert sum("tt.atomic_rmw" in ln for ln in stray) == 1
    assert len(stages) == 3
    find = lambda reg, word: [i for i, ln in enumerate(reg) if word in ln]
    for n, reg in enumerate(stages):
        if n:  # gate/up waits for o, down for gate/up
            spins = find(reg, "W_LOOP" if spin == "thread0" else "scf.while")
            assert spins, f"stage {n}: no spin"
            before = [ln for ln in reg[:spins[0]] if "tt.load" in ln][-1]
            after = next(ln for ln in reg[spins[0]:] if "tt.load" in ln)
            assert re.search(r"tensor<[12]x128x!tt\.ptr<bf16>>", before), before
            assert re.search(r"tensor<128x!tt\.ptr<bf16>>", after), after
        done = [i for i in find(reg, "tt.atomic_rmw add") if reg[i].startswith("      %")][-1]
        barrier = max(i for i in find(reg, "gpu.barrier") if i < done)
        assert max(find(reg, "tt.store")) < barrier, f"stage {n}: a store after the release"
        resets = [ln for ln in reg[done:] if "st.relaxed.gpu.global.b32" in ln]
        if n == 2:  # the ticket and three counts, as four stores in one asm block
            assert len(resets) == 1 and resets[0].count("st.relaxed.gpu.global.b32") == 4
        else:
            assert not resets
    if spin == "thread0":  # the spin is PTX: one per wait, with its give-up add
        assert "scf.while" not in ir
        assert ir.count("W_LOOP") == 2 * 2 and ir.count("ld.acquire.gpu") == 2
        assert ir.count("ld.relaxed.gpu") == 2
        assert ir.count("red.relaxed.gpu.global.add.u32") == 2
        # gate/up waits for o's 64 programs on word 1, down for gate/up's 96 on word 2; the
        # give-up word (4) lies 3 and 2 words (of 128 bytes) past them
        for reg, target, give_up in ((stages[1], 64, 384), (stages[2], 96, 256)):
            spin_asm = next(ln for ln in reg if "W_LOOP" in ln)
            assert f"%v_w, {target};" in spin_asm and f"[$1+{give_up}], 1;" in spin_asm
    else:  # a first read and the loop's, per wait
        assert ir.count("ld.acquire.gpu") == 4


@pytest.mark.parametrize("spin", ["thread0", "all"])
def test_trap_stops_the_kernel_after_a_give_up_and_nowhere_else(spin):
    """trap=True (the engine's), lowered for 'cuda': a PTX trap follows each waiting stage's
    give-up count (thread0: in the spin's asm, right after its give-up add, off the path
    that saw the count; "all": one per wait) and the stray ticket's
    count, so a handover that failed is an error, not results; without trap, none. Interpret
    mode (no trap) gives the same bits."""
    assert "trap;" not in _chain_ir(spin=spin)
    ir = _chain_ir(spin=spin, trap=True)
    *stages, stray = _regions(ir)
    assert sum("trap;" in ln for ln in stray) == 1
    for n, reg in enumerate(stages):
        traps = [ln for ln in reg if "trap;" in ln]
        assert len(traps) == (1 if n else 0), f"stage {n}: {traps}"
        if n and spin == "thread0":  # the give-up add, the trap, then the exit
            asm = traps[0].replace("\\0A", "\n").replace("\\09", "\t")
            assert re.search(r"add\.u32 \[\$1\+\d+\], 1;\n\ttrap;\n\tbra W_DONE;\nW_SEEN:",
                             asm), asm
    c = _case(128, 192, jnp.float32)
    ys, xs, state = gemv_flow(c["attn"], _stages(c, True), state_for(4), h=c["h"],
                              interpret=True, trap=True, spin=spin)
    _same(ys + xs, sum(_separate(c, True), []))
    assert int(give_ups(state)) == 0


def test_the_guess_requests_weights_before_drawing_a_relaxed_ticket():
    """order="guess", lowered for 'cuda': in each stage's branch (by program index) a weight
    tile's load comes before the ticket, a relaxed atomic (no fence to wait for those loads);
    there is no acq_rel ticket; the branch's stage runs under ticket == pid."""
    lines = _chain_ir(order="guess").splitlines()
    tickets = [i for i, ln in enumerate(lines) if "tt.atomic_rmw add, relaxed" in ln]
    assert len(tickets) == 3  # one per stage branch
    indent = lambda ln: len(ln) - len(ln.lstrip())
    for i in tickets:  # its branch: from the enclosing region's opening line to the ticket
        lo = max(j for j in range(i) if indent(lines[j]) < indent(lines[i]))
        loads = [ln for ln in lines[lo:i] if "tt.load" in ln]
        assert loads and all(re.search(r"tensor<[12]x128x!tt\.ptr<bf16>>", ln)
                             for ln in loads), loads
    first_acq_rel = next(i for i, ln in enumerate(lines) if "atomic_rmw add, acq_rel" in ln)
    assert first_acq_rel > tickets[0]  # the done counts, not a ticket


def test_l2_guess_asks_l2_for_the_own_block_before_the_ticket():
    """l2_guess=True, lowered for 'cuda': one bulk L2 prefetch per stage branch (by program
    index; gated: two) before the ticket atomic and any load; in interpret mode the same
    bits (it is a prefetch)."""
    lines = _chain_ir(l2_guess=True).splitlines()
    first = lambda word: next(i for i, ln in enumerate(lines) if word in ln)
    before_ticket = "\n".join(lines[:first("tt.atomic_rmw")])
    assert before_ticket.count("cp.async.bulk.prefetch.L2") == 1 + 2 + 1
    assert first("tt.atomic_rmw") < first("tt.load")
    c = _case(128, 192, jnp.float32)
    ys, xs, state = gemv_flow(c["attn"], _stages(c, True), state_for(4), h=c["h"],
                              interpret=True, l2_guess=True)
    _same(ys + xs, sum(_separate(c, True), []))
    with pytest.raises(ValueError, match="l2_guess"):
        gemv_flow(c["attn"], _stages(c, True), state_for(4), h=c["h"], interpret=True,
                  l2_guess=True, order="guess")


def test_a_guess_that_misses_runs_as_its_ticket_says(monkeypatch):
    """order="guess" when the guess fails (interpret mode draws tickets in index order, so a
    test makes every program bet on the mirror index, across stage boundaries): each drops
    its requested block and runs as its ticket says; the same bits, the state back to zero
    but for the misses, one per program whose bet was wrong."""
    from pallas_kernels import gemv_flow as gf
    c = _case(128, 192, jnp.float32)
    stages = _stages(c, True)
    monkeypatch.setattr(gf, "_guess", lambda pid, programs: programs - 1 - pid)
    ys, xs, state = gemv_flow(c["attn"], stages, state_for(4), h=c["h"], interpret=True,
                              order="guess")
    want_ys, want_xs = _separate(c, True)
    _same(ys + xs, want_ys + want_xs)
    total = 32 + 32 + 32 + 48  # o, gate/up, down, qkv programs at TILING: even, so no
    assert int(misses(state)) == total and int(give_ups(state)) == 0  # bet holds
    assert not np.asarray(state)[:-WORD].any()


def test_bad_input_is_refused_before_anything_runs():
    c = _case(128, 192, jnp.float32)
    stages = _stages(c, False)
    run = lambda st=stages, state=None, **kw: gemv_flow(
        c["attn"], st, state_for(len(st)) if state is None else state,
        **dict(dict(h=c["h"], interpret=True), **kw))
    with pytest.raises(ValueError, match=r"state must be int32 \[192\]"):
        run(state=jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="order must be one of"):
        run(order="fifo")
    with pytest.raises(ValueError, match="spin must be one of"):
        run(spin="thread1")
    with pytest.raises(ValueError, match="trap must be a bool"):
        run(trap=1)
    with pytest.raises(ValueError, match="backoff must be an int >= 0"):
        run(backoff=-1)
    with pytest.raises(ValueError, match="pass the residual h"):
        run(h=None)
    with pytest.raises(ValueError, match="first stage cannot be add_norm"):
        run(st=stages[1:])
    with pytest.raises(ValueError, match=r"stage 2 \(down\): gemv shape mismatch"):
        run(st=stages[:2] + [Stage(c["w_o"], tiling=TILING["o"], name="down")])
    with pytest.raises(ValueError, match="tiling takes exactly"):
        run(st=[Stage(c["w_o"], tiling=dict(block_n=2))])
    with pytest.raises(ValueError, match="per_program=5 must divide"):
        run(st=[Stage(c["w_o"], tiling=dict(TILING["o"], per_program=5))])
    with pytest.raises(ValueError, match="mlp_stages tiling names one of"):
        mlp_stages(c["w_o"], c["w_post"], c["w_pre"], c["w_gu"], c["w_down"],
                   tiling=dict(gate=dict(block_n=1)))


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
@pytest.mark.parametrize("order,spin", [("ticket", "thread0"), ("program_id", "thread0"),
                                        ("guess", "thread0"), ("ticket", "all")])
def test_the_real_grid_matches_the_separate_kernels_on_the_gpu(order, spin):
    """1.4B shapes, bf16, the engine's tilings: 4 stages (1,760 programs) with their spinning
    waits give the separate kernels' bits, call after call with a new input each time, and no
    program gave up."""
    from pallas_kernels.gemv_flow import ENGINE_TILING
    c = _case(2048, 5632, jnp.bfloat16, seed=3)
    # the weights as jit arguments: closed over, ~100 MB would compile in as constants
    flow = jax.jit(lambda c, st: gemv_flow(c["attn"], _stages(c, True, ENGINE_TILING), st,
                                           h=c["h"], order=order, spin=spin),
                   donate_argnums=1)
    separate = jax.jit(lambda c: _separate(c, True, ENGINE_TILING, interpret=False))
    state = state_for(4)
    rng = np.random.default_rng(9)
    for _ in range(8):
        c = dict(c, attn=jnp.asarray(rng.standard_normal((1, 2048)), jnp.bfloat16))
        ys, xs, state = flow(c, state)
        want_ys, want_xs = separate(c)
        print(f"{order}: guesses missed so far {int(misses(state))}")
        assert not np.asarray(state)[:-WORD].any(), "a program gave up, or the reset missed"
        _same(ys + xs, want_ys + want_xs)


# A child process (a trap loses the process's GPU context): the o stage's count starts one
# short, so every gate/up program gives up; with trap=True the first one stops the kernel.
_TRAP_CHILD = """
import jax, jax.numpy as jnp
from test_gemv_flow import _case, _stages
from pallas_kernels.flow_sync import WORD
from pallas_kernels.gemv_flow import gemv_flow, state_for
c = _case(128, 192, jnp.bfloat16)
ys, _, _ = gemv_flow(c["attn"], _stages(c, False), state_for(3).at[WORD].set(-1), h=c["h"],
                     trap=True)
jax.block_until_ready(ys)
print("NO TRAP")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not has_gpu(), reason="needs a GPU")
def test_a_give_up_on_the_gpu_is_counted_and_with_trap_stops_the_kernel():
    """On the GPU: a wait that is never met gives up after SPIN_LIMIT re-reads (seconds, not
    a hang) and is counted, once per gate/up program (32); the down programs, spinning from
    about the same moment on gate/up's count, may give up too before the late gate/up
    programs count themselves done (on the H100: all 32 did, 64 in all; interpret mode runs
    programs in order, so there only gate/up's). With trap=True the kernel stops instead
    and the call fails (in a child process)."""
    import os
    import subprocess
    import sys
    c = _case(128, 192, jnp.bfloat16)
    _, _, state = gemv_flow(c["attn"], _stages(c, False), state_for(3).at[WORD].set(-1),
                            h=c["h"])
    assert 192 // 2 // 3 <= int(give_ups(state)) <= 192 // 2 // 3 + 128 // 1 // 4
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    r = subprocess.run([sys.executable, "-c", _TRAP_CHILD], env=env, capture_output=True,
                       text=True, timeout=300)
    print("child's error:", r.stderr.strip().splitlines()[-1:] if r.stderr else None)
    assert r.returncode != 0 and "NO TRAP" not in r.stdout


@pytest.mark.parametrize("variant", ["flow4", "flow3", "flow4_gu2_pf1"])
def test_the_benchmarks_chains_agree(variant):
    """benchmarks.gemv_flow's two arms on small shapes in interpret mode: three layers, each
    fed the last one's output, give the same bits (what its max_abs_diff reports on the GPU),
    with the variant's options and tiling."""
    from benchmarks import gemv_flow as bench
    v = bench.VARIANTS[variant]
    ws = bench.weights(3, k=128, inter=192, dtype=jnp.float32)
    t = bench.tilings(v)
    t = bench._freeze({n: dict(x, block_k=64, per_program=min(x["per_program"], 2))
                       for n, x in t.items()})
    rng = np.random.default_rng(4)
    attn, h = (jnp.asarray(rng.standard_normal((1, 128)), jnp.float32) for _ in range(2))
    want = bench.separate(ws, attn, h, t, interpret=True)
    options = tuple((k, x) for k, x in v.items() if k not in ("stages", "tiling"))
    q, x, state = bench.flow(ws, attn, h, state_for(v["stages"]), t, v["stages"], options,
                             interpret=True)
    _same((q, x), want)
    assert not np.asarray(state).any()


def test_the_benchmark_refuses_a_cpu_and_unknown_variants():
    from benchmarks.gemv_flow import main
    with pytest.raises(SystemExit):
        main(["--variants", "flow9"])
    if has_gpu():
        pytest.skip("has a GPU")
    with pytest.raises(SystemExit, match="needs a GPU"):
        main(["--layers", "1"])


def test_offline_compile_lowers_every_benchmark_variant(monkeypatch):
    """`python -m pallas_kernels.offline_compile --flow` (the pre-flight sm_90 compile of
    every benchmarks.gemv_flow variant at the 1.4B shapes): its lowering runs for each, here
    without Triton's compile (no Triton package in the test environment)."""
    from benchmarks.gemv_flow import VARIANTS
    from engine_helpers import offline_compile_tags
    from pallas_kernels import offline_compile_flow
    tags = [(tag, n) for tag, n, _ in offline_compile_tags(monkeypatch,
                                                            offline_compile_flow.check_flow)]
    assert tags == [(f"flow {name}", 1) for name in VARIANTS] + [
        (f"flow_layer flow5 ns{n}", 1) for n in (1, 2)]

