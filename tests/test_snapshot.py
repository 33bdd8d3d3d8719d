"""Snapshots (pagedkv.snapshot): save/load, export/import of one sequence, damaged files, atomic writes.

The reference for a restored cache is the same cache never saved: both are
driven through the same calls and must answer alike, bit for bit.
"""
import os
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv
from pagedkv import KVCache, OutOfPagesError, SnapshotError
from pagedkv import snapshot as snap



def _assert_same(a: KVCache, b: KVCache) -> None:
    """Every observable of two caches agrees: tables, K/V, stats, free queue, prefix index."""
    a.check_invariants()
    b.check_invariants()
    assert a.stats(metrics=True) == b.stats(metrics=True)
    assert a.seq_ids() == b.seq_ids()
    assert np.array_equal(a.pool.free_pages(), b.pool.free_pages())
    ids = a.seq_ids()
    if ids:
        va, vb = a.page_table(ids), b.page_table(ids)
        for name in ("indptr", "indices", "last_page_len", "page_positions", "seq_lens"):
            assert np.array_equal(getattr(va, name), getattr(vb, name)), name
    for seq_id in ids:
        for layer in range(a.num_layers):
            for x, y in zip(a.gather(layer, seq_id), b.gather(layer, seq_id)):
                assert np.array_equal(x, y)
    assert np.array_equal(np.asarray(a.kv), np.asarray(b.kv))
    sa, sb = a._sealed_state(), b._sealed_state()
    assert np.array_equal(sa["sealed"], sb["sealed"]) and sa["pages_sealed"] == sb["pages_sealed"]
    assert (sa["checksums"] is None) == (sb["checksums"] is None)
    if sa["checksums"] is not None:
        assert np.array_equal(sa["checksums"], sb["checksums"])
        assert not a.verify_pages() and not b.verify_pages()
    if a.prefix_caching:
        pa, pb = a.prefix_index, b.prefix_index
        assert np.array_equal(pa.cached_pages(), pb.cached_pages())
        assert [pa.page_hash(p) for p in pa.cached_pages()] == [pb.page_hash(p) for p in pb.cached_pages()]


def _call(cache, method, *args, **kwargs):
    """(result, exception type and text) of a call, for comparing two caches."""
    try:
        return getattr(cache, method)(*args, **kwargs), None
    except (ValueError, KeyError, MemoryError) as exc:
        return None, (type(exc), str(exc))


def _same_result(x, y) -> None:
    (rx, ex), (ry, ey) = x, y
    assert ex == ey
    if isinstance(rx, np.ndarray):
        assert np.array_equal(rx, ry)
    else:
        assert rx == ry


CONFIGS = [
    # windowed rings that wrap, sink pages, prefix caching with salts
    dict(num_layers=2, num_kv_heads=1, head_dim=2, num_pages=20, page_size=4, window=8, sink_tokens=4,
         enable_prefix_caching=True, dtype=np.float32, page_checksums=True),
    dict(num_layers=1, num_kv_heads=2, head_dim=2, num_pages=24, page_size=1, window=5, sink_tokens=2,
         enable_prefix_caching=True, dtype=np.float16),
    dict(num_layers=2, num_kv_heads=1, head_dim=3, num_pages=16, page_size=2, enable_prefix_caching=True,
         prefix_hash="sha256", dtype=np.float32),
    dict(num_layers=1, num_kv_heads=1, head_dim=2, num_pages=12, page_size=3, window=7, dtype=np.float16,
         page_checksums=True),
]


