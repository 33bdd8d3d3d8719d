"""KVCache against the plain-Python reference model in reference_cache.py."""
import math
import threading

import numpy as np
import pytest
from hypothesis import assume, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedkv import KVCache, OutOfPagesError
from reference_cache import OutOfPages, RefCache
import reference_formats

HEADS, DIM = 2, 3


def snapshot(cache):
    """Everything observable about a cache, for 'nothing changed' checks."""
    ids = cache.seq_ids()
    view = cache.page_table(ids)
    return (
        cache.stats(),
        cache.pool.free_pages().tolist(),
        ids,
        view.indptr.tolist(),
        view.indices.tolist(),
        view.seq_lens.tolist(),
        cache.kv.tobytes(),
    )


def random_kv(rng, n, dtype=np.float32):
    k = rng.standard_normal((n, HEADS, DIM)).astype(dtype)
    v = rng.standard_normal((n, HEADS, DIM)).astype(dtype)
    return k, v


def fill(cache, seq_id, n, rng, layers=None):
    """Append n tokens to one sequence and store random K/V in every layer."""
    slots = cache.append([seq_id], [n])
    kvs = []
    for layer in range(cache.num_layers) if layers is None else layers:
        k, v = random_kv(rng, n, cache.dtype)
        cache.store(layer, slots, k, v)
        kvs.append((k, v))
    return slots, kvs


# --------------------------------------------------------------------- layout
def test_pool_layout_is_flashinfer_nhd():
    cache = KVCache(3, 4, 8, num_pages=5, page_size=16, dtype=np.float16)
    assert cache.kv.shape == (3, 5, 2, 16, 4, 8)
    assert cache.kv.flags.c_contiguous and cache.kv.dtype == np.float16
    assert cache.stats()["bytes_per_page"] == 3 * 2 * 16 * 4 * 8 * 2


def test_store_writes_k_and_v_at_their_slots():
    cache = KVCache(2, HEADS, DIM, num_pages=4, page_size=4, dtype=np.float32)
    cache.add_sequence(7)
    slots = cache.append([7], [6])
    rng = np.random.default_rng(0)
    k, v = random_kv(rng, 6)
    cache.store(1, slots, k, v)
    for t, slot in enumerate(slots):
        page, offset = divmod(int(slot), 4)
        np.testing.assert_array_equal(cache.kv[1, page, 0, offset], k[t])
        np.testing.assert_array_equal(cache.kv[1, page, 1, offset], v[t])
    assert not cache.kv[0].any()


def test_float32_input_into_float16_pool_converts():
    cache = KVCache(1, HEADS, DIM, num_pages=2, page_size=4, dtype=np.float16)
    cache.add_sequence(0)
    slots = cache.append([0], [3])
    k, v = random_kv(np.random.default_rng(1), 3)
    cache.store(0, slots, k, v)
    got_k, got_v, _ = cache.gather(0, 0)
    np.testing.assert_array_equal(got_k, k.astype(np.float16))
    np.testing.assert_array_equal(got_v, v.astype(np.float16))


def test_padding_slot_is_skipped():
    cache = KVCache(1, HEADS, DIM, num_pages=2, page_size=4, dtype=np.float32)
    cache.add_sequence(0)
    slots = cache.append([0], [2])
    k, v = random_kv(np.random.default_rng(2), 3)
    cache.store(0, np.array([slots[0], -1, slots[1]]), k, v)
    got_k, _, _ = cache.gather(0, 0)
    np.testing.assert_array_equal(got_k, k[[0, 2]])


