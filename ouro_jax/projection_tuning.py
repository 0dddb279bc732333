"""The projection kernels' tilings and row limits, and the functions that fit a tiling to a
model's shapes (ouro_jax.projections routes the calls; benchmarks.tuning overrides these
tables per run, in place, so the dicts here are the ones the engine reads)."""

from __future__ import annotations

NAMES = ("qkv", "o", "gate_up", "down")

# Per projection, the GEMV tiling measured fastest at one row on the H200 among those whose
# per-row accumulators also fit 5 rows in registers (benchmarks/results/gemv_session4*_h200.*).
# One tiling per projection for every row count: a row's result then does not depend on how
# many rows share the call ('gemv@5': decode's 1 row and batch-1 verification's k+1 rows get
# bit-identical projections). Bit-identical speculation in bf16 would also need decode and
# verification to share an attention kernel: with Pallas attention they do not (decode vs
# ragged kernel), and on the H200 'gemv@5' matched greedy decode no better than 'gemv'.
# With '+stream' one-row calls take the streaming kernel and 2..N-row calls this one, so that
# identity does not hold there.
GEMV_TUNING = {
    "qkv": dict(use_dot=False, block_n=16, block_k=256, num_warps=8, num_stages=1),
    "o": dict(use_dot=False, block_n=2, block_k=2048, num_warps=4, num_stages=1),
    "gate_up": dict(use_dot=False, block_n=4, block_k=256, num_warps=2, num_stages=1),
    "down": dict(use_dot=False, block_n=4, block_k=512, num_warps=4, num_stages=1),
}
# '+stream': the streaming GEMV (pallas_kernels/gemv_stream.py) for one-row calls. Per
# projection the tiling fastest at one row in the first H200 sweep
# (benchmarks/results/gemv_stream_session7_h200.json), which the end-to-end figures ran
# (batch-1 native 231.9 tok/s with '+norms'). The second sweep
# (gpu_session7_call2_output.log) timed one block per program (st1_k512_p1_w4) 0.2-0.5 us
# faster for qkv, o and gate/up alone; not yet measured end to end (--stream-tiling).
# qkv and gate/up run with the add_norm prologue in the engine, which that sweep left out;
# with it (session 9, gemv_stream_add_norm_session9_h200.json) the fastest were qkv
# st4_k512_p4_w4 (11.41 vs 12.00 us) and gate/up st2_k512_p8_w4 (17.05 vs 17.33), and
# batch-1 native went from 232.7 to 239.2 tok/s with both (ab_b1_*_session9_h200.json).
# Session 31: qkv and gate/up read the whole K = 2048 row as one chunk at 8 warps (the same
# programs and blocks per program): the norm prologue converts x to the weight tile's layout
# and reduces each statistic once instead of once per 512-wide chunk (SASS barriers 41 -> 15
# for qkv, offline), and at ~72 registers twice the warps fit an SM. Batch-1 native greedy
# on an H100, two calls: +0.6 / +1.0% (ab_b1_fold_row2d_session30_h100.json) and +1.4 /
# +0.9 / +2.0% over three passes (ab_b1_k2048w8_session31_h100.json), the same tokens as
# the 512-wide tiling (digest 3961d77b) and greedy k=4 speculative tokens equal native ones
# at batch 1 (decode_w8_spec_session31_h100.json). Not yet measured on an H200; the old
# tiling is --stream-tiling qkv=st4_k512_p4_w4,gate_up=st2_k512_p8_w4.
# Session 34: every projection's weight loads carry L2's evict-first policy (gemv_stream
# evict_first): each weight byte is read once per loop, so its lines should not push out
# the small arrays every layer reads again. Batch-1 native greedy on two H100s: +0.9%
# (208.3 / 209.0 against 205.9 / 207.1 tok/s, ab_b1_evict_lc_session34_h100.json) and
# +1.3% (207.8 / 207.7 against 205.0 / 205.3, ab_b1_evict2_session34_h100.json), the
# same tokens (digest 3961d77b); the JAX GEMV chain 50.7 against 52.5 / 52.7 us per layer
# application (side_prefetch_ffi_session34_h100.json). Not yet measured on an H200;
# --stream-set qkv.evict_first=0,... turns it off, and a --stream-tiling override keeps it.
STREAM_TUNING = {
    "qkv": dict(block_n=4, block_k=2048, per_program=4, num_warps=8, evict_first=True),
    "o": dict(block_n=2, block_k=512, per_program=2, num_warps=4, evict_first=True),
    "gate_up": dict(block_n=2, block_k=2048, per_program=8, num_warps=8, evict_first=True),
    "down": dict(block_n=1, block_k=512, per_program=4, num_warps=4, evict_first=True),
}
# Calls the streaming kernel takes: one row (decode, draft), the only count measured on a GPU;
# the kernel itself takes up to gemv_stream.MAX_ROWS (down needs 255 registers at 4 rows).
STREAM_MAX_ROWS = 1
# Calls with more rows go to XLA. Default 1: at 5 rows the kernel is 3-5x slower than XLA
# (qkv 37.4 vs 7.8 us, gemv_engine_session4_h200.json), which took batch-1 speculative k=4
# from ~230 to 209.8 tok/s (decode_session4_greedy_h200.json).
GEMV_MAX_ROWS = 1
# 'gemv@N' takes N up to 5: the tilings above were compiled (offline_compile) and measured
# for 1-5 rows; gate/up uses 254 registers per thread at 5 rows, more would spill.
GEMV_ROW_LIMIT = 5