class SaveReloadMachine(RuleBasedStateMachine):
    """Random calls on two caches; one of them is saved and reloaded at random points."""

    def __init__(self):
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "cache.pkv")
        self.next_id = 0
        self.salts = {}  # seq_id -> the extra_key it was added with (an import must name it)

    def teardown(self):
        self.tmp.cleanup()

    @initialize(config=st.sampled_from(CONFIGS))
    def start(self, config):
        self.config = config
        self.a = KVCache(**config)
        self.b = KVCache(**config)

    def _ids(self):
        return self.a.seq_ids()

    @rule(prompt=st.lists(st.integers(0, 3), max_size=14), salt=st.sampled_from([None, "t1", 7]))
    def add(self, prompt, salt):
        seq_id = self.next_id
        self.next_id += 1
        self.salts[seq_id] = salt
        _same_result(_call(self.a, "add_sequence", seq_id, prompt, salt),
                     _call(self.b, "add_sequence", seq_id, prompt, salt))

    @precondition(lambda self: self.config.get("enable_prefix_caching"))
    @rule(blocks=st.lists(st.integers(0, 2), min_size=1, max_size=4), extra=st.integers(0, 3))
    def add_blocks(self, blocks, extra):
        seq_id = self.next_id
        self.next_id += 1
        block_tokens = 2 * self.config["page_size"]
        n = len(blocks) * block_tokens - extra % block_tokens
        kwargs = dict(block_hashes=blocks, block_tokens=block_tokens, num_prompt_tokens=n)
        _same_result(_call(self.a, "add_sequence", seq_id, **kwargs), _call(self.b, "add_sequence", seq_id, **kwargs))

    @precondition(lambda self: self.a.num_sequences > 0)
    @rule(data=st.data(), with_tokens=st.booleans())
    def append(self, data, with_tokens):
        ids = data.draw(st.lists(st.sampled_from(self._ids()), min_size=1, max_size=3, unique=True))
        counts = data.draw(st.lists(st.integers(0, 6), min_size=len(ids), max_size=len(ids)))
        tokens = data.draw(st.lists(st.integers(0, 3), min_size=sum(counts), max_size=sum(counts))) \
            if with_tokens else None
        ra = _call(self.a, "append", ids, counts, tokens)
        rb = _call(self.b, "append", ids, counts, tokens)
        _same_result(ra, rb)
        slots = ra[0]
        if slots is not None and slots.size:
            seed = data.draw(st.integers(0, 2**32 - 1))
            rng = np.random.default_rng(seed)
            for layer in range(self.config["num_layers"]):
                shape = (slots.size, self.config["num_kv_heads"], self.config["head_dim"])
                k, v = rng.standard_normal(shape), rng.standard_normal(shape)
                self.a.store(layer, slots, k, v)
                self.b.store(layer, slots, k, v)

    @precondition(lambda self: self.a.num_sequences > 0)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self._ids()))
        child = self.next_id
        self.next_id += 1
        self.salts[child] = self.salts.get(parent)
        _same_result(_call(self.a, "fork", parent, child), _call(self.b, "fork", parent, child))

    @precondition(lambda self: self.a.num_sequences > 0)
    @rule(data=st.data())
    def truncate(self, data):
        seq_id = data.draw(st.sampled_from(self._ids()))
        new_len = data.draw(st.integers(0, self.a.seq_len(seq_id)))
        _same_result(_call(self.a, "truncate", seq_id, new_len), _call(self.b, "truncate", seq_id, new_len))

    @precondition(lambda self: self.a.num_sequences > 0)
    @rule(data=st.data())
    def remove(self, data):
        seq_id = data.draw(st.sampled_from(self._ids()))
        _same_result(_call(self.a, "remove_sequence", seq_id), _call(self.b, "remove_sequence", seq_id))

    @rule(mmap=st.booleans())
    def save_and_reload(self, mmap):
        self.b.save(self.path)
        self.b = KVCache.load(self.path, mmap=mmap)

    @precondition(lambda self: self.a.num_sequences > 0)
    @rule(data=st.data())
    def export_import(self, data):
        """Move a sequence out and back in (both caches do it): the same K/V; or, when a fork
        still holds some of its pages and the free pages cannot hold a copy of all of them,
        OutOfPagesError from the import with nothing changed (the sequence stays removed)."""
        seq_id = data.draw(st.sampled_from(self._ids()))
        outcomes = []
        for cache in (self.a, self.b):
            blob = cache.export_sequence(seq_id)
            before = [cache.gather(layer, seq_id) for layer in range(cache.num_layers)]
            cache.remove_sequence(seq_id)
            free_before = cache.stats()["pages_free"]
            result = _call(cache, "import_sequence", seq_id, blob, extra_key=self.salts.get(seq_id))
            outcomes.append(result)
            if result[1] is not None:
                assert result[1][0] is OutOfPagesError
                assert seq_id not in cache.seq_ids() and cache.stats()["pages_free"] == free_before
                continue
            after = [cache.gather(layer, seq_id) for layer in range(cache.num_layers)]
            for x, y in zip(before, after):
                for u, w in zip(x, y):
                    assert np.array_equal(u, w)
        _same_result(*outcomes)

    @invariant()
    def same(self):
        if hasattr(self, "a"):
            _assert_same(self.a, self.b)


SaveReloadMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_save_reload_equals_uninterrupted_run = SaveReloadMachine.TestCase


def _filled(cache: KVCache, seq_ids, counts, seed=0):
    rng = np.random.default_rng(seed)
    slots = cache.append(seq_ids, counts)
    for layer in range(cache.num_layers):
        shape = (slots.size, cache.num_kv_heads, cache.head_dim)
        cache.store(layer, slots, rng.standard_normal(shape), rng.standard_normal(shape))
    return slots


@pytest.mark.parametrize("page_size", [4, 1])
@pytest.mark.parametrize("mmap", [False, True])
def test_wrapped_ring_comes_back_with_its_geometry(tmp_path, page_size, mmap):
    """Window 8: 13 single-token appends wrap the ring; after save/load one more append matches."""
    kwargs = dict(num_layers=2, num_kv_heads=2, head_dim=4, num_pages=16, page_size=page_size, window=8,
                  dtype=np.float32)
    a, b = KVCache(**kwargs), KVCache(**kwargs)
    for cache in (a, b):
        cache.add_sequence(0)
        for t in range(13):
            _filled(cache, [0], [1], seed=t)
    b.save(tmp_path / "ring.pkv")
    b = KVCache.load(tmp_path / "ring.pkv", mmap=mmap)
    assert b.window == 8
    _assert_same(a, b)
    for cache in (a, b):
        _filled(cache, [0], [1], seed=99)
    _assert_same(a, b)
    _, _, positions = b.gather(0, 0)
    # Nothing still inside the window of the next query (position 14) was dropped.
    assert set(range(14 - 8 + 1, 14)) <= set(positions.tolist())


def _small_cache(seed=0) -> KVCache:
    cache = KVCache(2, 1, 4, 6, page_size=2, window=4, sink_tokens=2, enable_prefix_caching=True,
                    dtype=np.float16, page_checksums=True)
    cache.add_sequence(1, [1, 2, 3, 4, 5], extra_key="tenant")
    _filled(cache, [1], [4], seed)
    cache.fork(1, 2)
    _filled(cache, [2], [3], seed + 1)
    return cache


@pytest.fixture
def small_file(tmp_path):
    path = tmp_path / "small.pkv"
    _small_cache().save(path)
    return path


def _layout(path):
    """(header+table bytes, pages section offset, pages section length) of a snapshot file."""
    data = path.read_bytes()
    num_sections = struct.unpack_from("<I", data, 16)[0]
    table_end = 64 + 40 * num_sections
    entries = [struct.unpack_from("<16sQQQ", data, 64 + 40 * i) for i in range(num_sections)]
    pages = [e for e in entries if e[0].rstrip(b"\0") == b"pages"][0]
    return table_end, pages[1], pages[2]


