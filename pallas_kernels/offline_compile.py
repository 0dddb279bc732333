"""Compile the kernels for sm_90 on a machine with no GPU: a pre-flight check that costs no device time.

    pip install --target /tmp/tritonpkg triton      # any recent wheel; it bundles ptxas/cuobjdump
    TRITON_PKG=/tmp/tritonpkg PYTHONPATH=. python -m pallas_kernels.offline_compile [--gemv |
        --gemm | --gemm-few | --stream | --flow | --flow-o | --prologue | --decode-b1 |
        --decode-rows | --stream-rows [--no-evict] | --merge]

JAX (CPU jaxlib) lowers each pallas_call to Triton IR for the 'cuda' platform. Triton (from pip,
which may not be the version inside XLA) then compiles that IR to a cubin. This prints
registers, spills and shared memory per configuration (the gemv_flow kernels' targets are in
offline_compile_flow.py). A failure here is a strong hint that the
device compile will fail; a success is a good but not certain sign that it will pass.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import subprocess
import sys
import tempfile
import threading

import jax
import jax.numpy as jnp
from jax._src.pallas.triton import pallas_call_registration as _reg

_captured: list[str] = []


@contextlib.contextmanager
def sm90_device_info():
    """Lowering for 'cuda' on a machine without a GPU: jax 0.11's Pallas-Triton lowering asks
    the local device for its compute capability and fails on a CPU; inside this context it is
    told an H200's (sm_90). jax 0.10 does not ask, and nothing changes there."""
    lib = getattr(_reg, "gpu_info_lib", None)
    # the devices, not jax.default_backend(): callers may have told the engine it runs on a
    # GPU by patching that (benchmarks.lower_time --platform cuda)
    if lib is None or jax.devices()[0].platform == "gpu":
        yield
        return
    from jax.experimental.pallas import triton as plt
    orig = lib.get_gpu_info
    lib.get_gpu_info = lambda: plt.get_gpu_info_from_version(plt.GpuVersion.H200)
    try:
        yield
    finally:
        lib.get_gpu_info = orig


def lower_for_cuda(fn, *args):
    """jit(fn) traced on `args` (arrays or ShapeDtypeStructs) and lowered for 'cuda' on any
    machine, a CPU one included: runs the Pallas lowering (for Mosaic GPU kernels: layouts,
    transforms, wgmma operand checks) without a GPU. PTX generation happens later, in the
    CUDA plugin, and is not exercised here."""
    from jax._src.pallas.mosaic_gpu import pallas_call_registration  # noqa: F401 - the cuda rule
    with sm90_device_info():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


_orig = _reg.lowering.lower_jaxpr_to_triton_module
_lower_lock = threading.Lock()  # triton_modules patches a jax function while it lowers


def triton_modules(fn, *args) -> list[tuple[str, tuple]]:
    """(Triton IR as text, grid) of every pallas_call in jit(fn)(*args) lowered for 'cuda',
    as Pallas emits them; on a CPU too (sm90_device_info). A fresh function object each
    call, so JAX's lowering caches never skip the pallas_call rule."""
    seen = []

    def hook(*a, **k):
        r = _orig(*a, **k)
        seen.append((r.module.operation.get_asm(enable_debug_info=False), tuple(r.grid)))
        return r
    with _lower_lock:
        _reg.lowering.lower_jaxpr_to_triton_module = hook
        try:
            with sm90_device_info():
                jax.jit(lambda *a: fn(*a)).trace(*args).lower(lowering_platforms=("cuda",))
        finally:
            _reg.lowering.lower_jaxpr_to_triton_module = _orig
    return seen


def _hook(*a, **k):
    r = _orig(*a, **k)
    _captured.append(r.module.operation.get_asm(enable_debug_info=False))
    return r


def sass_counts(cuobjdump: str, cubin: str) -> str:
    """How many block barriers, warp shuffles and shared-memory stores / loads the cubin's
    SASS holds: the prologue's reductions and re-layouts, which counting them compares
    across variants (ncu, session 30: the norm-prologue GEMVs stall on these)."""
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout
    ops = {"BAR.SYNC": r"\bBAR\.SYNC", "SHFL": r"\bSHFL\.", "STS": r"\bSTS\b", "LDS": r"\bLDS\b"}
    return " ".join(f"{name} {len(re.findall(rx, sass))}" for name, rx in ops.items())


