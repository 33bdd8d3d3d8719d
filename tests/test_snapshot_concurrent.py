"""Snapshots taken while other threads change the cache (#29, item 11).

Worker threads append, store, fork, truncate, remove and add sequences with
prompts that hit the prefix cache; a KV-event publisher drains events; a
saver saves and exports all the while. Every file must load, pass
``check_invariants()`` and equal the cache at one point in time.

How "one point in time" is checked without trusting the saver: each worker
owns its sequences (no other thread changes them), so after each of its calls
it records what they are (ids, lengths, page tables), read with
``page_table`` under the cache's lock. A snapshot's sequences of one worker
must equal one of that worker's recorded states from the save's time span.
The K/V bytes are checked against the page tables: the K of the token at
position ``p`` of family ``f`` is ``f * 1000 + p`` (plus the layer / 4), its
V is ``-p``, so bytes from another moment (a page since freed and handed to
another sequence) do not pass.

``PAGEDKV_SOAK_SECONDS=60`` runs the stress test for that long instead of
a few seconds.
"""
import os
import threading
import time

import numpy as np
import pytest

from pagedkv import KVCache, OutOfPagesError, SnapshotError
from pagedkv import snapshot as snap

zmq = pytest.importorskip("zmq", reason='the KV-event publisher needs pyzmq: pip install "pagedkv[events]"')
from pagedkv.events import ZmqEventPublisher  # noqa: E402

SECONDS = float(os.environ.get("PAGEDKV_SOAK_SECONDS", "3"))
CHUNK = 5  # most tokens one append adds: only the last CHUNK positions of a sequence may be unstored
CONFIG = dict(num_layers=2, num_kv_heads=2, head_dim=8, num_pages=160, page_size=4, dtype=np.float32,
              enable_prefix_caching=True, page_checksums=True, enable_kv_events=True)


def _token(family: int, position: int) -> int:
    return family * 1000 + position