def test_every_single_bit_flip_is_detected(tmp_path, small_file):
    data = bytearray(small_file.read_bytes())
    table_end, _, _ = _layout(small_file)
    rng = np.random.default_rng(1)
    offsets = list(range(table_end)) + rng.integers(table_end, len(data), 300).tolist()
    target = tmp_path / "flipped.pkv"
    for offset in offsets:
        bit = 1 << int(rng.integers(0, 8))
        data[offset] ^= bit
        target.write_bytes(data)
        with pytest.raises(SnapshotError):
            KVCache.load(target)
        data[offset] ^= bit
    target.write_bytes(data)
    _assert_same(_small_cache(), KVCache.load(target))


def test_page_flip_names_page_and_sequences(tmp_path, small_file):
    data = bytearray(small_file.read_bytes())
    _, start, length = _layout(small_file)
    reference = _small_cache()
    page = int(reference.page_table([1]).indices[0])  # a sink page shared by sequences 1 and 2
    page_bytes = length // (reference.num_layers * reference.num_pages)
    data[start + page * page_bytes + 3] ^= 0x10
    path = tmp_path / "page.pkv"
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match=rf"section 'pages'.* page {page} \(held by sequences \[1, 2\]\)"):
        KVCache.load(path)
    # mmap=True reads no page at load; verify() finds it.
    KVCache.load(path, mmap=True)
    with pytest.raises(SnapshotError, match=rf"page {page} "):
        snap.verify(path)


def test_truncated_and_extended_files_are_refused(tmp_path, small_file):
    data = small_file.read_bytes()
    rng = np.random.default_rng(2)
    path = tmp_path / "cut.pkv"
    for length in sorted(set(rng.integers(0, len(data), 40).tolist()) | {0, 10, 63, 64, len(data) - 1}):
        path.write_bytes(data[:length])
        with pytest.raises(SnapshotError, match="truncated|section"):
            KVCache.load(path)
    path.write_bytes(data + b"garbage")
    with pytest.raises(SnapshotError, match="appended"):
        KVCache.load(path)


def test_swapped_pages_are_refused(tmp_path, small_file):
    data = bytearray(small_file.read_bytes())
    _, start, length = _layout(small_file)
    cache = _small_cache()
    page_bytes = length // (cache.num_layers * cache.num_pages)
    layer_bytes = page_bytes * cache.num_pages
    p, q = (int(x) for x in cache.page_table([2]).indices[-2:])
    for layer in range(cache.num_layers):
        a = start + layer * layer_bytes + p * page_bytes
        b = start + layer * layer_bytes + q * page_bytes
        data[a:a + page_bytes], data[b:b + page_bytes] = data[b:b + page_bytes], data[a:a + page_bytes]
    path = tmp_path / "swapped.pkv"
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match=rf"checksum mismatch in page {min(p, q)}"):
        KVCache.load(path)


def test_newer_format_version_is_refused(tmp_path, small_file):
    data = bytearray(small_file.read_bytes())
    struct.pack_into("<I", data, 8, snap.FORMAT_VERSION + 1)
    struct.pack_into("<Q", data, 56, snap._checksum(bytes(data[:56])))  # a valid header otherwise
    path = tmp_path / "newer.pkv"
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match=f"format version {snap.FORMAT_VERSION + 1} is newer"):
        KVCache.load(path)


def test_wrong_kind_and_magic_are_refused(tmp_path):
    path = tmp_path / "x.pkv"
    path.write_bytes(b"\x93NUMPY" + bytes(200))
    with pytest.raises(SnapshotError, match="bad magic"):
        KVCache.load(path)
    blob = _small_cache().export_sequence(1)
    path.write_bytes(blob)
    with pytest.raises(SnapshotError, match="exported sequence, expected a KVCache snapshot"):
        KVCache.load(path)


def test_inconsistent_state_is_refused_by_the_core():
    cache = _small_cache()
    state = cache._export_state()
    state["ref_counts"] = state["ref_counts"].copy()
    shared = int(cache.page_table([1]).indices[0])
    state["ref_counts"][shared] = 1  # held by two sequences
    fresh = KVCache(**{k: v for k, v in snap._cache_kwargs(cache._config()).items()})
    with pytest.raises(ValueError, match=rf"page {shared} has ref count 1 but 2 .*sequences \[1, 2\]"):
        fresh._restore_state(state)
    assert fresh.num_sequences == 0 and fresh.pool.num_free == fresh.num_pages
    fresh.check_invariants()
    state = cache._export_state()
    state["sequences"][0][1]["pages"] = np.array([0, 99], dtype=np.int32)
    with pytest.raises(ValueError, match="page ids in"):
        fresh._restore_state(state)


def test_mmap_is_copy_on_write(tmp_path, small_file):
    before = small_file.read_bytes()
    cache = KVCache.load(small_file, mmap=True)
    if sys.platform.startswith("linux"):  # a view of the guarded map (tests/test_snapshot_mmap.py)
        assert not cache.kv.flags.owndata
    _filled(cache, [1, 2], [1, 1], seed=5)
    cache.kv[...] = 1.0
    del cache
    assert small_file.read_bytes() == before


