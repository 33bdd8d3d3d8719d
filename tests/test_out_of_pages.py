"""OutOfPagesError messages: what was asked, what is free, what to do; nothing changed.

Every site that raises OutOfPagesError is driven into it here: KVCache.append
over the whole pool (refused before any slot is reserved), KVCache.append
short of free pages (new pages, copy-on-write copies after fork, window
releases, free pages that hold cached prefixes) and PagePool.allocate. The
expected figures are worked out by hand from the release rule and the page
counts of each scenario.
"""
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import KVCache, OutOfPagesError, PagePool

NO_WINDOW_CLAUSES = ("window releases", "counting the", "releases in this call")


def cache_state(cache):
    ids = cache.seq_ids()
    view = cache.page_table(ids)
    return (cache.stats(), cache.pool.free_pages().tolist(), ids, view.indices.tolist(),
            view.seq_lens.tolist(), cache.kv.tobytes())


def out_of_pages(cache, seq_ids, num_tokens, **kw):
    """Run a failing append; check that nothing changed and return its message."""
    before = cache_state(cache)
    with pytest.raises(OutOfPagesError) as info:
        cache.append(seq_ids, num_tokens, **kw)
    assert cache_state(cache) == before
    cache.check_invariants()
    return str(info.value)


def test_append_larger_than_the_whole_pool_names_the_tokens_asked():
    cache = KVCache(1, 1, 4, num_pages=4, page_size=4)
    cache.add_sequence(0)
    message = out_of_pages(cache, [0], [1000])
    # 1000 tokens need ceil(1000 / 4) = 250 pages; the pool has 4 (16 tokens).
    assert re.match(r"^Cannot append 1000 tokens to 1 sequence: they need 250 new pages of 4 tokens, "
                    r"more than the whole pool holds \(4 pages, 4 of them free\)\. Nothing was changed\.", message)
    assert "num_pages >= 250" in message
    assert "20 tokens" not in message
    assert not any(clause in message for clause in NO_WINDOW_CLAUSES), message


def test_append_larger_than_the_pool_with_a_window_suggests_smaller_chunks():
    cache = KVCache(1, 1, 4, num_pages=4, page_size=4, window=8)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.append([1], [5])  # 2 pages in use
    message = out_of_pages(cache, [0, 1], [30, 20])
    # Sequence 0 (empty) needs ceil(30 / 4) = 8 pages; sequence 1 (5 tokens, 2 pages,
    # nothing out of the window yet) needs ceil(25 / 4) - 2 = 5: 13 new pages, 2 free,
    # so a pool of 4 + 13 - 2 = 15 pages holds the append.
    assert message.startswith("Cannot append 50 tokens to 2 sequences: they need 13 new pages of 4 tokens, "
                              "more than the whole pool holds (4 pages, 2 of them free)."), message
    assert "Append in smaller chunks" in message and "num_pages >= 15" in message