def compile_captured(tag, num_warps=4, num_stages=2, counts=False):
    import triton
    from triton.backends.compiler import GPUTarget
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for asm in _captured:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "k.ttir")
            open(path, "w").write(asm)
            try:
                k = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                   options=dict(num_warps=num_warps, num_stages=num_stages))
            except Exception as e:  # noqa: BLE001 - report and go on
                print(f"{tag}: FAILED {type(e).__name__}: {str(e)[:500]}")
                continue
            open(os.path.join(d, "k.cubin"), "wb").write(k.asm["cubin"])
            res = subprocess.run([os.path.join(bindir, "cuobjdump"), "-res-usage",
                                  os.path.join(d, "k.cubin")], capture_output=True, text=True).stdout
            usage = " ".join(w for l in res.splitlines() if "REG" in l for w in l.split()
                             if w.startswith(("REG", "STACK", "LOCAL")))
            extra = (" " + sass_counts(os.path.join(bindir, "cuobjdump"),
                                       os.path.join(d, "k.cubin"))) if counts else ""
            print(f"{tag}: ok {usage} shared {k.metadata.shared} B{extra}")
    _captured.clear()


def check_gemv():
    """The engine's GEMV tilings (ouro_jax.projections) at 1-5 rows, then every
    benchmarks/gemv.py variant on the 1.4B projection shapes at 1 and 8 rows."""
    from benchmarks.gemv import SHAPES, VARIANTS
    from ouro_jax.projections import GEMV_ROW_LIMIT, GEMV_TUNING
    from pallas_kernels.gemv import gemv
    S = jax.ShapeDtypeStruct
    for name, (n, k, gated) in SHAPES.items():
        kw = GEMV_TUNING[name]
        for m in range(1, GEMV_ROW_LIMIT + 1):  # up to the largest gemv@N
            f = jax.jit(functools.partial(gemv, gated=gated, **kw))
            f.trace(S((m, k), jnp.bfloat16), S((n, k), jnp.bfloat16)).lower(
                lowering_platforms=("cuda",))
            compile_captured(f"gemv engine {name} M{m}", num_warps=kw["num_warps"],
                             num_stages=kw["num_stages"])
    from pallas_kernels.gemv import gemv_normed
    for name, (n, k, gated) in SHAPES.items():  # the 'norms' prologues (qkv and gate_up)
        if name not in ("qkv", "gate_up"):
            continue
        kw = GEMV_TUNING[name]
        for branch in (False, True):
            def f(x, nw, w, b=None, bw=None, gated=gated, kw=kw):
                return gemv_normed(x, nw, w, eps=1e-6, branch=b, branch_w=bw, gated=gated, **kw)
            args = [S((1, k), jnp.bfloat16), S((k,), jnp.bfloat16), S((n, k), jnp.bfloat16)]
            if branch:
                args += [S((1, k), jnp.bfloat16), S((k,), jnp.bfloat16)]
            jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
            compile_captured(f"gemv_normed engine {name} branch={branch}",
                             num_warps=kw["num_warps"], num_stages=kw["num_stages"])
    if "--engine-only" in sys.argv:
        return
    for name, (n, k, gated) in SHAPES.items():
        for m in (1, 8):
            for vname, kw in VARIANTS.items():
                if m > 4 and not kw["use_dot"]:
                    continue
                f = jax.jit(functools.partial(gemv, gated=gated, **kw))
                try:
                    f.trace(S((m, k), jnp.bfloat16), S((n, k), jnp.bfloat16)).lower(
                        lowering_platforms=("cuda",))
                except ValueError as e:  # a tiling this shape does not divide
                    print(f"gemv {name} M{m} {vname}: skipped ({e})")
                    continue
                compile_captured(f"gemv {name} M{m} {vname}", num_warps=kw["num_warps"],
                                 num_stages=kw["num_stages"])


def _lower_stream(n: int, k: int, gated: bool, kw: dict, prologue: str, rows: int = 1) -> None:
    """Lowers the streaming GEMV at `rows` rows for an n x k weight (the add_norm prologue,
    or none), which _hook captures for compile_captured."""
    from pallas_kernels.gemv_stream import gemv_stream, gemv_stream_normed
    S = jax.ShapeDtypeStruct

    def f(x, w, b, nw):
        if not prologue:
            return gemv_stream(x, w, gated=gated, **kw)
        return gemv_stream_normed(x, nw, w, eps=1e-6, branch=b, branch_w=nw, gated=gated, **kw)
    jax.jit(f).trace(S((rows, k), jnp.bfloat16), S((n, k), jnp.bfloat16),
                     S((rows, k), jnp.bfloat16), S((k,), jnp.bfloat16)
                     ).lower(lowering_platforms=("cuda",))