def test_import_into_too_small_cache_changes_nothing():
    source = _small_cache()
    blob = source.export_sequence(2)
    target = KVCache(2, 1, 4, 6, page_size=2, window=4, sink_tokens=2, enable_prefix_caching=True,
                     dtype=np.float16, page_checksums=True)
    target.add_sequence(5, [9, 9, 9])
    _filled(target, [5], [7], seed=3)
    stats, kv = target.stats(metrics=True), target.kv.copy()
    free = target.pool.free_pages()
    assert len(free) < len(source.page_table([2]).indices)
    with pytest.raises(OutOfPagesError, match="Nothing was changed"):
        target.import_sequence(8, blob, extra_key="tenant")
    after = target._export_state()
    assert np.array_equal(target.kv, kv) and np.array_equal(target.pool.free_pages(), free)
    assert after["sequences"][0][0] == 5 and len(after["sequences"]) == 1
    assert target.stats(metrics=True) == stats
    target.check_invariants()


def test_import_checks_geometry_and_bytes():
    source = _small_cache()
    blob = bytearray(source.export_sequence(1))
    other = KVCache(2, 1, 4, 16, page_size=4, window=4, sink_tokens=2, dtype=np.float16)
    with pytest.raises(SnapshotError, match="page_size"):
        other.import_sequence(1, bytes(blob))
    target = KVCache(2, 1, 4, 16, page_size=2, window=4, sink_tokens=2, dtype=np.float16)
    blob[-1] ^= 1
    with pytest.raises(SnapshotError, match="exported page"):
        target.import_sequence(1, bytes(blob))
    assert target.num_sequences == 0
    blob[-1] ^= 1
    target.import_sequence(1, bytes(blob))  # no prefix caching here: the chain is dropped
    for layer in range(2):
        for x, y in zip(source.gather(layer, 1), target.gather(layer, 1)):
            assert np.array_equal(x, y)
    with pytest.raises(ValueError, match="already exists"):
        target.import_sequence(1, bytes(blob))


def test_imported_pages_serve_prefix_hits():
    source = KVCache(1, 1, 2, 8, page_size=2, enable_prefix_caching=True, dtype=np.float32)
    source.add_sequence(0, [1, 2, 3, 4, 5])
    _filled(source, [0], [5])
    target = KVCache(1, 1, 2, 8, page_size=2, enable_prefix_caching=True, dtype=np.float32)
    target.import_sequence(3, source.export_sequence(0))
    assert target.add_sequence(4, [1, 2, 3, 4, 5, 6]) == 4


_WRITER = """
import numpy as np
from pagedkv import KVCache
cache = KVCache(4, 4, 64, 256, page_size=16, dtype=np.float32)
cache.add_sequence(0)
cache.append([0], [16 * 200])
cache.kv[...] = 2.0
print("ready", flush=True)
while True:
    cache.save({path!r})
"""


def test_killed_writer_leaves_old_or_new_snapshot(tmp_path):
    """SIGKILL a process that saves over an existing snapshot: the file always loads, old or new."""
    path = tmp_path / "cache.pkv"
    old = KVCache(4, 4, 64, 256, page_size=16, dtype=np.float32)
    old.add_sequence(0)
    old.append([0], [5])
    old.save(path)
    script = _WRITER.format(path=str(path))
    # The writer imports pagedkv exactly as this process did (checkout or installed package).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    rng = np.random.default_rng(3)
    for attempt in range(6):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.0, 0.3)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        loaded = KVCache.load(path)
        loaded.check_invariants()
        length = loaded.seq_len(0)
        assert length in (5, 16 * 200)
        if length == 5:
            assert not loaded.kv.any()
        else:
            assert (loaded.kv == 2.0).all()


def test_snapshot_has_no_pickle_and_refuses_oversized_entries():
    """A metadata entry claiming more bytes than its section is refused before allocation."""
    bogus = struct.pack("<HBB", 1, 2, 1) + b"x" + bytes(3) + struct.pack("<Q", 2**40)
    with pytest.raises(SnapshotError, match="runs past the section"):
        snap._decode("config", bogus)
    assert issubclass(SnapshotError, ValueError) and pagedkv.SnapshotError is SnapshotError


def _classic_same(a, b):
    a.check_invariants()
    b.check_invariants()
    assert a.stats() == b.stats()
    assert np.array_equal(a.resident_pages, b.resident_pages)
    assert list(a) == list(b)
    tokens = np.arange(0, 200)
    for x, y in zip(a.get_many(tokens), b.get_many(tokens)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_classic_save_reload_equals_uninterrupted_run(tmp_path, dtype):
    """Random puts and gets on two PagedKVCache; one is saved and reloaded every few steps (FIFO order kept)."""
    rng = np.random.default_rng(4)
    a = pagedkv.PagedKVCache(5, 3, page_size=4, dtype=dtype)
    b = pagedkv.PagedKVCache(5, 3, page_size=4, dtype=dtype)
    path = tmp_path / "classic.pkv"
    for step in range(60):
        tokens = rng.integers(0, 120, int(rng.integers(1, 6)))
        keys, values = rng.standard_normal((tokens.size, 3)), rng.standard_normal((tokens.size, 3))
        looked_up = rng.permutation(tokens)[:2]
        for cache in (a, b):
            cache.put_many(tokens, keys, values)
            cache.get_many(looked_up)
            if step % 21 == 3:
                cache.clear()
        if step % 5 == 4:
            b.save(path)
            b = pagedkv.PagedKVCache.load(path)
        _classic_same(a, b)


def test_classic_damage_is_refused(tmp_path):
    cache = pagedkv.PagedKVCache(3, 2, page_size=2)
    cache.put_many([0, 1, 2, 9], np.ones((4, 2)), np.zeros((4, 2)))
    path = tmp_path / "classic.pkv"
    cache.save(path)
    data = bytearray(path.read_bytes())
    rng = np.random.default_rng(5)
    for offset in list(range(0, 300, 3)) + rng.integers(0, len(data), 60).tolist():
        data[offset] ^= 4
        path.write_bytes(data)
        with pytest.raises(SnapshotError):
            pagedkv.PagedKVCache.load(path)
        data[offset] ^= 4
    path.write_bytes(data[:-1])
    with pytest.raises(SnapshotError, match="truncated"):
        pagedkv.PagedKVCache.load(path)
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match="PagedKVCache snapshot, expected a KVCache snapshot"):
        KVCache.load(path)
    _classic_same(cache, pagedkv.PagedKVCache.load(path))


