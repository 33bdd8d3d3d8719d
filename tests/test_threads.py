"""Threads and re-entrancy: every public class used from several threads at once, and
called again from finalizers that the garbage collector runs inside its own calls.

A regression here is usually a hang (a spin in the page map or the free queue, a
lock its own thread holds), so every workload runs in daemon threads joined with a
timeout: a hang fails the test instead of stopping the run. Contents are checked
against references that do not depend on the interleaving: each thread owns its
own sequences, tokens or pages, and every stored value encodes where it belongs.
"""
import gc
import threading
import time

import numpy as np
import pytest

from pagedkv import KVCache, OutOfPagesError, PagedKVCache, PagePool
from pagedkv_c._lock import CacheLock

TIMEOUT_S = 120
REENTERED = "called again on a thread that is still inside one of its calls"


def run_threads(*targets, timeout=TIMEOUT_S):
    """Run each target in a daemon thread; fail if one hangs, re-raise the first error."""
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as exc:  # surfaced in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,), daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    hung = sum(thread.is_alive() for thread in threads)
    assert not hung, f"{hung} of {len(threads)} threads did not finish within {timeout} s (hang)"
    if errors:
        raise errors[0]


# ------------------------------------------------------- reported reproductions
def test_classic_put_many_with_list_inputs_from_two_threads_completes():
    dim = 8
    cache = PagedKVCache(max_pages=4096, dim=dim, page_size=16)

    def writer(base):
        def run():
            for step in range(300):
                tokens = [base + 64 * step + t for t in range(64)]
                rows = [[float(t)] * dim for t in tokens]
                cache.put_many(tokens, rows, [[-r for r in row] for row in rows])
        return run

    run_threads(writer(0), writer(10**6))
    cache.check_invariants()
    assert len(cache) == 2 * 300 * 64
    tokens = np.array(list(cache))
    keys, values, present = cache.get_many(tokens)
    assert present.all()
    np.testing.assert_array_equal(keys, np.repeat(tokens[:, None], dim, axis=1).astype(np.float32))
    np.testing.assert_array_equal(values, -keys)


def test_standalone_pool_shared_by_two_threads_completes():
    pool = PagePool(8192)

    def churn():
        for _ in range(3000):  # enough for the former race to hang nearly every run
            pool.free(pool.allocate(4096))

    run_threads(churn, churn)
    pool.check_invariants()
    assert pool.num_free == pool.num_pages


# ------------------------------------------- garbage collection in locked regions
class _GarbageStream:
    """Keeps one finalizable cycle of garbage waiting for the next collection.

    Installed as a gc callback with the gen-0 threshold at 1, it makes every
    container allocation collect, and every collection run one finalizer:
    so each call runs a finalizer at each point where it allocates, inside
    its locked regions included.
    """

    def __init__(self, finalize):
        self.finalize = finalize
        self.active = False

    def _make(self):
        stream = self

        class Garbage:
            def __init__(self):
                self.cycle = self

            def __del__(self):
                if stream.active:
                    stream.finalize()

        Garbage()

    def __call__(self, phase, info):
        if phase == "stop" and self.active:
            self._make()

    def __enter__(self):
        self.thresholds = gc.get_threshold()
        gc.collect()
        gc.callbacks.append(self)
        self.active = True
        self._make()
        gc.set_threshold(1)
        return self

    def __exit__(self, *exc):
        self.active = False
        gc.set_threshold(*self.thresholds)
        gc.callbacks.remove(self)
        gc.collect()
        return False


def test_finalizer_removing_a_sequence_inside_a_locked_call_completes():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=4, num_pages=64, page_size=4)
    for seq_id in range(3):
        cache.add_sequence(seq_id)
    cache.append([0, 1, 2], [5, 5, 5])
    victims = [1, 2]
    log = []

    def finalize():
        # A request's finalizer that frees its sequence; it acts only when it
        # runs inside a call of the cache (where a read is refused).
        if not victims:
            return
        try:
            cache.seq_len(0)
            return
        except RuntimeError as exc:
            log.append(("read refused", str(exc)))
        seq_id = victims.pop()
        try:
            cache.remove_sequence(seq_id)
            log.append(("deferred" if seq_id in cache else "removed", seq_id))
        except BaseException as exc:  # a finalizer's error would only be printed
            log.append(("error", repr(exc)))

    def scenario():
        with _GarbageStream(finalize):
            while victims:
                cache.page_table([0, 0, 0, 0])

    run_threads(scenario, timeout=60)
    assert [entry[0] for entry in log] == ["read refused", "deferred"] * 2, log
    assert REENTERED in log[0][1] and "remove_sequence" in log[0][1]
    assert cache.seq_ids() == [0]
    assert cache.pool.num_free == 64 - 2
    cache.check_invariants()


