"""Prefix-cache KV events recorded by the core (KVCache(enable_kv_events=True)), without the wire.

The stream of BlockStored / BlockRemoved / AllBlocksCleared must rebuild exactly the set of
hashes that the prefix index reports, and every stored hash must be the XXH3-128 of its
parent, the salt and its token ids (the chain of pagedkv_c._prefix), computed here with the
``xxhash`` package from bytes written by the test.
"""
import copy
import gc
import pickle
import sys
import threading
import time

import numpy as np
import pytest
import xxhash

from pagedkv import KVCache
from pagedkv_c._kv_events import EncodedBatch, PayloadArena
from pagedkv_c._pool import OutOfPagesError


def cached_hashes(cache):
    """The 128-bit hashes of the pages the prefix index holds, as the cache reports them."""
    index = cache.prefix_index
    return {index.page_hash(int(p)) for p in index.cached_pages()}


def apply(events, state):
    """Apply decoded tuples to a set of hashes; stored hashes must be new, removed ones present."""
    for event in events:
        if event[0] == "BlockStored":
            for h in event[1]:
                assert h not in state, "a page was stored twice without a removal"
                state.add(h)
        elif event[0] == "BlockRemoved":
            for h in event[1]:
                assert h in state, "a page was removed that was never stored"
                state.remove(h)
        else:
            assert event == ("AllBlocksCleared",)
            state.clear()


def reference_hash(parent, token_ids):
    """XXH3-128 of parent (lo, hi), a zero salt and the int32 token ids, all little-endian."""
    parent = parent or 0
    head = np.array([parent & (2**64 - 1), parent >> 64, 0, 0], dtype="<u8").tobytes()
    return xxhash.xxh3_128_intdigest(head + np.asarray(token_ids, dtype="<i4").tobytes())


def check_chain(events, page_size):
    for event in events:
        if event[0] == "BlockStored" and event[3]:
            hashes, parent, tokens, block_size = event[1], event[2], event[3], event[4]
            assert block_size == page_size and len(tokens) == len(hashes) * page_size
            for i, h in enumerate(hashes):
                assert h == reference_hash(parent, tokens[i * page_size:(i + 1) * page_size])
                parent = h