# ------------------------------------------------ crafted files: bounds checked before anything is built
# A reader and writer of the container as the README documents it (independent of pagedkv.snapshot):
# a 64-byte header, a 40-byte table entry per section, sections without gaps, the pages section on a
# 4096-byte boundary; checksums are the low 64 bits of XXH3-128 (the ``xxhash`` package).
_DOC_DTYPES = {1: "<i4", 2: "<i8", 3: "<u8", 4: "u1"}


def _doc_checksum(data: bytes) -> int:
    return xxhash.xxh3_128_intdigest(bytes(data)) & (2**64 - 1)


def _doc_read(data: bytes):
    """(magic, {tag: section bytes} in file order) of a container."""
    magic, num_sections = data[:8], struct.unpack_from("<I", data, 16)[0]
    sections = {}
    for i in range(num_sections):
        tag, offset, length, _ = struct.unpack_from("<16sQQQ", data, 64 + 40 * i)
        sections[tag.rstrip(b"\0").decode()] = data[offset:offset + length]
    return magic, sections


def _doc_entries(section: bytes) -> dict:
    """The named arrays of a metadata section."""
    out, pos = {}, 0
    while pos < len(section):
        name_length, code, ndim = struct.unpack_from("<HBB", section, pos)
        name = section[pos + 4:pos + 4 + name_length].decode()
        pos += 4 + name_length
        pos += -pos % 8
        shape = struct.unpack_from(f"<{ndim}Q", section, pos)
        pos += 8 * ndim
        array = np.frombuffer(section, dtype=_DOC_DTYPES[code], count=int(np.prod(shape, dtype=np.int64)),
                              offset=pos).reshape(shape)
        out[name] = array.copy()
        pos += array.nbytes
        pos += -pos % 8
    return out


def _doc_encode(entries: dict) -> bytes:
    out = bytearray()
    codes = {np.dtype(v): k for k, v in _DOC_DTYPES.items()}
    for name, array in entries.items():
        array = np.asarray(array, order="C")  # (ascontiguousarray would make a 0-d array 1-D)
        out += struct.pack("<HBB", len(name), codes[array.dtype.newbyteorder("<")], array.ndim) + name.encode()
        out += bytes(-len(out) % 8)
        out += struct.pack(f"<{array.ndim}Q", *array.shape) + array.tobytes()
        out += bytes(-len(out) % 8)
    return bytes(out)


def _doc_write(path, magic: bytes, sections: dict, pages_length: int | None = None) -> None:
    """Write ``sections`` (tag -> bytes, ``pages`` last) as a container with every checksum valid.

    ``pages_length`` (default: the bytes given) is the length the table and header claim for the
    pages section; only the bytes given are written.
    """
    tags = list(sections)
    assert tags[-1] == "pages"
    offset = 64 + 40 * len(tags)
    table, body = bytearray(), bytearray()
    for tag in tags[:-1]:
        table += struct.pack("<16sQQQ", tag.encode(), offset, len(sections[tag]), _doc_checksum(sections[tag]))
        body += sections[tag]
        offset += len(sections[tag])
    padding = -offset % 4096
    claimed = len(sections["pages"]) if pages_length is None else pages_length
    table += struct.pack("<16sQQQ", b"pages", offset + padding, claimed, _doc_checksum(sections["checksums"]))
    head = struct.pack("<8sIIIIQQ16s", magic, 1, 64, len(tags), 0, offset + padding + claimed,
                       _doc_checksum(table), bytes(16))
    head += struct.pack("<Q", _doc_checksum(head))
    path.write_bytes(head + table + body + bytes(padding) + sections["pages"])


def _crafted(tmp_path, cache: KVCache, edit, name="crafted.pkv"):
    """Save ``cache``, change its sections with ``edit(sections)`` (tag -> {name: array} for metadata,
    bytes for checksums and pages), rewrite it with valid checksums; return the path."""
    path = tmp_path / name
    cache.save(path)
    magic, raw = _doc_read(path.read_bytes())
    sections = {tag: (_doc_entries(data) if tag not in ("checksums", "pages") else data) for tag, data in raw.items()}
    pages_length = edit(sections)
    _doc_write(path, magic, {tag: (_doc_encode(v) if isinstance(v, dict) else v) for tag, v in sections.items()},
               pages_length)
    return path


def _load_peak(path, **kwargs) -> tuple[SnapshotError, int]:
    """The SnapshotError a load raises and the peak bytes traced (NumPy reports its allocations) meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(SnapshotError) as info:
            KVCache.load(path, **kwargs)
        return info.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_crafted_sections_load_back_when_untouched(tmp_path):
    """The test's own writer produces files pagedkv loads: the crafted files below differ only in what they change."""
    cache = _small_cache()
    path = _crafted(tmp_path, cache, lambda sections: None)
    _assert_same(cache, KVCache.load(path))