def test_append_short_of_free_pages_without_a_window():
    cache = KVCache(1, 1, 4, num_pages=4, page_size=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.append([0, 1], [12, 1])  # 3 + 1 pages: none free
    cache.remove_sequence(1)       # 1 free
    message = out_of_pages(cache, [0], [8])
    assert message == (
        "Cannot append 8 tokens to 1 sequence: they need 2 new pages of 4 tokens, but only 1 of the 4 pages "
        "is free. Nothing was changed. Free pages by removing or truncating sequences (remove_sequence, "
        "truncate), or create the cache with num_pages >= 5 or with a sliding window (window=W), which "
        "releases the pages that leave it."
    )


def test_append_short_of_free_pages_counts_what_the_window_releases():
    cache = KVCache(1, 1, 4, num_pages=6, page_size=2, window=4)
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.append([0, 1], [6, 4])  # 3 + 2 pages, 1 free
    # Appending 10 tokens at length 6 first releases the pages whose positions are
    # all below 6 - 4 + 1 = 3: page 0 (positions 0, 1). The tokens need positions
    # 6..15, 5 new pages; 1 free + 1 released = 2 available, so 3 short: 6 + 3 = 9.
    message = out_of_pages(cache, [0], [10])
    assert message.startswith(
        "Cannot append 10 tokens to 1 sequence: they need 5 new pages of 2 tokens, but only 1 of the 6 pages "
        "is free, plus 1 that the window releases in this call. Nothing was changed."
    ), message
    assert "num_pages >= 9" in message and "append fewer tokens per call" in message
    assert "window=W" not in message  # the cache has one already


def test_append_names_copy_on_write_copies_after_fork():
    cache = KVCache(1, 1, 4, num_pages=3, page_size=4)
    cache.add_sequence(0)
    cache.append([0], [6])  # 2 pages, the last one half full
    cache.fork(0, 1)        # both share the 2 pages; 1 free
    # Sequence 0 writes into its shared last page: 1 copy, then positions 8..8 take 1 more page.
    message = out_of_pages(cache, [0], [3])
    assert message.startswith(
        "Cannot append 3 tokens to 1 sequence: they need 2 new pages of 4 tokens (including 1 copy-on-write "
        "copy of a shared last page), but only 1 of the 3 pages is free. Nothing was changed."
    ), message
    assert "num_pages >= 4" in message
    assert not any(clause in message for clause in NO_WINDOW_CLAUSES), message


def test_append_names_free_pages_that_hold_cached_prefixes():
    cache = KVCache(1, 1, 4, num_pages=4, page_size=2, enable_prefix_caching=True)
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    cache.append([0], [5])  # 3 pages, 2 of them full and cached
    cache.remove_sequence(0)  # all 4 free, the 2 cached ones still findable
    assert cache.add_sequence(1, [1, 2, 3, 4, 9]) == 4  # a hit takes the 2 cached pages back
    cache.add_sequence(2)
    message = out_of_pages(cache, [1, 2], [1, 4])
    # Sequence 1 at length 4 needs 1 page for position 4, sequence 2 needs 2: 3 > 2 free.
    assert message.startswith(
        "Cannot append 5 tokens to 2 sequences: they need 3 new pages of 2 tokens, but only 2 of the 4 pages "
        "are free. Nothing was changed."
    ), message
    cache.remove_sequence(1)  # its 2 pages go back to the free queue, still cached
    message = out_of_pages(cache, [2], [10])
    assert message.startswith(
        "Cannot append 10 tokens to 1 sequence: they need 5 new pages of 2 tokens, but only 4 of the 4 pages "
        "are free (2 of them hold cached prefixes, taken back as needed). Nothing was changed."
    ), message


def test_allocate_names_the_pages_asked_and_free():
    pool = PagePool(3)
    pool.allocate(2)
    before = (pool.num_free, pool.free_pages().tolist(), [pool.ref_count(p) for p in range(3)])
    with pytest.raises(OutOfPagesError) as info:
        pool.allocate(2)
    assert str(info.value) == (
        "Cannot allocate 2 pages: only 1 of the 3 pages is free. Nothing was allocated. Free pages you no "
        "longer need (free), or create the pool with num_pages >= 4."
    )
    assert (pool.num_free, pool.free_pages().tolist(), [pool.ref_count(p) for p in range(3)]) == before


def test_the_suggested_pool_size_is_enough():
    """The num_pages the message suggests lets the same calls succeed."""
    def run(num_pages):
        cache = KVCache(1, 1, 4, num_pages=num_pages, page_size=4)
        for s in range(3):
            cache.add_sequence(s)
        cache.append([0, 1], [9, 7])
        cache.fork(0, 3)
        cache.append([0, 2, 3], [8, 5, 2])
        return cache

    with pytest.raises(OutOfPagesError) as info:
        run(6)
    suggested = int(re.search(r"num_pages >= (\d+)", str(info.value)).group(1))
    run(suggested).check_invariants()
    with pytest.raises(OutOfPagesError):
        run(suggested - 1)


@pytest.mark.parametrize("num_tokens", [81, 97, 100, 1000])
def test_the_suggested_pool_size_is_enough_over_the_whole_pool(num_tokens):
    """An append larger than the whole pool suggests a num_pages that holds it, and no fewer."""
    def run(num_pages):
        cache = KVCache(2, 2, 64, num_pages=num_pages, page_size=16)
        cache.add_sequence(0)
        cache.append([0], [num_tokens])
        return cache

    with pytest.raises(OutOfPagesError) as info:
        run(4)
    suggested = int(re.search(r"num_pages >= (\d+)", str(info.value)).group(1))
    assert suggested == -(-num_tokens // 16)
    run(suggested).check_invariants()
    with pytest.raises(OutOfPagesError):
        run(suggested - 1)


def test_an_append_past_any_pool_says_no_pool_holds_it():
    cache = KVCache(1, 1, 4, num_pages=4, page_size=4)
    cache.add_sequence(0)
    message = out_of_pages(cache, [0], [2**40])
    assert "they need 274877906944 new pages" in message
    assert "num_pages is at most 2147483646" in message and "num_pages >=" not in message


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_suggested_pool_size_is_exactly_enough(data):
    """Random calls (window, sinks, forks, prefix caching) replayed on ever larger pools: each
    time a call runs out of pages, a pool of the num_pages its message suggests gets past that
    call, and a pool of one page fewer fails at the same call."""
    page_size = data.draw(st.sampled_from([1, 2, 4]), label="page_size")
    window = data.draw(st.one_of(st.none(), st.integers(1, 12)), label="window")
    sinks = data.draw(st.integers(0, 5), label="sink_tokens") if window is not None else 0
    prefix = data.draw(st.booleans(), label="prefix caching")
    calls = data.draw(st.lists(st.tuples(st.sampled_from(["append", "append", "fork", "remove"]),
                                         st.lists(st.integers(0, 40), min_size=1, max_size=3)),
                               min_size=1, max_size=10), label="calls")

    def run(num_pages):
        """Replay the calls on a pool of ``num_pages``: (index of the call that ran out, its message)."""
        cache = KVCache(1, 1, 2, num_pages=num_pages, page_size=page_size, window=window,
                        sink_tokens=sinks, enable_prefix_caching=prefix)
        cache.add_sequence(0)
        next_id = 1
        for index, (op, numbers) in enumerate(calls):
            ids = cache.seq_ids()
            try:
                if op == "append":
                    chosen = sorted({ids[n % len(ids)] for n in numbers})
                    counts = numbers[:len(chosen)]
                    cache.append(chosen, counts, token_ids=list(range(sum(counts))) if prefix else None)
                elif op == "fork":
                    cache.fork(ids[numbers[0] % len(ids)], next_id)
                    next_id += 1
                elif len(ids) > 1:
                    cache.remove_sequence(ids[numbers[0] % len(ids)])
            except OutOfPagesError as exc:
                return index, str(exc)
        cache.check_invariants()
        return None, None

    num_pages = 1
    failed_at, message = run(num_pages)
    while failed_at is not None:
        suggested = int(re.search(r"num_pages >= (\d+)", message).group(1))
        assert suggested > num_pages, message
        assert run(suggested - 1)[0] == failed_at, message
        num_pages = suggested
        now_failed_at, message = run(num_pages)
        assert now_failed_at is None or now_failed_at > failed_at, message
        failed_at = now_failed_at
