"""Programmatic dependent launch (pallas_kernels._common.PDL): the trigger and wait the kernels
emit, checked on the Triton IR that JAX lowers for the 'cuda' platform (no GPU needed), and
the switches' errors. Whether it pays is a benchmark (`benchmarks.decode --pdl`)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _common
from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
from pallas_kernels.offline_compile import triton_modules

S = jax.ShapeDtypeStruct
TRIGGER, WAIT = "griddepcontrol.launch_dependents", "griddepcontrol.wait"


def triton_ir(fn, *shapes) -> list[str]:
    """The Triton IR of every pallas_call in jit(fn) lowered for CUDA on this (CPU) machine."""
    return [ir for ir, _ in triton_modules(fn, *shapes)]


def _loads(ir: str):
    """(line number, shape) of every tt.load of a pointer tensor."""
    return [(i, tuple(int(d) for d in m.group(1).split("x")))
            for i, line in enumerate(ir.splitlines())
            if (m := re.search(r"tt\.load %\S+ : tensor<([0-9x]+)x!tt\.ptr", line))]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


class DefUse:
    """Def-use chains of a printed Triton IR function. MLIR reuses value names across sibling
    regions, so a use resolves to the nearest definition above it whose region is still open
    (no line in between is indented less than the definition)."""

    def __init__(self, ir: str):
        self.lines = ir.splitlines()
        self.defs = {}  # name -> [(line, operand names)]
        for i, line in enumerate(self.lines):
            m = re.match(r"\s*(%[\w.]+)(?::\d+)? = (.*)", line)
            if m:
                self.defs.setdefault(m.group(1), []).append(
                    (i, re.findall(r"%[\w.]+", m.group(2))))

    def resolve(self, name: str, use: int):
        for i, operands in reversed(self.defs.get(name, ())):
            if i < use and min(map(_indent, self.lines[i + 1:use + 1])) >= _indent(
                    self.lines[i]):
                return i, operands
        return None

    def reaches(self, name: str, use: int, target_line: int) -> bool:
        """Whether the value `name` used at line `use` is computed from the value defined
        at target_line."""
        todo, seen = [(name, use)], set()
        while todo:
            found = self.resolve(*todo.pop())
            if found is None or found[0] in seen:
                continue
            line, operands = found
            if line == target_line:
                return True
            seen.add(line)
            todo.extend((op, line) for op in operands)
        return False

    def load_reaches(self, load_line: int, target_line: int) -> bool:
        ptr = re.search(r"tt\.load (%[\w.]+)", self.lines[load_line]).group(1)
        return self.reaches(ptr, load_line, target_line)


def assert_reads_follow_the_wait(ir: str, load_lines, wait_line: int):
    """Every load in load_lines computes its address from the wait's result."""
    du = DefUse(ir)
    for i in load_lines:
        assert du.load_reaches(i, wait_line), f"read not ordered after the wait: {du.lines[i]}"


def _asm_line(ir: str, text: str):
    lines = [i for i, line in enumerate(ir.splitlines()) if text in line]
    return lines


@pytest.mark.parametrize("prologue", ["", "add_norm"])
def test_stream_gemv_trigger_weights_then_wait_then_activations(prologue):
    """With pdl="start": the trigger first, then the first weight block's loads (2-D tiles,
    independent of the wait), then the wait, and the loads of x and the branch after it with
    addresses computed from the wait's result (the data dependency that keeps the compiler
    from hoisting them), checked by walking the IR's def-use chains."""
    k, n = 1024, 256
    x, w = S((1, k), jnp.bfloat16), S((n, k), jnp.bfloat16)
    tiling = dict(block_n=4, block_k=512, per_program=2, num_warps=4, pdl="start")
    if prologue:
        [ir] = triton_ir(lambda x, b, bw, nw, w: gemv_stream_normed(
            x, nw, w, eps=1e-6, branch=b, branch_w=bw, **tiling)[0],
            x, x, S((k,), jnp.bfloat16), S((k,), jnp.bfloat16), w)
    else:
        [ir] = triton_ir(lambda x, w: gemv_stream(x, w, **tiling), x, w)
    [trig], [wait] = _asm_line(ir, TRIGGER), _asm_line(ir, WAIT)
    loads = _loads(ir)
    tiles = [i for i, shape in loads if len(shape) == 2]
    rows = [i for i, shape in loads if shape == (512,)]  # block_k chunks of a row
    assert trig < tiles[0] < wait, (trig, tiles[:2], wait)
    assert rows and min(rows) > wait
    # x (2 chunks), and with the prologue the branch (2) and the norm weights (2 + 2, which
    # need not wait), and the x' store's read-before-write (2)
    assert len(rows) == (2 if not prologue else 10)
    du = DefUse(ir)
    late = [i for i in rows if du.load_reaches(i, wait)]
    # x and the branch, both chunks each, compute their addresses from the wait's result
    assert len(late) == (2 if not prologue else 4), (len(late), len(rows))
    assert not any(du.load_reaches(i, wait) for i in tiles[:2]), "the first weight block waits"


def test_stream_gemv_emits_nothing_by_default_or_when_switched_off():
    x, w = S((1, 1024), jnp.bfloat16), S((256, 1024), jnp.bfloat16)
    tiling = dict(block_n=4, block_k=512, per_program=2, num_warps=4)
    [ir] = triton_ir(lambda x, w: gemv_stream(x, w, **tiling), x, w)
    assert TRIGGER not in ir and WAIT not in ir
    _common.PDL["on"] = False
    try:
        [ir] = triton_ir(lambda x, w: gemv_stream(x, w, pdl="start", **tiling), x, w)
    finally:
        _common.PDL["on"] = True
    assert TRIGGER not in ir and WAIT not in ir