@pytest.mark.parametrize("mmap", [False, True])
def test_page_size_without_layers_is_bounded_by_the_file(tmp_path, mmap):
    """No K/V bytes (num_layers=0) but prefix caching: page_size x num_pages kept token ids are refused
    when the file is far too small for them, before they are allocated."""
    cache = KVCache(0, 1, 1, 4096, page_size=4, enable_prefix_caching=True)
    cache.add_sequence(1, list(range(10)))
    cache.append([1], [10])
    path = tmp_path / "ok.pkv"
    cache.save(path)
    _assert_same(cache, KVCache.load(path, mmap=mmap))  # the honest file loads

    def huge_pages(sections):
        sections["config"]["page_size"] = np.array(2**20)  # 4096 pages x 2**20 tokens x 4 bytes = 16 GiB
        sections["tables"]["fields"][:, 0] = 0  # a sequence of 0 tokens holds no page
        sections["tables"]["fields"][:, 4] = 0
        sections["tables"]["pages"] = np.zeros(0, np.int32)
        sections["hashes"]["fields"][:, 1:] = 0
        sections["hashes"]["chain"] = np.zeros((0, 2), np.uint64)
        sections["hashes"]["token_ids"] = np.zeros(0, np.int32)
        sections["pool"]["ref_counts"][:] = 0
        sections["pool"]["free_queue"] = np.arange(4096, dtype=np.int32)
        for key in ("pages", "has_tokens"):
            sections["prefix"][key] = sections["prefix"][key][:0]
        sections["prefix"]["hashes"] = np.zeros((0, 2), np.uint64)
        sections["prefix"]["tokens"] = np.zeros((0, 2**20), np.int32)

    error, peak = _load_peak(_crafted(tmp_path, cache, huge_pages), mmap=mmap)
    assert "section 'config'" in str(error) and "page_size 1048576" in str(error)
    assert peak < 2**26


def test_negative_ring_capacity_cannot_cancel_the_bound_of_other_page_tables(tmp_path):
    """The page tables' rings and sink arrays are bounded by the sum of their ring capacities: one
    forged negative capacity would cancel the others and let every page table before it be built (the
    core checks each table only as it builds it), so it is refused before any page table exists."""
    num_pages, num_tables = 2**16, 256  # each page table's sink array: 4 * num_pages bytes

    def edit(sections):
        tables = sections["tables"]
        fields = np.zeros((num_tables + 1, 5), dtype=np.int64)  # empty sequences: length 0, no pages
        fields[:, 2] = num_pages  # ring_first: after the sink pages
        fields[:, 3] = 1  # ring capacity
        fields[num_tables, 3] = -num_tables * (num_pages + 8)
        tables["seq_ids"] = np.arange(num_tables + 1, dtype=np.int64)
        tables["fields"], tables["pages"] = fields, np.zeros(0, dtype=np.int32)

    cache = KVCache(0, 1, 1, num_pages, page_size=1, window=2, sink_tokens=num_pages, dtype=np.float16)
    error, peak = _load_peak(_crafted(tmp_path, cache, edit))
    assert f"section 'tables': sequence {num_tables}" in str(error)
    assert peak < num_tables * 4 * num_pages // 8  # far below the sink arrays of the forged tables


def test_pool_geometry_must_match_the_pages_section(tmp_path):
    """Layers, heads, head dim, page size and dtype of the config imply the pages section's length."""
    cache = _small_cache()
    for key, value in (("num_layers", 2**20), ("num_kv_heads", 2**16), ("head_dim", 2**16), ("page_size", 2**20)):
        path = _crafted(tmp_path, cache, lambda s: s["config"].__setitem__(key, np.array(value)))
        error, peak = _load_peak(path)
        assert "section 'pages'" in str(error) and "expected" in str(error), key
        assert peak < 2**24, key
    path = _crafted(tmp_path, cache, lambda s: s["config"].__setitem__("dtype", np.frombuffer(b"float32", np.uint8)))
    assert "section 'pages'" in str(_load_peak(path)[0])


def test_claimed_lengths_past_the_end_are_refused_before_reading(tmp_path):
    cache = _small_cache()
    # A pages section of 2**40 bytes that the file does not hold (its header claims it consistently).
    path = _crafted(tmp_path, cache, lambda s: 2**40)
    error, peak = _load_peak(path)
    assert "section 'header'" in str(error) and "truncated" in str(error)
    assert peak < 2**24
    # A metadata section whose table entry runs past the end of the file.
    cache.save(tmp_path / "ok.pkv")
    data = bytearray((tmp_path / "ok.pkv").read_bytes())
    num_sections = struct.unpack_from("<I", data, 16)[0]
    for i in range(num_sections):
        if data[64 + 40 * i:64 + 40 * i + 16].rstrip(b"\0") == b"tables":
            struct.pack_into("<Q", data, 64 + 40 * i + 24, 2**50)
    table = bytes(data[64:64 + 40 * num_sections])
    struct.pack_into("<Q", data, 32, _doc_checksum(table))
    struct.pack_into("<Q", data, 56, _doc_checksum(bytes(data[:56])))
    (tmp_path / "long.pkv").write_bytes(data)
    error, peak = _load_peak(tmp_path / "long.pkv")
    assert "section 'tables'" in str(error) and peak < 2**24


def _big_pool_cache() -> KVCache:
    """A cache whose pool (8 MiB) dwarfs its metadata: a load that built it would show in the peak."""
    cache = KVCache(4, 8, 16, 256, page_size=16, enable_prefix_caching=True, dtype=np.float16)
    cache.add_sequence(1, list(range(40)))
    cache.append([1], [40])
    cache.fork(1, 2)
    cache.append([2], [20])
    return cache


