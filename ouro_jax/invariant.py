"""Batch-invariant kernels (`Ouro(batch_invariant=True)`, the CLI's `--batch-invariant`):
every row's arithmetic is the same whatever else shares the call.

Why: greedy speculative decoding is exact in exact arithmetic, but in bf16 its verification
runs k+1 positions per sequence through kernels that native decode runs with one, and the
GPU kernels pick other tilings, split-K and instructions for other row counts. The rounding
then differs, and near-tied argmaxes flip: on the H200 only 4 of 8, 21-22 of 32 and 40-44 of
64 sequences came out identical to native greedy (docs/performance.md). The same effect makes
a request's tokens depend on the batch it shares. In this mode:

- every projection (qkv, o, gate/up, down) and the LM head go through the skinny Pallas GEMM
  (pallas_kernels.gemm) with fixed K steps per weight: a row's dot products then run the
  same K blocks in the same order; where a tiling splits K, the fp32 partials are added left
  to right (gemm.sum_splits, or for o and down inside the next add_norm kernel), also the
  same order at any row count. The tile's rows and columns may change with the call's row
  count (ROUTES, below: 16-row tiles for one row, session 40's 64-row tiles up to 64 rows,
  wider ones above). That those tile shapes (mma.sync for 16-row tiles, wgmma from 64) give
  the same bits is measured, not documented: 0 differing elements at 384, 320, 64, 5 and 1
  rows, at the 1.4B shapes, on one H100 with jax 0.11.2 (session 42); not probed on an
  H200 or another card. tests/test_invariant.py::test_gpu_routes_keep_the_bits rechecks it
  on the GPU the tests run on; no check runs at serving time;
- attention, decode (one query) included, goes through the ragged paged kernel with one
  split and a fixed query tile (pallas_kernels.ragged): a query's keys are read in the same
  blocks in the same order whether 1 or k+1 queries of its sequence share the tile, and
  the keys a tile masks for that query add exact zeros; RoPE and the K/V write before it
  run in one kernel, one token per program (pallas_kernels.rope_kv);
- the RMSNorms and the sandwich layer's residual adds run in one kernel per norm pair, one
  row per program (pallas_kernels.add_norm): a row's sum of squares then runs the same
  code at any row count. The other sums XLA would reduce (the exit gate's logit, the
  log-probs' log-sum-exp) add halves elementwise in a fixed order (row_sum): a reduction's
  tree, like a dot's algorithm, is the compiler's choice and may follow the shape;
- maxima and argmaxes are exact in any order, and the elementwise rest runs with
  xla_allow_excess_precision off (ouro_jax.programs), so XLA keeps every bf16 rounding the
  HLO asks for wherever it puts its fusion boundaries. Assumed, not forced: that XLA
  contracts a*b + c into one FMA alike in the decode and the verification program (its
  elementwise chains fuse whatever the shape).

Tested in interpret mode on the CPU and compiled on an H100 (tests/test_invariant.py; at
the 1.4B shape greedy k=4 output equalled native's in every sequence at batch 1, 8, 32 and
64: benchmarks/results/decode_invariant*_session38_h100.json). Not covered: sampling at
temperature > 0 still sums top-p's softmax and speculative sampling's log-softmaxes with
XLA's reductions. It costs throughput (no one-row GEMVs, no fused decode kernel): it is
opt-in. On an H100, session 42 (decode_inv_shipped_session42_h100.json): native 175.9 /
7,117.8 tok/s at batch 1 / 64, k=4 d=2 240.7 / 6,879.2; the default on the same card
210.2 native and 274.8 at k=4 at batch 1 (decode_direct1_b1_session42_h100.json). Output
is not approximated: it is the same model in another summation order, as bf16 is anyway.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ouro_jax import trace_once
from ouro_jax.projection_tuning import GEMM_TUNING, fit_gemm_tuning
from ouro_jax.projections import XLA, Residual

# The mode's GEMM tiling per weight, for calls of more rows than every route of ROUTES (below).
# Any one tiling per weight keeps the guarantee (a row's arithmetic then never depends on
# the row count); the speed is what differs. Process-wide, so benchmarks.decode
# --invariant-tiling can try others before anything compiles. Session 40's tilings follow;
# session 42 (below) widened qkv's, o's, gate/up's and down's for many rows and kept these
# as the routes up to 64 rows.
# o and down: 64-row blocks, 64 columns, K split in four (more programs for one-row calls).
# The pick of session 40's sweep at 1 and 320 rows on an H100, after the kernel masked the
# ragged row block (gemm_masked_*_session40_h100): o 5.18 / 22.45 us, down 10.12 / 34.67,
# against session 39's 16-row split-K 4.93 / 31.82 and 10.06 / 59.97 and XLA 3.14 / 13.85,
# 9.08 / 28.71. End to end, batch-1 native 140.4 tok/s (142.6 with the 16-row tiles) and
# batch 64 5,355.8 (decode_masked_{pick,shipped}_b*_session40_h100.json; session 39, rows
# clamped: 105.4 and 4,908.4). qkv and gate/up keep GEMM_TUNING's 64-row tiles, which the
# same pick kept, and the LM head takes qkv's 64 x 64 tile, the widest projection measured
# (gemm_session5_*; session 42 left the head as it was: not swept at 320 rows).
_SPLIT_K = dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4, k_splits=4)
TUNING = {"qkv": dict(GEMM_TUNING["qkv"]), "o": dict(_SPLIT_K),
          "gate_up": dict(GEMM_TUNING["gate_up"]), "down": dict(_SPLIT_K),
          "head": dict(GEMM_TUNING["qkv"])}
NAMES = ("qkv", "o", "gate_up", "down", "head")
# Row-count routes: ROUTES[name] is a tuple of (max_rows, tile) tried in order, where a tile
# sets only ROUTE_KEYS; a call with more rows than every route takes TUNING[name] as it is.
# The K blocks, the K split and the order the partials are added (block_k, k_splits) stay
# TUNING's, so a row's dot products run the same K steps in the same order on any route;
# the tile's rows and columns, warps and pipeline depth only say which program computes
# them and with which tensor-core instruction shape. That those give the same bits (mma.sync
# for 16-row tiles, wgmma from 64, any N) is measured, not documented:
# benchmarks.gemm_tiling_bits and the `gpu` test tests/test_invariant.py::
# test_gpu_routes_keep_the_bits compare every routed tile against TUNING's on a GPU.
ROUTE_KEYS = ("block_m", "block_n", "num_warps", "num_stages")
ROUTES: dict[str, tuple] = {name: () for name in NAMES}


def _tile(block_m, block_n, num_warps, num_stages) -> dict:
    return dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)


# Session 42 (one H100, benchmarks/results/README.md "Session 42"): one-row calls take 16-row
# tiles, calls of up to 64 rows (native and draft decode to batch 64) keep session 40's
# tiles, and more rows (the batch-64 verification's 320, prefill) take wider ones. Every
# tile here gave the old tiles' bits in every element at 384, 320, 64, 5 and 1 rows (the
# bits probe in gpu_session42_call_h100.txt). Per call, us (the sweep there; "invariant" =
# session 40's tiling as the mode ran it, shipped -> session 42's): at 320 rows qkv 49.12 ->
# 33.69, gate/up 85.48 -> 60.38, o 39.93 -> 32.44, down 53.28 -> 44.12; at one row 15.63 ->
# 15.45, 27.59 -> 25.35, 15.55 -> 8.31, 21.91 -> 14.21. (The same tile timed twice in that
# sweep differed by up to 16%: down's session-40 tile 53.28 as "invariant", 45.76 as its
# own variant: down's gain at 320 rows is within that.) Without the 64-row band (the wide
# tiles at 64 rows too) batch-64 native fell from 6,445.1 to 6,039.2 tok/s. End to end,
# with the ragged kernel's direct store, against neither: batch 1 native 175.9 tok/s
# against 165.8, k=4 240.7 against 229.2; batch 64 native 7,117.8 against 6,445.1, k=4
# 6,879.2 against 5,996.0
# (decode_inv_shipped_session42_h100.json, decode_direct0_inv_b1_p{1,4}_session42_h100.json,
# decode_inv_noroutes_session42_h100.json).
_ONE_ROW = {"qkv": _tile(16, 32, 4, 4), "o": _tile(16, 64, 4, 4),
            "gate_up": _tile(16, 32, 4, 4), "down": _tile(16, 64, 4, 4)}
_MANY_ROWS = {"qkv": _tile(64, 128, 4, 4), "o": _tile(128, 64, 8, 3),
              "gate_up": _tile(128, 64, 8, 3), "down": _tile(64, 128, 4, 4)}
for _name, _wide in _MANY_ROWS.items():  # (up to 64 rows: session 40's tile, as it was)
    ROUTES[_name] = ((1, _ONE_ROW[_name]),
                     (64, {k: TUNING[_name][k] for k in ROUTE_KEYS}))
    TUNING[_name] = dict(TUNING[_name], **_wide)
del _name, _wide


def tiling_for(name: str, rows: int) -> dict:
    """The GEMM tiling the mode runs for weight `name` on a call of `rows` rows (static)."""
    routes = ROUTES.get(name, ())
    bounds = [max_rows for max_rows, _ in routes]
    if bounds != sorted(set(bounds)) or any(set(t) - set(ROUTE_KEYS) for _, t in routes):
        raise ValueError(f"invariant.ROUTES[{name!r}]: routes are (max_rows, tile) in "
                         f"increasing max_rows, a tile setting only {ROUTE_KEYS}; got {routes}")
    for max_rows, tile in routes:
        if rows <= max_rows:
            return {**TUNING[name], **tile}
    return dict(TUNING[name])


# The GEMM's smallest tile side (pallas_kernels.gemm.check_supported): every projection's
# dims must be multiples of it
TILE = 16
OPTION = "invariant"  # the engine's backend option (ouro_jax.engine.forward_block)


def applies(backend: str) -> bool:
    """Whether an engine backend string ('pallas+invariant', 'pallas+kvxla+invariant') asks
    for this mode."""
    return OPTION in backend.split("+")


def head_for(backend: str):
    """The LM head a program with this backend string uses."""
    from ouro_jax.model import lm_head
    return Invariant.head if applies(backend) else lm_head


def logprobs_for(backend: str):
    """The token log-prob function a program with this backend string uses."""
    from ouro_jax.sampling import token_logprobs
    return invariant_token_logprobs if applies(backend) else token_logprobs


def row_sum(x: jax.Array) -> jax.Array:
    """Sum over the last axis in one fixed order: zero-padded to a power of two, then halves
    added elementwise until one column is left. Elementwise adds are not reassociated, so
    each row's bits depend on that row alone, unlike a reduction whose tree the compiler
    may choose by shape."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def invariant_token_logprobs(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """sampling.token_logprobs with the log-sum-exp's sum in row_sum's order (the max is
    exact in any order)."""
    x = logits.astype(jnp.float32)
    m = jnp.max(x, axis=-1)
    lse = m + jnp.log(row_sum(jnp.exp(x - m[..., None])))
    return jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - lse


# The projections whose output only feeds a residual branch (Residual.branch): with split-K
# their fp32 partials go to the next add_norm kernel unsummed, which adds them in gemm's order
# (one XLA kernel fewer per projection).
BRANCHES = ("o", "down")


def _gemm(x, w, name: str, gated: bool = False, partials: bool = False):
    from pallas_kernels.gemm import gemm
    n_out = w.shape[0] // 2 if gated else w.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    # (fit_gemm_tuning shrinks block_k and k_splits from TUNING's alone, so every route of
    # a weight keeps the same K steps on a small model too)
    tuning = fit_gemm_tuning(tiling_for(name, x2.shape[0]), n_out, x.shape[-1])
    y = trace_once.call(gemm, x2, w, gated=gated,
                        interpret=jax.default_backend() != "gpu", fixed_rows=True,
                        partials=partials, **tuning)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _add_norm(x, norm_w, eps, branch=None, branch_w=None):
    """pallas_kernels.add_norm over any leading shape: (h, rms_norm(h, norm_w) or None)."""
    from pallas_kernels.add_norm import add_norm
    lead, k = x.shape[:-1], x.shape[-1]
    b = None if branch is None else branch.reshape(-1, branch.shape[-1])
    h, y = trace_once.call(add_norm, x.reshape(-1, k), norm_w, eps=eps, branch=b,
                           branch_w=branch_w, interpret=jax.default_backend() != "gpu")
    return h.reshape(*lead, k), (None if y is None else y.reshape(*lead, k))


@dataclasses.dataclass(frozen=True)
class Invariant(XLA):
    """Projections whose rows do not depend on each other (see the module docstring). The
    sandwich layer's residual adds are deferred (residual() gives a Residual) and done with
    the next norm in one add_norm kernel, as the default's GEMV prologues do."""

    def project(self, name, x, w, next_weight=None):
        # (no SplitAttn reaches here: the mode runs no fused decode kernel to defer a merge)
        return _gemm(x, w, name, partials=name in BRANCHES)

    def gated(self, x, w, next_weight=None):
        return _gemm(x, w, "gate_up", gated=True)

    def norm(self, x, w, eps):
        """model.rms_norm, one row per program (pallas_kernels.add_norm)."""
        return _add_norm(x, w, eps)[1]

    def materialize(self, x, eps):
        if isinstance(x, Residual):
            return _add_norm(x.resid, None, eps, x.branch, x.weight)[0]
        return super().materialize(x, eps)

    def normed(self, name, x, norm_w, w, eps, gated=False, next_weight=None):
        if isinstance(x, Residual):
            h, hx = _add_norm(x.resid, norm_w, eps, x.branch, x.weight)
        else:
            h = super().materialize(x, eps)
            hx = _add_norm(h, norm_w, eps)[1]
        return (self.gated(hx, w) if gated else self.project(name, hx, w)), h

    def residual(self, h, m, w, eps):
        return Residual(h, m, w)

    def final_norm(self, x, w, eps):
        """The last layer's residual add and the loop's norm in one add_norm."""
        if isinstance(x, Residual):
            return _add_norm(x.resid, w, eps, x.branch, x.weight)[1]
        return self.norm(super().materialize(x, eps), w, eps)

    @staticmethod
    def gate_logit(params, h):
        """model.exit_gate_logit with its sum by row_sum rather than a dot."""
        from ouro_jax.model import exit_gate_logit
        return exit_gate_logit(params, h, sum_rows=row_sum)

    @staticmethod
    def head(params, h):
        """The LM head through the GEMM; a vocabulary that is not a multiple of the tile is
        padded with zero rows for the call and the padding sliced off (small test models:
        real checkpoints' vocabularies are multiples of 16, so no copy)."""
        w = params.lm_head.astype(h.dtype)
        v = w.shape[0]
        if v % TILE:
            w = jnp.pad(w, ((0, TILE - v % TILE), (0, 0)))
        return _gemm(h, w, "head")[..., :v]