# The skinny GEMM (pallas_kernels/gemm.py) for calls of 2..GEMM_MAX_ROWS rows ('gemm' in the
# spec): per projection the tiling fastest at 64 rows on the H200 among 12
# (benchmarks/results/gemm_session5_h200.json; only o_proj beats XLA there). The end-to-end
# A/B (ab_proj_gemv_gemm_b8_64_h200.json) ran with earlier first guesses for qkv and gate/up.
GEMM_TUNING = {
    "qkv": dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4),
    "o": dict(block_m=64, block_n=16, block_k=256, num_warps=4, num_stages=4),
    "gate_up": dict(block_m=64, block_n=64, block_k=128, num_warps=8, num_stages=4),
    "down": dict(block_m=64, block_n=16, block_k=256, num_warps=4, num_stages=4),
}
GEMM_MAX_ROWS = 64
GEMM_ROW_LIMIT = 512  # without split-K the kernel turns compute-bound well before this

# '+mgpu[:NAME,...]': one-row calls of those projections (default all four) through the Mosaic
# GPU GEMV (pallas_kernels/gemv_mgpu_normed.py: TMA ring of weight tiles, wgmma; qkv and
# gate/up with the norm prologue, o and down plain), jax >= 0.11; with '+stream' the others
# keep the streaming kernel. (block_n, block_k, k_splits, stages, overlap) per projection: the
# fastest by device time on the H200 (benchmarks/results/gemv_mgpu_device_session13_h200.json,
# us per call including split-K's XLA sum, against the streaming GEMV): qkv 9.94 (9.69),
# o 5.29 (4.85), gate/up 19.08 (15.57); down 10.22 (8.51) at 8 splits, bit-identical to XLA
# there, against 10.21 at bn64 bk128 with 4 splits. The kernel wins nowhere yet:
# batch-1 native decode ran 177.7 tok/s with all four on it and 220 with down alone, against
# 240 for 'auto' (ab2_b1_*_session13_h200.json). benchmarks.decode --mgpu-tiling overrides
# these per run.
MGPU_TUNING = {
    "qkv": (64, 256, 1, 4, False),
    "o": (64, 256, 4, 2, False),
    "gate_up": (64, 128, 1, 4, False),
    "down": (64, 64, 8, 4, False),
}


def mgpu_available() -> bool:
    """Whether this jax has the Mosaic GPU Pallas API the '+mgpu' kernels use (jax >= 0.11;
    jax 0.10.2 lacks GPU interpret mode and fails to import the module without absl)."""
    try:
        import jax.experimental.pallas.mosaic_gpu as plgpu
        return hasattr(plgpu, "InterpretGPUParams") and hasattr(plgpu, "kernel")
    except ImportError:
        return False


