"""Paged KV cache: a registered pytree of device buffers, plus a host-side page allocator.

Layout (the Pallas kernels in pallas_kernels/ read exactly this):

    k, v          [E, P, page_size, KVH, head_dim]   E = T * L planes, plane index ut * L + l
    block_tables  [B, max_pages]  int32               physical page of each logical page
    lengths       [B]             int32               tokens whose K/V are final in every loop

Why this layout:
- One plane per (loop, layer) with a shared page table: a token's page is the same in every
  plane, so one block table serves all T*L planes and the speculative draft (loops < d) and
  verification (loops >= d) write the same pages without any bookkeeping of their own.
- Token-major pages ([page_size, KVH, head_dim]): writing one token is one contiguous
  KVH*head_dim row, and a kernel reading a page gets every KV head of it in one block, which
  suits GQA (all query heads of a KV head served from one load).
- Page 0 is a trash page that no sequence owns. Block-table slots past a sequence's
  allocation point at it; positions past the table's width are clamped to its last column
  (slot_indices here, load_kv_block in the kernels), so every read stays in bounds. Writes of
  padded rows and padded positions that map to page 0 are dropped (see write_kv). Reads past
  a sequence's length are masked.
- Rollback is by length alone: positions >= length may hold stale K/V (rejected speculative
  tokens) and are overwritten before they are ever read, because a query at position p only
  attends to positions <= p and position p is written before it is read.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ouro_jax.config import OuroConfig

TRASH_PAGE = 0


class KVPoolExhausted(RuntimeError):
    """The requests of a batch need more KV pages than the pool holds."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    block_tables: jax.Array
    lengths: jax.Array

    @property
    def page_size(self) -> int:
        return self.k.shape[2]

    @property
    def num_pages(self) -> int:
        return self.k.shape[1]


def pages_needed(tokens: int, page_size: int) -> int:
    return max(1, math.ceil(tokens / page_size))


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(0, (int(n) - 1).bit_length()))


def bucket_pages(n: int, minimum: int = 16) -> int:
    """Pool size bucket: quarter-octave steps (at most 25% waste, few distinct shapes, so
    few compiles), unlike a power of two that could double a 100 GB pool."""
    n = max(int(n), minimum)
    step = max(1, 1 << max(0, n.bit_length() - 3))
    return -(-n // step) * step


def init_planes(cfg: OuroConfig, num_pages: int, page_size: int, dtype) -> tuple[jax.Array, jax.Array]:
    shape = (cfg.kv_entries, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def kv_bytes_per_token(cfg: OuroConfig, dtype) -> int:
    return 2 * cfg.kv_entries * cfg.num_key_value_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


class PageAllocator:
    """Host-side free list. Allocation happens once per batch at admission, before any device
    work, so running out of pages is an error up front and never a crash mid-run."""

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError("a KV pool needs at least 2 pages (page 0 is the trash page)")
        if num_pages > 2**31:
            raise ValueError(f"a KV pool of {num_pages} pages has page ids beyond int32")
        self.num_pages = num_pages
        self.page_size = page_size
        # Lazy: pages never handed out are the range [_fresh, num_pages), so a huge pool costs
        # nothing here (its device memory is checked before it is allocated); released pages
        # are reused first, in the order they came back.
        self._fresh = TRASH_PAGE + 1
        self._released: list[int] = []  # pop() gives the next one

    @property
    def free_pages(self) -> int:
        return len(self._released) + self.num_pages - self._fresh

    def _take(self) -> int:
        if self._released:
            return self._released.pop()
        self._fresh += 1
        return self._fresh - 1

    def allocate(self, token_counts: list[int]) -> list[list[int]]:
        need = [pages_needed(t, self.page_size) for t in token_counts]
        if sum(need) > self.free_pages:
            raise KVPoolExhausted(
                f"KV pool exhausted: the batch needs {sum(need)} pages of {self.page_size} tokens "
                f"({sum(token_counts)} tokens incl. room for generation), but only "
                f"{self.free_pages} of {self.num_pages - 1} usable pages are free; raise the pool "
                f"size (kv_pool_tokens) or send fewer/shorter requests")
        return [[self._take() for _ in range(n)] for n in need]

    def release(self, pages: list[list[int]]) -> None:
        for row in pages:
            self._released.extend(reversed(row))


def block_table_array(pages: list[list[int]], batch: int, max_pages: int) -> np.ndarray:
    """[batch, max_pages] int32, padded with the trash page (also for padding rows)."""
    table = np.full((batch, max_pages), TRASH_PAGE, np.int32)
    for i, row in enumerate(pages):
        table[i, :len(row)] = row
    return table


def slot_indices(block_tables: jax.Array, positions: jax.Array, page_size: int):
    """(page, slot) of token positions [B, C] through the block table [B, max_pages]."""
    max_pages = block_tables.shape[1]
    logical = jnp.clip(positions // page_size, 0, max_pages - 1)
    page = jnp.take_along_axis(block_tables, logical, axis=1)
    # Positions past the table (padding) go to the trash page.
    page = jnp.where(positions // page_size < max_pages, page, TRASH_PAGE)
    return page, positions % page_size


def write_kv(planes: tuple[jax.Array, jax.Array], entry, page, slot, k, v):
    """Scatter k, v [B, C, KVH, hd] into plane `entry` at (page, slot) [B, C].

    Writes aimed at the trash page (padding rows, positions past a row's table) are dropped:
    they get page indices past the pool, which a scatter skips. Every remaining (page, slot)
    belongs to one token of one sequence, so the indices are unique and the scatter says so;
    without that promise XLA's GPU scatter emitter updates every element with an atomic
    read-modify-write (a CAS loop for 16-bit types): 7.1 us per K or V write at batch 64 in
    session 3's trace, 15% of a decode step. The trash page is never written (stays zero)."""
    kc, vc = planes
    # Each dropped update gets its own out-of-bounds page, so the promise holds literally.
    beyond = kc.shape[1] + jnp.arange(page.size, dtype=page.dtype).reshape(page.shape)
    page = jnp.where(page == TRASH_PAGE, beyond, page)
    kc = kc.at[entry, page, slot].set(k.astype(kc.dtype), mode="drop", unique_indices=True)
    vc = vc.at[entry, page, slot].set(v.astype(vc.dtype), mode="drop", unique_indices=True)
    return kc, vc


def gather_kv(planes: tuple[jax.Array, jax.Array], entry, block_tables):
    """The XLA gather path: [B, max_pages * page_size, KVH, hd] for plane `entry`."""
    kc, vc = planes
    b, mp = block_tables.shape
    ps = kc.shape[2]
    k = kc[entry, block_tables].reshape(b, mp * ps, *kc.shape[3:])
    v = vc[entry, block_tables].reshape(b, mp * ps, *vc.shape[3:])
    return k, v
