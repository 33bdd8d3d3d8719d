"""Typed use of the public API, checked twice.

``tests/test_typing.py`` runs ``mypy --strict`` on this file against the
installed package, so the stubs of the compiled core (``pagedkv_c/*.pyi``)
must describe every call below; ``assert_type`` pins the types that mypy
infers. It also runs :func:`main`, whose runtime asserts check that the
objects really have the dtypes and types the stubs claim.
"""
from typing import Any, assert_type

import numpy as np
from numpy.typing import NDArray

import pagedkv
from pagedkv_c._page_table import PageTable
from pagedkv_c._prefix import PrefixIndex


def use_page_pool() -> None:
    pool = pagedkv.PagePool(8)
    pages = pool.allocate(3)
    assert_type(pages, NDArray[np.int32])
    assert pages.dtype == np.int32
    pool.incref(pages[:1])
    pool.free([int(p) for p in pages])
    assert_type(pool.ref_count(int(pages[0])), int)
    assert pool.ref_count(int(pages[0])) == 1
    assert_type(pool.num_free, int)
    assert_type(pool.free_pages(), NDArray[np.int32])
    try:
        pool.allocate(8)
    except pagedkv.OutOfPagesError as exc:
        assert isinstance(exc, MemoryError)
    else:
        raise AssertionError("allocate(8) with 7 free pages must raise OutOfPagesError")
    pool.check_invariants()


def use_page_table() -> None:
    pool = pagedkv.PagePool(16)
    table = PageTable(pool, 4, window=8, sink_tokens=2)
    slots, cow_pairs = table.append(10)
    assert_type(slots, NDArray[np.int64])
    assert_type(cow_pairs, NDArray[np.int32])
    assert slots.dtype == np.int64 and cow_pairs.dtype == np.int32
    page_ids, first_positions = table.pages()
    assert page_ids.dtype == np.int32 and first_positions.dtype == np.int64
    assert_type(table.window, int | None)
    assert table.window == 8
    child: PageTable = table.fork()
    child.release()
    table.truncate(10)
    assert_type(table.seq_len, int)


def use_kv_cache() -> None:
    cache = pagedkv.KVCache(num_layers=2, num_kv_heads=2, head_dim=4, num_pages=16, page_size=4,
                            dtype=np.float32, enable_prefix_caching=True)
    served = cache.add_sequence(0, prompt_token_ids=[1, 2, 3, 4, 5])
    assert_type(served, int)
    slots = cache.append([0], [5])
    assert_type(slots, NDArray[np.int64])
    assert slots.dtype == np.int64
    k: NDArray[np.float32] = np.ones((5, 2, 4), dtype=np.float32)
    cache.store(0, slots, k, 2 * k)
    keys, values, positions = cache.gather(0, 0)
    assert_type(positions, NDArray[np.int64])
    assert positions.dtype == np.int64 and keys.dtype == np.float32
    assert np.array_equal(values, 2 * keys)
    view = cache.page_table([0])
    assert_type(view, pagedkv.PageTableView)
    assert_type(view.indptr, NDArray[np.int32])
    assert view.indptr.dtype == np.int32 and view.seq_lens.dtype == np.int64
    assert_type(view.block_tables(), NDArray[np.int32])
    cache.fork(0, 1)
    cache.truncate(1, 4)
    stats = cache.stats()
    assert_type(stats, dict[str, int | float])
    index = cache.prefix_index
    assert_type(index, PrefixIndex | None)
    assert index is not None and index.algorithm_name == "xxh3_128"
    assert_type(cache.window, int | None)
    assert_type(cache.seq_ids(), list[int])
    cache.remove_sequence(1)
    cache.check_invariants()


def use_classic_cache() -> None:
    cache = pagedkv.PagedKVCache(max_pages=2, dim=4, page_size=4)
    cache.put(0, [1.0, 2.0, 3.0, 4.0], np.zeros(4))
    item = cache.get(0)
    assert_type(item, tuple[NDArray[np.floating[Any]], NDArray[np.floating[Any]]] | None)
    assert item is not None and item[0].dtype == np.float32
    cache.put_many(np.arange(1, 4), np.ones((3, 4)), np.ones((3, 4)))
    keys, values, present = cache.get_many([0, 1, 9])
    assert_type(present, NDArray[np.bool_])
    assert present.dtype == np.bool_ and present.tolist() == [True, True, False]
    assert_type(len(cache), int)
    assert_type(cache.resident_pages, NDArray[np.int64])
    assert_type(cache.num_resident_pages, int)
    assert_type(0 in cache, bool)
    tokens = list(cache)
    assert_type(tokens, list[int])
    assert tokens == [0, 1, 2, 3]
    stats = cache.stats()
    assert_type(stats, dict[str, int])
    assert stats["hits"] == 3 and stats["misses"] == 1
    cache.clear()


def use_attention() -> None:
    cache = pagedkv.KVCache(num_layers=1, num_kv_heads=2, head_dim=8, num_pages=8, page_size=4,
                            dtype=np.float32)
    for seq_id in (0, 1):
        cache.add_sequence(seq_id)
    slots = cache.append([0, 1], [3, 5])
    k = np.ones((8, 2, 8), dtype=np.float32)
    cache.store(0, slots, k, k)
    q = np.ones((2, 4, 8), dtype=np.float32)
    out = pagedkv.attention.decode(q, cache, 0, [0, 1])
    assert_type(out, NDArray[np.float32])
    assert out.dtype == np.float32 and out.shape == (2, 4, 8)
    out, lse = pagedkv.attention.decode(q, cache, 0, [0, 1], return_lse=True)
    assert_type(lse, NDArray[np.float32])
    assert lse.dtype == np.float32 and lse.shape == (2, 4)
    q_chunk = np.ones((8, 4, 8), dtype=np.float16)
    chunk = pagedkv.attention.prefill(q_chunk, cache, 0, [0, 1], qo_indptr=[0, 3, 8], num_threads=1)
    assert_type(chunk, NDArray[np.float32])
    assert chunk.dtype == np.float32 and chunk.shape == (8, 4, 8)
    capped = pagedkv.attention.prefill(q_chunk, cache, 0, [0, 1], [0, 3, 8], softcap=30.0,
                                       sink_logits=[0.0, 1.0, -np.inf, 2.0])
    assert_type(capped, NDArray[np.float32])
    info = pagedkv.attention.kernel_info()
    assert info["openmp"] is pagedkv.openmp_enabled()


def use_build_info() -> None:
    enabled = pagedkv.openmp_enabled()
    assert_type(enabled, bool)
    assert isinstance(enabled, bool)
    info = pagedkv.build_info()
    assert_type(info, dict[str, bool | int])
    assert info["openmp"] is enabled


def main() -> None:
    """Run every example."""
    use_page_pool()
    use_page_table()
    use_kv_cache()
    use_classic_cache()
    use_attention()
    use_build_info()


if __name__ == "__main__":
    main()