@pytest.mark.parametrize("case", ["ref_count", "page_id", "free_queue_twice", "free_queue_missing", "ring",
                                  "prefix_page", "seal_flag"])
def test_inconsistent_sections_are_refused_before_the_cache_is_built(tmp_path, case):
    cache = _big_pool_cache()
    shared = int(cache.page_table([1]).indices[0])  # held by sequences 1 and 2

    def edit(s):
        if case == "ref_count":
            s["pool"]["ref_counts"][shared] = 1
        elif case == "page_id":
            s["tables"]["pages"][0] = 256
        elif case == "free_queue_twice":
            s["pool"]["free_queue"][1] = s["pool"]["free_queue"][0]
        elif case == "free_queue_missing":
            s["pool"]["free_queue"] = s["pool"]["free_queue"][1:]
        elif case == "ring":
            s["tables"]["fields"][0, 3] = 3  # ring capacity, not a power of two
        elif case == "prefix_page":
            s["prefix"]["pages"][0] = 300
        elif case == "seal_flag":
            s["sealed"]["sealed"][0] = 2

    error, peak = _load_peak(_crafted(tmp_path, cache, edit))
    section = {"ref_count": "tables", "page_id": "tables", "free_queue_twice": "pool", "free_queue_missing": "pool",
               "ring": "tables", "prefix_page": "prefix", "seal_flag": "sealed"}[case]
    assert f"section '{section}'" in str(error)
    if case == "ref_count":
        assert f"page {shared}" in str(error) and "sequences [1, 2]" in str(error)
    assert peak < cache.kv.nbytes // 4  # the 8 MiB pool was never allocated


def test_layer_digests_combine_to_the_page_checksums():
    """Hashing a pool one layer and one run of pages at a time gives the documented page checksum."""
    from pagedkv_c._checksum import combine_digests, layer_digests, page_checksums

    rng = np.random.default_rng(5)
    kv = rng.standard_normal((3, 7, 2, 2, 2, 3)).astype(np.float16)
    digests = np.zeros((7, 3, 16), dtype=np.uint8)
    for layer in range(3):
        for first, stop in ((0, 3), (3, 3), (3, 7)):
            layer_digests(kv, layer, first, stop, digests)
    for page in range(7):
        for layer in range(3):
            assert digests[page, layer].tobytes() == xxhash.xxh3_128(kv[layer, page].tobytes()).digest()
    out = np.zeros(7, dtype=np.uint64)
    combine_digests(digests, out)
    reference = [xxhash.xxh3_128_intdigest(digests[p].tobytes()) & (2**64 - 1) for p in range(7)]
    assert out.tolist() == reference == page_checksums(kv, np.arange(7)).tolist()
    skip = np.zeros(7, dtype=np.uint8)
    skip[[1, 4]] = 1
    fresh, kept = np.zeros((7, 3, 16), dtype=np.uint8), np.full(7, 9, dtype=np.uint64)
    for layer in range(3):
        layer_digests(kv, layer, 0, 7, fresh, skip)
    combine_digests(fresh, kept, skip)
    assert not fresh[[1, 4]].any() and kept[[1, 4]].tolist() == [9, 9]
    assert kept[[0, 2, 3, 5, 6]].tolist() == out[[0, 2, 3, 5, 6]].tolist()
    empty = np.zeros(0, dtype=np.uint64)
    combine_digests(np.zeros((0, 3, 16), np.uint8), empty)
    none = np.zeros(2, dtype=np.uint64)
    combine_digests(np.zeros((2, 0, 16), np.uint8), none)  # no layers: the hash of the empty string
    assert none.tolist() == [xxhash.xxh3_128_intdigest(b"") & (2**64 - 1)] * 2
    with pytest.raises(ValueError, match="Invalid value of stop"):
        layer_digests(kv, 0, 4, 8, digests)
    with pytest.raises(ValueError, match="Invalid shape of digests"):
        layer_digests(kv, 0, 0, 7, np.zeros((7, 2, 16), np.uint8))
    with pytest.raises(ValueError, match="Invalid value of layer"):
        layer_digests(kv, 3, 0, 7, digests)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_threads_and_runs_give_the_same_file(tmp_path, num_threads, monkeypatch):
    """Runs smaller than a layer (many per layer) and either thread count write and read the same bytes;
    a page whose bytes changed after its seal would make a file that does not load, so the save refuses
    to write it and the previous snapshot stays as it was (#29)."""
    cache = _small_cache()
    cache.seal()
    reference = tmp_path / "reference.pkv"
    monkeypatch.setattr(snap, "_RUN_BYTES", 1 << 30)
    snap.save_cache(cache, reference, num_threads=1)
    monkeypatch.setattr(snap, "_RUN_BYTES", 40)
    path = tmp_path / "runs.pkv"
    snap.save_cache(cache, path, num_threads=num_threads)
    assert path.read_bytes() == reference.read_bytes()
    _assert_same(cache, snap.load_cache(path, num_threads=num_threads))
    sealed = np.flatnonzero(cache._sealed_state()["sealed"])
    assert sealed.size
    cache.kv[1, int(sealed[0])] += 1  # damage in memory after the seal
    good = path.read_bytes()
    with pytest.raises(SnapshotError, match=rf"sealed page {int(sealed[0])} .*no longer has the checksum"):
        snap.save_cache(cache, path, num_threads=num_threads)
    assert path.read_bytes() == good
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    _assert_same(cache.load(reference), snap.load_cache(path, num_threads=num_threads))
    with pytest.raises(ValueError, match="num_threads"):
        snap.save_cache(cache, path, num_threads=3)


