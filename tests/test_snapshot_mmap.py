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
    import os, subprocess, sys
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
    }[writer]
    subprocess.run([sys.executable, "-c", code, path, other], check=True, timeout=60)
    print("file now", os.path.getsize(path), "bytes", flush=True)
    for (layer, s), k in want.items():
        assert np.array_equal(mapped.gather(layer, s)[0], k), (layer, s)
    mapped.check_invariants()
    mapped.save(path + ".again")
    again = KVCache.load(path + ".again")
    assert np.array_equal(again.gather(1, 2)[0], want[(1, 2)])
    print("OK", flush=True)
''')


@pytest.mark.parametrize("writer", ["truncate", "cp", "in_place"])
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
    assert size == os.path.getsize(other) if writer == "cp" else True


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