def fit_mgpu_tuning(name: str, tuning: tuple, n_out: int, k: int, dtype, normed: bool) -> dict:
    """The Mosaic GEMV tiling for one projection call, shrunk to fit a small model (block_n
    to 64, k_splits to a divisor leaving multiples of 64, block_k by halving to >= 64); a
    shape the kernel cannot take at all is an error naming the projection."""
    import jax.numpy as jnp
    from pallas_kernels.gemv import pow2_divisor
    bn, bk, ks, st, ov = tuning
    why = None
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        why = f"runs bf16 or fp16 weights, not {jnp.dtype(dtype)}"
    elif n_out % 64:
        why = f"needs {n_out} output features to be a multiple of 64"
    elif k % (256 if normed else 64):
        why = f"needs K={k} to be a multiple of {256 if normed else 64}"
    if why:
        raise ValueError(f"projections '+mgpu' ({name}): the Mosaic GPU GEMV {why}")
    bn = bn if n_out % bn == 0 else 64
    ks = max(d for d in range(1, ks + 1) if k % (d * 64) == 0)
    bk = pow2_divisor(k // ks, bk, floor=64) or 64
    return dict(block_n=bn, block_k=bk, k_splits=ks, stages=st, overlap=ov)


def fit_gemm_tuning(tuning: dict, n_out: int, k: int) -> dict:
    """GEMM tiling shrunk (by halving, not below 16) to divide a small test model's shape."""
    from pallas_kernels.gemv import pow2_divisor
    out = dict(tuning)
    out["block_n"] = pow2_divisor(n_out, tuning["block_n"], floor=16) or tuning["block_n"]
    out["block_k"] = pow2_divisor(k, tuning["block_k"], floor=16) or tuning["block_k"]
    if tuning.get("k_splits", 1) > 1:
        # the most splits, up to the tiling's, that divide K's blocks; where K is one block,
        # smaller blocks (not below 16), so that a small test model still runs split-K
        def splits(bk):
            return max(d for d in range(1, tuning["k_splits"] + 1) if (k // bk) % d == 0)
        while (splits(out["block_k"]) == 1 and out["block_k"] >= 32
               and k % (out["block_k"] // 2) == 0):
            out["block_k"] //= 2
        out["k_splits"] = splits(out["block_k"])
    return out


def fit_stream_tuning(tuning: dict, n_out: int, k: int) -> dict:
    """The streaming GEMV's tiling shrunk to divide a small test model's shape: block sizes by
    halving, per_program to the largest divisor of the block count not above it."""
    from pallas_kernels.gemv import pow2_divisor
    out = dict(tuning)
    out["block_n"] = pow2_divisor(n_out, tuning["block_n"])
    out["block_k"] = pow2_divisor(k, tuning["block_k"])
    blocks = n_out // out["block_n"]
    out["per_program"] = max(d for d in range(1, tuning["per_program"] + 1) if blocks % d == 0)
    if out.get("depth", 1) > out["per_program"]:  # (blocks in flight: at most the program's)
        out["depth"] = out["per_program"]
    return out


def fit_tuning(tuning: dict, n_out: int, k: int) -> dict:
    """The tuning with block sizes shrunk (by halving) until they divide this shape: the
    measured tilings are for the 1.4B/2.6B shapes; small test models get smaller tiles."""
    from pallas_kernels.gemv import pow2_divisor
    out = dict(tuning)
    out["block_n"] = pow2_divisor(n_out, tuning["block_n"])
    out["block_k"] = pow2_divisor(k, tuning["block_k"])
    if out["use_dot"] and out["block_n"] < 16:
        out["use_dot"] = False
    return out


# '+inv' (projections.PallasGemv.inv_rows): the rows its calls have by default (native and
# draft decode at batch 2 to 64; the verification of batch 1 to 12 at k=4)
INV_ROWS = (2, 64)