def _runs_cache() -> KVCache:
    """3 layers of 40 pages (64 bytes a page and layer), three sequences, one forked: many runs of pages."""
    cache = KVCache(3, 1, 4, 40, page_size=2, dtype=np.float32)
    for seq_id, tokens in ((1, 21), (2, 9), (3, 30)):
        cache.add_sequence(seq_id)
        _filled(cache, [seq_id], [tokens], seed=seq_id)
    cache.fork(2, 4)
    _filled(cache, [4], [3], seed=4)
    return cache


@pytest.mark.parametrize("num_threads", [1, 2])
def test_damage_in_a_later_run_is_named(tmp_path, num_threads, monkeypatch):
    """Runs of 3 pages (14 runs a layer, the last one shorter): a flipped bit in one of the last runs of
    the last layer, and one more in the first run, are both found; the message names the lower page id."""
    monkeypatch.setattr(snap, "_RUN_BYTES", 3 * 64)
    cache = _runs_cache()
    path = tmp_path / "runs.pkv"
    snap.save_cache(cache, path, num_threads=num_threads)
    _, start, length = _layout(path)
    page_bytes = length // (cache.num_layers * cache.num_pages)
    assert page_bytes == 64
    data = bytearray(path.read_bytes())
    late = int(cache.page_table([3]).indices[-1])  # the last page of sequence 3
    assert late // 3 >= 10  # in the 11th run of a layer or later
    at = start + (2 * cache.num_pages + late) * page_bytes + 5
    data[at] ^= 0x04
    damaged = tmp_path / "late.pkv"
    damaged.write_bytes(data)
    with pytest.raises(SnapshotError, match=rf"checksum mismatch in page {late} \(held by sequences \[3\]\)$"):
        snap.load_cache(damaged, num_threads=num_threads)
    early = int(cache.page_table([1]).indices[0])
    data[start + early * page_bytes] ^= 0x80
    damaged.write_bytes(data)
    with pytest.raises(SnapshotError, match=rf"page {early} \(held by sequences \[1\]\) and 1 more pages"):
        snap.load_cache(damaged, num_threads=num_threads)
    _assert_same(cache, snap.load_cache(path, num_threads=num_threads))


@pytest.mark.parametrize("num_threads", [1, 2])
def test_file_cut_while_its_pages_are_read(tmp_path, num_threads, monkeypatch):
    """A file that shrinks after its sections were checked (cut in the middle of a run of pages):
    the page read comes up short and the load raises SnapshotError, leaving no thread behind."""
    monkeypatch.setattr(snap, "_RUN_BYTES", 4 * 64)
    cache = _runs_cache()
    path = tmp_path / "cut.pkv"
    cache.save(path)
    _, start, length = _layout(path)
    checked = snap._check_before_build

    def check_then_cut(state, parsed, size):
        checked(state, parsed, size)
        os.truncate(path, start + length // 2 + 2 * 64 + 7)  # past the middle, inside a run

    monkeypatch.setattr(snap, "_check_before_build", check_then_cut)
    threads_before = {t.ident for t in threading.enumerate()}
    with pytest.raises(SnapshotError, match=r"section 'pages': the file ended early"):
        snap.load_cache(path, num_threads=num_threads)
    assert {t.ident for t in threading.enumerate()} == threads_before


def test_without_positional_io_the_same_file_and_checks(tmp_path, monkeypatch):
    """Where os has no preadv and pwrite (Windows), two threads take turns on the file under a lock:
    the same bytes are written, read back and checked."""
    monkeypatch.setattr(snap, "_RUN_BYTES", 5 * 64)
    cache = _runs_cache()
    reference = tmp_path / "reference.pkv"
    snap.save_cache(cache, reference, num_threads=2)
    monkeypatch.delattr(os, "preadv", raising=False)
    monkeypatch.delattr(os, "pwrite", raising=False)
    path = tmp_path / "locked.pkv"
    snap.save_cache(cache, path, num_threads=2)
    assert path.read_bytes() == reference.read_bytes()
    _assert_same(cache, snap.load_cache(path, num_threads=2))
    _, start, length = _layout(path)
    data = bytearray(path.read_bytes())
    page = int(cache.page_table([2]).indices[-1])
    data[start + (cache.num_pages + page) * 64 + 1] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match=rf"checksum mismatch in page {page} \(held by sequences \[2"):
        snap.load_cache(path, num_threads=2)


def test_start_writeback_is_a_checked_hint(tmp_path):
    from pagedkv_c._file_io import start_writeback

    path = tmp_path / "hint.bin"
    with open(path, "wb", buffering=0) as f:
        f.write(b"x" * 10000)
        assert start_writeback(f.fileno(), 0, 10000) in (True, False)
        os.fsync(f.fileno())
    assert path.read_bytes() == b"x" * 10000
    with pytest.raises(ValueError, match="Invalid value of offset"):
        start_writeback(0, -1, 10)
    with pytest.raises(ValueError, match="Invalid value of fd"):
        start_writeback(-1, 0, 10)
    with pytest.raises(TypeError, match="nbytes"):
        start_writeback(0, 0, 1.5)


@pytest.mark.parametrize("umask", [0o022, 0o000])
def test_snapshots_are_readable_by_their_owner_only(tmp_path, umask):
    """docs/snapshots.md: a snapshot holds every cached prompt's K/V, so it is created 0600 whatever the umask."""
    cache = KVCache(1, 1, 4, num_pages=4)
    classic = pagedkv.PagedKVCache(max_pages=2, dim=4)
    old = os.umask(umask)
    try:
        cache.save(tmp_path / "cache.snap")
        classic.save(tmp_path / "classic.snap")
    finally:
        os.umask(old)
    for name in ("cache.snap", "classic.snap"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600, name
