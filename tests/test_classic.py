"""PagedKVCache (classic single-stream API) against a plain-Python reference model."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedkv import PagedKVCache
from reference_cache import RefClassicCache

INT64_MAX = 2**63 - 1


def same_array(got, expected):
    """Exact equality: dtype, shape and bytes."""
    return got.dtype == expected.dtype and got.shape == expected.shape and got.tobytes() == expected.tobytes()


def snapshot(cache, tokens):
    """Everything observable about a cache, for 'nothing changed' checks."""
    keys, values, present = cache.get_many(list(tokens))
    return (
        len(cache),
        cache.resident_pages.tolist(),
        cache.evictions,
        keys.tobytes(),
        values.tobytes(),
        present.tolist(),
        [token in cache for token in tokens],
    )


def rows(n, dim, start=0.0, dtype=np.float32):
    """Distinct, exactly representable rows (n, dim)."""
    return (start + np.arange(n * dim, dtype=np.float64).reshape(n, dim)).astype(dtype)


# ----------------------------------------------------------------- must hold
def test_three_pages_dim_four_returns_exactly_what_was_put():
    cache = PagedKVCache(max_pages=3, dim=4)
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((5, 4)).astype(np.float32)
    values = rng.standard_normal((5, 4)).astype(np.float32)
    for token in range(5):
        cache.put(token, keys[token], values[token])
    for token in (0, 4):
        key, value = cache.get(token)
        assert same_array(key, keys[token]) and same_array(value, values[token])
    assert cache.get(10) is None
    cache.check_invariants()


def test_page_size_four_two_pages_evicts_the_first_page_once():
    cache = PagedKVCache(max_pages=2, dim=3, page_size=4)
    for token in range(12):
        cache.put(token, [token, token + 0.5, -token], [2 * token, 0, 1])
    for token in range(4):
        assert token not in cache and cache.get(token) is None
    for token in range(4, 12):
        key, value = cache.get(token)
        assert same_array(key, np.array([token, token + 0.5, -token], dtype=np.float32))
        assert same_array(value, np.array([2 * token, 0, 1], dtype=np.float32))
    assert cache.evictions == 1
    assert cache.resident_pages.tolist() == [1, 2]
    assert len(cache) == 8
    cache.check_invariants()


# ------------------------------------------------------------------ semantics
def test_get_returns_fresh_arrays_that_do_not_alias_the_cache():
    cache = PagedKVCache(2, 4, page_size=2)
    key = np.arange(4, dtype=np.float32)
    value = -key
    cache.put(1, key, value)
    key[:] = 99  # the cache copied the input
    got_key, got_value = cache.get(1)
    assert got_key.base is None and got_key.flags.owndata and got_key.flags.writeable
    assert got_value.base is None and got_value.flags.owndata
    got_key[:] = 7
    got_value[:] = 7
    again_key, again_value = cache.get(1)
    assert again_key.tolist() == [0, 1, 2, 3] and again_value.tolist() == [0, -1, -2, -3]
    assert not np.shares_memory(again_key, got_key)
    keys, values, _ = cache.get_many([1])
    keys[:] = 5
    assert cache.get(1)[0].tolist() == [0, 1, 2, 3]


def test_unwritten_slots_of_a_resident_page_are_absent():
    cache = PagedKVCache(4, 2, page_size=4)
    cache.put(5, [1, 2], [3, 4])
    assert cache.resident_pages.tolist() == [1]
    assert len(cache) == 1
    for token in (4, 6, 7):
        assert token not in cache and cache.get(token) is None
    keys, values, present = cache.get_many([4, 5, 6])
    assert present.tolist() == [False, True, False]
    assert keys[[0, 2]].tolist() == [[0, 0], [0, 0]] and values[0].tolist() == [0, 0]


def test_overwrite_keeps_count_and_fifo_order():
    cache = PagedKVCache(2, 1, page_size=2)
    cache.put(0, [1], [1])
    cache.put(2, [2], [2])
    cache.put(0, [3], [3])  # overwrite: page 0 stays the oldest (FIFO, not LRU)
    assert len(cache) == 2 and cache.get(0)[0].tolist() == [3]
    cache.put(4, [4], [4])
    assert cache.resident_pages.tolist() == [1, 2]
    assert 0 not in cache and cache.evictions == 1


def test_evicted_page_is_reused_with_a_clean_slate():
    cache = PagedKVCache(1, 1, page_size=3)
    cache.put(0, [1], [1])
    cache.put(1, [2], [2])
    cache.put(5, [3], [3])  # page 1 replaces page 0 in the same physical page
    assert [t in cache for t in range(6)] == [False, False, False, False, False, True]
    assert len(cache) == 1
    cache.check_invariants()


def test_resident_pages_order_survives_ring_wrap_around():
    cache = PagedKVCache(3, 1, page_size=1)
    for token in range(10):
        cache.put(token, [token], [token])
        assert cache.resident_pages.tolist() == list(range(max(0, token - 2), token + 1))
    assert cache.evictions == 7


def test_any_int64_token_index_works():
    cache = PagedKVCache(4, 2, page_size=64)
    tokens = [0, 2**40 + 3, 2**62, INT64_MAX]
    for i, token in enumerate(tokens):
        cache.put(token, [i, i], [-i, -i])
    assert cache.resident_pages.tolist() == [t // 64 for t in tokens]
    for i, token in enumerate(tokens):
        assert cache.get(token)[0].tolist() == [i, i]
    assert cache.get(INT64_MAX - 1) is None
    assert np.int64(2**62) in cache and np.uint64(2**62) in cache
    cache.check_invariants()


def test_integer_and_list_inputs_are_cast_to_the_cache_dtype():
    cache = PagedKVCache(2, 3, dtype=np.float64)
    cache.put(0, [1, 2, 3], np.array([4, 5, 6], dtype=np.int8))
    key, value = cache.get(0)
    assert key.dtype == np.float64 and key.tolist() == [1, 2, 3] and value.tolist() == [4, 5, 6]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_every_float_dtype_round_trips_exactly(dtype):
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((10, 5)).astype(dtype)
    values = rng.standard_normal((10, 5)).astype(dtype)
    cache = PagedKVCache(8, 5, page_size=3, dtype=dtype)
    cache.put_many(np.arange(10), keys, values)
    got_keys, got_values, present = cache.get_many(np.arange(10))
    assert present.all()
    assert same_array(got_keys, keys) and same_array(got_values, values)
    assert cache.get(3)[0].dtype == np.dtype(dtype)


def test_strided_byteswapped_and_readonly_inputs_are_accepted():
    cache = PagedKVCache(2, 4, page_size=4)
    wide = np.arange(8, dtype=np.float32)
    swapped = np.arange(4, dtype=">f4")
    readonly = np.arange(4, dtype=np.float32)
    readonly.flags.writeable = False
    cache.put(0, wide[::2], swapped)
    cache.put(1, readonly, readonly)
    assert cache.get(0)[0].tolist() == [0, 2, 4, 6] and cache.get(0)[1].tolist() == [0, 1, 2, 3]
    fortran = np.asfortranarray(rows(3, 4))
    cache.put_many(np.array([2, 3, 4], dtype=np.int32), fortran, fortran[:, ::-1])
    keys, values, present = cache.get_many(np.array([2, 3, 4], dtype=np.uint8))
    assert present.all() and keys.tolist() == rows(3, 4).tolist()
    assert values.tolist() == rows(3, 4)[:, ::-1].tolist()


def test_put_many_spanning_more_pages_than_the_limit_evicts_within_the_call():
    cache = PagedKVCache(2, 1, page_size=2)
    tokens = [0, 1, 2, 3, 4, 0, 5]  # page 0 is evicted by page 2, then comes back
    cache.put_many(tokens, rows(7, 1), rows(7, 1, start=100))
    reference = RefClassicCache(2, 1, 2, np.float32)
    for token, key, value in zip(tokens, rows(7, 1), rows(7, 1, start=100)):
        reference.put(token, key, value)
    assert cache.resident_pages.tolist() == reference.fifo == [2, 0]
    assert cache.evictions == reference.evictions == 2
    assert len(cache) == len(reference) == 3  # tokens 4, 5 (page 2) and 0 (page 0)
    assert cache.get(0)[0].tolist() == [5.0] and cache.get(4)[1].tolist() == [104.0]


def test_runs_near_the_int64_limit():
    cache = PagedKVCache(3, 1, page_size=7)
    tokens = np.array([INT64_MAX - k for k in range(9, -1, -1)], dtype=np.int64)  # ends at the limit
    cache.put_many(tokens, rows(10, 1), rows(10, 1, start=100))
    keys, values, present = cache.get_many(tokens)
    assert present.all() and keys[:, 0].tolist() == list(range(10))
    assert values[:, 0].tolist() == list(range(100, 110))
    assert len(cache) == 10
    cache.check_invariants()


def test_get_many_run_broken_by_an_absent_slot():
    cache = PagedKVCache(2, 1, page_size=8)
    cache.put_many([0, 1, 3, 4], [[0], [1], [3], [4]], [[0], [1], [3], [4]])
    keys, _, present = cache.get_many(list(range(6)))
    assert present.tolist() == [True, True, False, True, True, False]
    assert keys[:, 0].tolist() == [0, 1, 0, 3, 4, 0]


def test_put_many_duplicates_last_one_wins():
    cache = PagedKVCache(2, 2)
    cache.put_many([3, 3, 3], [[1, 1], [2, 2], [3, 3]], [[4, 4], [5, 5], [6, 6]])
    assert len(cache) == 1 and cache.get(3)[0].tolist() == [3, 3] and cache.get(3)[1].tolist() == [6, 6]


def test_get_many_shapes_dtypes_zero_rows_and_empty_batch():
    cache = PagedKVCache(2, 3, page_size=2, dtype=np.float16)
    cache.put(1, [1, 2, 3], [4, 5, 6])
    keys, values, present = cache.get_many([1, 0, 1, 9])
    assert keys.shape == values.shape == (4, 3) and keys.dtype == values.dtype == np.float16
    assert present.dtype == np.bool_ and present.tolist() == [True, False, True, False]
    assert keys.tolist() == [[1, 2, 3], [0, 0, 0], [1, 2, 3], [0, 0, 0]]
    assert values[3].tolist() == [0, 0, 0]
    empty = cache.get_many([])
    assert empty[0].shape == (0, 3) and empty[2].shape == (0,)
    cache.put_many([], np.empty((0, 3)), np.empty((0, 3)))
    assert len(cache) == 1


def test_get_many_into_out_arrays():
    cache = PagedKVCache(2, 2, page_size=2)
    cache.put(0, [1, 2], [3, 4])
    out = (np.full((2, 2), 9, np.float32), np.full((2, 2), 9, np.float32), np.ones(2, bool))
    result = cache.get_many([0, 3], out=out)
    assert all(a is b for a, b in zip(result, out))
    assert out[0].tolist() == [[1, 2], [0, 0]] and out[1].tolist() == [[3, 4], [0, 0]]
    assert out[2].tolist() == [True, False]


def test_clear_drops_everything_and_keeps_the_eviction_count():
    cache = PagedKVCache(2, 1, page_size=1)
    for token in range(5):
        cache.put(token, [token], [token])
    assert cache.evictions == 3
    cache.clear()
    assert len(cache) == 0 and cache.resident_pages.tolist() == [] and cache.evictions == 3
    assert all(cache.get(t) is None for t in range(5))
    cache.check_invariants()
    cache.put(7, [7], [7])
    cache.put(8, [8], [8])
    cache.put(9, [9], [9])
    assert cache.resident_pages.tolist() == [8, 9] and cache.evictions == 4
    cache.check_invariants()


def test_attributes_and_repr():
    cache = PagedKVCache(5, 8, page_size=16, dtype="float16")
    assert (cache.max_pages, cache.dim, cache.page_size) == (5, 8, 16)
    assert cache.dtype == np.float16 and cache.evictions == 0
    assert cache.nbytes == 5 * 2 * 16 * 8 * 2
    assert repr(cache) == (
        "PagedKVCache(max_pages=5, dim=8, page_size=16, dtype=float16, tokens=0, "
        "num_resident_pages=0, evictions=0)"
    )


def test_page_size_defaults_to_64_and_values_come_back_in_the_cache_dtype():
    cache = PagedKVCache(2, 1)
    assert cache.page_size == 64 and cache.dtype == np.float32
    cache.put(0, [0.1], [0.1])
    key, _ = cache.get(0)
    assert key.dtype == np.float32 and float(key[0]) == float(np.float32(0.1)) != 0.1


def test_resident_pages_and_counts_are_read_only_attributes():
    cache = PagedKVCache(2, 1, page_size=2)
    cache.put_many([0, 5], [[1.0], [2.0]], [[1.0], [2.0]])
    assert cache.resident_pages.tolist() == [0, 2] and cache.num_resident_pages == 2
    for name in ("resident_pages", "num_resident_pages", "evictions", "nbytes"):
        with pytest.raises(AttributeError):
            setattr(cache, name, 0)
    pages = cache.resident_pages
    pages[0] = 7  # a copy: the cache is not changed through it
    assert cache.resident_pages.tolist() == [0, 2]


def test_stats_count_every_lookup_of_get_and_get_many_and_nothing_else():
    cache = PagedKVCache(2, 1, page_size=2)
    assert cache.stats() == {"hits": 0, "misses": 0, "evictions": 0, "num_tokens": 0,
                             "num_resident_pages": 0, "max_pages": 2, "capacity_tokens": 4}
    cache.put_many([0, 1, 2], [[0.0], [1.0], [2.0]], [[0.0], [1.0], [2.0]])
    cache.get(0)                      # hit
    cache.get(3)                      # miss: resident page, slot never written
    cache.get_many([0, 1, 2, 3, 9])   # 3 hits, 2 misses
    0 in cache, list(cache), len(cache)  # neither
    cache.put(4, [4.0], [4.0])        # evicts logical page 0 (tokens 0 and 1)
    cache.get(0)                      # miss: evicted
    cache.clear()
    assert cache.stats() == {"hits": 4, "misses": 4, "evictions": 1, "num_tokens": 0,
                             "num_resident_pages": 0, "max_pages": 2, "capacity_tokens": 4}


def test_iteration_gives_present_tokens_in_ascending_order_as_a_snapshot():
    cache = PagedKVCache(3, 1, page_size=4)
    cache.put_many([9, 2, 8, 0, 3], np.zeros((5, 1)), np.zeros((5, 1)))  # pages 2, 0 in FIFO order
    assert cache.resident_pages.tolist() == [2, 0]
    it = iter(cache)
    cache.clear()
    assert list(it) == [0, 2, 3, 8, 9]  # collected when iteration started
    assert list(cache) == [] and len(cache) == 0


# ----------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"max_pages": 0}, ValueError, "max_pages"),
        ({"max_pages": -2}, ValueError, "max_pages"),
        ({"max_pages": 2**31 - 1}, ValueError, "max_pages"),
        ({"max_pages": 2.0}, TypeError, "max_pages"),
        ({"dim": 0}, ValueError, "dim"),
        ({"dim": -1}, ValueError, "dim"),
        ({"dim": "4"}, TypeError, "dim"),
        ({"page_size": 0}, ValueError, "page_size"),
        ({"page_size": True}, TypeError, "page_size"),
        ({"dtype": np.int32}, TypeError, "dtype"),
        ({"dtype": np.complex64}, TypeError, "dtype"),
        ({"dtype": ">f4"}, TypeError, "dtype"),
        ({"dtype": None}, TypeError, "dtype"),
        ({"dtype": "not a dtype"}, TypeError, "dtype"),
        ({"max_pages": 2**30, "page_size": 2**31 - 1, "dim": 2**31 - 1}, ValueError, "max_pages"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, match):
    args = {"max_pages": 2, "dim": 4, "page_size": 4, **kwargs}
    with pytest.raises(exc, match=match):
        PagedKVCache(**args)


DIM = 3
GOOD = [1.0, 2.0, 3.0]
TWO_NEW_PAGES = [8, 9, 12]  # pages 2 and 3 are not resident: storing them would evict


def full_cache():
    """max_pages=2, page_size=4, both pages resident and partly written."""
    cache = PagedKVCache(2, DIM, page_size=4)
    cache.put_many([0, 1, 5], rows(3, DIM), rows(3, DIM, start=50))
    return cache


@pytest.mark.parametrize(
    "call, args, exc, match",
    [
        ("put", (-1, GOOD, GOOD), ValueError, "token_idx"),
        ("put", (2**63, GOOD, GOOD), ValueError, "token_idx"),
        ("put", (1.0, GOOD, GOOD), TypeError, "token_idx"),
        ("put", (True, GOOD, GOOD), TypeError, "token_idx"),
        ("put", ("8", GOOD, GOOD), TypeError, "token_idx"),
        ("put", (None, GOOD, GOOD), TypeError, "token_idx"),
        ("put", (np.float64(8), GOOD, GOOD), TypeError, "token_idx"),
        ("put", (8, [1.0, 2.0], GOOD), ValueError, "key"),
        ("put", (8, GOOD, [1.0] * 4), ValueError, "value"),
        ("put", (8, np.ones((1, DIM), np.float32), GOOD), ValueError, r"key.*\(1, 3\)"),
        ("put", (8, GOOD, np.ones((DIM, 1), np.float32)), ValueError, "value"),
        ("put", (8, np.float32(1), GOOD), ValueError, "key"),
        ("put", (8, [[1.0, 2.0], [3.0]], GOOD), ValueError, "key"),
        ("put", (8, ["a", "b", "c"], GOOD), TypeError, "key"),
        ("put", (8, GOOD, [True, False, True]), TypeError, "value"),
        ("put", (8, GOOD, np.ones(DIM, complex)), TypeError, "value"),
        ("put", (8, [object(), 1, 2], GOOD), TypeError, "key"),
        ("put", (8, None, GOOD), TypeError, "key"),
        ("get", (-3,), ValueError, "token_idx"),
        ("get", (0.0,), TypeError, "token_idx"),
        ("get", (False,), TypeError, "token_idx"),
        ("__contains__", (-1,), ValueError, "token_idx"),
        ("__contains__", ("0",), TypeError, "token_idx"),
        ("put_many", (TWO_NEW_PAGES + [-1], rows(4, DIM), rows(4, DIM)), ValueError, r"token_idxs\[3\] = -1"),
        ("put_many", ([8.0, 9.0], rows(2, DIM), rows(2, DIM)), TypeError, "token_idxs"),
        ("put_many", ([True, False], rows(2, DIM), rows(2, DIM)), TypeError, "token_idxs"),
        ("put_many", ([[8, 9]], rows(2, DIM), rows(2, DIM)), ValueError, "token_idxs"),
        ("put_many", (8, rows(1, DIM), rows(1, DIM)), ValueError, "token_idxs"),
        ("put_many", (np.array([8, 2**63], np.uint64), rows(2, DIM), rows(2, DIM)), ValueError, "token_idxs"),
        ("put_many", (TWO_NEW_PAGES, rows(3, DIM + 1), rows(3, DIM)), ValueError, "keys"),
        ("put_many", (TWO_NEW_PAGES, rows(2, DIM), rows(3, DIM)), ValueError, "keys"),
        ("put_many", (TWO_NEW_PAGES, rows(3, DIM), rows(3, DIM).ravel()), ValueError, "values"),
        ("put_many", (TWO_NEW_PAGES, rows(3, DIM), rows(3, DIM)[None]), ValueError, "values"),
        ("put_many", (TWO_NEW_PAGES, rows(3, DIM).astype(str), rows(3, DIM)), TypeError, "keys"),
        ("put_many", (TWO_NEW_PAGES, rows(3, DIM), rows(3, DIM) > 1), TypeError, "values"),
        ("put_many", (TWO_NEW_PAGES, [[1, 2, 3], [4, 5, 6], [7, 8]], rows(3, DIM)), ValueError, "keys"),
        ("get_many", ([0, -5],), ValueError, "token_idxs"),
        ("get_many", ([0.5],), TypeError, "token_idxs"),
        ("get_many", ([0, 1], (np.zeros((2, DIM), np.float32),) * 2), TypeError, "out"),
        ("get_many", ([0, 1], [np.zeros((2, DIM), np.float32)] * 2 + [np.zeros(2, bool)]), TypeError, "out"),
        ("get_many", ([0, 1], (np.zeros((2, DIM)), np.zeros((2, DIM), np.float32), np.zeros(2, bool))),
         TypeError, r"out\[0\]"),
        ("get_many", ([0, 1], (np.zeros((2, DIM), np.float32), np.zeros((3, DIM), np.float32), np.zeros(2, bool))),
         ValueError, r"out\[1\]"),
        ("get_many", ([0, 1], (np.zeros((2, DIM), np.float32), np.zeros((2, DIM), np.float32), np.zeros(2, np.uint8))),
         TypeError, r"out\[2\]"),
        ("get_many", ([0, 1], (np.zeros((2, DIM), np.float32), np.zeros((2, DIM), np.float32).T.copy().T,
                               np.zeros(2, bool))), ValueError, r"out\[1\]"),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, args, exc, match):
    cache = full_cache()
    tokens = range(16)
    before = snapshot(cache, tokens)
    with pytest.raises(exc, match=match):
        getattr(cache, call)(*args)
    assert snapshot(cache, tokens) == before
    cache.check_invariants()


def test_get_many_rejects_read_only_and_overlapping_out_arrays():
    cache = full_cache()
    keys = np.zeros((2, DIM), np.float32)
    values = np.zeros((2, DIM), np.float32)
    present = np.zeros(2, bool)
    keys.flags.writeable = False
    with pytest.raises(ValueError, match=r"out\[0\].*writeable"):
        cache.get_many([0, 1], out=(keys, values, present))
    assert not keys.any()
    shared = np.zeros((2, DIM), np.float32)
    with pytest.raises(ValueError, match="overlap"):
        cache.get_many([0, 1], out=(shared, shared, present))
    assert not shared.any() and not present.any()
    # Output rows written over the token indices would change them mid-call.
    buffer = np.zeros(2 * DIM * 2, dtype=np.float32)
    tokens = buffer.view(np.int64)[:2]
    with pytest.raises(ValueError, match="token_idxs"):
        cache.get_many(tokens, out=(buffer[:2 * DIM].reshape(2, DIM), values, present))
    assert not buffer.any()


# ----------------------------------------------- put_many == loop of put, any input
# Scattered tokens, or runs of consecutive tokens (which the batch calls copy
# run by run) that cross page boundaries and overlap one another.
runs_strategy = st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), max_size=4).map(
    lambda runs: [token for start, length in runs for token in range(start, start + length)]
)
tokens_strategy = st.one_of(st.lists(st.integers(0, 40), max_size=30), runs_strategy)


@settings(max_examples=150, deadline=None)
@given(
    tokens=tokens_strategy,
    max_pages=st.integers(1, 4),
    page_size=st.integers(1, 5),
    split=st.integers(0, 30),
)
def test_batch_calls_equal_loops_of_single_calls(tokens, max_pages, page_size, split):
    dim = 2
    keys = rows(len(tokens), dim)
    values = rows(len(tokens), dim, start=1000)
    batched = PagedKVCache(max_pages, dim, page_size=page_size)
    looped = PagedKVCache(max_pages, dim, page_size=page_size)
    # Two batches, to cover a batch that starts with pages already resident.
    batched.put_many(tokens[:split], keys[:split], values[:split])
    batched.put_many(tokens[split:], keys[split:], values[split:])
    for token, key, value in zip(tokens, keys, values):
        looped.put(token, key, value)
    universe = list(range(53))
    assert snapshot(batched, universe) == snapshot(looped, universe)
    got_keys, got_values, present = batched.get_many(universe)
    for i, token in enumerate(universe):
        single = looped.get(token)
        assert present[i] == (single is not None)
        if single is not None:
            assert same_array(got_keys[i], single[0]) and same_array(got_values[i], single[1])
        else:
            assert not got_keys[i].any() and not got_values[i].any()
    batched.check_invariants()


# ------------------------------------------------- stateful, against the model
SMALL_TOKENS = st.integers(0, 24)
HUGE_TOKENS = st.integers(INT64_MAX - 40, INT64_MAX)
TOKENS = st.one_of(SMALL_TOKENS, SMALL_TOKENS, HUGE_TOKENS)
FORMS = st.sampled_from(["exact", "list", "float64", "strided"])


class CacheMachine(RuleBasedStateMachine):
    """Random put/get/put_many/get_many/clear and failing calls against RefClassicCache."""

    @initialize(
        max_pages=st.integers(1, 4),
        page_size=st.integers(1, 5),
        dim=st.integers(1, 3),
        dtype=st.sampled_from([np.float32, np.float16, np.float64]),
    )
    def make(self, max_pages, page_size, dim, dtype):
        self.cache = PagedKVCache(max_pages, dim, page_size=page_size, dtype=dtype)
        self.model = RefClassicCache(max_pages, dim, page_size, dtype)
        self.dim = dim
        self.counter = 0
        self.seen = set()

    def fresh_rows(self, n):
        """n distinct key rows and value rows, never seen before (detects stale data)."""
        start = (self.counter % 500) + 0.5
        self.counter += n
        keys = rows(n, self.dim, start=start, dtype=np.float64)
        return keys, -keys

    def convert(self, arr, form):
        dtype = self.cache.dtype
        if form == "exact":
            return np.ascontiguousarray(arr, dtype=dtype)
        if form == "list":
            return arr.tolist()
        if form == "float64":
            return arr.astype(np.float64)
        doubled = np.repeat(arr.astype(dtype), 2, axis=-1)
        return doubled[..., ::2]  # non-contiguous view with the same values

    @rule(token=TOKENS, form=FORMS)
    def put(self, token, form):
        keys, values = self.fresh_rows(1)
        self.cache.put(token, self.convert(keys[0], form), self.convert(values[0], form))
        self.model.put(token, keys[0], values[0])
        self.seen.add(token)

    @rule(tokens=st.lists(TOKENS, max_size=12), form=FORMS, as_array=st.booleans())
    def put_many(self, tokens, form, as_array):
        keys, values = self.fresh_rows(len(tokens))
        token_arg = np.array(tokens, dtype=np.int64) if as_array else tokens
        self.cache.put_many(token_arg, self.convert(keys, form), self.convert(values, form))
        for token, key, value in zip(tokens, keys, values):
            self.model.put(token, key, value)
        self.seen.update(tokens)

    @rule(token=TOKENS)
    def get(self, token):
        got = self.cache.get(token)
        expected = self.model.lookup(token)
        assert (got is None) == (expected is None)
        if expected is not None:
            assert same_array(got[0], expected[0]) and same_array(got[1], expected[1])
        assert (token in self.cache) == (expected is not None)

    @rule(tokens=st.lists(TOKENS, max_size=12))
    def get_many(self, tokens):
        keys, values, present = self.cache.get_many(tokens)
        assert keys.shape == values.shape == (len(tokens), self.dim)
        for i, token in enumerate(tokens):
            expected = self.model.lookup(token)
            assert present[i] == (expected is not None)
            if expected is None:
                assert not keys[i].any() and not values[i].any()
            else:
                assert same_array(keys[i], expected[0]) and same_array(values[i], expected[1])

    @rule()
    def clear(self):
        self.cache.clear()
        self.model.clear()

    @rule(
        kind=st.sampled_from(["negative", "float token", "short key", "2-D key", "bad batch", "ragged"]),
        token=TOKENS,
    )
    def failing_call(self, kind, token):
        before = snapshot(self.cache, sorted(self.seen))
        good = np.zeros(self.dim)
        with pytest.raises((TypeError, ValueError)):
            if kind == "negative":
                self.cache.put(-1 - token, good, good)
            elif kind == "float token":
                self.cache.put(float(token), good, good)
            elif kind == "short key":
                self.cache.put(token, np.zeros(self.dim + 1), good)
            elif kind == "2-D key":
                self.cache.put(token, good[None, :], good)
            elif kind == "bad batch":
                # Valid tokens first: a cache that mutated before validating
                # would store (and maybe evict) them.
                self.cache.put_many([token, token + 1 if token < INT64_MAX else 0, -1],
                                    np.zeros((3, self.dim)), np.zeros((3, self.dim)))
            else:
                self.cache.put_many([token], np.zeros((1, self.dim)), np.zeros((2, self.dim)))
        assert snapshot(self.cache, sorted(self.seen)) == before
        for _ in range(2):  # the two snapshots' lookups
            for token in self.seen:
                self.model.lookup(token)

    @invariant()
    def matches_model(self):
        self.cache.check_invariants()
        assert len(self.cache) == len(self.model)
        assert self.cache.resident_pages.tolist() == self.model.fifo
        assert self.cache.num_resident_pages == len(self.model.fifo)
        assert self.cache.evictions == self.model.evictions
        assert list(self.cache) == self.model.tokens()
        assert self.cache.stats() == {
            "hits": self.model.hits, "misses": self.model.misses, "evictions": self.model.evictions,
            "num_tokens": len(self.model), "num_resident_pages": len(self.model.fifo),
            "max_pages": self.model.max_pages, "capacity_tokens": self.model.max_pages * self.model.page_size,
        }
        tokens = sorted(self.seen)
        keys, values, present = self.cache.get_many(tokens)
        for i, token in enumerate(tokens):
            expected = self.model.lookup(token)
            assert present[i] == (expected is not None)
            if expected is not None:
                assert same_array(keys[i], expected[0]) and same_array(values[i], expected[1])


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None)
