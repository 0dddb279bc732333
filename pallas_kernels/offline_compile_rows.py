"""Pipelined self-speculation's kernel calls for `python -m pallas_kernels.offline_compile
--decode-rows` (the decode kernel with a plane per row at 2 and 16 rows; rope_kv_write and
the ragged kernel at 64) and `--stream-rows` (the engine's streaming GEMV tilings at 1 and 2
rows, as '+stream@2' runs them), at the 1.4B shapes; the capture and compile machinery is
offline_compile's."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

from pallas_kernels import offline_compile as oc


def check_decode_rows():
    """paged_decode_attention_qkv as pipelined self-speculation calls it (--decode-rows):
    2 and 16 rows (batch 1 and 8, lead and trail rows) reading a plane per row (a base of
    one loop per row, entry_stride 24), beside the same call with one plane: registers and
    shared memory at the default tiling (ouro_jax.pipelined); then at 64 rows rope_kv_write
    and the ragged kernel (the warps given here are what compile_captured assumes)."""
    from pallas_kernels import paged_decode_attention_qkv
    from pallas_kernels.decode import default_num_warps
    S, i32, bf = jax.ShapeDtypeStruct, jnp.int32, jnp.bfloat16
    kc = S((96, 64, 16, 16, 128), bf)
    for rows in (2, 16):
        for per_row in (False, True):
            base = S((rows,) if per_row else (), i32)

            def fq(qkv, kc_, vc_, b, bt, ln, pg, sl, cs, sn):
                return paged_decode_attention_qkv(qkv, kc_, vc_, (b, 3), bt, ln, pg, sl,
                                                  rope=(cs, sn), entry_stride=24)
            jax.jit(fq).trace(S((rows, 48, 128), bf), kc, kc, base, S((rows, 13), i32),
                              S((rows,), i32), S((rows,), i32), S((rows,), i32),
                              S((rows, 128), bf), S((rows, 128), bf)
                              ).lower(lowering_platforms=("cuda",))
            warps = default_num_warps(rows, bf, True)
            planes = "a plane per row" if per_row else "one plane"
            oc.compile_captured(f"decode {rows} rows, {planes} (warps {warps})",
                                num_warps=warps)
    # from 64 rows (batch 32 and up): RoPE and the K/V write, then the ragged kernel at the
    # engine's decode tuning (one split, the direct store), each with a plane per row
    from pallas_kernels import ragged_paged_attention
    from pallas_kernels.rope_kv import rope_kv_write
    rows = 64
    for per_row in (False, True):
        base = S((rows,) if per_row else (), i32)
        jax.jit(lambda qkv, c, s_, kc_, vc_, b, pg, sl: rope_kv_write(
            qkv, c, s_, kc_, vc_, (b, 3), pg, sl, n_kv=16, entry_stride=24)
        ).trace(S((rows, 48, 128), bf), S((rows, 128), bf), S((rows, 128), bf), kc, kc, base,
                S((rows,), i32), S((rows,), i32)).lower(lowering_platforms=("cuda",))
        oc.compile_captured(f"rope_kv_write {rows} rows, "
                         f"{'a plane per row' if per_row else 'one plane'}", num_warps=4,
                         num_stages=1)
        jax.jit(lambda q, kc_, vc_, b, bt, ln: ragged_paged_attention(
            q, kc_, vc_, (b, 3), bt, ln, entry_stride=24, q_len=1, num_splits=1, block_q=16)
        ).trace(S((rows, 16, 128), bf), kc, kc, base, S((rows, 13), i32), S((rows,), i32)
                ).lower(lowering_platforms=("cuda",))
        oc.compile_captured(f"ragged {rows} rows, "
                         f"{'a plane per row' if per_row else 'one plane'}", num_warps=4)



def check_stream_rows():
    """The engine's streaming tilings (STREAM_TUNING) at 1 and 2 rows (--stream-rows), as
    'stream@2' would run pipelined speculation's 2-row calls: qkv and gate/up with the
    add_norm prologue, o and down plain. Registers and spills per row count. With
    --no-evict, without the evict-first weight loads: pip's Triton 3.9 fails to parse the
    cache-modifier attribute jax 0.10.2 writes for them (at one row too), which the GPU
    machine's own toolchain compiles."""
    from benchmarks.gemv import SHAPES
    from ouro_jax.projections import STREAM_TUNING
    for name, (n, k, gated) in SHAPES.items():
        kw = {key: v for key, v in STREAM_TUNING[name].items()
              if not ("--no-evict" in sys.argv and key == "evict_first")}
        prologue = "add_norm" if name in ("qkv", "gate_up") else ""
        for rows in (1, 2):
            oc._lower_stream(n, k, gated, kw, prologue, rows)
            oc.compile_captured(f"stream {name} {rows} row(s) {prologue or 'plain'}",
                             num_warps=kw["num_warps"], num_stages=1)
