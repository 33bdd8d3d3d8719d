"""Snapshots and exported sequences from bytes this process did not write (issue 29).

Every input here is forged: a real snapshot or export whose sections are
edited and whose checksums are recomputed (``tests/_snapshot_forge.py``), so
only the loader's own validation stands between the bytes and the cache.
The rule: a forged input is a ``SnapshotError`` (naming its section) raised
before anything is built or changed, ``verify`` refuses exactly what
``load`` refuses, and what does load passes ``check_invariants()`` and keeps
working (append, store, save, load again).
"""
import hashlib
import os
import struct
import tempfile
import tracemalloc

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv import KVCache, OutOfPagesError, PagedKVCache, SnapshotError
from pagedkv import snapshot as snap
from pagedkv_c._prefix import salt_digest

from _snapshot_forge import forge, forge_file, sections_of


def _filled(cache, seq_ids, counts, token_ids=None, seed=0):
    rng = np.random.default_rng(seed)
    slots = cache.append(seq_ids, counts, token_ids)
    for layer in range(cache.num_layers):
        shape = (slots.size, cache.num_kv_heads, cache.head_dim)
        cache.store(layer, slots, rng.standard_normal(shape), rng.standard_normal(shape))
    return slots


def _windowed(**kwargs) -> KVCache:
    """The issue's case: window 8, 3 sink tokens, pages of 2, a forked sequence."""
    cache = KVCache(2, 1, 4, 32, page_size=2, window=8, sink_tokens=3, dtype=np.float32, **kwargs)
    cache.add_sequence(0)
    _filled(cache, [0], [13])
    cache.fork(0, 1)
    cache.check_invariants()
    return cache


def _saved(tmp_path, cache, name="ok.pkv"):
    path = tmp_path / name
    cache.save(path)
    return path


def _refused_everywhere(path, section: str, match: str = ""):
    """verify, load and mmap load all raise the same kind of SnapshotError naming ``section``."""
    for attempt in (lambda: snap.verify(path), lambda: KVCache.load(path), lambda: KVCache.load(path, mmap=True)):
        with pytest.raises(SnapshotError, match=rf"section '{section}'.*{match}"):
            attempt()


def _usable(cache: KVCache, tmp_path) -> KVCache:
    """The cache passes its invariants and survives append, store, fork, save and load."""
    cache.check_invariants()
    ids = cache.seq_ids()
    if len(ids):
        _filled(cache, list(ids), [3] * len(ids), seed=9)
        cache.fork(int(ids[0]), 10**6)
    cache.check_invariants()
    path = tmp_path / "again.pkv"
    cache.save(path)
    snap.verify(path)
    again = KVCache.load(path)
    again.check_invariants()
    return again


# ------------------------------------------------------------ 1. forged window geometry
def _table_edit(row: int, column: int, delta: int):
    def edit(sections):
        sections["tables"]["fields"][row, column] += delta
    return edit


# (fields column, change) of length, sink_count, ring_first; each breaks the exact page cover. (Length
# 14 instead of 13 is not among them: 14 tokens appended at once leave the same pages held.)
GEOMETRY_EDITS = {"length+2": (0, 2), "length+3": (0, 3), "length-2": (0, -2), "ring_first+1": (2, 1),
                  "ring_first-1": (2, -1), "sink_count-1": (1, -1)}


@pytest.mark.parametrize("edit", sorted(GEOMETRY_EDITS))
def test_forged_window_geometry_in_a_snapshot_is_refused(tmp_path, edit):
    """The issue's case (length raised by 2) and its neighbours: verify and load refuse them."""
    cache = _windowed()
    path = _saved(tmp_path, cache)
    forge_file(path, _table_edit(0, *GEOMETRY_EDITS[edit]))
    _refused_everywhere(path, "tables", "sequence 0")


@pytest.mark.parametrize("edit", sorted(GEOMETRY_EDITS))
def test_forged_window_geometry_in_an_export_is_refused(tmp_path, edit):
    cache = _windowed()
    blob = forge(cache.export_sequence(0), _table_edit(0, *GEOMETRY_EDITS[edit]))
    target = KVCache(2, 1, 4, 32, page_size=2, window=8, sink_tokens=3, dtype=np.float32)
    target.add_sequence(7)
    _filled(target, [7], [5])
    before, kv = target._export_state(), target.kv.copy()
    with pytest.raises(SnapshotError, match="section 'tables'"):
        target.import_sequence(5, blob)
    after = target._export_state()
    assert list(target.seq_ids()) == [7] and np.array_equal(target.kv, kv)
    assert np.array_equal(before["free_queue"], after["free_queue"])
    target.check_invariants()