def test_second_deferred_removal_of_one_sequence_is_a_key_error():
    cache = KVCache(num_layers=0, num_kv_heads=1, head_dim=1, num_pages=8, page_size=2)
    cache.add_sequence(7)
    cache.add_sequence(8)
    outcomes = []

    def finalize():
        if outcomes or 7 not in cache:
            return
        try:
            cache.seq_len(8)
            return  # not inside a call of the cache
        except RuntimeError:
            pass
        for _ in range(2):
            try:
                cache.remove_sequence(7)
                outcomes.append("ok")
            except KeyError:
                outcomes.append("KeyError")

    def scenario():
        with _GarbageStream(finalize):
            while not outcomes:
                cache.page_table([7, 8, 7])

    run_threads(scenario, timeout=60)
    assert outcomes == ["ok", "KeyError"]
    assert cache.seq_ids() == [8]
    cache.check_invariants()


def test_gc_inside_every_kv_cache_call_defers_removals_and_refuses_the_rest():
    page_size, heads, dim = 4, 2, 4
    cache = KVCache(num_layers=2, num_kv_heads=heads, head_dim=dim, num_pages=4096, page_size=page_size,
                    dtype=np.float32, enable_prefix_caching=True)
    victims = list(range(100, 3100))  # plenty: every collection frees one
    for seq_id in victims:
        cache.add_sequence(seq_id)
    cache.append(victims, [1] * len(victims))
    live = {0: 0}  # seq_id -> length, the reference
    cache.add_sequence(0)
    outcomes = {}
    current = [None]

    def finalize():
        # A request's finalizer frees its sequence, then looks at the cache.
        if not victims:
            return
        seq_id = victims.pop()
        record = outcomes.setdefault(current[0], set())
        try:
            cache.remove_sequence(seq_id)
            record.add("deferred" if seq_id in cache else "removed")
        except BaseException as exc:
            record.add(f"remove failed: {exc!r}")
        try:
            cache.seq_len(0)
        except RuntimeError as exc:
            record.add("read refused" if REENTERED in str(exc) else f"read failed: {exc!r}")

    def expected_rows(seq_id, positions):
        return (np.asarray(positions, dtype=np.float32)[:, None, None] + 1000 * seq_id
                + np.zeros((1, heads, dim), dtype=np.float32))

    def slots_of(seq_id, positions):
        table = cache.page_table([seq_id]).block_tables()[0]
        return [int(table[p // page_size]) * page_size + p % page_size for p in positions]

    def calls():
        yield "add_sequence", lambda: cache.add_sequence(1, [5, 6, 7, 8, 9])
        live[1] = 0
        yield "append", lambda: cache.append([0, 1], [6, 6])
        live[0] = live[1] = 6
        yield "store", lambda: cache.store(1, slots_of(0, range(6)), expected_rows(0, range(6)),
                                           -expected_rows(0, range(6)))
        yield "fork", lambda: cache.fork(0, 2)
        live[2] = 6
        yield "truncate", lambda: cache.truncate(2, 3)
        live[2] = 3
        yield "seq_len", lambda: cache.seq_len(0)
        yield "num_cached_tokens", lambda: cache.num_cached_tokens(0)
        yield "gather", lambda: cache.gather(1, 0)
        yield "page_table", lambda: cache.page_table([0, 1, 2])
        yield "seq_ids", cache.seq_ids
        yield "stats", cache.stats
        yield "check_invariants", cache.check_invariants
        yield "remove_sequence", lambda: cache.remove_sequence(1)
        del live[1]

    def scenario():
        with _GarbageStream(finalize):
            for name, call in calls():
                current[0] = name
                call()
                current[0] = None

    run_threads(scenario)
    failures = {name: r for name, r in outcomes.items() if any("failed" in x for x in r)}
    assert not failures, failures
    # Removals inside a locked region were deferred, and reads there refused.
    reentered = {name for name, r in outcomes.items() if "deferred" in r}
    assert {"append", "fork", "gather", "page_table", "check_invariants"} <= reentered, outcomes
    assert all("read refused" in outcomes[name] for name in reentered)
    cache.check_invariants()
    assert sorted(cache.seq_ids()) == sorted(set(live) | set(victims))
    for seq_id, length in live.items():
        assert cache.seq_len(seq_id) == length
    keys, values, positions = cache.gather(1, 0)
    np.testing.assert_array_equal(keys, expected_rows(0, positions))
    np.testing.assert_array_equal(values, -expected_rows(0, positions))


def test_gc_inside_every_classic_cache_call_never_hangs():
    dim, page_size = 3, 4
    cache = PagedKVCache(max_pages=8, dim=dim, page_size=page_size)
    outcomes = {}
    current = [None]

    def finalize():
        record = outcomes.setdefault(current[0], set())
        try:
            len(cache)
            record.add("ok")
        except RuntimeError as exc:
            record.add("refused" if REENTERED in str(exc) else f"failed: {exc!r}")

    def row(t):
        return [float(t)] * dim

    def scenario():
        with _GarbageStream(finalize):
            for name, call in [
                ("put", lambda: cache.put(0, row(0), row(-0.0))),
                ("put_many", lambda: cache.put_many(list(range(1, 40)), [row(t) for t in range(1, 40)],
                                                    [row(-t) for t in range(1, 40)])),
                ("get", lambda: cache.get(39)),
                ("get_many", lambda: cache.get_many([0, 39, 38])),
                ("contains", lambda: 39 in cache),
                ("len", lambda: len(cache)),
                ("iter", lambda: list(cache)),
                ("resident_pages", lambda: cache.resident_pages),
                ("stats", cache.stats),
                ("check_invariants", cache.check_invariants),
                ("repr", lambda: repr(cache)),
            ]:
                current[0] = name
                call()
                current[0] = None

    run_threads(scenario)
    assert not [r for r in outcomes.values() if any("failed" in x for x in r)], outcomes
    assert any("refused" in r for r in outcomes.values()), "no finalizer ran inside a locked region"
    cache.check_invariants()
    resident = set(range(40)[-8 * page_size:])  # FIFO: pages 0 and 1 evicted
    assert list(cache) == sorted(resident)
    keys, values, present = cache.get_many(sorted(resident))
    assert present.all()
    np.testing.assert_array_equal(keys[:, 0], sorted(resident))
    np.testing.assert_array_equal(values, -keys)
    cache.clear()
    cache.check_invariants()


def test_gc_inside_every_pool_call_completes():
    pool = PagePool(64)
    held = [pool.allocate(1) for _ in range(30)]
    freed = []
    outcomes = []

    def finalize():
        # A finalizer that gives back the pages its object held.
        if held:
            pages = held.pop()
            try:
                pool.free(pages)
                freed.append(int(pages[0]))
            except BaseException as exc:
                outcomes.append(repr(exc))

    def scenario():
        with _GarbageStream(finalize):
            mine = pool.allocate(5)
            pool.incref(list(mine))
            pool.free(mine.tolist())
            pool.free(mine)
            pool.free_pages()
            pool.ref_count(0)
            pool.check_invariants()

    run_threads(scenario)
    assert not outcomes, outcomes
    assert freed, "no finalizer ran"
    pool.check_invariants()
    assert pool.num_free == 64 - len(held)
    assert sorted(pool.free_pages().tolist()) == sorted(set(range(64)) - {int(p[0]) for p in held})


# ------------------------------------------------------- many threads at once
def test_kv_cache_every_mutating_call_from_several_threads():
    heads, dim, page_size = 2, 4, 4
    cache = KVCache(num_layers=2, num_kv_heads=heads, head_dim=dim, num_pages=400, page_size=page_size,
                    dtype=np.float32, enable_prefix_caching=True)

    def worker(index):
        def run():
            rng = np.random.default_rng(index)
            mine = {}  # seq_id -> {position: value}: each thread owns its sequences
            next_id = index * 100_000
            for step in range(250):
                action = int(rng.integers(0, 8))
                if action == 0 or not mine:
                    next_id += 1
                    # Prompts unique to this sequence: prefix hits would share pages across threads.
                    cache.add_sequence(next_id, [next_id] * 9)
                    mine[next_id] = {}
                    continue
                seq_id = int(rng.choice(list(mine)))
                if action == 1:
                    cache.remove_sequence(seq_id)
                    del mine[seq_id]
                elif action == 2:
                    next_id += 1
                    cache.fork(seq_id, next_id)
                    mine[next_id] = dict(mine[seq_id])
                elif action == 3 and cache.seq_len(seq_id):
                    new_len = int(rng.integers(0, cache.seq_len(seq_id) + 1))
                    cache.truncate(seq_id, new_len)
                    mine[seq_id] = {p: v for p, v in mine[seq_id].items() if p < new_len}
                else:
                    n = int(rng.integers(1, 6))
                    n0 = cache.seq_len(seq_id)
                    try:
                        slots = cache.append([seq_id], [n])
                    except OutOfPagesError:
                        continue
                    values = seq_id * 1000.0 + np.arange(n0, n0 + n, dtype=np.float32)
                    k = np.repeat(values, heads * dim).reshape(n, heads, dim)
                    for layer in range(2):
                        cache.store(layer, slots, k, -k)
                    mine[seq_id].update(zip(range(n0, n0 + n), values.tolist()))
                cache.page_table(list(mine))
                for seq_id, rows in mine.items():
                    keys, values, positions = cache.gather(1, seq_id)
                    expected = np.array([rows[p] for p in positions.tolist()], dtype=np.float32)
                    np.testing.assert_array_equal(keys[:, 0, 0], expected)
                    np.testing.assert_array_equal(values[:, 0, 0], -expected)
            for seq_id in mine:
                cache.remove_sequence(seq_id)
        return run

    run_threads(*[worker(i) for i in range(4)], lambda: [cache.stats() for _ in range(200)])
    cache.check_invariants()
    assert cache.seq_ids() == []
    assert cache.pool.num_free == cache.num_pages


def test_classic_cache_every_call_from_several_threads():
    dim, page_size = 4, 4
    cache = PagedKVCache(max_pages=16, dim=dim, page_size=page_size)  # small: evictions race too
    lookups = []

    def check_rows(tokens, keys, values, present):
        tokens = np.asarray(tokens)[present]
        np.testing.assert_array_equal(keys[present], np.repeat(tokens[:, None], dim, axis=1))
        np.testing.assert_array_equal(values[present], -keys[present])

    def worker(index):
        def run():
            rng = np.random.default_rng(index)
            base = index * 10_000  # each thread writes its own tokens; a token's value is its index
            count = 0
            for step in range(400):
                action = int(rng.integers(0, 9))
                tokens = (base + rng.integers(0, 200, size=int(rng.integers(1, 20)))).tolist()
                if action == 0:
                    t = tokens[0]
                    cache.put(t, [t] * dim, [-t] * dim)
                elif action == 1:  # list inputs: the conversion runs Python code
                    cache.put_many(tokens, [[t] * dim for t in tokens], [[-t] * dim for t in tokens])
                elif action == 2:
                    rows = np.repeat(np.array(tokens, dtype=np.float32)[:, None], dim, axis=1)
                    cache.put_many(np.array(tokens, dtype=np.int64), rows, -rows)
                elif action == 3:
                    item = cache.get(tokens[0])
                    count += 1
                    if item is not None:
                        check_rows(tokens[:1], item[0][None], item[1][None], np.array([True]))
                elif action == 4:
                    check_rows(tokens, *cache.get_many(tokens))
                    count += len(tokens)
                elif action == 5:
                    present = list(cache)
                    assert present == sorted(set(present))
                    assert all(t in cache or True for t in present)
                elif action == 6:
                    assert len(cache.resident_pages) <= 16 and len(cache) <= 16 * page_size
                    cache.stats()
                elif action == 7 and index == 0 and step % 50 == 0:
                    cache.clear()
                else:
                    tokens[0] in cache
            lookups.append(count)
        return run

    run_threads(*[worker(i) for i in range(4)])
    cache.check_invariants()
    stats = cache.stats()
    assert stats["hits"] + stats["misses"] == sum(lookups)
    present = list(cache)
    assert len(present) == len(cache) == stats["num_tokens"]
    check_rows(present, *cache.get_many(present))


def test_pool_every_mutating_call_from_several_threads():
    pool = PagePool(512)
    owner = {}  # page -> thread holding it; a page handed to two threads at once is a bug
    owner_lock = threading.Lock()

    def worker(index):
        def run():
            rng = np.random.default_rng(index)
            mine = []
            for _ in range(2000):
                action = int(rng.integers(0, 4))
                if action == 0 or not mine:
                    try:
                        pages = pool.allocate(int(rng.integers(0, 40)))
                    except OutOfPagesError:
                        continue
                    with owner_lock:
                        for page in pages.tolist():
                            assert page not in owner, f"page {page} handed out twice"
                            owner[page] = index
                    mine.extend(pages.tolist())
                elif action == 1:
                    pick = mine[: int(rng.integers(1, len(mine) + 1))]
                    pool.incref(pick)
                    assert all(pool.ref_count(p) >= 2 for p in pick)
                    pool.free(np.array(pick, dtype=np.int32))
                else:
                    cut = int(rng.integers(1, len(mine) + 1))
                    pick, mine[:] = mine[:cut], mine[cut:]
                    with owner_lock:
                        for page in pick:
                            assert owner.pop(page) == index
                    pool.free(pick)
                if rng.integers(0, 50) == 0:
                    pool.free_pages()
            with owner_lock:
                for page in mine:
                    del owner[page]
            pool.free(mine)
        return run

    run_threads(*[worker(i) for i in range(4)])
    pool.check_invariants()
    assert pool.num_free == pool.num_pages and not owner


def test_finalizers_on_any_thread_while_others_hold_the_kv_cache_lock():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=4096, page_size=2, dtype=np.float32)
    victims = list(range(10**6, 10**6 + 2000))
    for seq_id in victims:
        cache.add_sequence(seq_id)
    cache.append(victims, [1] * len(victims))
    victims_lock = threading.Lock()
    errors = []

    def finalize():
        # Runs on whichever thread collects: re-entrant there, or waiting for another thread's call.
        with victims_lock:
            seq_id = victims.pop() if victims else None
        if seq_id is not None:
            try:
                cache.remove_sequence(seq_id)
            except BaseException as exc:
                errors.append(exc)

    def worker(index):
        def run():
            for step in range(150):
                seq_id = index * 1000 + step
                cache.add_sequence(seq_id)
                cache.append([seq_id], [3])
                cache.page_table([seq_id])
                cache.gather(0, seq_id)
                cache.remove_sequence(seq_id)
        return run

    with _GarbageStream(finalize):
        run_threads(*[worker(i) for i in range(3)])
    assert not errors, errors
    assert len(victims) < 2000, "no finalizer ran"
    cache.check_invariants()
    assert sorted(cache.seq_ids()) == sorted(victims)
    assert cache.pool.num_free == cache.num_pages - len(victims)


def test_cache_lock_contended_by_threads_that_release_the_gil_while_holding_it():
    # The holder sleeps (without the GIL) inside the lock, so the others find it
    # held and block in the lock's waiting path; each release must wake one of
    # them, and hand the lock over rather than let the holder's thread take it
    # again at once (which would keep the others waiting until it is done).
    lock = CacheLock("Probe", "do not")
    inside = []
    holders = []
    start = threading.Barrier(4)

    def worker(index):
        def run():
            start.wait()
            for step in range(300):
                with lock:
                    assert not inside, "two threads hold the lock at once"
                    inside.append(index)
                    if step % 3 == 0:
                        time.sleep(1e-4)
                    holders.append(index)
                    inside.pop()
        return run

    run_threads(*[worker(i) for i in range(4)])
    assert sorted(holders) == sorted(list(range(4)) * 300)
    switches = sum(a != b for a, b in zip(holders, holders[1:]))
    assert switches >= 100, f"the lock changed hands {switches} times in 1200 holds"
    assert "held=False" in repr(lock)
    with lock, pytest.raises(RuntimeError, match=REENTERED):
        lock.__enter__()