def check_stream():
    """Every benchmarks/gemv.py STREAM_VARIANTS tiling of the streaming GEMV on the 1.4B
    projection shapes at one row, plain and with the add_norm prologue (qkv, gate_up)."""
    from benchmarks.gemv import SHAPES, STREAM_VARIANTS
    only = [a.split("=", 1)[1] for a in sys.argv if a.startswith("--only=")]
    for name, (n, k, gated) in SHAPES.items():
        for vname, kw in STREAM_VARIANTS.items():
            if only and vname not in only[0].split(","):
                continue
            for prologue in ("", "add_norm") if name in ("qkv", "gate_up") else ("",):
                try:
                    _lower_stream(n, k, gated, kw, prologue)
                except ValueError as e:  # a tiling this shape does not divide
                    print(f"stream {name} {vname}: skipped ({e})")
                    continue
                compile_captured(f"stream {name} {vname} {prologue or 'plain'}",
                                 num_warps=kw["num_warps"], num_stages=1)


def check_prologue():
    """The engine's qkv and gate/up streaming GEMVs with the add_norm prologue (the 1.4B
    shapes, one row): at 512-wide chunks and 4 warps (shipped until session 30), with
    fold_sums, row2d and both, and with the whole K = 2048 row as one chunk at 4 and 8 warps
    (benchmarks.gemv's fifth round; 8 warps shipped since session 31): registers, and the
    barriers, shuffles and shared-memory traffic in their SASS (sass_counts)."""
    from benchmarks.gemv import SHAPES
    from ouro_jax.projections import STREAM_TUNING
    k512 = {"block_k": 512, "num_warps": 4}  # spelled out: not whatever ships today
    variants = (k512, dict(k512, fold_sums=True), dict(k512, row2d=True),
                dict(k512, fold_sums=True, row2d=True), {"block_k": 2048, "num_warps": 4},
                {"block_k": 2048, "num_warps": 8})
    for name in ("qkv", "gate_up"):
        n, k, gated = SHAPES[name]
        for var in variants:
            kw = dict(STREAM_TUNING[name], **var)
            _lower_stream(n, k, gated, kw, "add_norm")
            tag = "+".join(f"{key}={v}" if key in ("block_k", "num_warps") else key
                           for key, v in var.items())
            tag += " (shipped)" if all(kw[key] == STREAM_TUNING[name].get(key, False)
                                       for key in kw) else ""
            compile_captured(f"prologue {name} {tag}", num_warps=kw["num_warps"],
                             num_stages=1, counts=True)


def check_gemm(few: bool = False):
    """Every benchmarks/gemv.py GEMM_VARIANTS tiling of the skinny GEMM on the 1.4B projection
    shapes at 64 and 192 rows (batch-64 decode and batch-64 k=2 verification). few
    (--gemm-few): the few-row tilings (FEW_ROW_VARIANTS) with their row block fixed, as the
    batch-invariant mode runs them, at 1 and 320 rows (batch-1 decode, batch-64 k=4
    verification)."""
    from benchmarks.gemv import FEW_ROW_VARIANTS, GEMM_VARIANTS, SHAPES
    from pallas_kernels.gemm import check_supported, gemm
    S = jax.ShapeDtypeStruct
    variants = {v: GEMM_VARIANTS[v] for v in FEW_ROW_VARIANTS} if few else GEMM_VARIANTS
    for name, (n, k, gated) in SHAPES.items():
        for m in ((1, 320) if few else (64, 192)):
            for vname, kw in variants.items():
                try:
                    check_supported(m, k, n // 2 if gated else n, block_m=kw["block_m"],
                                    block_n=kw["block_n"], block_k=kw["block_k"],
                                    k_splits=kw.get("k_splits", 1))
                except ValueError as e:
                    print(f"gemm {name} M{m} {vname}: skipped ({e})")
                    continue
                f = jax.jit(functools.partial(gemm, gated=gated, fixed_rows=few, **kw))
                f.trace(S((m, k), jnp.bfloat16), S((n, k), jnp.bfloat16)).lower(
                    lowering_platforms=("cuda",))
                compile_captured(f"gemm {name} M{m} {vname}", num_warps=kw["num_warps"],
                                 num_stages=kw["num_stages"])


