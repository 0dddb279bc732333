"""Lossless 12-bit packing of bf16 weights for the batch-1 GEMVs (pallas_kernels/gemv_packed.py).

Why: a one-row projection reads every weight once per call, so its time is mostly bytes. A bf16
weight is a high byte (sign and the exponent's top 7 bits) and a low byte (the exponent's last
bit and the 7 mantissa bits). Within a chunk of one row the exponents span few values, so the
high byte is stored as a 4-bit code: the sign and a 3-bit offset from the chunk's smallest
top-7 exponent bits (`base7`). That covers 16 binades per chunk; a chunk whose exponents span
more (an exact zero, a denormal, a tiny value next to a large one) is an *escape*: its raw bf16
values are kept in a side table and the kernel reads them instead. Decoding is exact, bit for
bit, for every input: nothing is approximated (tests/test_packed12.py checks the round trip).
12 bits per weight plus 4 bytes per chunk and the escapes' raw rows: 75.4% of bf16's bytes
with no escapes, ~79-81% for Gaussian weights at block_k=512 (3.3-5.7% of chunks escape).
A chunk escapes when its exponents' top 7 bits span more than 7 values: a span of 17 or more
binades always escapes, 14 or fewer never, 15-16 depending on alignment.

Layout for W [N, K], chunk size BK (block_k, a multiple of 32 dividing K), J = BK / 8. Element
q of chunk c (q = p * BK/2 + i * J + j; p in {0, 1}, i in {0..3}, j < J) has
* its low byte in byte i of lo[n, c * BK/4 + p * J + j] (uint32);
* its 4-bit code (sign << 3 | offset) in byte i of codes[n, c * J + j] (uint32): the low
  nibble for p = 0, the high nibble for p = 1;
* meta[n, c] (int32) = base7 | (slot + 1) << 8, slot the row of `esc` holding the raw chunk
  (slot + 1 = 0: not escaped).
So the kernel turns two uint32 words of low bytes and one of codes into eight weights with
integer ops, and the eight matching x values are eight contiguous slices of the chunk's x.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_K = 512  # the chunk size the packed GEMV tilings use


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Packed12:
    """A packed bf16 matrix [n, k]. Arrays: lo [n, k/4] uint32, codes [n, k/8] uint32, meta
    [n, k/block_k] int32, esc [max(escapes, 1), block_k] bf16 (a zero row when none)."""
    lo: jax.Array
    codes: jax.Array
    meta: jax.Array
    esc: jax.Array
    n: int = dataclasses.field(metadata=dict(static=True))
    k: int = dataclasses.field(metadata=dict(static=True))
    block_k: int = dataclasses.field(metadata=dict(static=True))
    escapes: int = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self):
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        """Bytes a GEMV reads when no chunk escapes, plus the escaped chunks' raw bytes."""
        return (self.lo.size * 4 + self.codes.size * 4 + self.meta.size * 4
                + self.escapes * self.block_k * 2)


def check_packable(shape, dtype, block_k: int) -> None:
    if len(shape) != 2:
        raise ValueError(f"packed12 packs a 2-D weight [N, K], got shape {tuple(shape)}")
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"packed12 packs bf16 weights (lossless only for bf16), got {dtype}")
    if type(block_k) is not int or block_k < 32 or block_k % 32:
        raise ValueError(f"packed12 block_k must be a multiple of 32, got {block_k!r}")
    if shape[1] % block_k:
        raise ValueError(f"packed12: block_k={block_k} must divide K={shape[1]}")


