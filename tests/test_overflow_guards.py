"""Sizes, counts, positions and offsets that cross into C: each limit, at and past it.

Every case is cheap: pools without layers (``num_layers=0``) or with one-element
heads, and lazily mapped zero arrays where a call needs a long input.
"""
import numpy as np
import pytest

from pagedkv import KVCache, PagePool, attention
from pagedkv_c._page_table import PageTable

INT32_MAX = 2**31 - 1
MAX_POSITION = 2**62


def pages_manager(num_pages, page_size=1, **kwargs):
    return KVCache(num_layers=0, num_kv_heads=1, head_dim=1, num_pages=num_pages,
                   page_size=page_size, **kwargs)


# ------------------------------------------------------------ CSR int32 limit
def full_sequence(num_pages):
    cache = pages_manager(num_pages)
    cache.add_sequence(0)
    cache.append([0], [num_pages], return_slot_mapping=False)
    return cache


def test_page_table_refuses_a_batch_past_the_int32_csr_limit():
    cache = full_sequence(65536)
    before = cache.stats()
    # 65536 * 32768 = 2**31 pages: one past the limit of int32 indptr
    with pytest.raises(ValueError, match=r"2\*\*31 - 1.*int32"):
        cache.page_table([0] * 32768)
    with pytest.raises(ValueError, match=r"2\*\*31 - 1.*int32"):
        cache.page_table([0] * 65537)
    assert cache.stats() == before
    cache.check_invariants()
    view = cache.page_table([0] * 3)  # repeats within the limit still work
    assert view.indptr.tolist() == [0, 65536, 131072, 196608]


def test_decode_refuses_a_batch_past_the_int32_csr_limit():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=1, num_pages=65536, page_size=1)
    cache.add_sequence(0)
    cache.append([0], [65536], return_slot_mapping=False)
    q = np.zeros((32768, 1, 1), np.float32)
    with pytest.raises(ValueError, match=r"2\*\*31 - 1.*int32"):
        attention.decode(q, cache, 0, [0] * 32768)


# ------------------------------------------------------------ ref counts
# Reaching the limit through incref takes 2**31 increments (tens of seconds):
# the tests put a page next to it with PagePool._set_ref_count_for_tests.
def test_incref_refuses_to_overflow_the_int32_ref_count():
    pool = PagePool(3)
    pool.allocate(3)
    pool._set_ref_count_for_tests(0, INT32_MAX - 3)
    free_before = pool.free_pages().tolist()
    # page 0 listed 4 times: one past the limit, whichever order
    for ids in ([0, 1, 0, 0, 0], [0, 0, 0, 0, 1], np.array([1, 0, 2, 0, 0, 0], np.int32)):
        with pytest.raises(ValueError, match=r"2\*\*31 - 1.*ref count"):
            pool.incref(ids)
        assert [pool.ref_count(p) for p in range(3)] == [INT32_MAX - 3, 1, 1]
    assert pool.free_pages().tolist() == free_before
    pool.check_invariants()
    pool.incref(np.array([0, 1, 0, 2, 0], np.int32))  # exactly up to the limit
    assert [pool.ref_count(p) for p in range(3)] == [INT32_MAX, 2, 2]
    for ids in ([0], [1, 0], np.zeros(2**20, np.int32)):
        with pytest.raises(ValueError, match=r"2\*\*31 - 1.*ref count"):
            pool.incref(ids)
    assert [pool.ref_count(p) for p in range(3)] == [INT32_MAX, 2, 2]
    pool.incref([1, 2])  # the failed calls left no planning state behind
    assert [pool.ref_count(p) for p in range(3)] == [INT32_MAX, 3, 3]
    pool.free([0])
    assert pool.ref_count(0) == INT32_MAX - 1
    pool.check_invariants()


def test_incref_of_a_long_batch_at_the_limit():
    pool = PagePool(1)
    pool.allocate(1)
    many = np.zeros(2**20, np.int32)
    pool._set_ref_count_for_tests(0, INT32_MAX - 2**20)
    pool.incref(many)
    assert pool.ref_count(0) == INT32_MAX
    pool._set_ref_count_for_tests(0, INT32_MAX - 2**20 + 1)
    with pytest.raises(ValueError, match=r"2\*\*31 - 1.*ref count"):
        pool.incref(many)
    assert pool.ref_count(0) == INT32_MAX - 2**20 + 1
    pool.check_invariants()


