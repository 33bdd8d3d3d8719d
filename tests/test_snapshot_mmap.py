"""``KVCache.load(path, mmap=True)`` while another process changes the file (#29, item 5).

A private map of a file is not the process's own memory: untouched pages are
read from the file at their first access, a rewrite in place changes them,
and when the file is truncated the kernel unmaps even the pages already
copied, so the next access past the new end kills the process with SIGBUS.
``cp new old`` truncates ``old`` first. The map is therefore guarded by a
read lease (``pagedkv_c._file_io.GuardedMap``): the writer waits until the
bytes are in process memory. The dangerous part runs in a child process, so
that a SIGBUS fails the test instead of killing pytest.
"""
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pagedkv import KVCache

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The loader: builds a cache with known K/V, saves it, maps it, lets a writer process change the file,
# then reads every page of the map (gather of every layer, check_invariants, a store and a save).
LOADER = textwrap.dedent('''
    import os, subprocess, sys, threading
    import numpy as np
    from pagedkv import KVCache
    path, other, writer = sys.argv[1], sys.argv[2], sys.argv[3]
    rng = np.random.default_rng(0)
    cache = KVCache(2, 2, 32, 600, page_size=16, dtype=np.float32)
    for seq_id, tokens in ((1, 4000), (2, 3000)):
        cache.add_sequence(seq_id)
        slots = cache.append([seq_id], [tokens])
        for layer in range(2):
            cache.store(layer, slots, rng.standard_normal((tokens, 2, 32)), rng.standard_normal((tokens, 2, 32)))
    cache.save(path)
    KVCache(2, 2, 32, 4, page_size=16, dtype=np.float32).save(other)  # a much smaller snapshot
    want = {(layer, s): cache.gather(layer, s)[0] for layer in range(2) for s in (1, 2)}
    mapped = KVCache.load(path, mmap=True)
    # Touch a few pages before the writer comes (their copies must survive too): a store into sequence 2.
    slots = mapped.append([2], [5])
    new = rng.standard_normal((5, 2, 32))
    for layer in range(2):
        mapped.store(layer, slots, new, new)
        want[(layer, 2)] = np.concatenate([want[(layer, 2)], new.astype(np.float32)])
    code = {
        "truncate": "import os, sys; os.truncate(sys.argv[1], 0)",
        "cp": "import shutil, sys; shutil.copyfile(sys.argv[2], sys.argv[1])",
        "in_place": "import sys\\nwith open(sys.argv[1], 'r+b') as f:\\n    f.seek(8192); f.write(bytes(1 << 20))",
    }[writer.replace("_while_storing", "")]
    stop, stored = threading.Event(), []

    def store_meanwhile():
        # Stores into the map while the writer waits and the map is copied: none may be lost.
        while not stop.is_set() and len(stored) < 2000:  # (the pool has room for 2592 more tokens)
            slot = mapped.append([2], [1])
            value = np.full((1, 2, 32), len(stored), dtype=np.float32)
            for layer in range(2):
                mapped.store(layer, slot, value, value)
            stored.append(value)

    storer = threading.Thread(target=store_meanwhile)
    if writer.endswith("_while_storing"):
        storer.start()
    subprocess.run([sys.executable, "-c", code, path, other], check=True, timeout=60)
    if writer.endswith("_while_storing"):
        stop.set()
        storer.join()
        assert len(stored) > 0
        for layer in range(2):
            want[(layer, 2)] = np.concatenate([want[(layer, 2)]] + [value[:1] for value in stored])
    print("file now", os.path.getsize(path), "bytes", flush=True)
    for (layer, s), k in want.items():
        assert np.array_equal(mapped.gather(layer, s)[0], k), (layer, s)
    mapped.check_invariants()
    mapped.save(path + ".again")
    again = KVCache.load(path + ".again")
    assert np.array_equal(again.gather(1, 2)[0], want[(1, 2)])
    print("OK", flush=True)
''')