def _fields(w: jax.Array, block_k: int):
    """(lo, codes, base7, escaped) for w [N, K] bf16; jit-able (no data-dependent shapes)."""
    n, k = w.shape
    c, j = k // block_k, block_k // 8
    bits = jax.lax.bitcast_convert_type(w, jnp.uint16).astype(jnp.uint32)
    bits = bits.reshape(n, c, 2, 4, j)  # (row, chunk, p, i, j)
    shifts = (8 * jnp.arange(4, dtype=jnp.uint32))[:, None]  # byte i of a word
    lo = jnp.sum((bits & 0xFF) << shifts, axis=3, dtype=jnp.uint32)  # [n, c, 2, j]
    hi = bits >> 8
    e7 = (hi & 0x7F).astype(jnp.int32)
    lo_e7, hi_e7 = e7.min(axis=(2, 3, 4)), e7.max(axis=(2, 3, 4))  # [n, c]
    base7 = jnp.maximum(lo_e7, hi_e7 - 7)
    escaped = hi_e7 - lo_e7 > 7
    off = jnp.clip(e7 - base7[:, :, None, None, None], 0, 7)
    code = ((hi >> 7) << 3) | off.astype(jnp.uint32)  # [n, c, 2, 4, j]
    nib = code[:, :, 0] | (code[:, :, 1] << 4)  # [n, c, 4, j]
    codes = jnp.sum(nib << shifts, axis=2, dtype=jnp.uint32)  # [n, c, j]
    return lo.reshape(n, k // 4), codes.reshape(n, k // 8), base7, escaped


_fields_jit = jax.jit(_fields, static_argnums=1)


def pack(w: jax.Array, block_k: int = BLOCK_K) -> Packed12:
    """W [N, K] bf16 -> Packed12. Syncs with the host once (to size the escape table).
    gemv_packed needs a power-of-two block_k >= 64 (the default 512 is what it was tuned
    on); unpack takes any block_k pack does. `escapes` is a static field: matrices with
    different counts trace separately."""
    check_packable(w.shape, w.dtype, block_k)
    n, k = w.shape
    lo, codes, base7, escaped = _fields_jit(w, block_k)
    flat = np.asarray(escaped).reshape(-1)
    idx = np.flatnonzero(flat)
    slot = np.zeros(flat.shape, np.int32)
    slot[idx] = np.arange(1, idx.size + 1, dtype=np.int32)
    meta = base7 | (jnp.asarray(slot.reshape(escaped.shape)) << 8)
    if idx.size:
        esc = w.reshape(n * (k // block_k), block_k)[jnp.asarray(idx)]
    else:
        esc = jnp.zeros((1, block_k), jnp.bfloat16)
    return Packed12(lo, codes, meta, esc, n, k, block_k, int(idx.size))


def decode_words(lo_word, code_word, base7, p: int, bits: bool = False):
    """The four weights (as fp32) in each of plane p's low-byte words: one [...] uint32 array
    of low bytes, its code words and the chunk's base7 ([...] uint32, broadcastable). Returns
    [fp32 for byte i in 0..3] (bits: their uint32 bit patterns instead). The kernel and
    unpack share this, so the test of the round trip tests the kernel's arithmetic too."""
    c = (code_word >> (4 * p)) & 0x0F0F0F0F
    h = ((c & 0x08080808) << 4) | ((c & 0x07070707) + base7 * 0x01010101)  # 4 high bytes
    out = []
    for i in range(4):
        b = (((h >> (8 * i)) & 0xFF) << 24) | (((lo_word >> (8 * i)) & 0xFF) << 16)
        out.append(b if bits else jax.lax.bitcast_convert_type(b, jnp.float32))
    return out


def unpack(p: Packed12) -> jax.Array:
    """The bf16 matrix back, bit for bit (escaped chunks from the side table)."""
    n, k, bk = p.n, p.k, p.block_k
    c, j = k // bk, bk // 8
    lo = p.lo.reshape(n, c, 2, j)
    codes = p.codes.reshape(n, c, 1, j)
    base7 = (p.meta & 0xFF).astype(jnp.uint32).reshape(n, c, 1, 1)
    planes = []
    for q in range(2):
        vals = decode_words(lo[:, :, q:q + 1], codes, base7, q, bits=True)  # 4 x [n, c, 1, j]
        planes.append(jnp.concatenate(vals, axis=2))  # [n, c, 4, j]
    # as bits throughout: a float select or convert may quiet a signalling NaN's payload
    w = (jnp.stack(planes, axis=2).reshape(n, c, bk) >> 16).astype(jnp.uint16)
    slot = (p.meta >> 8) - 1  # [n, c]
    raw = jax.lax.bitcast_convert_type(p.esc, jnp.uint16)[jnp.maximum(slot, 0)]  # [n, c, bk]
    w = jnp.where((slot >= 0)[..., None], raw, w).reshape(n, k)
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16)
