"""The decode kernel's in-kernel split merge (opt-in: `paged_decode_attention_qkv(...,
counters=)`), apart from the kernel it runs in (pallas_kernels/decode.py)."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import next_pow2, pl, plt


def merge_if_last(o_ref, lse_ref, out_ref, cnt_ref, b, kvh, group: int, num_splits: int,
                  gpu_sync: bool):
    """The split combine inside the kernel: every split program of (b, kvh) has stored its
    partial (o, lse) and increments the (b, kvh) counter; the one that reads num_splits - 1
    is the last, merges all partials in split order (the result does not depend on which
    program is last) with _common.combine_splits' math (the max first, then the weighted
    sums), stores the output and resets the counter to 0 for the next call. Two loops over
    the splits, so registers do not grow with the split count, on next_pow2(group) rows (the
    real heads; the dot tile's padding to 16 rows stays out).

    Memory ordering (the pattern of CUTLASS's semaphores): a CTA barrier orders every warp's
    partial stores before the counter's atomic, which Pallas lowers to atom.acq_rel.gpu by one
    thread (release: the stores are visible GPU-wide before the increment; acquire: the last
    program sees the other programs' stores); a second barrier orders that acquire before the
    other warps' loads of the partials."""
    if gpu_sync:
        plt.debug_barrier()
    old = plt.atomic_add(cnt_ref, (b, kvh), jnp.int32(1))
    rows = jnp.minimum(lax.iota(jnp.int32, next_pow2(group)), group - 1)

    @pl.when(old == num_splits - 1)
    def _():
        if gpu_sync:
            plt.debug_barrier()
        m = lax.fori_loop(1, num_splits, lambda s, m: jnp.maximum(m, lse_ref[b, kvh, s, rows]),
                          lse_ref[b, kvh, 0, rows])

        def add(s, carry):  # all-empty rows: every w == 1 and every o == 0 -> 0
            num, den = carry
            w = jnp.exp(lse_ref[b, kvh, s, rows] - m)
            return num + w[:, None] * o_ref[b, kvh, s, rows, :], den + w

        hd = o_ref.shape[-1]
        num, den = lax.fori_loop(0, num_splits, add, (jnp.zeros((rows.shape[0], hd), jnp.float32),
                                                      jnp.zeros(rows.shape, jnp.float32)))
        out_ref[b, kvh, rows, :] = (num / den[:, None]).astype(out_ref.dtype)
        cnt_ref[b, kvh] = jnp.int32(0)