def test_ref_count_hook_keeps_the_pool_consistent():
    pool = PagePool(2)
    with pytest.raises(ValueError, match="not allocated"):
        pool._set_ref_count_for_tests(0, 5)
    pool.allocate(1)
    for bad in (0, INT32_MAX + 1):
        with pytest.raises(ValueError, match="count"):
            pool._set_ref_count_for_tests(0, bad)
    with pytest.raises(RuntimeError, match="KVCache"):
        pages_manager(2).pool._set_ref_count_for_tests(0, 5)


def test_fork_refuses_to_overflow_the_int32_ref_count():
    pool = PagePool(2)
    table = PageTable(pool, 1)
    table.append(2)  # pages 0 and 1
    pool._set_ref_count_for_tests(1, INT32_MAX - 1)
    child = table.fork()  # exactly up to the limit
    assert pool.ref_count(1) == INT32_MAX and pool.ref_count(0) == 2
    with pytest.raises(ValueError, match=r"2\*\*31 - 1.*ref count"):
        table.fork()
    with pytest.raises(ValueError, match=r"2\*\*31 - 1.*ref count"):
        child.fork()
    assert pool.ref_count(1) == INT32_MAX and pool.ref_count(0) == 2
    child.release()
    assert pool.ref_count(1) == INT32_MAX - 1 and pool.ref_count(0) == 1
    pool.check_invariants()


def test_windowed_fork_checks_sink_and_window_pages():
    pool = PagePool(8)
    table = PageTable(pool, 2, window=2, sink_tokens=2)
    table.append(9)  # sink page, released pages, window pages
    ids, _ = table.pages()
    for page in ids.tolist():
        pool._set_ref_count_for_tests(page, INT32_MAX)
        refs = [pool.ref_count(p) for p in ids.tolist()]
        with pytest.raises(ValueError, match=r"2\*\*31 - 1.*ref count"):
            table.fork()
        assert [pool.ref_count(p) for p in ids.tolist()] == refs
        pool._set_ref_count_for_tests(page, 1)
    table.fork().release()
    pool.check_invariants()


# ------------------------------------------------------------ read-only pool
def test_page_table_refuses_the_pool_of_a_kv_cache():
    cache = pages_manager(8, page_size=4)
    with pytest.raises(RuntimeError, match="KVCache"):
        PageTable(cache.pool, 4)
    assert cache.pool.num_free == 8
    cache.check_invariants()
    table = PageTable(PagePool(8), 4)  # a standalone pool still works
    table.append(5)
    assert table.num_pages == 2


# ------------------------------------------------------------ constructor limits
@pytest.mark.parametrize("name", ["window", "sink_tokens"])
def test_window_and_sinks_stop_at_the_position_limit(name):
    kwargs = {"window": 4, name: MAX_POSITION} if name == "sink_tokens" else {name: MAX_POSITION}
    cache = pages_manager(4, page_size=2, **kwargs)
    cache.add_sequence(0)
    cache.append([0], [5], return_slot_mapping=False)
    cache.check_invariants()
    table = PageTable(PagePool(4), 2, **kwargs)
    table.append(5)
    assert table.num_pages == 3
    past = {"window": 4, name: MAX_POSITION + 1} if name == "sink_tokens" else {name: MAX_POSITION + 1}
    with pytest.raises(ValueError, match=rf"{name}.*{MAX_POSITION}"):
        pages_manager(4, page_size=2, **past)
    with pytest.raises(ValueError, match=rf"{name}.*{MAX_POSITION}"):
        PageTable(PagePool(4), 2, **past)


def test_sink_pages_are_bounded_by_the_pool():
    # 2**62 sink tokens would be 2**61 sink pages; a sequence cannot hold
    # more pages than the pool has, so the table sizes its sinks by the pool.
    cache = pages_manager(4, page_size=2, window=1, sink_tokens=MAX_POSITION)
    cache.add_sequence(0)
    cache.append([0], [8], return_slot_mapping=False)
    assert cache.page_table([0]).indices.shape == (4,)
    cache.check_invariants()