def _kv_rows(family: int, first: int, count: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V of positions ``[first, first + count)`` of ``family`` in ``layer``, shape (count, heads, dim)."""
    positions = np.arange(first, first + count, dtype=np.float32)
    shape = (count, CONFIG["num_kv_heads"], CONFIG["head_dim"])
    k = np.broadcast_to((_token(family, 0) + positions + layer / 4)[:, None, None], shape)
    v = np.broadcast_to((-positions)[:, None, None], shape)
    return np.ascontiguousarray(k), np.ascontiguousarray(v)


def _check_bytes(cache: KVCache, seq_id: int, length: int) -> None:
    """The K/V of every cached position but the last CHUNK is the family pattern of one family."""
    for layer in range(cache.num_layers):
        k, v, positions = cache.gather(layer, seq_id)
        if cache.window is None:
            assert np.array_equal(positions, np.arange(length))
        keep = positions < length - CHUNK
        if not keep.any():
            continue
        k, v = k[keep], v[keep]
        at = positions[keep].astype(np.float32)[:, None, None]
        assert np.array_equal(v, np.broadcast_to(-at, v.shape)), f"sequence {seq_id}: V of another moment"
        base = k - at - layer / 4
        assert np.all(base == base[0, 0, 0]) and base[0, 0, 0] % 1000 == 0, f"sequence {seq_id}: K of another moment"


class _Worker(threading.Thread):
    """Owns the sequences ``base + n``; every mutating call, then a record of what its sequences are."""

    def __init__(self, cache: KVCache, index: int, stop: threading.Event, seed: int):
        super().__init__(name=f"worker-{index}", daemon=True)
        self.cache, self.stop, self.rng = cache, stop, np.random.default_rng(seed)
        self.base = (index + 1) * 1_000_000
        self.families = [10 * (index + 1) + j for j in range(2)]
        self.family: dict[int, int] = {}  # seq id -> family
        self.next_id = self.base
        # (call began, call returned, {seq id: (length, pages)} after it), one per call
        self.history: list[tuple[float, float, dict]] = []
        self.calls = 0
        self.error: BaseException | None = None
        self.lock = threading.Lock()  # guards history (read by the checker)

    def _record(self, since: float) -> None:
        """Note what the sequences are after a call that began at ``since`` (its effect may date from then)."""
        ids = sorted(self.family)
        state = {}
        if ids:
            view = self.cache.page_table(ids)
            for b, seq_id in enumerate(ids):
                pages = tuple(view.indices[view.indptr[b]:view.indptr[b + 1]].tolist())
                state[seq_id] = (int(view.seq_lens[b]), pages)
        with self.lock:
            self.history.append((since, time.monotonic(), state))

    def _call(self, method: str, *args, **kwargs):
        """One call of the cache, then a record of the state it left."""
        since = time.monotonic()
        try:
            return getattr(self.cache, method)(*args, **kwargs)
        finally:
            self._record(since)

    def states_between(self, start: float, end: float) -> list[dict]:
        """The recorded states that may have held at some moment of ``[start, end]``.

        Waits until the worker has recorded a call that began after ``end``
        (or stopped): a call that ended before then may not be recorded yet.
        """
        while True:
            with self.lock:
                history = list(self.history)
            if (history and history[-1][0] > end) or not self.is_alive():
                break
            time.sleep(0.001)
        with self.lock:
            history = list(self.history)
        out = []
        for i, (since, _, state) in enumerate(history):
            # The state holds from its call (at the earliest) until the next call returned (at the latest).
            until = history[i + 1][1] if i + 1 < len(history) else float("inf")
            if since <= end and until >= start:
                out.append(state)
        return out

    def _append(self, seq_id: int, count: int, with_tokens: bool) -> None:
        cache, family = self.cache, self.family[seq_id]
        first = cache.seq_len(seq_id)
        tokens = [_token(family, p) for p in range(first, first + count)] if with_tokens else None
        slots = self._call("append", [seq_id], [count], token_ids=tokens)
        for layer in range(cache.num_layers):
            cache.store(layer, slots, *_kv_rows(family, first, count, layer))

    def _remove(self, seq_id: int) -> None:
        del self.family[seq_id]
        self._call("remove_sequence", seq_id)

    def _step(self) -> None:
        rng, cache = self.rng, self.cache
        ids = sorted(self.family)
        op = rng.integers(6) if ids else 0
        if op == 0 or len(ids) < 2:  # a new sequence on a prompt that hits the prefix cache
            seq_id, family = self.next_id, int(rng.choice(self.families))
            self.next_id += 1
            prompt = [_token(family, p) for p in range(int(rng.integers(1, 30)))]
            self.family[seq_id] = family
            try:
                self._call("add_sequence", seq_id, prompt)
            except BaseException:
                del self.family[seq_id]
                raise
            while cache.seq_len(seq_id) < len(prompt):  # the rest of the prompt, in chunks
                self._append(seq_id, min(CHUNK, len(prompt) - cache.seq_len(seq_id)), False)
        elif op in (1, 2):
            self._append(int(rng.choice(ids)), int(rng.integers(1, CHUNK + 1)), True)
        elif op == 3:
            child = self.next_id
            self.next_id += 1
            parent = int(rng.choice(ids))
            self.family[child] = self.family[parent]
            try:
                self._call("fork", parent, child)
            except BaseException:
                del self.family[child]
                raise
        elif op == 4:
            seq_id = int(rng.choice(ids))
            try:
                self._call("truncate", seq_id, int(rng.integers(0, cache.seq_len(seq_id) + 1)))
            except ValueError:  # a window released keys that the shorter sequence's queries need: no change
                if cache.window is None:
                    raise
        else:
            self._remove(int(rng.choice(ids)))

    def run(self) -> None:
        try:
            self._record(time.monotonic())
            while not self.stop.is_set():
                try:
                    self._step()
                except OutOfPagesError:  # the pool is shared: give some back
                    for seq_id in sorted(self.family)[: max(1, len(self.family) // 2)]:
                        self._remove(seq_id)
                self.calls += 1
                if len(self.family) > 12:
                    self._remove(min(self.family))
        except BaseException as exc:  # reported by the test
            self.error = exc


def _owner(workers: list[_Worker], seq_id: int) -> _Worker:
    return workers[seq_id // 1_000_000 - 1]


def _check_snapshot(loaded: KVCache, workers: list[_Worker], start: float, end: float) -> None:
    """``loaded`` passes its invariants and holds, for every worker, one of its states of ``[start, end]``."""
    loaded.check_invariants()
    assert not loaded.verify_pages(), "a sealed page's recorded checksum does not match its bytes"
    ids = loaded.seq_ids()
    view = loaded.page_table(ids) if ids else None
    found: dict[int, dict] = {}
    for b, seq_id in enumerate(ids):
        pages = tuple(view.indices[view.indptr[b]:view.indptr[b + 1]].tolist())
        found.setdefault(seq_id // 1_000_000, {})[seq_id] = (int(view.seq_lens[b]), pages)
        _check_bytes(loaded, seq_id, int(view.seq_lens[b]))
    for index, worker in enumerate(workers):
        mine = found.get(index + 1, {})
        states = worker.states_between(start, end)
        if mine not in states:
            closest = min(states, key=lambda state: len(set(state.items()) ^ set(mine.items())))
            differ = {seq_id: (mine.get(seq_id), closest.get(seq_id)) for seq_id in set(mine) | set(closest)
                      if mine.get(seq_id) != closest.get(seq_id)}
            pytest.fail(f"worker {index}: the snapshot's sequences are none of its {len(states)} states during "
                        f"the save; (snapshot, closest state) differ in {differ}")


def _check_export(data: bytes, seq_id: int, workers: list[_Worker], start: float, end: float) -> None:
    """An exported sequence imports, and its length is one the owner's sequence had during the export."""
    source = workers[0].cache
    target = KVCache(**{**CONFIG, "enable_kv_events": False, "window": source.window,
                        "sink_tokens": source.sink_tokens})
    target.import_sequence(seq_id, data)
    target.check_invariants()
    length = target.seq_len(seq_id)
    lengths = {state[seq_id][0] for state in _owner(workers, seq_id).states_between(start, end) if seq_id in state}
    assert length in lengths, f"exported sequence {seq_id} has length {length}, never its length during the export"
    _check_bytes(target, seq_id, length)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("window", [None, 12], ids=["full", "window"])
def test_snapshots_taken_under_load_all_load_and_are_points_in_time(tmp_path, window):
    config = CONFIG if window is None else {**CONFIG, "window": window, "sink_tokens": 4}
    cache = KVCache(**config)
    stop = threading.Event()
    workers = [_Worker(cache, i, stop, seed=100 + i) for i in range(3)]
    path = tmp_path / "snap.pkv"
    saves = exports = 0
    with ZmqEventPublisher(cache, f"tcp://127.0.0.1:{_free_port()}", interval=0.005):
        for worker in workers:
            worker.start()
        try:
            deadline = time.monotonic() + SECONDS
            rng = np.random.default_rng(7)
            while time.monotonic() < deadline and not any(w.error for w in workers):
                start = time.monotonic()
                cache.save(path)
                end = time.monotonic()
                saves += 1
                try:
                    loaded = KVCache.load(path)
                except SnapshotError as exc:
                    pytest.fail(f"save {saves} wrote a file that does not load: {exc}")
                _check_snapshot(loaded, workers, start, end)
                ids = cache.seq_ids()
                if ids:
                    seq_id = int(rng.choice(ids))
                    start = time.monotonic()
                    try:
                        data = cache.export_sequence(seq_id)
                    except KeyError:  # removed meanwhile
                        continue
                    end = time.monotonic()
                    _check_export(data, seq_id, workers, start, end)
                    exports += 1
        finally:
            stop.set()
            for worker in workers:
                worker.join()
    for worker in workers:
        if worker.error is not None:
            raise worker.error
    print(f"{saves} saves and {exports} exports, all loaded; worker steps {[worker.calls for worker in workers]}")
    assert saves >= 3 and exports >= 1
    assert all(worker.calls > 50 for worker in workers), [worker.calls for worker in workers]
    cache.check_invariants()


def test_classic_snapshots_taken_under_load_all_load(tmp_path):
    """``PagedKVCache.save`` while threads put (evicting pages) and clear: every file loads, and every
    token present in it holds its own K and V (key = token, value = -token), never another moment's."""
    from pagedkv import PagedKVCache

    cache = PagedKVCache(24, 16, page_size=4, dtype=np.float32)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                if rng.random() < 0.01:
                    cache.clear()
                    continue
                tokens = rng.integers(0, 400, size=int(rng.integers(1, 12)))
                rows = np.repeat(tokens.astype(np.float32)[:, None], 16, axis=1)
                cache.put_many(tokens, rows, -rows)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(seed,), daemon=True) for seed in range(3)]
    for thread in threads:
        thread.start()
    path = tmp_path / "classic.pkv"
    saves = 0
    try:
        deadline = time.monotonic() + min(SECONDS, 2.0)
        while time.monotonic() < deadline and not errors:
            cache.save(path)
            saves += 1
            try:
                loaded = PagedKVCache.load(path)
            except SnapshotError as exc:
                pytest.fail(f"save {saves} wrote a file that does not load: {exc}")
            loaded.check_invariants()
            tokens = np.array(list(loaded), dtype=np.int64)
            if tokens.size:
                keys, values, present = loaded.get_many(tokens)
                assert present.all()
                expected = np.repeat(tokens.astype(np.float32)[:, None], 16, axis=1)
                assert np.array_equal(keys, expected) and np.array_equal(values, -expected), \
                    f"save {saves}: a token holds the K/V of another moment"
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    if errors:
        raise errors[0]
    assert saves >= 3