@pytest.mark.parametrize("writer", ["truncate", "cp", "in_place", "cp_while_storing"])
def test_a_mapped_snapshot_survives_truncation_and_rewrites(tmp_path, writer):
    path, other = str(tmp_path / "mapped.pkv"), str(tmp_path / "other.pkv")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "src"), REPO])}
    result = subprocess.run([sys.executable, "-c", LOADER, path, other, writer], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, (f"the loader died (return code {result.returncode}, -7 is SIGBUS):\n"
                                    f"{result.stdout}\n{result.stderr}")
    assert result.stdout.splitlines()[-1] == "OK"
    # The writer did change the file: the map kept the bytes it had at the load.
    size = os.path.getsize(path)
    assert size == 0 if writer == "truncate" else True
    assert size == os.path.getsize(other) if writer.startswith("cp") else True


def _small(tmp_path):
    cache = KVCache(1, 1, 4, 8, page_size=2, dtype=np.float32)
    cache.add_sequence(1)
    slots = cache.append([1], [5])
    cache.store(0, slots, np.ones((5, 1, 4)), -np.ones((5, 1, 4)))
    path = tmp_path / "small.pkv"
    cache.save(path)
    return cache, path


def _base(array):
    while isinstance(array, np.ndarray):
        array = array.base
    return array.obj if isinstance(array, memoryview) else array


def test_mmap_maps_the_pages_under_a_lease(tmp_path):
    cache, path = _small(tmp_path)
    mapped = KVCache.load(path, mmap=True)
    guard = _base(mapped.kv)
    if sys.platform.startswith("linux"):
        from pagedkv_c._file_io import GuardedMap
        assert isinstance(guard, GuardedMap) and not guard.broken and not guard.private
    assert np.array_equal(mapped.gather(0, 1)[0], cache.gather(0, 1)[0])


def test_a_file_open_for_writing_is_read_not_mapped(tmp_path, caplog):
    """A file that some process holds open for writing cannot be leased (that writer would not be held):
    load(mmap=True) reads its pages instead, says so in the log, and the writer cannot hurt the cache."""
    cache, path = _small(tmp_path)
    with open(path, "r+b") as writer, caplog.at_level(logging.WARNING, logger="pagedkv.snapshot"):
        mapped = KVCache.load(path, mmap=True)
        writer.truncate(0)
    assert "cannot be guarded" in caplog.text and "read into memory" in caplog.text
    assert isinstance(_base(mapped.kv), np.ndarray) or _base(mapped.kv) is None
    assert np.array_equal(mapped.gather(0, 1)[0], cache.gather(0, 1)[0])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GuardedMap needs file leases (Linux only)")
def test_a_writer_between_the_lease_and_the_map_is_detected(tmp_path):
    """A process that opens the file for writing after the lease and before the map waits for the lease
    thread, which lets it go (there is nothing to copy yet); map() then refuses (ESTALE), since what the
    loader read may no longer be the file's bytes."""
    import errno

    from pagedkv_c._file_io import GuardedMap

    path = tmp_path / "file.bin"
    path.write_bytes(bytes(3 * 4096))
    with open(path, "rb") as f:
        guard = GuardedMap(f.fileno())
        subprocess.run([sys.executable, "-c", "import sys; open(sys.argv[1], 'r+b').write(b'changed')", str(path)],
                       check=True, timeout=60)
        assert guard.broken
        with pytest.raises(OSError) as info:
            guard.map(0, 3 * 4096)
        assert info.value.errno == errno.ESTALE
    assert path.read_bytes().startswith(b"changed")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GuardedMap needs file leases (Linux only)")
def test_guarded_map_arguments(tmp_path):
    from pagedkv_c._file_io import GuardedMap, prefault

    path = tmp_path / "file.bin"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "rb") as f:
        guard = GuardedMap(f.fileno())
    with pytest.raises(ValueError, match="offset"):
        guard.map(100, 4096)
    with pytest.raises(ValueError, match="length"):
        guard.map(0, 0)
    with pytest.raises(TypeError, match="fd"):
        GuardedMap(1.0)
    guard.map(4096, 8192)
    with pytest.raises(ValueError, match="already mapped"):
        guard.map(0, 4096)
    view = np.frombuffer(guard, dtype=np.uint8)
    assert len(guard) == 8192 and np.array_equal(view, np.frombuffer(path.read_bytes()[4096:12288], np.uint8))
    view[:4] = 7  # copy-on-write: the file does not change
    assert path.read_bytes()[4096:4100] == bytes(range(4))
    guard.make_private()
    assert guard.private and np.all(view[:4] == 7)
    with pytest.raises(TypeError, match="ndarray"):
        prefault(b"abc")
    with pytest.raises(ValueError, match="writeable"):
        prefault(np.zeros(8)[::2])