def test_store_and_evict_events_in_order():
    cache = KVCache(0, 1, 1, 4, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    cache.append([0], [5], token_ids=[1, 2, 3, 4, 5])
    events, dropped = cache.take_kv_events()
    assert dropped == 0 and len(events) == 1
    (stored,) = events.tolist()
    h1 = reference_hash(None, [1, 2])
    h2 = reference_hash(h1, [3, 4])
    assert stored == ("BlockStored", [h1, h2], None, [1, 2, 3, 4], 2)
    assert events.num_pages_stored == 2 and events.num_pages_removed == 0
    cache.remove_sequence(0)
    assert len(cache.take_kv_events()[0]) == 0  # freed pages stay cached: no event
    # Eight new tokens need all four pages: the allocator hands out the two
    # cached ones (least recently freed first) and evicts them.
    cache.add_sequence(1, [9] * 8)
    cache.append([1], [8], token_ids=[9] * 8)
    events = cache.take_kv_events()[0].tolist()
    assert events[0] == ("BlockRemoved", [h2, h1]) or events[0] == ("BlockRemoved", [h1, h2])
    assert [e[0] for e in events] == ["BlockRemoved", "BlockStored"]
    check_chain(events, 2)
    assert cached_hashes(cache) == set(events[1][1])


def test_a_page_written_again_is_removed_before_its_new_content_is_stored():
    cache = KVCache(0, 1, 1, 8, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    cache.add_sequence(0, [1, 2, 3, 4])
    cache.append([0], [4], token_ids=[1, 2, 3, 4])
    cache.truncate(0, 3)  # the second page becomes partial: it leaves the index when written
    cache.take_kv_events()
    cache.append([0], [1], token_ids=[7])
    events = cache.take_kv_events()[0].tolist()
    h1 = reference_hash(None, [1, 2])
    assert events == [("BlockRemoved", [reference_hash(h1, [3, 4])]),
                      ("BlockStored", [reference_hash(h1, [3, 7])], h1, [3, 7], 2)]


def test_reset_prefix_cache_follows_vllm_contract():
    cache = KVCache(0, 1, 1, 8, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    cache.add_sequence(0, [1, 2, 3])
    cache.append([0], [3], token_ids=[1, 2, 3])
    cache.take_kv_events()
    assert cache.reset_prefix_cache() is False  # a sequence holds pages: nothing changes
    assert len(cache.take_kv_events()[0]) == 0 and len(cached_hashes(cache)) == 1
    cache.remove_sequence(0)
    assert cache.reset_prefix_cache() is True
    assert cache.take_kv_events()[0].tolist() == [("AllBlocksCleared",)]
    assert cached_hashes(cache) == set()
    cache.check_invariants()
    # The same prompt now misses and is stored again.
    assert cache.add_sequence(1, [1, 2, 3]) == 0
    assert KVCache(0, 1, 1, 4).reset_prefix_cache() is True  # nothing to reset without prefix caching


def test_overflow_drops_new_events_and_counts_them():
    cache = KVCache(0, 1, 1, 64, page_size=1, enable_prefix_caching=True, enable_kv_events=True,
                    kv_events_capacity=5)
    cache.add_sequence(0, list(range(12)))
    cache.append([0], [12], token_ids=list(range(12)))  # 12 full pages, 5 kept
    events, dropped = cache.take_kv_events()
    assert events.num_pages_stored == 5 and dropped == 7 and events.num_dropped == 7
    assert events.tolist()[0][1] == [reference_hash(None, [0])] + events.tolist()[0][1][1:]
    stats = cache.stats()
    assert stats["kv_events_dropped"] == 7 and stats["kv_events_recorded"] == 5
    assert cache.take_kv_events()[1] == 0  # the count is per drain


def test_enable_kv_events_checks():
    with pytest.raises(ValueError, match="enable_kv_events"):
        KVCache(0, 1, 1, 4, enable_kv_events=True)
    with pytest.raises(TypeError, match="enable_kv_events"):
        KVCache(0, 1, 1, 4, enable_prefix_caching=True, enable_kv_events=1)
    with pytest.raises(ValueError, match="kv_events_capacity"):
        KVCache(0, 1, 1, 4, enable_prefix_caching=True, enable_kv_events=True, kv_events_capacity=0)
    with pytest.raises(RuntimeError, match="enable_kv_events=True"):
        KVCache(0, 1, 1, 4, enable_prefix_caching=True).take_kv_events()
    assert not KVCache(0, 1, 1, 4, enable_prefix_caching=True).kv_events_enabled


@pytest.mark.parametrize("window,sinks", [(None, 0), (12, 0), (10, 3)])
def test_random_run_events_rebuild_the_cached_hashes(window, sinks):
    """A long random run of adds, appends, forks, truncations and removals."""
    page_size = 4
    rng = np.random.default_rng(17 if window is None else window)
    cache = KVCache(0, 1, 1, 48, page_size=page_size, window=window, sink_tokens=sinks,
                    enable_prefix_caching=True, enable_kv_events=True)
    prompts = [rng.integers(0, 3, size=24).tolist() for _ in range(4)]  # shared prefixes
    tokens, state, next_id = {}, set(), 0
    for step in range(1000):
        op = rng.integers(0, 5)
        try:
            if op == 0 or not tokens:
                prompt = prompts[rng.integers(len(prompts))][:rng.integers(1, 24)]
                cache.add_sequence(next_id, prompt)
                seq, next_id = next_id, next_id + 1
                tokens[seq] = prompt[:cache.seq_len(seq)]  # served from cache
                rest = prompt[len(tokens[seq]):]
                cache.append([seq], [len(rest)], token_ids=rest)
                tokens[seq] = list(prompt)
            elif op == 1:
                seq = list(tokens)[rng.integers(len(tokens))]
                new = rng.integers(0, 3, size=rng.integers(1, 9)).tolist()
                cache.append([seq], [len(new)], token_ids=new)
                tokens[seq] += new
            elif op == 2:
                seq = list(tokens)[rng.integers(len(tokens))]
                cache.fork(seq, next_id)
                tokens[next_id] = list(tokens[seq])
                next_id += 1
            elif op == 3:
                seq = list(tokens)[rng.integers(len(tokens))]
                new_len = int(rng.integers(0, len(tokens[seq]) + 1))
                try:
                    cache.truncate(seq, new_len)
                except ValueError:  # with a window: keys the new last query needs are gone
                    continue
                tokens[seq] = tokens[seq][:new_len]
            else:
                seq = list(tokens)[rng.integers(len(tokens))]
                cache.remove_sequence(seq)
                del tokens[seq]
        except OutOfPagesError:
            for seq in list(tokens)[: len(tokens) // 2]:
                cache.remove_sequence(seq)
                del tokens[seq]
            # An add_sequence that could not append leaves its sequence behind.
            tokens = {s: t for s, t in tokens.items() if s in cache}
            for s in list(tokens):
                tokens[s] = tokens[s][:cache.seq_len(s)]
        if step % 50 == 0:
            events, dropped = cache.take_kv_events()
            assert dropped == 0
            decoded = events.tolist()
            check_chain(decoded, page_size)
            apply(decoded, state)
            assert state == cached_hashes(cache)
        if step == 500:
            for seq in list(tokens):
                cache.remove_sequence(seq)
            tokens.clear()
            assert cache.reset_prefix_cache()
    events, dropped = cache.take_kv_events()
    apply(events.tolist(), state)
    assert dropped == 0 and state == cached_hashes(cache) and state
    cache.check_invariants()


def page_records(events):
    """Events as page-level records: ("S", hash, parent, token ids) / ("R", hash) / ("C",)."""
    records = []
    for event in events:
        if event[0] == "BlockStored":
            parent, size = event[2], event[4]
            for i, h in enumerate(event[1]):
                records.append(("S", h, parent, tuple(event[3][i * size:(i + 1) * size])))
                parent = h
        elif event[0] == "BlockRemoved":
            records.extend(("R", h) for h in event[1])
        else:
            records.append(("C",))
    return records


def first_events(events, num_records):
    """The events that hold the first ``num_records`` page records, the last one cut to fit."""
    kept = []
    for event in events:
        if num_records == 0:
            break
        if event[0] == "AllBlocksCleared":
            kept.append(event)
            num_records -= 1
            continue
        n = min(num_records, len(event[1]))
        if event[0] == "BlockStored":
            kept.append(("BlockStored", event[1][:n], event[2], event[3][:n * event[4]], event[4]))
        else:
            kept.append(("BlockRemoved", event[1][:n]))
        num_records -= n
    return kept


def drive_in_lockstep(caches, seed, steps, drain_every, on_drain):
    """The same random adds (shared prefixes), appends, forks, removals and resets on every cache.

    Every ``drain_every`` steps ``on_drain([cache.take_kv_events() for cache in caches])``.
    """
    rng = np.random.default_rng(seed)
    page_size = caches[0].page_size
    prompts = [rng.integers(0, 3, size=8 * page_size).tolist() for _ in range(4)]
    live, next_id = [], 0

    def on_each(call):
        """Run ``call(cache)`` on every cache; all must run out of pages, or none."""
        failed = []
        for cache in caches:
            try:
                call(cache)
                failed.append(False)
            except OutOfPagesError:
                failed.append(True)
        assert len(set(failed)) == 1, "twin caches diverged"
        return failed[0]

    def add(cache, seq, prompt):
        cached = cache.add_sequence(seq, prompt)
        cache.append([seq], [len(prompt) - cached], token_ids=prompt[cached:])

    for step in range(1, steps + 1):
        op = rng.integers(0, 10)
        failed = False
        if op < 5 or not live:
            prompt = prompts[rng.integers(len(prompts))][:rng.integers(1, 8 * page_size)]
            prompt = prompt + rng.integers(0, 3, size=rng.integers(0, 2 * page_size)).tolist()
            failed = on_each(lambda cache: add(cache, next_id, prompt))
            live.append(next_id)
            next_id += 1
        elif op < 7:
            seq = live[rng.integers(len(live))]
            new = rng.integers(0, 3, size=rng.integers(1, 2 * page_size)).tolist()
            failed = on_each(lambda cache: cache.append([seq], [len(new)], token_ids=new))
        elif op == 7:
            seq = live[rng.integers(len(live))]
            on_each(lambda cache: cache.fork(seq, next_id))
            live.append(next_id)
            next_id += 1
        elif op == 8 or len(live) > 1:
            seq = live.pop(int(rng.integers(len(live))))
            on_each(lambda cache: cache.remove_sequence(seq))
        else:
            failed = True  # remove everything, then reset the prefix cache
        if failed:
            for seq in live:
                on_each(lambda cache: cache.remove_sequence(seq) if seq in cache else None)
            live = []
            if op >= 8:
                assert all(cache.reset_prefix_cache() for cache in caches)
        if step % drain_every == 0:
            on_drain([cache.take_kv_events() for cache in caches])
    on_drain([cache.take_kv_events() for cache in caches])


@pytest.mark.parametrize("capacity", [1, 3, 8, 14])
def test_a_full_log_keeps_the_first_records_of_each_drain_and_counts_the_rest(capacity):
    """Against a twin cache whose log never fills: the same operations, the same drains."""
    page_size = 2
    args = dict(page_size=page_size, enable_prefix_caching=True, enable_kv_events=True)
    complete = KVCache(0, 1, 1, 40, **args)
    bounded = KVCache(0, 1, 1, 40, kv_events_capacity=capacity, **args)
    totals = {"kept": 0, "dropped": 0, "drains_with_drops": 0}

    def on_drain(drained):
        (all_events, all_dropped), (events, dropped) = drained
        assert all_dropped == 0
        everything = all_events.tolist()
        reference = page_records(everything)
        kept = events.tolist()
        assert page_records(kept) == reference[:capacity]
        assert kept == first_events(everything, capacity) and len(events) == len(kept)
        assert dropped == events.num_dropped == max(0, len(reference) - capacity)
        assert events.num_records == min(capacity, len(reference))
        assert events.num_pages_stored == sum(r[0] == "S" for r in reference[:capacity])
        assert events.num_pages_removed == sum(r[0] == "R" for r in reference[:capacity])
        check_chain(kept, page_size)
        totals["kept"] += events.num_records
        totals["dropped"] += dropped
        totals["drains_with_drops"] += dropped > 0

    drive_in_lockstep([complete, bounded], seed=capacity, steps=400, drain_every=9, on_drain=on_drain)
    stats = bounded.stats()
    assert stats["kv_events_recorded"] == totals["kept"] and stats["kv_events_dropped"] == totals["dropped"]
    assert complete.stats()["kv_events_recorded"] == totals["kept"] + totals["dropped"]
    assert totals["drains_with_drops"] > 5  # the bound was hit many times
    bounded.check_invariants()


def test_pending_records_count_as_recorded_before_the_drain():
    cache = KVCache(0, 1, 1, 8, page_size=2, enable_prefix_caching=True, enable_kv_events=True)
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    cache.append([0], [5], token_ids=[1, 2, 3, 4, 5])
    assert cache.stats()["kv_events_recorded"] == 2
    events, _ = cache.take_kv_events()
    assert cache.stats()["kv_events_recorded"] == 2 and events.num_records == 2
    assert cache.take_kv_events()[0].num_records == 0 and cache.stats()["kv_events_recorded"] == 2


def event_batches(seed, num_batches, tokens_per_batch=40_000):
    """Drained KVEvents of a cache of 1-token pages, each of about ``tokens_per_batch`` stored pages."""
    rng = np.random.default_rng(seed)
    cache = KVCache(0, 1, 1, 2 * tokens_per_batch, page_size=1, enable_prefix_caching=True, enable_kv_events=True)
    for step in range(num_batches):
        length = int(rng.integers(tokens_per_batch // 2, tokens_per_batch))
        tokens = rng.integers(0, 2**31 - 1, size=length).tolist()
        cache.add_sequence(step, tokens)
        cache.append([step], [length], token_ids=tokens)
        cache.remove_sequence(step)
        events, dropped = cache.take_kv_events()
        assert dropped == 0
        yield events


def test_payload_arena_payloads_equal_encode_and_survive_later_payloads():
    arena = PayloadArena()
    kept = []
    rng = np.random.default_rng(1)
    for i, events in enumerate(event_batches(0, 30)):
        options = dict(data_parallel_rank=i % 3, window=None if i % 2 else 64, medium="GPU" if i % 4 else "CPU",
                       hash_format="bytes" if i % 5 == 0 else "int")
        payload = arena.encode(events, 100.0 + i, **options)
        expected = events.encode(100.0 + i, **options)
        assert len(payload) == len(expected) and bytes(payload) == expected
        view = memoryview(payload)
        assert view.readonly and view.nbytes == len(expected)
        view.release()
        kept.append((payload, expected))
        if rng.random() < 0.3:
            arena.populate()  # faults in memory ahead without touching what was written
        if rng.random() < 0.4:
            del kept[int(rng.integers(len(kept)))]  # a chunk whose payloads are all gone is written again
    assert len(kept) > 10
    for payload, expected in kept:
        assert bytes(payload) == expected


def test_payload_arena_reuses_a_chunk_once_its_payloads_are_gone():
    arena = PayloadArena()
    batches = list(event_batches(2, 3))
    first = arena.encode(batches[0], 1.0)
    start = np.frombuffer(first, dtype=np.uint8).__array_interface__["data"][0]
    del first
    second = arena.encode(batches[1], 2.0)
    assert np.frombuffer(second, dtype=np.uint8).__array_interface__["data"][0] == start
    assert bytes(second) == batches[1].encode(2.0)
    third = arena.encode(batches[2], 3.0)  # second is alive: third goes after it
    assert np.frombuffer(third, dtype=np.uint8).__array_interface__["data"][0] >= start + len(second)
    assert bytes(second) == batches[1].encode(2.0) and bytes(third) == batches[2].encode(3.0)


def test_payload_arena_populate_in_another_thread_leaves_payloads_intact():
    arena = PayloadArena()
    stop = threading.Event()
    errors = []

    def populate():
        try:
            while not stop.is_set():
                arena.populate()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    thread = threading.Thread(target=populate)
    thread.start()
    kept = []
    try:
        for i, events in enumerate(event_batches(3, 40, tokens_per_batch=20_000)):
            kept.append((arena.encode(events, float(i)), events.encode(float(i))))
    finally:
        stop.set()
        thread.join()
    assert not errors
    for payload, expected in kept:
        assert bytes(payload) == expected


def test_payload_arena_checks_its_options_before_allocating():
    arena = PayloadArena()
    (events,) = event_batches(4, 1, tokens_per_batch=100)
    with pytest.raises(ValueError, match="hash_format"):
        arena.encode(events, 0.0, hash_format="hex")
    with pytest.raises(ValueError, match="data_parallel_rank"):
        arena.encode(events, 0.0, data_parallel_rank=-1)
    with pytest.raises(TypeError, match="medium"):
        arena.encode(events, 0.0, medium=b"CPU")
    with pytest.raises(TypeError):
        arena.encode(None, 0.0)
    assert not arena.needs_populate  # nothing was allocated
    with pytest.raises(TypeError, match="PayloadArena.encode"):
        EncodedBatch()
    with pytest.raises(BufferError):
        memoryview(EncodedBatch.__new__(EncodedBatch))


def test_payload_arena_a_payload_dropped_by_another_thread_during_an_encode_frees_no_bytes_in_use():
    """The encoding runs without the GIL: another thread may drop the last payload of the
    chunk meanwhile (a ZeroMQ send finishing, a replay's list going away). The payload being
    written must still count as one of the chunk's, so later payloads go after it."""

    def address(payload):
        return np.frombuffer(payload, dtype=np.uint8).__array_interface__["data"][0]

    switch_interval = sys.getswitchinterval()
    for attempt in range(8):
        arena = PayloadArena()
        first, second, third = event_batches(40 + attempt, 3, tokens_per_batch=40_000)
        holder = [arena.encode(first, 0.0)]  # the only payload of the current chunk
        go = threading.Event()
        dropper = threading.Thread(target=lambda: (go.wait(), holder.clear()))
        dropper.start()
        sys.setswitchinterval(30.0)  # the GIL changes hands only where a thread lets it go
        try:
            go.set()
            start = time.perf_counter()
            while time.perf_counter() - start < 0.02:  # keeps the GIL: the dropper wakes and waits for it
                pass
            kept = arena.encode(second, 1.0)  # the dropper runs while this encodes
        finally:
            sys.setswitchinterval(switch_interval)
        dropper.join()
        later = arena.encode(third, 2.0)
        assert not holder
        assert address(later) >= address(kept) + len(kept) or address(later) + len(later) <= address(kept)
        assert bytes(kept) == second.encode(1.0) and bytes(later) == third.encode(2.0)


def test_payload_arena_a_payload_freed_by_the_cycle_collector_gives_back_its_place():
    """A payload referenced only from a reference cycle goes with the cycle collector; the
    chunk must count it gone as when its last reference is dropped, and be written again
    from its start."""
    arena = PayloadArena()
    first_events, second_events = event_batches(5, 2, tokens_per_batch=1000)
    first = arena.encode(first_events, 0.0)
    start = np.frombuffer(first, dtype=np.uint8).__array_interface__["data"][0]
    cycle = [first]
    cycle.append(cycle)
    del first, cycle
    gc.collect()
    second = arena.encode(second_events, 1.0)
    assert np.frombuffer(second, dtype=np.uint8).__array_interface__["data"][0] == start
    assert bytes(second) == second_events.encode(1.0)


def test_payload_arena_and_its_payloads_refuse_copy_and_pickle():
    """A shallow copy of a payload shares its chunk without being counted in it (the chunk
    is then written again while the original's neighbours live); a pickle carries the
    chunk's address as a string, and the copy it loads frees memory it never allocated."""
    arena = PayloadArena()
    (events,) = event_batches(6, 1, tokens_per_batch=100)
    payload = arena.encode(events, 0.0)
    for obj in (arena, payload):
        with pytest.raises(TypeError):
            copy.copy(obj)
        with pytest.raises(TypeError):
            pickle.dumps(obj)
    assert bytes(payload) == events.encode(0.0)