def check_model(cfg) -> None:
    """Raises, before anything is built, for a model whose projections the GEMM cannot tile."""
    hd = cfg.head_dim
    dims = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads * head_dim": cfg.num_attention_heads * hd,
            "num_key_value_heads * head_dim": cfg.num_key_value_heads * hd}
    bad = {k: v for k, v in dims.items() if v % TILE}
    if bad:
        raise ValueError(f"batch_invariant runs every projection through the Pallas GEMM, "
                         f"whose tiles need multiples of {TILE}: "
                         + ", ".join(f"{k} = {v}" for k, v in bad.items()))
    if hd & (hd - 1):  # (the attention kernels' blocks span head_dim: Triton's are powers of 2)
        raise ValueError(f"batch_invariant runs Pallas attention kernels whose blocks span "
                         f"head_dim, which must be a power of two; got head_dim = {hd}")


def ragged_tuning(cfg) -> dict:
    """The ragged attention's fixed tuning: one split, and a query tile of 16 rows of M
    (block_q * the padded GQA group), the tile its own default picks for short queries."""
    from pallas_kernels._common import next_pow2
    group_pad = next_pow2(cfg.num_attention_heads // cfg.num_key_value_heads)
    return dict(num_splits=1, block_q=max(1, 16 // group_pad))


def attend_qkv(attend, cfg, page, slot, interpret: bool):
    """attention.make_paged_attend's `attend.qkv` in this mode: RoPE and the K/V write of
    every token in one kernel (pallas_kernels.rope_kv, one token per program), then the
    ragged kernel as `attend` runs it (attend.ragged), minus its XLA write. page, slot
    [B, C]: each token's cache slot."""
    from ouro_jax.attention import _entry
    from ouro_jax.kv_cache import TRASH_PAGE
    from pallas_kernels.rope_kv import rope_kv_write
    pages, slots = page.reshape(-1), slot.reshape(-1)  # (once per program, not per layer)

    def qkv_attend(qkv, cos, sin, planes, loop, layer):
        b, c, rows, hd = qkv.shape
        q, kc, vc = trace_once.call(
            rope_kv_write, qkv.reshape(b * c, rows, hd), cos.reshape(b * c, hd),
            sin.reshape(b * c, hd), planes[0], planes[1], _entry(loop, layer),
            pages, slots, n_kv=cfg.num_key_value_heads,
            trash_page=TRASH_PAGE, entry_stride=cfg.num_hidden_layers, interpret=interpret)
        planes = (kc, vc, *planes[2:])
        return attend.ragged(q, planes, loop, layer), planes
    return qkv_attend