class _Forging:
    """A KVCache stand-in whose exported state says page 0 has one reference more than the tables hold."""

    def __init__(self, cache: KVCache):
        self.cache, self.kv = cache, cache.kv

    @staticmethod
    def _forge(state: dict) -> dict:
        state["ref_counts"] = state["ref_counts"].copy()
        state["ref_counts"][0] += 1
        return state

    def _snapshot(self, kv_out):
        state, sealed = self.cache._snapshot(kv_out)
        return self._forge(state), sealed

    def _export_state(self):
        return self._forge(self.cache._export_state())

    def _sealed_state(self):
        return self.cache._sealed_state()


def test_a_file_that_would_not_load_never_replaces_the_snapshot(tmp_path):
    """The new file's metadata is read back and checked as load checks it, before the rename (#29)."""
    cache = KVCache(**{**CONFIG, "enable_kv_events": False})
    cache.add_sequence(1, [_token(1, p) for p in range(9)])
    slots = cache.append([1], [9])
    for layer in range(cache.num_layers):
        cache.store(layer, slots, *_kv_rows(1, 0, 9, layer))
    path = tmp_path / "good.pkv"
    cache.save(path)
    good = path.read_bytes()
    with pytest.raises(SnapshotError, match="page 0 has ref count 2"):
        snap.save_cache(_Forging(cache), path)
    assert path.read_bytes() == good
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good.pkv"]  # no temporary file left
    KVCache.load(path).check_invariants()