def test_honest_window_states_still_load(tmp_path):
    """Every state the release rule reaches (decode, long prefill, truncate, 1-token window) loads."""
    for window, sink in ((8, 3), (1, 0), (3, 1), (5, 4)):
        cache = KVCache(1, 1, 2, 64, page_size=2, window=window, sink_tokens=sink, dtype=np.float32)
        cache.add_sequence(0)
        _filled(cache, [0], [13])  # a prefill longer than the window
        cache.fork(0, 1)
        for _ in range(5):
            _filled(cache, [1], [1])
        cache.add_sequence(2)
        _filled(cache, [2], [2])
        cache.add_sequence(3)
        for _ in range(11):
            _filled(cache, [3], [1])
        for new_len in range(cache.seq_len(3) - 1, -1, -1):  # the first shorter length the window allows
            try:
                cache.truncate(3, new_len)
                break
            except ValueError:
                continue
        cache.check_invariants()
        for seq_id in cache.seq_ids():
            exported = cache.export_sequence(int(seq_id))
            other = KVCache(1, 1, 2, 64, page_size=2, window=window, sink_tokens=sink, dtype=np.float32)
            other.import_sequence(0, exported)
            other.check_invariants()
        path = _saved(tmp_path, cache)
        snap.verify(path)
        _usable(KVCache.load(path), tmp_path)


# ------------------------------------------------------------ 2. verify and load agree
def test_negative_prefix_hit_count_is_refused_by_verify_and_load(tmp_path):
    cache = KVCache(1, 1, 2, 16, page_size=2, enable_prefix_caching=True, dtype=np.float32)
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    path = _saved(tmp_path, cache)

    def edit(sections):
        sections["counters"]["prefix_hit_counts"][3] = -1
    forge_file(path, edit)
    _refused_everywhere(path, "counters", "prefix_hit_counts")


def test_forged_hash_chain_count_is_refused_by_verify_and_load(tmp_path):
    cache = KVCache(1, 1, 2, 16, page_size=2, enable_prefix_caching=True, dtype=np.float32)
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    _filled(cache, [0], [5])
    path = _saved(tmp_path, cache)

    def edit(sections):
        sections["hashes"]["fields"][0, 5] += 1  # num_hashable past the hashed pages
    forge_file(path, edit)
    _refused_everywhere(path, "hashes", "sequence 0")


def test_core_errors_name_their_section(tmp_path):
    """Each part of the state the core checks is named as the file section it came from."""
    cache = KVCache(1, 1, 2, 16, page_size=2, enable_prefix_caching=True, dtype=np.float32)
    cache.add_sequence(0, [1, 2, 3, 4, 5])
    _filled(cache, [0], [5])
    state = cache._export_state()
    fresh = KVCache(**snap._cache_kwargs(cache._config()))
    state["counters"]["prefix_hit_counts"] = state["counters"]["prefix_hit_counts"] - 5
    with pytest.raises(ValueError) as info:
        fresh._restore_state(state)
    assert getattr(info.value, "section", None) == "counters"


# ------------------------------------------------------------ 3. recorded seal checksums
def _sealed_cache() -> KVCache:
    cache = KVCache(2, 1, 4, 16, page_size=2, dtype=np.float32, page_checksums=True)
    cache.add_sequence(0)
    _filled(cache, [0], [7])
    cache.seal()
    assert not cache.verify_pages().bad_pages
    return cache


def test_forged_recorded_seal_checksum_is_refused(tmp_path):
    cache = _sealed_cache()
    page = int(cache.page_table([0]).indices[1])
    path = _saved(tmp_path, cache)
    _, sections = sections_of(path.read_bytes())
    assert sections["sealed"]["sealed"][page] == 1

    def edit(sections):
        sections["sealed"]["checksums"][page] = 0  # the pages and the checksum table are intact
    forge_file(path, edit)
    _refused_everywhere(path, "sealed", f"page {page}")


def test_honest_sealed_pages_save_and_load_again(tmp_path):
    cache = _sealed_cache()
    loaded = KVCache.load(_saved(tmp_path, cache))
    assert not loaded.verify_pages().bad_pages
    again = _usable(loaded, tmp_path)
    assert not again.verify_pages().bad_pages


# ------------------------------------------------------------ 4. counters never wrap
COUNTERS = ("pages_peak", "evictions", "cow_copies", "tokens_appended", "prefix_queries", "prefix_hits",
            "out_of_pages_errors", "sequences_added", "pages_allocated", "ring_reuses")