def main():
    if os.environ.get("TRITON_PKG"):
        sys.path.insert(0, os.environ["TRITON_PKG"])
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    _reg.lowering.lower_jaxpr_to_triton_module = _hook
    with sm90_device_info():
        return _main()


# Batch-1 decode attention tilings for the engine's fused-write kernel (--decode-b1): the
# default (32-key blocks, the splits choose_num_splits picks, an XLA combine after), and one
# program per KV head reading the whole context in one or two tiles (no splits, no combine;
# session 31's lead: a one-split kernel with 32-key blocks read its keys in series).
DECODE_B1_TILINGS = (dict(), dict(num_splits=1, block_t=256, num_warps=4, num_stages=1),
                     dict(num_splits=1, block_t=256, num_warps=8, num_stages=1),
                     dict(num_splits=1, block_t=128, num_warps=4, num_stages=2),
                     dict(num_splits=1, block_t=128, num_warps=8, num_stages=2))


def check_decode_b1():
    """paged_decode_attention_qkv at batch 1 and the 1.4B shapes (16 KV heads of 128, bf16,
    RoPE, the fused K/V write), a block table of 13 pages of 16 keys (about the benchmark's
    128 + 64; the engine's own grid had 5 splits in session 30's profile, 16 x 5 programs),
    per DECODE_B1_TILINGS: registers and shared memory."""
    from pallas_kernels import paged_decode_attention_qkv
    from pallas_kernels.decode import key_tiling
    S, i32, bf = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    kc = S((8, 64, 16, 16, 128), bf)
    for kw in DECODE_B1_TILINGS:
        def fq(qkv, kc_, vc_, e, bt, ln, pg, sl, cs, sn, kw=kw):
            return paged_decode_attention_qkv(qkv, kc_, vc_, e, bt, ln, pg, sl,
                                              rope=(cs, sn), **kw)
        jax.jit(fq).trace(S((1, 48, 128), bf), kc, kc, S((), i32), S((1, 13), i32),
                          S((1,), i32), S((1,), i32), S((1,), i32), S((1, 128), bf),
                          S((1, 128), bf)).lower(lowering_platforms=("cuda",))
        bt, ns, _ = key_tiling(1, 16, 1, bf, 13 * 16, True, block_t=kw.get("block_t"),
                               num_splits=kw.get("num_splits"))
        compile_captured(f"decode b1 block_t {bt} splits {ns} warps {kw.get('num_warps', 4)}",
                         num_warps=kw.get("num_warps", 4), num_stages=kw.get("num_stages", 2))


# The o projection with the decode attention's split merge as its prologue (--merge,
# gemv_merge): the engine's o tiling, then fewer programs (each merges the whole row from
# L2: S x K fp32 partials per program) and the one-chunk row.
MERGE_TILINGS = (dict(block_n=2, block_k=512, per_program=2, num_warps=4),
                 dict(block_n=4, block_k=512, per_program=2, num_warps=4),
                 dict(block_n=4, block_k=512, per_program=4, num_warps=4),
                 dict(block_n=2, block_k=2048, per_program=2, num_warps=8))


def check_merge():
    """gemv_merge.gemv_stream_merged at one row on the 1.4B o shape (16 KV heads of 128, 5
    splits as the engine's batch-1 decode runs them), per MERGE_TILINGS."""
    from pallas_kernels.gemv_merge import gemv_stream_merged
    S = jax.ShapeDtypeStruct
    for kw in MERGE_TILINGS:
        jax.jit(lambda p, l, w, kw=kw: gemv_stream_merged(p, l, w, dtype=jnp.bfloat16, **kw)
                ).trace(S((1, 16, 5, 1, 128), jnp.float32), S((1, 16, 5, 1), jnp.float32),
                        S((2048, 2048), jnp.bfloat16)).lower(lowering_platforms=("cuda",))
        compile_captured("merge o " + "_".join(f"{k}{v}" for k, v in kw.items()),
                         num_warps=kw["num_warps"], num_stages=1)


