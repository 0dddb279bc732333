"""Paged KV cache pieces: allocation, buckets, slot mapping, write and gather."""

import jax.numpy as jnp
import numpy as np
import pytest

from ouro_jax.config import TINY_GQA
from ouro_jax.kv_cache import (TRASH_PAGE, KVPoolExhausted, PageAllocator, block_table_array,
                               bucket_pages, gather_kv, init_planes, kv_bytes_per_token,
                               slot_indices, write_kv)


def test_allocator_never_hands_out_the_trash_page_and_fails_up_front():
    alloc = PageAllocator(num_pages=9, page_size=4)
    pages = alloc.allocate([5, 8, 1])  # 2 + 2 + 1 pages
    flat = [p for row in pages for p in row]
    assert TRASH_PAGE not in flat and len(set(flat)) == 5 and alloc.free_pages == 3
    with pytest.raises(KVPoolExhausted, match="needs 4 pages"):
        alloc.allocate([16])
    assert alloc.free_pages == 3  # a refused allocation changes nothing
    alloc.release(pages)
    assert alloc.free_pages == 8


def test_allocator_is_lazy_and_reuses_released_pages_first():
    """A pool of 2**31 pages costs no host memory (the free list is a range until pages come
    back), low ids go first, released pages are reused before fresh ones."""
    import tracemalloc
    tracemalloc.start()
    alloc = PageAllocator(num_pages=2**31, page_size=16)
    assert tracemalloc.get_traced_memory()[1] < 1 << 20
    tracemalloc.stop()
    assert alloc.free_pages == 2**31 - 1
    a, b = alloc.allocate([32, 16])
    assert (a, b) == ([1, 2], [3])
    alloc.release([a])
    assert alloc.allocate([48]) == [[1, 2, 4]] and alloc.free_pages == 2**31 - 5
    with pytest.raises(ValueError, match="beyond int32"):
        PageAllocator(num_pages=2**31 + 1, page_size=16)


def test_bucket_pages_bounds_waste_and_shapes():
    for n in [1, 15, 17, 100, 1000, 8449, 123457]:
        b = bucket_pages(n)
        assert b >= n and b <= max(16, 1.25 * n + 1)
    assert len({bucket_pages(n) for n in range(1000, 2000)}) <= 5


def test_slot_indices_map_through_the_table_and_padding_goes_to_trash():
    table = jnp.asarray(block_table_array([[7, 3], [5]], batch=3, max_pages=2))
    pos = jnp.asarray([[0, 5, 7], [2, 4, 9], [0, 1, 2]])
    page, slot = slot_indices(table, pos, page_size=4)
    np.testing.assert_array_equal(page, [[7, 3, 3], [5, TRASH_PAGE, TRASH_PAGE], [0, 0, 0]])
    np.testing.assert_array_equal(slot, [[0, 1, 3], [2, 0, 1], [0, 1, 2]])


def test_write_then_gather_round_trip():
    cfg = TINY_GQA
    planes = init_planes(cfg, num_pages=6, page_size=2, dtype=jnp.float32)
    table = jnp.asarray([[4, 1, 2]])
    pos = jnp.arange(5)[None]
    page, slot = slot_indices(table, pos, 2)
    k = jnp.arange(5 * cfg.num_key_value_heads * cfg.head_dim, dtype=jnp.float32).reshape(
        1, 5, cfg.num_key_value_heads, cfg.head_dim)
    planes = write_kv(planes, 3, page, slot, k, -k)
    keys, values = gather_kv(planes, 3, table)
    np.testing.assert_array_equal(keys[:, :5], k)
    np.testing.assert_array_equal(values[:, :5], -k)
    assert float(jnp.abs(planes[0][2]).sum()) == 0  # other planes untouched
    assert kv_bytes_per_token(cfg, jnp.bfloat16) == 2 * cfg.kv_entries * 2 * 8 * 2


def test_ouro_1_4b_kv_bytes_per_token_matches_ouro_md():
    from ouro_jax.config import OURO_1_4B

    assert kv_bytes_per_token(OURO_1_4B, jnp.bfloat16) == 768 * 1024


def test_padding_writes_are_dropped_and_indices_are_unique():
    """Writes that map to the trash page (padding rows, positions past the table) are dropped,
    so the trash page stays untouched and every scattered (page, slot) is distinct: the
    precondition of the unique-indices scatter (plain stores instead of atomics on the GPU)."""
    cfg = TINY_GQA
    planes = init_planes(cfg, num_pages=6, page_size=2, dtype=jnp.float32)
    table = jnp.asarray(block_table_array([[4, 1], [2]], batch=3, max_pages=2))
    pos = jnp.asarray([[1, 2, 3], [0, 1, 2], [0, 1, 2]])  # row 1 runs past its page, row 2 pads
    page, slot = slot_indices(table, pos, 2)
    kept = [(int(p), int(s)) for p, s in zip(page.ravel(), slot.ravel()) if p != TRASH_PAGE]
    assert len(kept) == len(set(kept)) == 5
    k = jnp.ones((3, 3, cfg.num_key_value_heads, cfg.head_dim), jnp.float32)
    kc, vc = write_kv(planes, 1, page, slot, k, 2 * k)
    assert float(jnp.abs(kc[:, TRASH_PAGE]).sum()) == 0
    assert float(jnp.abs(vc[:, TRASH_PAGE]).sum()) == 0
    written = {(p, s) for p in range(6) for s in range(2) if float(kc[1, p, s].sum()) != 0}
    assert written == set(kept)
    assert float(vc[1, 4, 1, 0, 0]) == 2.0 and float(kc[0].sum()) == 0  # plane 1 only


def test_kv_write_is_a_unique_indices_scatter():
    """Pins the scatter attributes XLA sees: unique indices (no atomics on the GPU)."""
    import jax

    cfg = TINY_GQA
    planes = init_planes(cfg, num_pages=4, page_size=2, dtype=jnp.bfloat16)
    page, slot = jnp.asarray([[1], [3]]), jnp.asarray([[0], [1]])
    k = jnp.ones((2, 1, cfg.num_key_value_heads, cfg.head_dim), jnp.bfloat16)
    text = jax.jit(lambda p: write_kv(p, 1, page, slot, k, k)).lower(planes).as_text()
    scatters = [line for line in text.splitlines() if "scatter" in line and "unique_indices" in line]
    assert len(scatters) == 2 and all("unique_indices = true" in line for line in scatters)