def test_counters_at_the_top_saturate_and_save_again(tmp_path):
    """load -> append -> save -> load with every counter at 2**63 - 1: nothing wraps, the file loads."""
    cache = KVCache(1, 1, 2, 8, page_size=2, window=4, enable_prefix_caching=True, dtype=np.float32,
                    page_checksums=True)
    cache.add_sequence(0, [1, 2, 3])
    _filled(cache, [0], [3])
    path = _saved(tmp_path, cache)
    top = 2**63 - 1

    def edit(sections):
        for name in COUNTERS:
            sections["counters"][name] = np.array(top)
        sections["counters"]["prefix_hit_counts"][:] = top
        sections["prefix"]["evictions"] = np.array(top)
        sections["sealed"]["pages_sealed"] = np.array(top)
    forge_file(path, edit)
    loaded = KVCache.load(path)
    for step in range(12):  # appends that release, reuse in place, evict cached pages and seal
        _filled(loaded, [0], [1], token_ids=[step % 3], seed=step)
    loaded.add_sequence(1, [1, 2, 3, 1, 2])
    loaded.fork(0, 2)
    _filled(loaded, [2], [1])
    with pytest.raises(OutOfPagesError):
        loaded.append([1, 2, 0], [9, 9, 9])
    loaded.seal()
    stats = loaded.stats(metrics=True)
    for name in ("tokens_appended", "prefix_queries", "prefix_hits", "sequences_added", "pages_allocated",
                 "out_of_pages_errors", "evictions", "cow_copies", "ring_reuses", "prefix_evictions"):
        assert stats[name] == top, name
    assert min(stats["prefix_hit_histogram"]) >= 0
    again = tmp_path / "again.pkv"
    loaded.save(again)
    reloaded = KVCache.load(again)
    assert reloaded.stats(metrics=True)["tokens_appended"] == top
    reloaded.check_invariants()


def test_classic_counters_at_the_top_saturate_and_save_again(tmp_path):
    cache = PagedKVCache(4, 2, page_size=2)
    cache.put(0, np.ones(2), np.ones(2))
    path = tmp_path / "classic.pkv"
    cache.save(path)
    top = 2**63 - 1

    def edit(sections):
        for name in ("hits", "misses", "evictions"):
            sections["counters"][name] = np.array(top)
    forge_file(path, edit)
    loaded = PagedKVCache.load(path)
    loaded.get(0)
    loaded.get(1)
    for position in range(2, 20, 2):  # evicts
        loaded.put(position, np.ones(2), np.ones(2))
    stats = loaded.stats()
    assert (stats["hits"], stats["misses"], stats["evictions"]) == (top, top, top)
    loaded.save(path)
    assert PagedKVCache.load(path).stats()["hits"] == top


# ------------------------------------------------------------ 9. imported hashes are recomputed
def _salted_export(extra_key="alice", tokens=(1, 2, 3, 4, 5, 6, 7), prefix_hash="xxh3_128"):
    source = KVCache(1, 1, 2, 16, page_size=2, enable_prefix_caching=True, prefix_hash=prefix_hash,
                     dtype=np.float32)
    source.add_sequence(0, list(tokens), extra_key=extra_key)
    _filled(source, [0], [len(tokens)], seed=4)
    return source, source.export_sequence(0)


def _target(prefix_hash="xxh3_128"):
    return KVCache(1, 1, 2, 16, page_size=2, enable_prefix_caching=True, prefix_hash=prefix_hash,
                   dtype=np.float32)


def _salt(extra_key, algorithm="xxh3_128"):
    """The salt digest as the (lo, hi) uint64 pair a hash chain state stores."""
    digest = salt_digest(algorithm, extra_key)
    return np.array([digest & (2**64 - 1), digest >> 64], dtype=np.uint64)


def _chain(salt, tokens, page_size=2, algorithm="xxh3_128"):
    """The token-keyed hash chain (see pagedkv_c._prefix.hash_token_pages), written out here."""
    parent, out = bytes(16), []
    for k in range(len(tokens) // page_size):
        data = parent + np.asarray(salt, dtype="<u8").tobytes() + np.asarray(
            tokens[k * page_size:(k + 1) * page_size], dtype="<i4").tobytes()
        if algorithm == "xxh3_128":
            digest = xxhash.xxh3_128_intdigest(data)
            lo, hi = digest & (2**64 - 1), digest >> 64
        else:
            raw = hashlib.sha256(data).digest()
            lo, hi = int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:16], "little")
        out.append((lo, hi))
        parent = np.array([lo, hi], dtype="<u8").tobytes()
    return np.array(out, dtype=np.uint64).reshape(-1, 2)


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_the_chain_written_out_matches_the_core(algorithm):
    source, blob = _salted_export(prefix_hash=algorithm)
    _, sections = sections_of(blob)
    salt = sections["hashes"]["salts"][0]
    assert np.array_equal(salt, _salt("alice", algorithm))
    assert np.array_equal(sections["hashes"]["chain"], _chain(salt, [1, 2, 3, 4, 5, 6], algorithm=algorithm))