def test_one_layer_of_the_pool_must_be_addressable():
    # num_layers=0 allocates nothing, but byte offsets into a layer are still
    # Py_ssize_t: 2 * 2**20 * 2**16 * 2**16 float16 values = 2**54 bytes per
    # page, so 2**9 pages are 2**63 bytes, one past the limit
    sizes = dict(num_layers=0, num_kv_heads=2**16, head_dim=2**16, page_size=2**20)
    with pytest.raises(MemoryError, match=r"num_pages.*2\*\*63 - 1"):
        KVCache(num_pages=2**9, **sizes)
    cache = KVCache(num_pages=2**9 - 1, **sizes)  # 2**63 - 2**54 bytes
    cache.add_sequence(0)
    cache.append([0], [3 * 2**20 + 1], return_slot_mapping=False)
    assert cache.page_table([0]).indices.tolist() == [0, 1, 2, 3]
    cache.check_invariants()


def test_block_prompt_length_is_checked_without_overflow():
    cache = pages_manager(4, page_size=4, enable_prefix_caching=True)
    blocks = np.zeros(4, np.int64)
    with pytest.raises(ValueError, match="num_prompt_tokens"):
        cache.add_sequence(0, block_hashes=blocks, block_tokens=2**31 - 4, num_prompt_tokens=2**63 - 1)
    assert cache.add_sequence(0, block_hashes=blocks, block_tokens=4, num_prompt_tokens=16) == 0


# ------------------------------------------------------------ attention positions
class PositionsCache:
    """Duck-typed cache with one sequence whose last page starts at ``first``."""

    def __init__(self, first, seq_len, window=1):
        self.kv = np.ones((1, 2, 2, 4, 1, 2), np.float32)
        self.num_layers, self.page_size, self.num_kv_heads, self.head_dim = 1, 4, 1, 2
        self.window = window
        self.sink_tokens = 0
        self.first, self.length = first, seq_len

    def page_table(self, seq_ids):
        class View:
            pass
        view = View()
        view.indptr = np.array([0, 1], np.int32)
        view.indices = np.array([1], np.int32)
        view.page_positions = np.array([self.first], np.int64)
        view.seq_lens = np.array([self.length], np.int64)
        return view


def test_attention_positions_at_the_limit():
    q = np.ones((1, 1, 2), np.float32)
    out = attention.decode(q, PositionsCache(MAX_POSITION - 3, MAX_POSITION), 0, [0])
    np.testing.assert_allclose(out, 1.0)  # V rows are ones
    out = attention.prefill(q, PositionsCache(MAX_POSITION - 3, MAX_POSITION), 0, [0], [0, 1])
    np.testing.assert_allclose(out, 1.0)


@pytest.mark.parametrize("first, seq_len", [
    (MAX_POSITION - 3, MAX_POSITION + 1),   # seq_len past the limit
    (MAX_POSITION + 1, MAX_POSITION + 2),   # a page position past it
    (2**63 - 2, 2**63 - 1),                 # page_positions + page_size would overflow int64
])
def test_attention_refuses_positions_past_the_limit(first, seq_len):
    q = np.ones((1, 1, 2), np.float32)
    with pytest.raises(ValueError, match=r"2\*\*62"):
        attention.decode(q, PositionsCache(first, seq_len), 0, [0])
    with pytest.raises(ValueError, match=r"2\*\*62"):
        attention.prefill(q, PositionsCache(first, seq_len), 0, [0], [0, 1])


def test_attention_refuses_a_window_past_the_limit():
    q = np.ones((1, 1, 2), np.float32)
    with pytest.raises(ValueError, match="cache.window"):
        attention.decode(q, PositionsCache(0, 4, window=MAX_POSITION + 1), 0, [0])
    out = attention.decode(q, PositionsCache(0, 4, window=MAX_POSITION), 0, [0])
    np.testing.assert_allclose(out, 1.0)


def test_attention_query_heads_stop_at_the_limit():
    cache = PositionsCache(0, 4)
    cache.kv = np.ones((1, 2, 2, 4, 1, 1), np.float32)
    cache.head_dim = 1
    # (at the limit the scratch of one work item is hundreds of MiB: not run)
    out = attention.decode(np.ones((1, 4, 1), np.float32), cache, 0, [0])
    assert out.shape == (1, 4, 1)
    with pytest.raises(ValueError, match=r"2\*\*20"):
        attention.decode(np.ones((1, 2**20 + 1, 1), np.float32), cache, 0, [0])


def test_prefix_index_refuses_empty_sizes():
    from pagedkv_c._prefix import PrefixIndex

    with pytest.raises(ValueError, match="num_pages"):
        PrefixIndex(0, 4)
    with pytest.raises(ValueError, match="page_size"):
        PrefixIndex(4, 0)
    assert PrefixIndex(1, 1).num_cached == 0
