"""Two streaming GEMVs in one persistent kernel, a grid barrier between them (experimental).

Batch-1 decode runs seven kernels per layer application, and each pays launch, ramp and tail
(~1.9 us per projection, session 9). This kernel replaces one boundary, the o projection ->
the MLP's gate/up, with _common.grid_barrier:

    phase 1: o = attn @ W_o^T                        (every program its blocks of o)
             gate/up's first weight block requested  (weights: no need to wait)
             grid barrier                            (every o block stored and visible)
    phase 2: x' = h + rms_norm(o, w_post_attn); y = silu(n @ W_gate^T) * (n @ W_up^T),
             n = rms_norm(x', w_pre_mlp)             (gemv_stream's add_norm prologue)

Same math and rounding as gemv_stream(attn, W_o) followed by gemv_stream_normed(h, w_pre_mlp,
W_gate_up, branch=o, branch_w=w_post_attn, gated=True), through the same helpers. The grid is
`programs` persistent programs, every one resident at once (the barrier spins): the default
128 is under the H200's 132 SMs. The barrier state (int32 [3], zeros at first) is threaded
through calls and donated. Not in the engine: `benchmarks.gemv_chain` times it against the
two kernels, and it becomes a candidate only if the barrier is cheaper than the boundary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._common import compiler_params, grid_barrier, pl
from pallas_kernels.gemv import check_norm_operands, check_operands
from pallas_kernels.gemv_blocks import block_loader, stream_blocks
from pallas_kernels.gemv_rows import row_inputs
from pallas_kernels.l2_prefetch import prefetch_block

PROGRAMS = 128
TILING = dict(o=dict(block_n=2, block_k=512), gate_up=dict(block_n=2, block_k=512))


def _kernel(a_ref, wo_ref, h_ref, wb_ref, wx_ref, wgu_ref, state_ref, o_ref, y_ref, xo_ref,
            state_out_ref, *, m, k_o, k, inter, tiling, per_program, eps, gpu_sync, l2_ahead,
            spin):
    del state_ref  # aliased with state_out_ref: the barrier's atomics go through the output
    p, programs, dt = pl.program_id(0), pl.num_programs(0), y_ref.dtype

    def phase(name, w_ref, k_in, gated):
        t = tiling[name]
        nk = k_in // t["block_k"]
        load = block_loader(w_ref, block_n=t["block_n"], block_k=t["block_k"], nk=nk,
                            gated=gated, up_offset=inter)
        n = per_program[name]
        # block i of the program, clamped to its last (n - 1): a repeat is harmless
        pf = lambda i: prefetch_block(
            w_ref, p, programs, jnp.minimum(jnp.asarray(i, jnp.int32), n - 1), k=k_in,
            block_n=t["block_n"], gated=gated, up_offset=inter, interpret=not gpu_sync)
        # l2_ahead: blocks 1..l2_ahead requested into L2 up front, then block i + 1 + l2_ahead
        # in iteration i: a deeper pipeline than the registers' one block, without registers
        ahead = (lambda i: pf(i + 1 + l2_ahead)) if l2_ahead else None
        kw = dict(p=p, programs=programs, per_program=n, block_n=t["block_n"],
                  block_k=t["block_k"], nk=nk, gated=gated, ahead=ahead)
        first = load(p)
        zero = jnp.int32(0)
        for i in range(1, min(l2_ahead, n - 1) + 1):
            zero = zero + pf(i)
        return load, first, t, nk, kw, zero

    load, first, t, nk, kw, zero = phase("o", wo_ref, k_o, False)
    xs = row_inputs((a_ref, None, None, None, None), m=m, nk=nk, block_k=t["block_k"], k=k_o,
                    dt=dt, prologue="", eps=eps, first_program=p == 0, row2d=False, after=zero)
    stream_blocks(load, first, xs, o_ref, **kw)
    # gate/up's first block (and with l2_ahead its next ones) requested before the barrier
    load, first, t, nk, kw, zero = phase("gate_up", wgu_ref, k, True)
    grid_barrier(state_out_ref, programs, gpu_sync=gpu_sync, spin=spin)
    xs = row_inputs((h_ref, o_ref, wb_ref, wx_ref, xo_ref), m=m, nk=nk, block_k=t["block_k"],
                    k=k, dt=dt, prologue="add_norm", eps=eps, first_program=p == 0, row2d=False,
                    after=zero)
    stream_blocks(load, first, xs, y_ref, **kw)


def _per_program(name: str, n_out: int, k_in: int, tiling: dict, programs: int) -> int:
    bn, bk = tiling["block_n"], tiling["block_k"]
    if n_out % bn or k_in % bk or (n_out // bn) % programs:
        raise ValueError(f"o_gate_up: the {name} tiling block_n={bn}, block_k={bk} must divide "
                         f"its {n_out} x {k_in} weight into a multiple of {programs} blocks")
    return n_out // bn // programs


def o_gate_up(attn, w_o, h, w_post_attn, w_pre_mlp, w_gate_up, state, *, eps: float,
              programs: int = PROGRAMS, tiling: dict | None = None, num_warps: int = 4,
              interpret: bool = False, l2_ahead: int = 0, spin: str | None = None):
    """attn [M, K_o] (the attention output), w_o [K, K_o], h [M, K] (the residual stream),
    the two norm weights [K], w_gate_up [2I, K], state int32 [3] (the barrier's; donate it; its last word counts programs that gave up waiting, 0 when the barrier held).
    Returns (y [M, I], x' [M, K], o [M, K], state): gemv_stream's results for the o
    projection and the gated, add_norm gate/up projection, in one kernel. l2_ahead: how many
    blocks each program keeps requested into L2 ahead of the one in registers (session 14;
    0: none). spin: the barrier's spin mode (_common.grid_barrier; None: _common.BARRIER)."""
    if type(l2_ahead) is not int or l2_ahead < 0:
        raise ValueError(f"o_gate_up l2_ahead must be an int >= 0, got {l2_ahead!r}")
    tiling = dict(TILING, **(tiling or {}))
    k = check_operands(attn, w_o, False)
    if h.shape != (attn.shape[0], k):
        raise ValueError(f"o_gate_up: attn {attn.shape} @ w_o {w_o.shape}^T gives "
                         f"[{attn.shape[0]}, {k}], but h is {h.shape}")
    inter = check_operands(h, w_gate_up, True)
    check_norm_operands("o_gate_up", h, w_pre_mlp, h, w_post_attn)
    if state.shape != (3,) or state.dtype != jnp.int32:
        raise ValueError(f"o_gate_up: the barrier state must be int32 [3], got {state.dtype} "
                         f"{state.shape}")
    if interpret and programs != 1:
        raise ValueError("o_gate_up in interpret mode takes programs=1: interpret mode runs "
                         "programs in turn, so they could not wait for each other")
    m, k_o = attn.shape
    per_program = dict(o=_per_program("o", k, k_o, tiling["o"], programs),
                       gate_up=_per_program("gate_up", inter, k, tiling["gate_up"], programs))
    dt = h.dtype
    kernel = functools.partial(_kernel, m=m, k_o=k_o, k=k, inter=inter, tiling=tiling,
                               per_program=per_program, eps=float(eps), gpu_sync=not interpret,
                               l2_ahead=l2_ahead, spin=spin)
    sd = jax.ShapeDtypeStruct
    o, y, x_new, state = pl.pallas_call(
        kernel, grid=(programs,), input_output_aliases={6: 3},
        out_shape=(sd((m, k), dt), sd((m, inter), dt), sd((m, k), dt), sd((3,), jnp.int32)),
        compiler_params=compiler_params(num_warps, 1), interpret=interpret, name="o_gate_up",
    )(attn.astype(dt), w_o.astype(dt), h, w_post_attn.astype(dt), w_pre_mlp.astype(dt),
      w_gate_up.astype(dt), state)
    return y, x_new, o, state