def test_forged_salt_cannot_plant_pages_under_another_tenant():
    """An attacker exports its own K/V for bob's prompt, sets bob's salt and a matching chain:
    the import is refused, and bob's request computes its own K/V."""
    bob_prompt = [1, 2, 3, 4, 5, 6, 7]
    _, blob = _salted_export("mallory", bob_prompt)
    bob_salt = _salt("bob")

    def plant(sections):
        sections["hashes"]["salts"][0] = bob_salt
        sections["hashes"]["chain"] = _chain(bob_salt, bob_prompt[:6])
    forged = forge(blob, plant)
    for extra_key in (None, "mallory"):
        target = _target()
        with pytest.raises(SnapshotError, match="section 'hashes'.*extra_key"):
            target.import_sequence(3, forged, extra_key=extra_key)
        assert target.num_sequences == 0 and target.prefix_index.num_cached == 0
        assert target.add_sequence(4, bob_prompt, extra_key="bob") == 0


def test_forged_chain_is_refused_on_import():
    _, blob = _salted_export("alice")

    def edit(sections):
        sections["hashes"]["chain"][1, 0] ^= 1
    target = _target()
    with pytest.raises(SnapshotError, match="section 'hashes'"):
        target.import_sequence(3, forge(blob, edit), extra_key="alice")
    assert target.num_sequences == 0 and target.prefix_index.num_cached == 0

    def tokens(sections):  # the kept token ids no longer give the chain
        sections["hashes"]["token_ids"][0] += 1
    with pytest.raises(SnapshotError, match="section 'hashes'"):
        target.import_sequence(3, forge(blob, tokens), extra_key="alice")


def test_import_with_the_right_extra_key_serves_only_that_tenant():
    _, blob = _salted_export("alice")
    target = _target()
    with pytest.raises(SnapshotError, match="extra_key"):
        target.import_sequence(3, blob)  # salted bytes need the caller to name the salt
    target.import_sequence(3, blob, extra_key="alice")
    target.check_invariants()
    assert target.add_sequence(4, [1, 2, 3, 4, 5, 6, 7], extra_key="bob") == 0
    assert target.add_sequence(5, [1, 2, 3, 4, 5, 6, 7], extra_key="alice") == 6


def test_forged_chain_in_a_snapshot_is_refused(tmp_path):
    cache = KVCache(1, 1, 2, 16, page_size=2, enable_prefix_caching=True, dtype=np.float32)
    cache.add_sequence(0, [1, 2, 3, 4, 5, 6, 7], extra_key="alice")
    _filled(cache, [0], [7])
    path = _saved(tmp_path, cache)

    def edit(sections):
        sections["hashes"]["chain"][2, 1] ^= 1 << 40
    forge_file(path, edit)
    _refused_everywhere(path, "hashes", "sequence 0")


def test_forged_index_hash_of_a_held_page_is_refused(tmp_path):
    """The prefix index must register a held page under the chain hash of its sequence."""
    cache = KVCache(1, 1, 2, 16, page_size=2, enable_prefix_caching=True, dtype=np.float32)
    cache.add_sequence(0, [1, 2, 3, 4, 5, 6, 7], extra_key="alice")
    _filled(cache, [0], [7])
    path = _saved(tmp_path, cache)
    bob_chain = _chain(_salt("bob"), [1, 2, 3, 4, 5, 6])

    def edit(sections):
        sections["prefix"]["hashes"][:3] = bob_chain
    forge_file(path, edit)
    _refused_everywhere(path, "prefix")


# ------------------------------------------------------------ 10. out of pages is OutOfPagesError
def test_import_larger_than_the_whole_pool_is_out_of_pages():
    source = KVCache(1, 1, 2, 16, page_size=2, dtype=np.float32)
    source.add_sequence(0)
    _filled(source, [0], [20])  # 10 pages
    target = KVCache(1, 1, 2, 8, page_size=2, dtype=np.float32)
    target.add_sequence(1)
    _filled(target, [1], [3])
    before, kv = target._export_state(), target.kv.copy()
    with pytest.raises(OutOfPagesError, match="Nothing was changed"):
        target.import_sequence(2, source.export_sequence(0))
    after = target._export_state()
    assert np.array_equal(before["free_queue"], after["free_queue"]) and np.array_equal(target.kv, kv)
    assert list(target.seq_ids()) == [1]
    target.check_invariants()