def _main():
    if "--merge" in sys.argv:
        return check_merge()
    if "--stream-rows" in sys.argv or "--decode-rows" in sys.argv:
        from pallas_kernels import offline_compile_rows as rows
        return (rows.check_stream_rows() if "--stream-rows" in sys.argv
                else rows.check_decode_rows())
    if "--decode-b1" in sys.argv:
        return check_decode_b1()
    if "--gemv" in sys.argv:
        return check_gemv()
    if "--gemm" in sys.argv or "--gemm-few" in sys.argv:
        return check_gemm(few="--gemm-few" in sys.argv)
    if "--stream" in sys.argv:
        return check_stream()
    if "--flow" in sys.argv or "--flow-o" in sys.argv:
        from pallas_kernels import offline_compile_flow
        return (offline_compile_flow.check_flow_o() if "--flow-o" in sys.argv
                else offline_compile_flow.check_flow())
    if "--prologue" in sys.argv:
        return check_prologue()
    from pallas_kernels import (paged_decode_attention, paged_decode_attention_qkv,
                                ragged_paged_attention)
    from pallas_kernels.decode import default_num_warps
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    pages = 40000  # > 4 GiB cache in fp32: exercises 64-bit offsets
    for dt in (jnp.bfloat16, jnp.float32):
        for kvh, g in ((16, 1), (4, 4)):
            kc = S((2, pages, 16, kvh, 128), dt)
            for kw in (dict(), dict(use_dot=False), dict(num_stages=3)):
                f = jax.jit(functools.partial(paged_decode_attention, **kw))
                f.trace(S((8, kvh * g, 128), dt), kc, kc, S((), i32), S((8, 256), i32),
                        S((8,), i32)).lower(lowering_platforms=("cuda",))
                # (8 rows: the warps the engine would compile them with)
                compile_captured(f"decode {jnp.dtype(dt).name} kvh{kvh} g{g} {kw}",
                                 num_warps=default_num_warps(8, dt, kw.get("use_dot", True)),
                                 num_stages=kw.get("num_stages", 2))
            # the fused RoPE + K/V write (paged_decode_attention_qkv; aliased caches)
            for rope in (False, True):
                def fq(qkv, kc_, vc_, e, bt, ln, pg, sl, cs, sn, rope=rope):
                    return paged_decode_attention_qkv(qkv, kc_, vc_, e, bt, ln, pg, sl,
                                                      rope=(cs, sn) if rope else None)
                jax.jit(fq).trace(S((8, kvh * (g + 2), 128), dt), kc, kc, S((), i32),
                                  S((8, 256), i32), S((8,), i32), S((8,), i32), S((8,), i32),
                                  S((8, 128), dt), S((8, 128), dt)).lower(
                    lowering_platforms=("cuda",))
                compile_captured(f"decode {jnp.dtype(dt).name} kvh{kvh} g{g} qkv rope={rope}",
                                 num_warps=default_num_warps(8, dt, True))
            # the same with the splits merged in the kernel (counters: atomics, CTA barriers)
            def fc(qkv, kc_, vc_, e, bt, ln, pg, sl, cs, sn, cnt):
                return paged_decode_attention_qkv(qkv, kc_, vc_, e, bt, ln, pg, sl,
                                                  rope=(cs, sn), counters=cnt)
            jax.jit(fc).trace(S((8, kvh * (g + 2), 128), dt), kc, kc, S((), i32),
                              S((8, 256), i32), S((8,), i32), S((8,), i32), S((8,), i32),
                              S((8, 128), dt), S((8, 128), dt), S((8, kvh), i32)).lower(
                lowering_platforms=("cuda",))
            compile_captured(f"decode {jnp.dtype(dt).name} kvh{kvh} g{g} qkv last_combine",
                             num_warps=default_num_warps(8, dt, True))
            for n in (40, 512):
                f = jax.jit(ragged_paged_attention)
                f.trace(S((n, kvh * g, 128), dt), kc, kc, S((), i32), S((8, 256), i32),
                        S((8,), i32), S((9,), i32)).lower(lowering_platforms=("cuda",))
                nw = 8 if n // 8 > 16 else 4  # mirrors the default (M = 64 rows -> 8 warps)
                compile_captured(f"ragged {jnp.dtype(dt).name} kvh{kvh} g{g} N{n}", num_warps=nw)


if __name__ == "__main__":
    # run as the imported module, not __main__: offline_compile_flow's targets reach the
    # capture list and compile through `pallas_kernels.offline_compile`, which `python -m`
    # would otherwise load a second time with a list of its own
    from pallas_kernels import offline_compile
    offline_compile.main()