# ---------------------------------------------------------------- page tables
def test_exact_multiple_of_page_size_has_full_last_page():
    cache = KVCache(1, HEADS, DIM, num_pages=8, page_size=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.add_sequence(2)
    cache.append([0, 1], [8, 5])
    view = cache.page_table([0, 1, 2])
    assert view.last_page_len.tolist() == [4, 1, 0]
    assert view.indptr.tolist() == [0, 2, 4, 4]
    assert view.indices.dtype == np.int32 and view.indptr.dtype == np.int32
    assert view.page_positions.tolist() == [0, 4, 0, 4]
    assert view.seq_lens.tolist() == [8, 5, 0]


def test_block_tables_are_indexed_by_logical_page():
    cache = KVCache(1, HEADS, DIM, num_pages=16, page_size=2, window=3, sink_tokens=1)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.append([0, 1], [1, 3])
    cache.append([0], [8])
    cache.append([0], [1])  # n0 = 9: releases logical pages 1..2 (positions 2..5 < 7)
    view = cache.page_table([0, 1])
    tables = view.block_tables()
    assert tables.shape == (2, 5)
    held = dict(zip(view.page_positions[: view.indptr[1]] // 2, view.indices[: view.indptr[1]]))
    assert sorted(held) == [0, 3, 4]
    assert [tables[0, k] for k in range(5)] == [held.get(k, -1) for k in range(5)]
    assert tables[1].tolist()[:2] == view.indices[view.indptr[1]:].tolist()
    assert tables[1, 2:].tolist() == [-1, -1, -1]
    assert (view.block_tables(pad=0)[1, 2:] == 0).all()


@pytest.mark.parametrize(
    "page_size, window, sinks",
    [
        (4, 6, 0),  # window not a multiple of the page size
        (4, 3, 0),  # window smaller than a page
        (4, 1, 0),  # window of one token
        (4, 10, 5),  # sinks not a multiple of the page size
        (3, 7, 2),
        (1, 4, 1),
    ],
)
def test_window_releases_pages_and_keeps_what_queries_need(page_size, window, sinks):
    cache = KVCache(1, HEADS, DIM, num_pages=64, page_size=page_size, window=window, sink_tokens=sinks)
    cache.add_sequence(0)
    rng = np.random.default_rng(3)
    stored = {}
    for step in range(60):
        n = 1 if step % 7 else 5
        n0 = cache.seq_len(0)
        slots, [(k, v)] = fill(cache, 0, n, rng)
        for t in range(n):
            stored[n0 + t] = k[t]
        length = n0 + n
        keys, _, positions = cache.gather(0, 0)
        # Every key a query of this append needs is cached.
        needed = set(range(max(0, n0 - window + 1), length)) | set(range(min(sinks, length)))
        assert needed <= set(positions.tolist())
        for row, pos in zip(keys, positions):
            np.testing.assert_array_equal(row, stored[pos].astype(np.float16))
        # Memory bound of a windowed sequence after an append of n tokens.
        view = cache.page_table([0])
        num_sink_pages = math.ceil(sinks / page_size)
        window_pages = view.indices.size - min(num_sink_pages, math.ceil(length / page_size))
        assert window_pages <= math.ceil((window + n - 2) / page_size) + 1
        cache.check_invariants()
    assert cache.stats()["evictions"] > 0


def test_decode_ring_reuses_pages_in_place():
    page_size, window = 4, 8
    cache = KVCache(1, HEADS, DIM, num_pages=8, page_size=page_size, window=window)
    cache.add_sequence(0)
    cache.append([0], [1])
    for _ in range(200):
        cache.append([0], [1])
    bound = math.ceil((window - 1) / page_size) + 1
    assert cache.stats()["pages_peak"] <= bound
    # Pages released by the window were reused, not taken from the free queue.
    assert set(cache.page_table([0]).indices.tolist()) <= set(range(bound))
    cache.check_invariants()


def test_append_longer_than_window_keeps_all_tokens_until_next_append():
    cache = KVCache(1, HEADS, DIM, num_pages=32, page_size=4, window=5)
    cache.add_sequence(0)
    cache.append([0], [3])
    cache.append([0], [30])
    assert cache.num_cached_tokens(0) == 33
    cache.append([0], [1])
    # n0 = 33: pages whose positions are all < 29 go.
    _, _, positions = cache.gather(0, 0)
    assert positions.tolist() == list(range(28, 34))
    cache.check_invariants()


@pytest.mark.parametrize("window, sinks", [(None, 0), (6, 2)])
def test_append_without_slot_mapping_does_the_same_page_work(window, sinks):
    """return_slot_mapping=False returns None and leaves the cache as the default call does."""
    caches = [KVCache(1, HEADS, DIM, num_pages=24, page_size=4, window=window, sink_tokens=sinks,
                      enable_prefix_caching=True) for _ in range(2)]
    rng = np.random.default_rng(7)
    steps = [(int(rng.integers(0, 3)), int(rng.integers(0, 9))) for _ in range(40)]
    for cache in caches:
        cache.add_sequence(0, prompt_token_ids=list(range(10)))
        cache.add_sequence(1, prompt_token_ids=list(range(7)))
    for seq_id, n in steps:
        seq_ids, counts = [seq_id % 2], [n]
        slots = caches[0].append(seq_ids, counts)
        assert slots.shape == (n,)
        assert caches[1].append(seq_ids, counts, return_slot_mapping=False) is None
        if seq_id == 2:  # now and then a sequence ends and a new one reuses its cached pages
            for cache in caches:
                cache.remove_sequence(0)
                cache.add_sequence(0, prompt_token_ids=list(range(10)))
    for cache in caches:
        cache.check_invariants()
    a, b = snapshot(caches[0]), snapshot(caches[1])
    assert a == b


def test_window_at_least_the_length_is_full_attention():
    full = KVCache(1, HEADS, DIM, num_pages=16, page_size=4)
    windowed = KVCache(1, HEADS, DIM, num_pages=16, page_size=4, window=1000, sink_tokens=3)
    for cache in (full, windowed):
        cache.add_sequence(0)
        for n in (5, 1, 1, 9, 3):
            cache.append([0], [n])
    assert full.page_table([0]).indices.tolist() == windowed.page_table([0]).indices.tolist()
    assert windowed.stats()["evictions"] == 0


# -------------------------------------------------------- fork / copy-on-write
def test_fork_diverge_remove_both_frees_every_page_once():
    cache = KVCache(2, HEADS, DIM, num_pages=10, page_size=4, dtype=np.float32)
    rng = np.random.default_rng(4)
    cache.add_sequence(0)
    _, parent_kv = fill(cache, 0, 6, rng)
    before = [cache.gather(layer, 0) for layer in range(2)]
    cache.fork(0, 1)
    assert cache.stats()["pages_in_use"] == 2
    assert [cache.pool.ref_count(int(p)) for p in cache.page_table([0]).indices] == [2, 2]
    # Child writes into the shared partial page: copy-on-write for all layers.
    fill(cache, 1, 3, rng)
    assert cache.stats()["cow_copies"] == 1
    for layer in range(2):
        for got, want in zip(cache.gather(layer, 0), before[layer]):
            np.testing.assert_array_equal(got, want)
        child_k, _, child_pos = cache.gather(layer, 1)
        np.testing.assert_array_equal(child_k[:6], parent_kv[layer][0])
        assert child_pos.tolist() == list(range(9))
    # Parent writes too: its page is no longer shared, so no copy.
    fill(cache, 0, 1, rng)
    assert cache.stats()["cow_copies"] == 1
    cache.check_invariants()
    cache.remove_sequence(0)
    cache.check_invariants()
    cache.remove_sequence(1)
    cache.check_invariants()
    assert cache.pool.num_free == 10
    assert sorted(cache.pool.free_pages().tolist()) == list(range(10))


def test_truncate_then_append_copies_a_shared_page():
    cache = KVCache(1, HEADS, DIM, num_pages=8, page_size=4, dtype=np.float32)
    rng = np.random.default_rng(5)
    cache.add_sequence(0)
    fill(cache, 0, 8, rng)
    cache.fork(0, 1)
    cache.truncate(1, 6)
    before = cache.gather(0, 0)
    fill(cache, 1, 2, rng)
    for got, want in zip(cache.gather(0, 0), before):
        np.testing.assert_array_equal(got, want)
    assert cache.stats()["cow_copies"] == 1
    cache.check_invariants()


def test_truncate_to_zero_frees_everything():
    cache = KVCache(1, HEADS, DIM, num_pages=4, page_size=4)
    cache.add_sequence(0)
    cache.append([0], [13])
    cache.truncate(0, 0)
    assert cache.seq_len(0) == 0 and cache.pool.num_free == 4
    cache.append([0], [16])
    cache.check_invariants()


def test_truncate_into_released_keys_is_refused():
    cache = KVCache(1, HEADS, DIM, num_pages=16, page_size=4, window=6, sink_tokens=2)
    cache.add_sequence(0)
    for _ in range(20):
        cache.append([0], [1])
    # n0 of the last append = 19, so positions < 14 left the window: pages 1, 2 are gone.
    before = snapshot(cache)
    with pytest.raises(ValueError, match=r"new_len <= 4 or 17 <= new_len <= 20"):
        cache.truncate(0, 16)
    assert snapshot(cache) == before
    cache.truncate(0, 17)
    cache.truncate(0, 3)
    _, _, positions = cache.gather(0, 0) if cache.num_layers else (None, None, None)
    assert cache.seq_len(0) == 3 and cache.num_cached_tokens(0) == 3
    cache.check_invariants()


def test_truncate_with_a_one_token_window_keeps_the_cache_consistent():
    """With window=1 the query at position new_len needs only itself, so
    truncate may go back to a length whose last token the window released."""
    cache = KVCache(1, HEADS, DIM, num_pages=8, page_size=1, window=1)
    cache.add_sequence(0)
    cache.append([0], [1])
    cache.append([0], [1])  # releases position 0
    cache.truncate(0, 1)
    assert cache.seq_len(0) == 1 and cache.num_cached_tokens(0) == 0
    cache.check_invariants()
    cache.append([0], [1])  # position 1, the next query's only key
    assert cache.gather(0, 0)[2].tolist() == [1]
    cache.check_invariants()


# ------------------------------------------------------------- all-or-nothing
def test_batch_that_overfills_the_pool_by_one_page_changes_nothing():
    cache = KVCache(1, HEADS, DIM, num_pages=6, page_size=4)
    for s in range(3):
        cache.add_sequence(s)
    cache.append([0], [3])  # one page, 1 free slot in it
    before = snapshot(cache)
    with pytest.raises(OutOfPagesError, match="need 6 new pages of 4 tokens, but only 5 of the 6 pages are free"):
        cache.append([0, 1, 2], [5, 8, 9])  # 1 + 2 + 3 = 6 new pages
    assert snapshot(cache) == before
    cache.check_invariants()
    cache.append([0, 1, 2], [5, 8, 8])  # exactly 5: fills the pool
    assert cache.pool.num_free == 0
    cache.check_invariants()


def test_pages_released_by_the_call_count_towards_it():
    cache = KVCache(1, HEADS, DIM, num_pages=4, page_size=2, window=2)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.append([0], [5])  # 3 pages
    cache.append([1], [1])  # 1 page: pool full
    # Sequence 1 needs 2 pages; only sequence 0's release (positions < 4) frees them,
    # and sequence 0's own token fits its partial last page.
    cache.append([1, 0], [4, 1])
    assert cache.pool.num_free == 0
    cache.check_invariants()


# -------------------------------------------------------------------- errors
def make_error_cache():
    cache = KVCache(2, HEADS, DIM, num_pages=8, page_size=4, dtype=np.float32, window=8)
    cache.add_sequence(0)
    cache.add_sequence(1)
    fill(cache, 0, 5, np.random.default_rng(6))
    return cache


GOOD_K = np.zeros((2, HEADS, DIM), np.float32)

ERROR_CASES = [
    ("add existing", lambda c: c.add_sequence(0), ValueError, "already exists"),
    ("add non-int", lambda c: c.add_sequence("a"), TypeError, "seq_id"),
    ("remove unknown", lambda c: c.remove_sequence(9), KeyError, "unknown sequence"),
    ("fork unknown", lambda c: c.fork(9, 3), KeyError, "unknown sequence"),
    ("fork onto existing", lambda c: c.fork(0, 1), ValueError, "already exists"),
    ("append unknown", lambda c: c.append([0, 9], [1, 1]), KeyError, "unknown sequence"),
    ("append duplicate", lambda c: c.append([0, 0], [1, 1]), ValueError, "more than once"),
    ("append negative", lambda c: c.append([0, 1], [1, -1]), ValueError, "num_tokens"),
    ("append length mismatch", lambda c: c.append([0, 1], [1]), ValueError, "num_tokens"),
    ("append float counts", lambda c: c.append([0], [1.5]), TypeError, "num_tokens"),
    ("append 2-D ids", lambda c: c.append([[0]], [1]), ValueError, "seq_ids"),
    ("truncate too long", lambda c: c.truncate(0, 6), ValueError, "new_len"),
    ("truncate negative", lambda c: c.truncate(0, -1), ValueError, "new_len"),
    ("truncate unknown", lambda c: c.truncate(5, 0), KeyError, "unknown sequence"),
    ("store bad layer", lambda c: c.store(2, [0, 1], GOOD_K, GOOD_K), IndexError, "layer"),
    ("store negative layer", lambda c: c.store(-1, [0, 1], GOOD_K, GOOD_K), IndexError, "layer"),
    ("store slot out of pool", lambda c: c.store(0, [0, 32], GOOD_K, GOOD_K), ValueError, r"\[-1, 31\]"),
    ("store slot below -1", lambda c: c.store(0, [-2, 1], GOOD_K, GOOD_K), ValueError, "slot_mapping"),
    ("store length mismatch", lambda c: c.store(0, [0, 1, 2], GOOD_K, GOOD_K), ValueError, "shape of k"),
    ("store bad heads", lambda c: c.store(0, [0], np.zeros((1, 3, DIM), np.float32), np.zeros((1, 3, DIM), np.float32)), ValueError, "shape of k"),
    ("store bool dtype", lambda c: c.store(0, [0, 1], GOOD_K.astype(bool), GOOD_K), TypeError, "dtype of k"),
    ("store v mismatch", lambda c: c.store(0, [0, 1], GOOD_K, GOOD_K[:1]), ValueError, "shape of v"),
    ("store objects", lambda c: c.store(0, [0, 1], [[[None] * DIM] * HEADS] * 2, GOOD_K), TypeError, "k"),
    ("gather bad layer", lambda c: c.gather(5, 0), IndexError, "layer"),
    ("gather unknown", lambda c: c.gather(0, 4), KeyError, "unknown sequence"),
    ("page_table unknown", lambda c: c.page_table([0, 4]), KeyError, "unknown sequence"),
    # Ids are integers: a float or bool equal to a known id must not select it.
    ("remove float id", lambda c: c.remove_sequence(1.0), TypeError, "seq_id"),
    ("remove bool id", lambda c: c.remove_sequence(True), TypeError, "seq_id"),
    ("remove numpy float id", lambda c: c.remove_sequence(np.float64(1)), TypeError, "seq_id"),
    ("fork float parent", lambda c: c.fork(1.0, 7), TypeError, "parent_id"),
    ("truncate float id", lambda c: c.truncate(1.0, 1), TypeError, "seq_id"),
    ("gather float id", lambda c: c.gather(0, 1.0), TypeError, "seq_id"),
    ("seq_len float id", lambda c: c.seq_len(np.float64(1)), TypeError, "seq_id"),
    # Counts no pool could hold are refused before any output is sized.
    ("append None ids", lambda c: c.append(None, [1]), TypeError, "seq_ids"),
    ("append str ids", lambda c: c.append("0", [1]), TypeError, "seq_ids"),
    ("append 2**31 tokens", lambda c: c.append([0], [2**31]), OutOfPagesError, "Cannot append 2147483648 tokens"),
    ("append 2**33 tokens", lambda c: c.append([0], [2**33]), OutOfPagesError, "Cannot append 8589934592 tokens"),
    ("append 2**62 tokens", lambda c: c.append([0, 1], [2**62, 2**62]), OutOfPagesError,
     "Cannot append 9223372036854775808 tokens to 2 sequences"),
    ("block_tokens without blocks", lambda c: c.add_sequence(5, block_tokens=16), ValueError, "block_tokens"),
    ("prompt length without blocks", lambda c: c.add_sequence(5, num_prompt_tokens=5), ValueError,
     "num_prompt_tokens"),
    # The pool of a KVCache is read-only: its page tables hold the references.
    ("pool.free", lambda c: c.pool.free([0]), RuntimeError, "KVCache"),
    ("pool.incref", lambda c: c.pool.incref([0]), RuntimeError, "KVCache"),
    ("pool.allocate", lambda c: c.pool.allocate(1), RuntimeError, "KVCache"),
]


@pytest.mark.parametrize("name, call, exc, match", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_input_raises_before_any_change(name, call, exc, match):
    cache = make_error_cache()
    before = snapshot(cache)
    with pytest.raises(exc, match=match):
        call(cache)
    assert snapshot(cache) == before
    cache.check_invariants()


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        ({"num_layers": -1}, ValueError),
        ({"num_kv_heads": 0}, ValueError),
        ({"head_dim": 0}, ValueError),
        ({"num_pages": 0}, ValueError),
        ({"page_size": 0}, ValueError),
        ({"window": 0}, ValueError),
        ({"sink_tokens": -1}, ValueError),
        ({"dtype": np.int8}, TypeError),
        ({"dtype": "float64"}, TypeError),
        ({"page_size": 2.0}, TypeError),
        ({"kv_dtype": "int3"}, ValueError),
        ({"kv_dtype": 8}, TypeError),
        ({"kv_dtype": np.float64}, ValueError),
        ({"dtype": np.float32, "kv_dtype": "int8"}, ValueError),
        ({"dtype": np.float32, "kv_dtype": "float16"}, ValueError),
        ({"head_dim": 512, "kv_dtype": "int8"}, ValueError),
        ({"prefix_hash": "md5"}, ValueError),  # checked even with prefix caching off
        ({"prefix_hash": None}, TypeError),
        ({"enable_prefix_caching": "yes"}, TypeError),
    ],
)
def test_bad_constructor_arguments(kwargs, exc):
    args = dict(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=4)
    args.update(kwargs)
    name = next(iter(kwargs))
    with pytest.raises(exc, match=name):
        KVCache(**args)


# ------------------------------------------------------------------- threads
def test_threads_hammering_one_cache_keep_it_consistent():
    cache = KVCache(2, HEADS, DIM, num_pages=96, page_size=4, dtype=np.float32, window=12, sink_tokens=2)
    errors = []

    def worker(thread_index):
        rng = np.random.default_rng(thread_index)
        mine = {}  # seq_id -> {position: k row of layer 1}
        try:
            for step in range(300):
                action = rng.integers(0, 10)
                if action == 0 or not mine:
                    seq_id = thread_index * 10_000 + step
                    cache.add_sequence(seq_id)
                    mine[seq_id] = {}
                elif action == 1:
                    seq_id = list(mine)[rng.integers(len(mine))]
                    cache.remove_sequence(seq_id)
                    del mine[seq_id]
                else:
                    seq_id = list(mine)[rng.integers(len(mine))]
                    n = int(rng.integers(1, 6))
                    n0 = cache.seq_len(seq_id)
                    try:
                        slots = cache.append([seq_id], [n])
                    except OutOfPagesError:
                        continue
                    k = (np.full((n, HEADS, DIM), seq_id) + np.arange(n0, n0 + n)[:, None, None]).astype(np.float32)
                    cache.store(1, slots, k, -k)
                    for t in range(n):
                        mine[seq_id][n0 + t] = k[t]
                for seq_id, rows in mine.items():
                    keys, values, positions = cache.gather(1, seq_id)
                    for row, value, pos in zip(keys, values, positions):
                        np.testing.assert_array_equal(row, rows[pos])
                        np.testing.assert_array_equal(value, -rows[pos])
        except Exception as exc:  # surfaced in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    cache.check_invariants()


# ------------------------------------------------------- stateful vs reference
CONFIGS = st.sampled_from(
    [
        # (num_pages, page_size, window, sinks)
        (12, 4, None, 0),
        (12, 4, 6, 0),
        (12, 4, 3, 0),
        (16, 4, 9, 5),
        (10, 3, 7, 2),
        (24, 1, 4, 1),
        (8, 16, 20, 3),
    ]
)


def stored(rows, kv_dtype):
    """What gather returns for float32 ``rows`` stored in a cache of page format ``kv_dtype`` (the reference)."""
    if kv_dtype in ("float16", "float32"):
        return rows.astype(kv_dtype)
    return reference_formats.decode(reference_formats.encode(rows, kv_dtype), kv_dtype, rows.shape[-1]).astype(
        np.float32)  # DIM is odd: no rotation, so every format's decode is exact in float32


class CacheMachine(RuleBasedStateMachine):
    """Random add/append/store/fork/truncate/remove, compared with RefCache after every step."""

    @initialize(config=CONFIGS, dtype=st.sampled_from([np.float16, np.float32, "bfloat16", "int8", "int4"]))
    def setup(self, config, dtype):
        num_pages, page_size, window, sinks = config
        self.cache = KVCache(2, HEADS, DIM, num_pages, page_size=page_size, kv_dtype=dtype,
                             window=window, sink_tokens=sinks)
        self.ref = RefCache(num_pages, page_size, window, sinks)
        self.rng = np.random.default_rng(0)
        self.next_id = 0
        self.last_append = {}

    def live(self):
        return sorted(self.ref.seqs)

    @rule()
    def add(self):
        self.cache.add_sequence(self.next_id)
        self.ref.add(self.next_id)
        self.next_id += 1

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data())
    def append(self, data):
        live = self.live()
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=len(live), unique=True))
        counts = data.draw(st.lists(st.integers(0, 2 * self.ref.page_size + 3), min_size=len(ids), max_size=len(ids)))
        try:
            tokens = self.ref.append(ids, counts)
        except OutOfPages:
            before = snapshot(self.cache)
            with pytest.raises(OutOfPagesError):
                self.cache.append(ids, counts)
            assert snapshot(self.cache) == before
            return
        slots = self.cache.append(ids, counts)
        assert slots.shape == (len(tokens),)
        for sid, t in zip(ids, counts):
            self.last_append[sid] = t
        for layer in range(2):
            k, v = random_kv(self.rng, len(tokens), np.float32)
            self.cache.store(layer, slots, k, v)
            self.ref.store(layer, tokens, stored(k, self.cache.kv_dtype), stored(v, self.cache.kv_dtype))

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.live()))
        self.cache.fork(parent, self.next_id)
        self.ref.fork(parent, self.next_id)
        self.last_append[self.next_id] = self.last_append.get(parent, 0)
        self.next_id += 1

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data())
    def truncate(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        length = self.ref.seqs[sid].length
        new_len = data.draw(st.integers(0, length + 1))
        if not self.ref.truncate_allowed(sid, new_len):
            before = snapshot(self.cache)
            with pytest.raises(ValueError, match="new_len"):
                self.cache.truncate(sid, new_len)
            assert snapshot(self.cache) == before
            return
        self.cache.truncate(sid, new_len)
        self.ref.truncate(sid, new_len)
        self.last_append[sid] = 0

    @precondition(lambda self: self.ref.seqs)
    @rule(data=st.data())
    def remove(self, data):
        sid = data.draw(st.sampled_from(self.live()))
        self.cache.remove_sequence(sid)
        self.ref.remove(sid)

    @invariant()
    def matches_reference(self):
        cache, ref = self.cache, self.ref
        cache.check_invariants()
        stats = cache.stats()
        assert stats["pages_in_use"] == ref.pages_in_use
        assert stats["evictions"] == ref.evictions
        assert stats["cow_copies"] == ref.cow_copies
        live = self.live()
        assert sorted(cache.seq_ids()) == live
        if not live:
            return
        view = cache.page_table(live)
        ps = ref.page_size
        for b, sid in enumerate(live):
            seq = ref.seqs[sid]
            assert cache.seq_len(sid) == seq.length
            positions = ref.cached_positions(sid)
            assert cache.num_cached_tokens(sid) == len(positions)
            listed = view.page_positions[view.indptr[b]:view.indptr[b + 1]] // ps
            assert listed.tolist() == sorted(seq.pages)
            expected_last = (seq.length - 1) % ps + 1 if seq.length else 0
            assert view.last_page_len[b] == expected_last
            if ref.window is not None and seq.length:
                t = self.last_append.get(sid, 0)
                num_sink = math.ceil(ref.sink_tokens / ps)
                window_pages = sum(1 for k in seq.pages if k >= num_sink)
                if t:
                    assert window_pages <= math.ceil((ref.window + t - 2) / ps) + 1
            for layer in range(2):
                keys, values, got_positions = cache.gather(layer, sid)
                assert got_positions.tolist() == positions
                for row_k, row_v, pos in zip(keys, values, positions):
                    want = seq.kv.get(pos, {}).get(layer)
                    assert want is not None, f"position {pos} of sequence {sid} was never stored"
                    np.testing.assert_array_equal(row_k, want[0])
                    np.testing.assert_array_equal(row_v, want[1])


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_membership_is_by_integer_id_only():
    cache = KVCache(1, HEADS, DIM, num_pages=4, page_size=4)
    cache.add_sequence(1)
    assert 1 in cache and np.int64(1) in cache
    assert 1.0 not in cache and True not in cache and "1" not in cache
    assert 2 not in cache


def test_pool_too_large_for_memory_names_num_pages():
    with pytest.raises(MemoryError, match="num_pages"):
        KVCache(2**20, 2**16, 2**16, 2**31 - 2)