# ------------------------------------------------------------ metadata entries of impossible shapes
def test_empty_entry_of_an_impossible_shape_names_its_section(tmp_path):
    """(0, 2**63) holds no bytes, so the size check passes; NumPy cannot shape it: SnapshotError, not ValueError."""
    cache = _windowed()
    blob = cache.export_sequence(0)
    magic, parts = sections_of(blob)
    raw = snap._encode({name: value for name, value in parts["tables"].items() if name != "pages"})
    entry = struct.pack("<HBB", 5, 1, 2) + b"pages" + bytes(7) + struct.pack("<2Q", 0, 2**63)
    magic, parts = sections_of(blob)
    metadata = [("config", snap._encode(parts["config"])), ("tables", raw + entry)]
    prefix, _ = snap._container(magic, metadata, parts["checksums"].astype("<u8").tobytes(), len(parts["pages"]), 8)
    forged = prefix + parts["pages"]
    target = KVCache(2, 1, 4, 32, page_size=2, window=8, sink_tokens=3, dtype=np.float32)
    with pytest.raises(SnapshotError, match="section 'tables'.*'pages'"):
        target.import_sequence(1, forged)
    path = _saved(tmp_path, cache)

    def edit(sections):
        sections["tables"]["pages"] = np.zeros((0, 2**40), np.int32)  # NumPy shapes it; the loader refuses it
    forge_file(path, edit)
    _refused_everywhere(path, "tables")


@pytest.mark.parametrize("mmap", [False, True])
def test_forgeries_the_core_finds_are_refused_before_the_pool_exists(tmp_path, mmap):
    """A forged chain (found by the core's recomputation) is refused before the 8 MiB pool is allocated."""
    cache = KVCache(4, 8, 16, 256, page_size=16, enable_prefix_caching=True, dtype=np.float16)
    cache.add_sequence(1, list(range(40)), extra_key="alice")
    _filled(cache, [1], [40])
    path = _saved(tmp_path, cache)

    def edit(sections):
        sections["hashes"]["chain"][0, 0] ^= 1
    forge_file(path, edit)
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError, match="section 'hashes'"):
            KVCache.load(path, mmap=mmap)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < cache.kv.nbytes // 4


# ------------------------------------------------------------ honest states are never refused
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(page_size=st.sampled_from([1, 2, 3, 4]), window=st.sampled_from([None, 1, 2, 3, 5, 8]),
       sink=st.sampled_from([0, 1, 3, 4]), ops=st.lists(st.tuples(st.sampled_from(["add", "append", "fork",
                                                                                   "truncate", "remove"]),
                                                                  st.integers(0, 9), st.integers(0, 12)),
                                                        min_size=1, max_size=25))
def test_every_reachable_state_loads_and_imports(page_size, window, sink, ops):
    """The exact checks refuse no state the core reaches: windows smaller and larger than a page, sinks,
    prefix hits that adopt cached pages, forks, truncations; saved, verified, loaded and exported back."""
    if window is None:
        sink = 0
    kwargs = dict(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=40, page_size=page_size, window=window,
                  sink_tokens=sink, enable_prefix_caching=True, dtype=np.float32)
    cache = KVCache(**kwargs)
    next_id, salts = 0, {}
    for op, a, b in ops:
        ids = [int(i) for i in cache.seq_ids()]
        try:
            if op == "add" or not ids:
                salts[next_id] = (None, 7)[a % 2]
                cache.add_sequence(next_id, [t % 3 for t in range(b)], extra_key=salts[next_id])
                next_id += 1
            elif op == "append":
                seq = ids[a % len(ids)]
                cache.append([seq], [b], [t % 3 for t in range(b)], return_slot_mapping=False)
            elif op == "fork":
                salts[next_id] = salts[ids[a % len(ids)]]
                cache.fork(ids[a % len(ids)], next_id)
                next_id += 1
            elif op == "truncate":
                seq = ids[a % len(ids)]
                cache.truncate(seq, max(cache.seq_len(seq) - b, 0))
            else:
                cache.remove_sequence(ids[a % len(ids)])
        except (ValueError, MemoryError):
            pass  # refused calls (out of pages, a truncation into released pages) change nothing
    cache.check_invariants()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "state.pkv")
        cache.save(path)
        snap.verify(path)
        loaded = KVCache.load(path)
        loaded.check_invariants()
    for seq_id in cache.seq_ids():
        other = KVCache(**kwargs)
        other.import_sequence(0, cache.export_sequence(int(seq_id)), extra_key=salts[int(seq_id)])
        other.check_invariants()
