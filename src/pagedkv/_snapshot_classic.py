"""Snapshots of a ``PagedKVCache`` (magic ``PKVCLAS``): its sections, save and load.

The container is :mod:`pagedkv._snapshot_format`'s; the public names are in
:mod:`pagedkv.snapshot`.
"""
from __future__ import annotations

import os

import numpy as np

from pagedkv._snapshot_format import (MAGIC_CLASSIC, _PAGE_ALIGN, SnapshotError, _atomic_write, _container,
                                      _encode, _parse, _pool_bytes, _read_from_file, _readinto)
from pagedkv_c._checksum import page_checksums
from pagedkv_c._file_io import prefault


def _classic_pages(kv: np.ndarray) -> np.ndarray:
    """A classic pool ``(max_pages, 2, page_size, dim)`` as the 6-D layout page checksums read (same bytes)."""
    view = kv.view(np.float16 if kv.dtype.itemsize == 2 else np.float32)
    return view.reshape((1, kv.shape[0], 2, kv.shape[2], 1, view.shape[-1]))


def save_classic(cache, path) -> None:
    """Write a snapshot of a ``PagedKVCache`` to ``path`` atomically (magic ``PKVCLAS``).

    Sections: ``config`` (max_pages, dim, page_size, dtype), ``counters``
    (hits, misses, evictions), ``state`` (resident logical pages and page ids
    in FIFO eviction order, the free queue, the presence bytes), then the page
    checksums and the pool's bytes.

    Other threads may go on using the cache: its state and a copy of its
    pool are taken in one hold of its lock (other calls wait for the copy;
    the copy costs as much memory as the pool until the call returns), and
    the checksums are computed from the copy that is written.

    Raises
    ------
    MemoryError
        No memory for the copy of the pool; an existing file is left as it was.
    OSError
        The file cannot be written; an existing file is left as it was.
    """
    pool = cache._pool_array()
    kv = np.zeros(pool.shape, dtype=pool.dtype)  # (shape and dtype never change)
    prefault(kv)
    state = cache._snapshot(kv)
    sections = [("config", _encode(cache._config())),
                ("counters", _encode({name: state[name] for name in ("hits", "misses", "evictions")})),
                ("state", _encode({name: state[name] for name in ("logical_pages", "page_ids", "free_queue",
                                                                   "present")}))]
    pages = _classic_pages(kv)
    checksums = page_checksums(pages, np.arange(kv.shape[0], dtype=np.int32)).astype("<u8").tobytes()
    prefix, _ = _container(MAGIC_CLASSIC, sections, checksums, kv.nbytes, _PAGE_ALIGN)
    _atomic_write(path, [prefix, _pool_bytes(kv)])


def load_classic(path):
    """Read a ``PagedKVCache`` snapshot; verify every section and page, then build the cache.

    Raises
    ------
    SnapshotError
        Any mismatch (as :func:`load_cache`); nothing is returned.
    OSError
        The file cannot be read.
    """
    from pagedkv_c._classic import PagedKVCache

    with open(path, "rb", buffering=0) as f:  # unbuffered: the pages are read straight into the pool
        size = os.fstat(f.fileno()).st_size
        parsed = _parse(_read_from_file(f), size, MAGIC_CLASSIC, os.fspath(path))
        num_pages = parsed.checksums.shape[0]
        config = parsed.section("config")
        max_pages = config.int("max_pages", 1, 2**31 - 2)
        dim = config.int("dim", 1, 2**31 - 1)
        page_size = config.int("page_size", 1, 2**31 - 1)
        dtype = np.dtype(config.text("dtype", ("float16", "float32", "float64")))
        if max_pages != num_pages:
            raise config.error(f"max_pages {max_pages} but the checksum table lists {num_pages} pages")
        expected = max_pages * 2 * page_size * dim * dtype.itemsize
        if parsed.pages_length != expected:
            raise SnapshotError(f"section 'pages': {parsed.pages_length} bytes, expected {expected}")
        counters = parsed.section("counters")
        section = parsed.section("state")
        state = {"logical_pages": section.array("logical_pages", np.int64, 1),
                 "page_ids": section.array("page_ids", np.int32, 1),
                 "free_queue": section.array("free_queue", np.int32, 1),
                 "present": section.array("present", np.uint8, 2, (max_pages, page_size)),
                 **{name: counters.int(name) for name in ("hits", "misses", "evictions")}}
        cache = PagedKVCache(max_pages, dim, page_size=page_size, dtype=dtype)
        kv = cache._pool_array()
        _readinto(f, parsed.pages_offset, kv)
    actual = page_checksums(_classic_pages(kv), np.arange(max_pages, dtype=np.int32))
    bad = np.flatnonzero(actual != parsed.checksums)
    if bad.size:
        ids = state["page_ids"]
        where = np.flatnonzero(ids == bad[0])
        held = (f"resident as logical page {int(state['logical_pages'][where[0]])}" if where.size
                else "not resident")
        raise SnapshotError(f"section 'pages': checksum mismatch in page {int(bad[0])} ({held})"
                            + (f" and {bad.size - 1} more pages" if bad.size > 1 else ""))
    try:
        cache._restore_state(state)
    except ValueError as exc:
        raise SnapshotError(f"section 'state': {exc}") from None
    return cache