def test_stream_gemv_pdl_modes_are_accepted_in_interpret_mode():
    """Interpret mode emits no asm, so the modes only have to be accepted there and change
    nothing; a bad mode is refused."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 256)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
    kw = dict(interpret=True, block_n=4, block_k=64, per_program=2)
    for mode in ("start", "end"):
        np.testing.assert_array_equal(np.asarray(gemv_stream(x, w, pdl=mode, **kw), np.float32),
                                      np.asarray(gemv_stream(x, w, **kw), np.float32))
    with pytest.raises(ValueError, match="pdl must be one of"):
        gemv_stream(x, w, pdl=True, **kw)


def _decode_ir(counters: bool, rows: int = 1):
    from pallas_kernels.decode import paged_decode_attention_qkv
    i32 = jnp.int32
    cache = S((2, 8, 16, 2, 128), jnp.bfloat16)
    args = [S((rows, 6, 128), jnp.bfloat16), cache, cache, S((), i32), S((rows, 4), i32),
            S((rows,), i32), S((rows,), i32), S((rows,), i32)]

    def f(qkv, kc, vc, e, bt, lens, page, slot, *cnt):
        return paged_decode_attention_qkv(qkv, kc, vc, e, bt, lens, page, slot, num_splits=2,
                                          counters=cnt[0] if cnt else None)[0]
    return triton_ir(f, *args, *([S((rows, 2), i32)] if counters else []))


def test_decode_kernel_trigger_needs_the_in_kernel_merge():
    from pallas_kernels import decode
    decode.TUNING["pdl"] = 1
    try:
        [ir] = _decode_ir(counters=True)
        with pytest.raises(ValueError, match="1 rows, 2 splits, counters missing"):
            _decode_ir(counters=False)
        with pytest.raises(ValueError, match="2 rows, 2 splits, counters given"):
            _decode_ir(counters=True, rows=2)
    finally:
        decode.TUNING.clear()
    [trig], [wait] = _asm_line(ir, TRIGGER), _asm_line(ir, WAIT)
    loads = _asm_line(ir, "tt.load %")
    assert trig < wait < min(loads), "a read comes before the wait"
    assert_reads_follow_the_wait(ir, loads, wait)  # every read of the kernel
    [plain] = _decode_ir(counters=True)
    assert TRIGGER not in plain and WAIT not in plain


def test_benchmark_pdl_switches():
    from benchmarks.tuning import apply_kernel_tuning
    from ouro_jax import projections
    try:
        t = apply_kernel_tuning("", "", "", "qkv,gate_up")
        assert t["pdl"] == ("qkv", "gate_up")
        assert projections.STREAM_TUNING["qkv"]["pdl"] == "start"
        assert apply_kernel_tuning("", "", "", "o", "end")["pdl"] == ("o",)
        assert projections.STREAM_TUNING["o"]["pdl"] == "end"
        assert "pdl" not in projections.STREAM_TUNING["qkv"]
        with pytest.raises(SystemExit, match="--pdl-at"):
            apply_kernel_tuning("", "", "", "o", "middle")
        apply_kernel_tuning("", "", "", "qkv,gate_up")
        assert "pdl" not in projections.STREAM_TUNING["o"]
        for bad in ("down", "lm_head", "qkv,x"):
            with pytest.raises(SystemExit, match="--pdl"):
                apply_kernel_tuning("", "", "", bad)
        with pytest.raises(SystemExit, match="needs last_combine=1"):
            apply_kernel_tuning("pdl=1", "", "", "")
        assert apply_kernel_tuning("last_combine=1,pdl=1", "")["decode"]["pdl"] == 1
    finally:
        apply_kernel_tuning("", "")
    assert "pdl" not in projections.STREAM_TUNING["qkv"]


def test_stream_gemv_late_trigger_follows_the_last_weight_block():
    """pdl="end": the wait first (before the activations, after the first weight block's
    loads), the trigger after the last block's loads, fed by the first of its tiles, and
    before the stores of that block."""
    x, w = S((1, 1024), jnp.bfloat16), S((256, 1024), jnp.bfloat16)
    tiling = dict(block_n=4, block_k=512, per_program=2, num_warps=4, pdl="end")
    [ir] = triton_ir(lambda x, w: gemv_stream(x, w, **tiling), x, w)
    [trig], [wait] = _asm_line(ir, TRIGGER), _asm_line(ir, WAIT)
    tiles = [i for i, shape in _loads(ir) if len(shape) == 2]
    stores = _asm_line(ir, "tt.store")
    assert tiles[0] < wait < trig < stores[-1]
    lines = ir.splitlines()
    # its operand: the weight loop's first carried tile (the last block's first chunk)
    [loop] = [i for i, line in enumerate(lines) if " = scf.for " in line]
    loop_value = re.match(r"\s*(%\d+):2 = scf.for", lines[loop]).group(1)
    assert f"}} {loop_value}#0 : tensor<4x512xbf16>" in lines[trig], lines[trig]


@pytest.mark.parametrize("argv,msg", [
    (["--pdl", "qkv", "--attention", "xla"], "need --attention pallas"),
    (["--pdl", "o", "--attention", "pallas", "--projections", "gemv"], "need --attention pallas"),
    (["--pdl", "qkv", "--attention", "pallas", "--kv-write", "xla"], "need --attention pallas"),
    (["--decode-kernel", "last_combine=1,pdl=1", "--attention", "pallas", "--batch", "1,8"],
     "needs --batch 1"),
])
def test_the_decode_benchmark_refuses_pdl_off_the_paths_where_a_pallas_kernel_waits(argv, msg):
    from benchmarks.decode import main
    with pytest.raises(SystemExit, match=msg):
        main(argv)
