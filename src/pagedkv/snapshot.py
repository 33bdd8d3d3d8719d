"""Snapshots: save a cache to a file, load it back, move one sequence between caches.

File format (version 2, all integers little-endian)
---------------------------------------------------
A file is a 64-byte header, a section table, then the sections in table
order. Every byte is covered by a checksum, so a flipped bit anywhere makes
:func:`load_cache` raise :class:`SnapshotError`.

===============  =============================================================
header           ``magic`` (8 bytes: ``b"PKVSNAP\\0"`` for a ``KVCache``,
(64 bytes)       ``b"PKVSEQ\\0\\0"`` for one exported sequence,
                 ``b"PKVCLAS\\0"`` for a ``PagedKVCache``), ``version`` u32,
                 ``header_bytes`` u32 (64), ``num_sections`` u32, 4 zero
                 bytes, ``file_length`` u64 (bytes), ``table_checksum`` u64,
                 16 zero bytes, ``header_checksum`` u64 over bytes 0..55
section table    per section 40 bytes: ``tag`` (16 bytes ASCII, zero padded),
                 ``offset`` u64, ``length`` u64 (bytes), ``checksum`` u64
metadata         named arrays (see below); checksum over the section's bytes
``checksums``    uint64 per page id: the page checksum (all layers, K and V)
``pages``        the pool's bytes, layer after layer exactly as in memory
                 (``kv.tobytes()``), starting on a 4096-byte boundary (zero
                 padding before it); its table checksum is the checksum of
                 the ``checksums`` section's bytes, and each page is checked
                 against its own entry there
===============  =============================================================

Version 2 adds per-layer attention settings (``KVCache(...,
layer_attention=...)``): the ``config`` section may hold ``layer_attention``,
int64 ``(num_layers, 3)``, per layer its window, sink tokens and chunk size
(-1 for None), with ``window`` -1 and ``sink_tokens`` 0; the pool is then
``(G, num_pages, ...)`` with ``G`` the layers per page group (all layers for
one group), and with more than one group the ``tables`` section lists every
group's tables, group after group (each in the same sequence order), with
``groups``, int64 per row, its page group. With prefix caching and more
than one group, the ``hashes`` section likewise lists every group's hash
chains, group after group in the order of ``tables`` (one row per table;
each group's chains are salted by its own mix, see ``pagedkv_c._prefix``).
Version 1 files, which have neither, and version 2 files of one group
still load, byte for byte as before.

Sections follow each other without gaps (only the padding before
``pages``, which must be zeros) and end exactly at ``file_length``, the
file's size. A metadata section is a run of entries, each: ``name_length``
u16, ``dtype`` u8 (1 int32, 2 int64, 3 uint64, 4 uint8), ``ndim`` u8 (at most
4), ``name`` (ASCII), zero padding to 8 bytes, ``shape`` (u64 each), the
array's bytes (C order), zero padding to 8 bytes. Scalars are 0-d int64
arrays, strings uint8 arrays.

Checksums: metadata sections, the section table and the header use the low
64 bits of XXH3-128 (``xxh3.h``, the core's own implementation); a page's
checksum is ``pagedkv_c._checksum.page_checksums`` (``page_checksum.h``), the
value the cache records for a sealed page.

Trust model: XXH3 detects accidents, not a forger, who can recompute every
checksum. The validation below is what stands against forged bytes: no file
or exported sequence can run code (no pickle), make the reader allocate more
than the file's size suggests, crash the process, corrupt another sequence,
or (through :func:`import_sequence`) plant K/V under another tenant's salt.
Every length is checked against the header and the file before it is read;
the pool must be exactly the ``pages`` section (layers x pages x 2 x page
size x heads x the bytes of a head row in the page format); ``num_pages`` is the checksum table's
length / 8; the kept token ids of prefix caching (num_pages x page_size
int32, not bounded by the pool when ``num_layers`` is 0) and the page
tables' rings and sink arrays (4 bytes per entry) together may take at most
twice the file's length or 256 MiB, whichever is more. Before it allocates
the cache or reads a page, ``load_cache`` checks all of that and the ids,
ref counts (equal to the page-table entries), free queue, counters, prefix
index, seal flags, the recorded checksum of each sealed page (equal to its
entry in ``checksums``), and each page table's geometry: its pages cover
exactly what its length, window and sink tokens say (the release rule of
DESIGN.md). Then the state is applied to a throwaway cache without K/V,
where the core checks it again (computing every hash chain again from its
salt and kept token or block ids, checking that the prefix index holds each
registered page under its sequence's hash) and which must pass
``check_invariants()``; only then is the cache built. :func:`verify` runs
the same checks, so it accepts exactly the files ``load_cache`` accepts. A whole-cache snapshot
is the cache: its salts and cached pages are taken as the file gives them
(checked for consistency, not for who wrote them). Counters hold at
``2**63 - 1`` instead of wrapping, so a loaded cache always saves a file
that loads.

Writes are atomic: the file is written to a temporary file in the target's
directory, flushed and fsynced, renamed over the target, and the directory is
fsynced, so a crash leaves the old snapshot or the new one, never a torn file.
No writer here opens an existing snapshot for writing: a file is only ever
replaced by a rename, so a process that mapped the old one keeps its bytes.
A save may run while other threads use the cache: it takes the state and a
copy of the pool in one hold of the cache's lock, writes the copy with
checksums computed from it, and renames only a file that would load.
"""
from __future__ import annotations

import errno
import logging
import os

import numpy as np

from pagedkv import _snapshot_format as _format
from pagedkv._snapshot_classic import load_classic, save_classic
from pagedkv._snapshot_format import (MAGIC_CACHE, MAGIC_SEQUENCE, _PAGE_ALIGN, SnapshotError, _atomic_write,
                                      _container, _each_run, _encode, _Parsed, _parse, _pool_bytes,
                                      _positional_reader, _positional_writer, _read_from_file, _readinto,
                                      _Section, _write_all)
# Not used here: importable from this module for the tests and tools that forge files.
from pagedkv._snapshot_format import _ENTRY, _HEADER_BYTES, MAGIC_CLASSIC, _checksum, _decode  # noqa: F401
from pagedkv_c._checks import checked_flag, checked_int
from pagedkv_c._checksum import combine_digests, layer_digests, page_checksums
from pagedkv_c._page_store import MAX_QUANTIZED_HEAD_DIM, PAGE_FORMATS, format_layout
from pagedkv_c._file_io import GuardedMap, prefault

__all__ = ["FORMAT_VERSION", "SnapshotError", "export_sequence", "import_sequence", "load_cache",
           "load_classic", "save_cache", "save_classic", "verify"]

#: Version of the file format that this pagedkv writes; it reads this version and refuses newer ones.
FORMAT_VERSION = _format.FORMAT_VERSION
_log = logging.getLogger(__name__)


# ------------------------------------------------------------------ KVCache
def _config_section(config: dict) -> bytes:
    arrays = {key: value for key, value in config.items() if key != "layer_attention"}
    if config.get("layer_attention") is not None:
        arrays["layer_attention"] = np.array(config["layer_attention"], dtype=np.int64).reshape(-1, 3)
    return _encode(arrays)


def _layer_attention(config: dict):
    """The ``layer_attention`` argument of a configuration: a tuple of AttentionSetting, or None."""
    from pagedkv_c._page_group import AttentionSetting

    if config.get("layer_attention") is None:
        return None
    return tuple(AttentionSetting(None if w == -1 else w, s, None if c == -1 else c)
                 for w, s, c in config["layer_attention"])


def _page_groups(config: dict) -> tuple[list[tuple[int, int]], int]:
    """``([(window, sink_tokens)] per page group, layers per page)`` of a configuration (window -1 = None).

    A chunked group's window is its chunk size (the cache stores chunks as a window of that many tokens).
    """
    from pagedkv_c._page_group import layer_groups

    settings = _layer_attention(config)
    if settings is None:
        return [(config["window"], config["sink_tokens"])], config["num_layers"]
    groups = layer_groups(settings)
    windows = [(a.chunk_size if a.chunk_size is not None else (-1 if a.window is None else a.window), a.sink_tokens)
               for a, _ in groups]
    return windows, config["num_layers"] if len(groups) == 1 else len(groups[0][1])


def _read_config(section: _Section, num_pages_bound: int | None, version: int = _format.FORMAT_VERSION) -> dict:
    config = {
        "num_layers": section.int("num_layers", 0, 2**20),
        "num_kv_heads": section.int("num_kv_heads", 1, 2**16),
        "head_dim": section.int("head_dim", 1, 2**16),
        "num_pages": section.int("num_pages", 1, 2**31 - 2),
        "page_size": section.int("page_size", 1, 2**20),
        "dtype": section.text("dtype", PAGE_FORMATS),
        "window": section.int("window", -1, 2**62),
        "sink_tokens": section.int("sink_tokens", 0, 2**62),
        "prefix_caching": section.int("prefix_caching", 0, 1),
        "prefix_hash": section.text("prefix_hash", ("xxh3_128", "sha256")),
        "page_checksums": section.int("page_checksums", 0, 1),
    }
    if config["dtype"] in ("int8", "int4") and config["head_dim"] > MAX_QUANTIZED_HEAD_DIM:
        raise section.error(f"{config['dtype']} pages with head_dim {config['head_dim']} (at most "
                            f"{MAX_QUANTIZED_HEAD_DIM})")
    if config["window"] == 0 or (config["window"] == -1 and config["sink_tokens"]):
        raise section.error(f"window {config['window']} with {config['sink_tokens']} sink tokens is not a valid cache")
    if num_pages_bound is not None and config["num_pages"] != num_pages_bound:
        raise section.error(f"num_pages {config['num_pages']} but the checksum table lists {num_pages_bound} pages")
    config["layer_attention"] = None
    if "layer_attention" in section.arrays:
        if version < 2:
            raise section.error(f"entry 'layer_attention' in a file of format version {version}")
        table = section.array("layer_attention", np.int64, 2, (config["num_layers"], 3))
        if config["window"] != -1 or config["sink_tokens"]:
            raise section.error("layer_attention with a window or sink tokens")
        config["layer_attention"] = tuple(tuple(int(x) for x in row) for row in table.tolist())
        try:
            _layer_attention(config)
        except (TypeError, ValueError) as exc:
            raise section.error(f"entry 'layer_attention': {exc}") from None
    return config


def _pool_shape(config: dict, num_pages: int) -> tuple:
    row_items = format_layout(config["dtype"], config["head_dim"])[1]
    return (_page_groups(config)[1], num_pages, 2, config["page_size"], config["num_kv_heads"], row_items)


def _pool_dtype(config: dict) -> np.dtype:
    """The pool's element dtype for the page format a config names."""
    return format_layout(config["dtype"], config["head_dim"])[0]


def _cache_kwargs(config: dict) -> dict:
    return {
        "num_layers": config["num_layers"], "num_kv_heads": config["num_kv_heads"], "head_dim": config["head_dim"],
        "num_pages": config["num_pages"], "page_size": config["page_size"], "kv_dtype": config["dtype"],
        "window": None if config["window"] == -1 else config["window"], "sink_tokens": config["sink_tokens"],
        "enable_prefix_caching": bool(config["prefix_caching"]), "prefix_hash": config["prefix_hash"],
        "page_checksums": bool(config["page_checksums"]), "layer_attention": _layer_attention(config),
    }


_TABLE_FIELDS = ("length", "sink_count", "ring_first", "ring_capacity", "num_pages")
_HASH_FIELDS = ("external", "num_hashed", "num_known", "num_blocks", "pages_per_block", "num_hashable",
                "num_registered")


def _tables_section(sequences: list, group_tables: list | None = None) -> bytes:
    """The page tables: group 0's ``sequences``, then each further group's (with a ``groups`` entry)."""
    rows = len(sequences)
    if group_tables:
        sequences = sequences + [(seq_id, table, None) for tables in group_tables for seq_id, table in tables]
    ids = np.array([seq_id for seq_id, _, _ in sequences], dtype=np.int64)
    fields = np.array([[t[key] if key != "num_pages" else t["pages"].shape[0] for key in _TABLE_FIELDS]
                       for _, t, _ in sequences], dtype=np.int64).reshape(len(sequences), len(_TABLE_FIELDS))
    pages = (np.concatenate([t["pages"] for _, t, _ in sequences]) if sequences
             else np.zeros(0, dtype=np.int32)).astype(np.int32)
    arrays = {"seq_ids": ids, "fields": fields, "pages": pages}
    if group_tables:
        arrays["groups"] = np.repeat(np.arange(len(group_tables) + 1, dtype=np.int64), rows)
    return _encode(arrays)


def _hashes_section(sequences: list) -> bytes:
    states = [h for _, _, h in sequences]
    fields = np.array([[int(h["external"]), h["chain"].shape[0], h["token_ids"].shape[0], h["block_ids"].shape[0],
                        h["pages_per_block"], h["num_hashable"], h["num_registered"]] for h in states],
                      dtype=np.int64).reshape(len(states), len(_HASH_FIELDS))

    def joined(key, dtype, tail=()):
        """The arrays ``key`` of every sequence, concatenated as ``dtype`` (empty of shape ``(0, *tail)``)."""
        parts = [h[key] for h in states]
        return np.concatenate(parts).astype(dtype) if parts else np.zeros((0,) + tail, dtype=dtype)

    salts = np.array([h["salt"] for h in states], dtype=np.uint64).reshape(len(states), 2)
    return _encode({"fields": fields, "salts": salts, "chain": joined("chain", np.uint64, (2,)),
                    "token_ids": joined("token_ids", np.int32), "block_ids": joined("block_ids", np.int64)})


def _read_tables(section: _Section, num_pages: int, num_groups: int = 1) -> list[tuple[int, dict]]:
    """Group 0's ``(seq_id, table)`` pairs; with ``num_groups > 1``, a list of such lists, one per group."""
    ids = section.array("seq_ids", np.int64, 1)
    fields = section.array("fields", np.int64, 2, (ids.shape[0], len(_TABLE_FIELDS)))
    pages = section.array("pages", np.int32, 1)
    counts = fields[:, 4]
    if (counts < 0).any() or (counts > num_pages).any() or int(counts.sum()) != pages.shape[0]:
        raise section.error(f"page counts {counts.tolist()} do not add up to the {pages.shape[0]} pages listed")
    if num_groups > 1 or "groups" in section.arrays:
        groups = section.array("groups", np.int64, 1, (ids.shape[0],))
        rows = ids.shape[0] // num_groups
        if num_groups == 1 or ids.shape[0] % num_groups or not np.array_equal(
                groups, np.repeat(np.arange(num_groups, dtype=np.int64), rows)):
            raise section.error(f"entry 'groups' does not list {num_groups} page groups of equal length in order")
        if np.unique(ids[:rows]).shape[0] != rows:
            raise section.error("a sequence id appears twice")
        if any(not np.array_equal(ids[:rows], ids[g * rows:(g + 1) * rows]) for g in range(1, num_groups)):
            raise section.error("the page groups do not list the same sequences in the same order")
        whole = _read_table_rows(section, ids, fields, pages)
        return [whole[g * rows:(g + 1) * rows] for g in range(num_groups)]
    if np.unique(ids).shape[0] != ids.shape[0]:
        raise section.error("a sequence id appears twice")
    return _read_table_rows(section, ids, fields, pages)


def _read_table_rows(section: _Section, ids: np.ndarray, fields: np.ndarray, pages: np.ndarray) -> list:
    out, start = [], 0
    for seq_id, row in zip(ids.tolist(), fields.tolist()):
        n = row[4]
        out.append((seq_id, {"length": row[0], "sink_count": row[1], "ring_first": row[2], "ring_capacity": row[3],
                             "pages": np.ascontiguousarray(pages[start:start + n])}))
        start += n
    return out


def _read_hashes(section: _Section, num_sequences: int) -> list[dict]:
    fields = section.array("fields", np.int64, 2, (num_sequences, len(_HASH_FIELDS)))
    salts = section.array("salts", np.uint64, 2, (num_sequences, 2))
    chain = section.array("chain", np.uint64, 2, (None, 2))
    token_ids = section.array("token_ids", np.int32, 1)
    block_ids = section.array("block_ids", np.int64, 1)
    if (fields < 0).any() or (fields[:, 0] > 1).any():
        raise section.error("negative counts or an external flag other than 0 or 1")
    for column, array, name in ((1, chain, "chain"), (2, token_ids, "token_ids"), (3, block_ids, "block_ids")):
        if sum(fields[:, column].tolist()) != array.shape[0]:  # Python ints: a crafted sum cannot wrap
            raise section.error(f"the counts of {name} do not add up to its {array.shape[0]} entries")
    out, starts = [], [0, 0, 0]
    for b, row in enumerate(fields.tolist()):
        parts = []
        for j, array in enumerate((chain, token_ids, block_ids)):
            parts.append(np.ascontiguousarray(array[starts[j]:starts[j] + row[j + 1]]))
            starts[j] += row[j + 1]
        out.append({"external": bool(row[0]), "salt": np.ascontiguousarray(salts[b]), "chain": parts[0],
                    "token_ids": parts[1], "block_ids": parts[2], "pages_per_block": row[4],
                    "num_hashable": row[5], "num_registered": row[6]})
    return out


def _holders(tables: list[tuple[int, dict]], page_id: int) -> list[int]:
    return [seq_id for seq_id, table in tables if (table["pages"] == page_id).any()]


def _read_and_check_pages(f, offset: int, kv: np.ndarray, expected: np.ndarray, tables: list[tuple[int, dict]],
                          threads: int) -> None:
    """Read the pages section at ``offset`` straight into ``kv``, hashing each run right after it is read,
    then compare every page checksum with ``expected`` (naming the first pages that differ)."""
    digests = np.zeros((kv.shape[1], kv.shape[0], 16), dtype=np.uint8)
    read_at = _positional_reader(f)

    def load_run(run) -> None:
        """Read one run from the file into the pool, then hash it while its bytes are in the CPU's cache."""
        layer, first, stop, view, start = run
        read_at(view, offset + start)
        layer_digests(kv, layer, first, stop, digests)

    _each_run(_page_runs(kv), load_run, threads)
    actual = np.zeros(kv.shape[1], dtype=np.uint64)
    combine_digests(digests, actual)
    _report_bad_pages(actual, expected, tables, "")


def _check_pages(kv: np.ndarray, expected: np.ndarray, tables: list[tuple[int, dict]], what: str) -> None:
    """Recompute every page checksum of ``kv`` and name the first pages that differ."""
    _report_bad_pages(page_checksums(kv, np.arange(kv.shape[1], dtype=np.int32)), expected, tables, what)


def _report_bad_pages(actual: np.ndarray, expected: np.ndarray, tables: list[tuple[int, dict]], what: str) -> None:
    """Raise SnapshotError naming the first page whose checksum differs (and the sequences holding it)."""
    bad = np.flatnonzero(actual != expected)
    if bad.size:
        first = int(bad[0])
        holders = _holders(tables, first)
        held = f"held by sequences {holders}" if holders else "held by no sequence"
        raise SnapshotError(
            f"section 'pages': checksum mismatch in {what + ' ' if what else ''}page {first} ({held})"
            + (f" and {bad.size - 1} more pages (first ids {bad[1:6].tolist()})" if bad.size > 1 else "")
        )


def save_cache(cache, path, *, num_threads: int | None = None) -> None:
    """Write a snapshot of a ``KVCache`` to ``path`` atomically (see the module notes for the format).

    Other threads may go on using the cache: the snapshot is the cache at
    one point in time. Its state (page tables, ref counts, free queue, prefix
    index, counters, seal flags and recorded checksums) and a copy of the
    pool's bytes are taken in one hold of the cache's lock, so every other
    call waits for that copy (a ``memcpy`` of the pool, without the GIL:
    about 0.1 to 0.25 s per GiB on a 2-core machine, see
    docs/snapshots.md); the new array is faulted in before the lock is taken.
    The copy costs as much memory as the pool until the call returns. Then,
    without the lock, the copy is written in runs of about 4 MiB of one
    layer's pages; each run is hashed (XXH3-128 per page and layer, in C
    without the GIL) just before it is written, while its bytes are in the
    CPU's cache. Each time another 32 MiB are written the kernel is asked to
    start writing them to the disk (Linux), so the disk works while the next
    runs are copied and the final fsync waits for little.

    ``path`` is replaced only by a file that would load: the page checksums
    are computed from the very bytes written; with ``page_checksums=True``
    each sealed page's checksum recorded at its seal must equal the checksum
    of its bytes (else the pool's memory changed since the seal, which
    ``verify_pages`` reports, and nothing is written); and before the rename
    the new file's header and metadata are read back and checked as
    :func:`load_cache` checks them.

    Parameters
    ----------
    cache : pagedkv.KVCache
        The cache; other threads may call it meanwhile.
    path : str or os.PathLike
        Target file; replaced atomically (by a rename, never rewritten in
        place) if it exists.
    num_threads : int, optional
        1: hash and write in the calling thread. 2 (the default, None): the
        calling thread and a helper thread each take the next run, hash it
        and write it at its place in the file (one write at a time), so one
        thread hashes while the other writes.

    Raises
    ------
    ValueError
        ``num_threads`` is not None, 1 or 2.
    TypeError
        ``num_threads`` is not an integer (a float or a bool is refused).
    SnapshotError
        A sealed page's bytes differ from the checksum recorded at its seal
        (naming the page and the sequences holding it), or the new file
        fails the checks of :func:`load_cache`; ``path`` is untouched.
    MemoryError
        No memory for the copy of the pool; ``path`` is untouched.
    OSError
        The file cannot be written; the old file (if any) is untouched.
    """
    threads = _checked_threads(num_threads)
    kv = np.zeros(cache.kv.shape, dtype=cache.kv.dtype)  # (shape and dtype never change)
    prefault(kv)
    state, sealed_state = cache._snapshot(kv)
    sequences = state["sequences"]
    sections = [("config", _config_section(state["config"])), ("counters", _encode(state["counters"])),
                ("pool", _encode({"ref_counts": state["ref_counts"], "free_queue": state["free_queue"]}))]
    if state["prefix"] is not None:
        sections.append(("prefix", _encode(state["prefix"])))
    sections.append(("tables", _tables_section(sequences, state["group_tables"])))
    if state["prefix"] is not None:
        sections.append(("hashes", _hashes_section(sequences + [
            (seq_id, table, h) for more, hashes in zip(state["group_tables"], state["group_hashes"])
            for (seq_id, table), h in zip(more, hashes)])))
    sections.append(("sealed", _sealed_section(sealed_state)))
    digests = np.zeros((kv.shape[1], kv.shape[0], 16), dtype=np.uint8)

    def write_pages(f) -> None:
        """Write the pages section to ``f``, hashing each run of pages just before it is written."""
        write_at = _positional_writer(f)
        offset = len(placeholder)  # the pages section follows the placeholder

        def save_run(run) -> None:
            """Hash one run of the copy, then write it while its bytes are in the CPU's cache."""
            layer, first, stop, view, start = run
            layer_digests(kv, layer, first, stop, digests)
            write_at(view, offset + start)

        _each_run(_page_runs(kv), save_run, threads)

    def finish(fd: int) -> None:
        """Check the sealed pages, then overwrite the placeholder at the start of ``fd`` with the real header."""
        checksums = np.zeros(kv.shape[1], dtype=np.uint64)
        combine_digests(digests, checksums)
        recorded = sealed_state["checksums"]
        if recorded is not None:
            bad = np.flatnonzero((sealed_state["sealed"] != 0) & (checksums != recorded))
            if bad.size:
                holders = sorted({seq_id for seq_id, table, _ in sequences + [(k, t, None) for more in
                                                                               state["group_tables"] for k, t in more]
                                  if (table["pages"] == bad[0]).any()})
                raise SnapshotError(
                    f"section 'pages': sealed page {int(bad[0])} (held by sequences {holders}) no longer has the "
                    f"checksum recorded at its seal" + (f", nor have {bad.size - 1} more sealed pages (first ids "
                                                        f"{bad[1:6].tolist()})" if bad.size > 1 else "")
                    + f"; its bytes changed in memory (KVCache.verify_pages lists such pages); {os.fspath(path)!r} "
                    f"was left as it was")
        prefix, _ = _container(MAGIC_CACHE, sections, checksums.astype("<u8").tobytes(), kv.nbytes, _PAGE_ALIGN)
        os.lseek(fd, 0, os.SEEK_SET)  # (os.pwrite is not on Windows)
        _write_all(lambda data: os.write(fd, data), prefix)

    def check(tmp: str) -> None:
        """Read back the new file's header and metadata and check them as load_cache does."""
        with open(tmp, "rb", buffering=0) as f:
            _checked_cache_file(f, tmp)

    # The header, table and checksums precede the pages: a placeholder of the
    # same length is written first and overwritten once the pages are hashed.
    placeholder, _ = _container(MAGIC_CACHE, sections, bytes(8 * kv.shape[1]), kv.nbytes, _PAGE_ALIGN)
    _atomic_write(path, [placeholder, write_pages], finish, check)


#: Bytes of one layer's pages hashed and written (or read and hashed) together:
#: small enough to stay in the CPU's cache between the two.
_RUN_BYTES = 4 << 20


def _checked_threads(num_threads) -> int:
    if num_threads is None:
        return 2
    return checked_int(num_threads, "num_threads", 1, 2)


def _page_runs(kv: np.ndarray) -> list[tuple[int, int, int, memoryview, int]]:
    """``(layer, first, stop, bytes, start)`` runs of about ``_RUN_BYTES`` of one layer's pages, in file
    order; ``start`` is the run's byte offset in the pool (and in the ``pages`` section)."""
    num_layers, num_pages = kv.shape[0], kv.shape[1]
    if not kv.size:
        return []
    page_bytes = kv.nbytes // (num_layers * num_pages)
    per_run = max(1, _RUN_BYTES // page_bytes)
    flat = memoryview(kv.reshape(-1).view(np.uint8))
    runs = []
    for layer in range(num_layers):
        for first in range(0, num_pages, per_run):
            stop = min(num_pages, first + per_run)
            start = (layer * num_pages + first) * page_bytes
            runs.append((layer, first, stop, flat[start:start + (stop - first) * page_bytes], start))
    return runs


def _sealed_section(state: dict) -> bytes:
    """The seal flags, the checksums recorded at the seals (with ``page_checksums``) and the seal counter."""
    arrays = {"sealed": state["sealed"], "pages_sealed": int(state["pages_sealed"])}
    if state["checksums"] is not None:
        arrays["checksums"] = state["checksums"]
    return _encode(arrays)


def load_cache(path, *, mmap: bool = False, num_threads: int | None = None):
    """Read a ``KVCache`` snapshot; verify everything, then build the cache.

    Parameters
    ----------
    path : str or os.PathLike
        A file written by :func:`save_cache` (``KVCache.save``).
    mmap : bool
        False (default): read the pool into memory and check every page's
        checksum before returning. True: the pool is a copy-on-write memory
        map of the file's ``pages`` section: pages are read from the file
        when first touched, writes stay in the process's memory and never
        reach the file. The header, the section table and every metadata
        section are verified at once; the page bytes are not read, so call
        :func:`verify` on the file (any time, e.g. from a background thread)
        to check them.

        **Never rewrite or truncate a mapped file in place** (``cp new old``,
        ``>``, ``dd``, ``truncate``): replace it by a rename (``mv``,
        :func:`save_cache`, ``cp`` to a temporary name then ``mv``), which
        leaves the mapped inode alone. A map alone would not survive such a
        change: the next access of an untouched page past a truncation kills
        the process with SIGBUS, and a rewrite changes pages not read yet.
        So the map is guarded (Linux): a read lease on the file
        (``pagedkv_c._file_io.GuardedMap``) makes the kernel hold any process
        that opens the file for writing or truncates it until this process
        has copied the map's bytes into its own memory (under the cache's
        lock, as much memory as the pool, within the kernel's
        ``lease-break-time``, 45 s by default); the cache then keeps the
        bytes it loaded. Where no lease can be taken (not Linux, another
        user's file without ``CAP_LEASE``, a file system without leases such
        as NFS, a file some process holds open for writing, or the signal
        :data:`pagedkv_c._file_io.LEASE_SIGNAL` taken by another handler)
        the pages are read into memory at load instead of mapped (not
        checked, as mapped ones), and the ``pagedkv.snapshot`` logger says
        why. See docs/snapshots.md.
    num_threads : int, optional
        For a full load, the pool is read straight into the new cache's pool
        in runs of about 4 MiB of one layer's pages, each hashed right after
        it is read, while its bytes are in the CPU's cache. 1: in the calling
        thread. 2 (the default, None): the calling thread and a helper thread
        each take the next run and read and hash it, at once (positional
        reads; where the platform has none, such as Windows, the reads take
        turns under a lock and only the hashing overlaps).

    Returns
    -------
    pagedkv.KVCache

    Raises
    ------
    SnapshotError
        Any mismatch: bad magic, unknown or newer version, truncated file,
        a section of the wrong length, a checksum mismatch (naming the page
        and the sequences holding it), an inconsistent page table or ref
        count, an id out of range; with ``mmap=True``, a file that another
        process opened for writing or truncated while it was loaded.
        Nothing is returned.
    OSError
        The file cannot be read (or, with ``mmap=True``, mapped).
    TypeError, ValueError
        ``num_threads`` is not None, 1 or 2 (a float or a bool is refused),
        or ``mmap`` is not a bool.
    """
    from pagedkv_c._kv_cache import KVCache

    threads = _checked_threads(num_threads)
    mmap = checked_flag(mmap, "mmap")
    with open(path, "rb", buffering=0) as f:  # unbuffered: the pages are read straight into the pool
        guard = _guard(f, path) if mmap else None  # before anything of the file is read
        parsed, state, tables, shape = _checked_cache_file(f, path)
        config = state["config"]
        cache = KVCache(**_cache_kwargs(config))
        if mmap:
            if cache.kv.size and guard is not None:
                try:
                    guard.map(parsed.pages_offset, parsed.pages_length)
                except OSError as exc:
                    if exc.errno != errno.ESTALE:
                        raise
                    raise SnapshotError(f"section 'pages': {os.fspath(path)!r} was opened for writing or "
                                        f"truncated by another process while it was loaded") from None
                cache._adopt_pool(np.frombuffer(guard, dtype=cache.kv.dtype).reshape(shape))
                guard.attach(cache)
            elif cache.kv.size:  # no guard here: the pages are read now (and checked later, as mapped ones)
                _readinto(f, parsed.pages_offset, cache.kv)
        else:
            _read_and_check_pages(f, parsed.pages_offset, cache.kv, parsed.checksums, tables, threads)
    _restore(cache, state, parsed)
    return cache


def _guard(f, path):
    """A ``GuardedMap`` of the open snapshot ``f`` (its read lease taken), or None where none can be taken.

    Without a guard a map of the file is not safe (a truncation kills the
    process with SIGBUS at the next access of an untouched page; a rewrite
    in place changes them), so :func:`load_cache` reads the pages instead and
    logs why.
    """
    try:
        return GuardedMap(f.fileno())
    except OSError as exc:
        _log.warning("load(%r, mmap=True): the file cannot be guarded against changes by other processes "
                     "(%s), so its pages are read into memory instead of mapped", os.fspath(path), exc.strerror)
        return None


def _checked_cache_file(f, path) -> tuple[_Parsed, dict, list, tuple]:
    """Parse and check a whole-cache snapshot open as ``f`` (everything but the page bytes).

    The checks of :func:`_check_before_build`, then every check of a load
    (the core's and ``check_invariants()``) on a throwaway cache without K/V,
    so that a forged state is refused before the pool is allocated or a page
    read, by :func:`load_cache` and :func:`verify` alike.

    Returns the parsed container, the state dict and page tables of
    :func:`_cache_state`, and the pool's shape. Raises SnapshotError first.
    """
    size = os.fstat(f.fileno()).st_size
    parsed = _parse(_read_from_file(f), size, MAGIC_CACHE, os.fspath(path))
    state, tables = _cache_state(parsed)
    _check_before_build(state, parsed, size)
    _check_state_without_pool(state, parsed)
    config = state["config"]
    return parsed, state, tables, _pool_shape(config, config["num_pages"])


def _cache_state(parsed: _Parsed) -> tuple[dict, list]:
    """The state dict of ``KVCache._restore_state`` from a verified container (shapes checked)."""
    num_pages = parsed.checksums.shape[0]
    config = _read_config(parsed.section("config"), num_pages, parsed.version)
    itemsize = _pool_dtype(config).itemsize
    expected = int(np.prod(_pool_shape(config, num_pages), dtype=object)) * itemsize
    if parsed.pages_length != expected:
        raise SnapshotError(f"section 'pages': {parsed.pages_length} bytes, expected {expected} for a pool of "
                            f"shape {_pool_shape(config, num_pages)} {config['dtype']}")
    counters = parsed.section("counters")
    names = ("pages_peak", "evictions", "cow_copies", "tokens_appended", "prefix_queries", "prefix_hits",
             "out_of_pages_errors", "sequences_added", "pages_allocated", "ring_reuses")
    pool = parsed.section("pool")
    num_groups = len(_page_groups(config)[0])
    tables = _read_tables(parsed.section("tables"), num_pages, num_groups)
    group_tables = []
    if num_groups > 1:
        tables, group_tables = tables[0], tables[1:]
    prefix = None
    sequences = [(seq_id, table, None) for seq_id, table in tables]
    group_hashes = []
    if config["prefix_caching"]:
        if "prefix" not in parsed.sections or "hashes" not in parsed.sections:
            raise SnapshotError("section 'prefix': missing for a cache with prefix caching")
        section = parsed.section("prefix")
        prefix = {"pages": section.array("pages", np.int32, 1),
                  "hashes": section.array("hashes", np.uint64, 2),
                  "has_tokens": section.array("has_tokens", np.uint8, 1),
                  "tokens": section.array("tokens", np.int32, 2),
                  "evictions": section.int("evictions")}
        hashes = _read_hashes(parsed.section("hashes"), len(tables) * num_groups)  # every group's, in order
        sequences = [(seq_id, table, h) for (seq_id, table), h in zip(tables, hashes)]
        group_hashes = [hashes[g * len(tables):(g + 1) * len(tables)] for g in range(1, num_groups)]
    elif "prefix" in parsed.sections or "hashes" in parsed.sections:
        raise SnapshotError("section 'prefix': present in a cache without prefix caching")
    from pagedkv_c._kv_cache import PREFIX_HIT_BUCKETS  # the core's bucket bounds, then an overflow bucket

    hit_counts = counters.array("prefix_hit_counts", np.int64, 1, (len(PREFIX_HIT_BUCKETS) + 1,))
    if (hit_counts < 0).any():
        bucket = int(np.flatnonzero(hit_counts < 0)[0])
        raise counters.error(f"entry 'prefix_hit_counts' has {int(hit_counts[bucket])} in bucket {bucket}, "
                             f"expected counts >= 0")
    state = {
        "config": config,
        "counters": {**{name: counters.int(name) for name in names}, "prefix_hit_counts": hit_counts},
        "ref_counts": pool.array("ref_counts", np.int32, 1),
        "free_queue": pool.array("free_queue", np.int32, 1),
        "prefix": prefix,
        "sequences": sequences,
        "group_tables": group_tables,
        "group_hashes": group_hashes,
    }
    return state, tables + [pair for more in group_tables for pair in more]


# ------------------------------------------------- checks before building
#: Besides the pool (exactly the ``pages`` section), a load allocates at most
#: this many bytes, or twice the file's length if that is more, for the kept
#: token ids of prefix caching and the page tables' rings and sink arrays: the
#: two allocations whose size is not a section's length.
_EXTRA_ALLOCATION_FLOOR = 2**28


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_before_build(state: dict, parsed: _Parsed, size: int) -> None:
    """Check sizes, ids, ref counts, free queue, prefix index, tables and seal flags; allocate nothing large.

    Runs on the decoded sections before any cache, pool or page table
    exists, so a crafted file is refused before it can make the loader
    allocate (the allocation bound of the module notes) or read page bytes.
    The core checks the same state again when it applies it.
    """
    config = state["config"]
    num_pages, page_size = config["num_pages"], config["page_size"]
    # The two allocations a file's sections do not bound by their own length.
    tokens_bytes = 4 * num_pages * page_size if config["prefix_caching"] else 0
    allowed = max(2 * size, _EXTRA_ALLOCATION_FLOOR)
    if tokens_bytes > allowed:
        raise SnapshotError(
            f"section 'config': {num_pages} pages of page_size {page_size} need {tokens_bytes} bytes of kept "
            f"token ids for prefix caching, more than a file of {size} bytes may make the loader allocate "
            f"({allowed} bytes besides the pool)")
    geometry = []  # per page group: (its config, sink pages, initial ring capacity, its tables)
    windows, _ = _page_groups(config)
    group_tables = [[(seq_id, table) for seq_id, table, _ in state["sequences"]]] + list(state["group_tables"])
    for (window, sink_tokens), tables in zip(windows, group_tables):
        sink_pages = min(_ceil_div(sink_tokens, page_size), num_pages) if window != -1 else 0
        initial_ring = 8
        if window != -1:
            initial_ring = 1
            while initial_ring < min(_ceil_div(window - 1, page_size) + 1, 1 << 16):
                initial_ring *= 2
        geometry.append((dict(config, window=window, sink_tokens=sink_tokens), sink_pages, initial_ring, tables))
    sequences = state["sequences"]
    all_tables = [pair for *_, tables in geometry for pair in tables]
    ring_bytes = sum(4 * (initial_ring + sink_pages + table["ring_capacity"])
                     for _, sink_pages, initial_ring, tables in geometry for _, table in tables)
    if tokens_bytes + ring_bytes > allowed:
        raise SnapshotError(
            f"section 'tables': {len(all_tables)} page tables (ring capacities and sink pages) need {ring_bytes} "
            f"bytes, more than a file of {size} bytes may make the loader allocate ({allowed} bytes besides the "
            f"pool{', with the kept token ids' if tokens_bytes else ''})")

    ref_counts, free_queue = state["ref_counts"], state["free_queue"]
    if ref_counts.shape != (num_pages,):
        raise SnapshotError(f"section 'pool': ref_counts has shape {ref_counts.shape}, expected ({num_pages},)")
    if (ref_counts < 0).any():
        page = int(np.flatnonzero(ref_counts < 0)[0])
        raise SnapshotError(f"section 'pool': page {page} has ref count {int(ref_counts[page])}")
    if ((free_queue < 0) | (free_queue >= num_pages)).any():
        raise SnapshotError(f"section 'pool': the free queue lists a page id outside [0, {num_pages - 1}]")
    queued = np.bincount(free_queue, minlength=num_pages)
    if (queued > 1).any():
        raise SnapshotError(f"section 'pool': page {int(np.flatnonzero(queued > 1)[0])} is queued twice")
    wrong = np.flatnonzero((queued == 1) != (ref_counts == 0))
    if wrong.size:
        page = int(wrong[0])
        raise SnapshotError(f"section 'pool': page {page} has ref count {int(ref_counts[page])} but is "
                            f"{'' if queued[page] else 'not '}in the free queue")

    held = np.zeros(num_pages, dtype=np.int64)
    owner = np.full(num_pages, -1, dtype=np.int64)
    lengths = [table["length"] for _, table, _ in sequences]
    for g, (group_config, sink_pages, initial_ring, tables) in enumerate(geometry):
        mine = np.zeros(num_pages, dtype=np.int64)
        if [table["length"] for _, table in tables] != lengths:
            raise SnapshotError(f"section 'tables': page group {g} has other sequence lengths than group 0")
        for seq_id, table in tables:
            pages = table["pages"]
            if pages.size and (pages.min() < 0 or pages.max() >= num_pages):
                raise SnapshotError(f"section 'tables': sequence {seq_id} holds a page id outside "
                                    f"[0, {num_pages - 1}]")
            np.add.at(mine, pages, 1)
            _check_table_geometry(seq_id, table, group_config, sink_pages, initial_ring)
        both = np.flatnonzero((mine > 0) & (owner >= 0))
        if both.size:
            raise SnapshotError(f"section 'tables': page {int(both[0])} is held by page groups "
                                f"{int(owner[both[0]])} and {g}")
        owner[mine > 0] = g
        held += mine
    bad = np.flatnonzero(held != ref_counts)
    if bad.size:
        page = int(bad[0])
        holders = sorted({seq_id for seq_id, table in all_tables if (table["pages"] == page).any()})
        raise SnapshotError(f"section 'tables': page {page} has ref count {int(ref_counts[page])} in section "
                            f"'pool' but {int(held[page])} page-table entries (held by sequences {holders})")

    prefix = state["prefix"]
    if prefix is not None:
        pages = prefix["pages"]
        n = pages.shape[0]
        if (prefix["hashes"].shape != (n, 2) or prefix["has_tokens"].shape != (n,)
                or prefix["tokens"].shape != (n, page_size)):
            raise SnapshotError(f"section 'prefix': expected pages (n,), hashes (n, 2), has_tokens (n,) and "
                                f"tokens (n, {page_size}) for the {n} cached pages")
        if n and (pages.min() < 0 or pages.max() >= num_pages or (np.diff(pages) <= 0).any()):
            raise SnapshotError(f"section 'prefix': cached pages are not increasing ids in [0, {num_pages - 1}]")
        if (prefix["has_tokens"] > 1).any():
            raise SnapshotError("section 'prefix': a has_tokens flag other than 0 or 1")
        if n > 1 and np.unique(prefix["hashes"], axis=0).shape[0] != n:
            raise SnapshotError("section 'prefix': two cached pages have the same hash")

    sealed = parsed.section("sealed")
    flags = sealed.array("sealed", np.uint8, 1, (num_pages,))
    if (flags > 1).any():
        raise sealed.error(f"page {int(np.flatnonzero(flags > 1)[0])} has a seal flag other than 0 or 1")
    if config["page_checksums"]:
        recorded = sealed.array("checksums", np.uint64, 1, (num_pages,))
        # A sealed page's recorded checksum is what save wrote to the checksum table (which the pages are
        # checked against): a forged one would make verify_pages() blame a good page, and the next save
        # write a file that does not load.
        wrong = np.flatnonzero((flags == 1) & (recorded != parsed.checksums))
        if wrong.size:
            page = int(wrong[0])
            raise sealed.error(f"page {page} is sealed with recorded checksum {int(recorded[page]):#018x} but the "
                               f"page checksum table has {int(parsed.checksums[page]):#018x}"
                               + (f" (and {wrong.size - 1} more pages)" if wrong.size > 1 else ""))
    elif "checksums" in sealed.arrays:
        raise sealed.error("recorded checksums in a cache without page_checksums")
    sealed.int("pages_sealed")


def _check_table_geometry(seq_id: int, table: dict, config: dict, sink_pages: int, initial_ring: int) -> None:
    """One sequence's page-table fields against the window, sink pages and pool.

    The held pages must cover exactly what the release rule leaves (DESIGN.md,
    "Page tables and the sliding window"; the core's ``PageTable._check_state``
    checks the same): the sink pages ``0 .. min(S, logical) - 1``, then window
    pages from ``ring_first`` to the last logical page, ``ring_first`` at
    least ``S`` and at most the page of the oldest position the next query
    attends to. A forged length or ring start would otherwise hand the next
    append a slot in a page the table does not hold.

    Not redundant with the core's check, which comes table by table as the
    throwaway cache builds each table's sink array and first ring: a forged
    negative ring capacity would cancel the other tables' bytes in the bound
    of :func:`_check_before_build` and let every table before it be built
    (``test_negative_ring_capacity_cannot_cancel_the_bound_of_other_page_tables``).
    Checked here, every capacity is known before any page table exists.
    """
    length, sink_count, ring_first, capacity = (table[key] for key in ("length", "sink_count", "ring_first",
                                                                       "ring_capacity"))
    ring_count = table["pages"].shape[0] - sink_count
    page_size, window = config["page_size"], config["window"]

    def fail(text: str) -> SnapshotError:
        """The error naming this sequence's page table."""
        return SnapshotError(f"section 'tables': sequence {seq_id}: {text}")

    if not 0 <= length <= 2**62:
        raise fail(f"length {length} outside [0, 2**62]")
    logical = _ceil_div(length, page_size)
    if sink_count != min(sink_pages, logical) or ring_count < 0:
        raise fail(f"{sink_count} sink pages of {table['pages'].shape[0]} held, expected the "
                   f"{min(sink_pages, logical)} sink pages of {length} tokens")
    if window == -1:
        if ring_first != 0 or ring_count != logical:
            raise fail(f"a sequence without a window holds all its {logical} pages, got {ring_count} from "
                       f"logical page {ring_first}")
    else:
        oldest = max(sink_pages, max(length - window + 1, 0) // page_size)
        end = max(logical, sink_pages)
        if not sink_pages <= ring_first <= oldest or ring_first + ring_count != end:
            raise fail(f"{ring_count} window pages from logical page {ring_first} do not cover {length} tokens "
                       f"(expected window pages from a logical page in [{sink_pages}, {oldest}] to logical page "
                       f"{end - 1})")
    largest = max(initial_ring, 4 * (config["num_pages"] + 16))
    if not max(ring_count, 1) <= capacity <= largest or capacity & (capacity - 1):
        raise fail(f"ring capacity {capacity}, expected a power of two in [{max(ring_count, 1)}, {largest}]")


def _restore(cache, state: dict, parsed: _Parsed, invariants: bool = False) -> None:
    """Apply a checked state to a new cache; with ``invariants``, check the result as a live cache is checked.

    The core checks the state again as it applies it (each error names its
    section), the seal flags and recorded checksums follow, and (with
    ``invariants``) the built cache must pass ``check_invariants()``; every
    failure is a SnapshotError. A load checks the invariants on the
    throwaway cache of :func:`_check_state_without_pool`, built from the same
    state by the same code, so not a second time on the cache it returns.
    """
    from pagedkv_c._kv_cache import StateError

    try:
        cache._restore_state(state)
    except StateError as exc:
        raise SnapshotError(f"section {exc.section!r}: {exc}") from None
    sealed = parsed.section("sealed")
    try:
        cache._restore_sealed_state(sealed.array("sealed", np.uint8, 1), sealed.arrays.get("checksums"),
                                    sealed.int("pages_sealed"))
    except (ValueError, TypeError) as exc:
        raise SnapshotError(f"section 'sealed': {exc}") from None
    if not invariants:
        return
    try:
        cache.check_invariants()
    except AssertionError as exc:  # a state the checks above let through: refuse it all the same
        raise SnapshotError(f"section 'tables': the restored cache is inconsistent: {exc}") from None


def _check_state_without_pool(state: dict, parsed: _Parsed) -> None:
    """Run every check a load runs on the state (the core's included) on a throwaway cache without K/V.

    The cache has ``num_layers`` 0, so only the page records, the prefix
    index and the page tables are allocated, as a load would; the K/V pool is
    not. A cache with per-layer attention settings keeps its layers (its page
    groups follow from them) with one KV head of one float16 element: a pool
    of ``4 * G * num_pages * page_size`` bytes, never more than the file's
    ``pages`` section. :func:`load_cache` and :func:`verify` both run it before they read
    a page, so they refuse the same files.
    """
    from pagedkv_c._kv_cache import KVCache

    if state["config"]["layer_attention"] is None:
        config = dict(state["config"], num_layers=0)
    else:  # the page groups need their layers: the smallest pool of the same groups instead
        config = dict(state["config"], num_kv_heads=1, head_dim=1, dtype="float16")
    throwaway = KVCache(**_cache_kwargs(config))
    _restore(throwaway, dict(state, config=config), parsed, invariants=True)


def verify(path) -> None:
    """Run every check :func:`load_cache` runs on a snapshot file, then check every page checksum.

    The state is applied to a throwaway cache without K/V (the core's checks
    and ``check_invariants()`` included), so ``verify`` refuses exactly the
    files ``load_cache`` refuses; the pool is not allocated.

    Use it on a file loaded with ``KVCache.load(path, mmap=True)``, whose
    pages are not read at load time: the map's untouched pages are the
    file's bytes.

    Raises
    ------
    SnapshotError
        The first mismatch found (as :func:`load_cache`).
    """
    with open(path, "rb", buffering=0) as f:  # unbuffered: the pages are read straight into the pool
        parsed, state, tables, shape = _checked_cache_file(f, path)
        config = state["config"]
        if parsed.pages_length:
            kv = np.memmap(f, dtype=_pool_dtype(config), mode="r", offset=parsed.pages_offset, shape=shape)
        else:
            kv = np.zeros(shape, dtype=_pool_dtype(config))
        _check_pages(kv, parsed.checksums, tables, "")


# --------------------------------------------------------- one sequence
def export_sequence(cache, seq_id) -> bytes:
    """One sequence of a ``KVCache`` with its K/V, as bytes (the container format, magic ``PKVSEQ``).

    Other threads may go on using the cache: the sequence's page table, hash
    chain and a copy of its pages are taken in one hold of the cache's lock,
    and the page checksums are computed from that copy.

    Raises
    ------
    KeyError
        Unknown ``seq_id``.
    """
    table, hashes, kv = cache._export_sequence_state(seq_id)
    config = cache._config()
    sections = [("config", _config_section(config)), ("tables", _tables_section([(0, table, hashes)]))]
    if hashes is not None:
        sections.append(("hashes", _hashes_section([(0, table, hashes)])))
    checksums = page_checksums(kv, np.arange(kv.shape[1], dtype=np.int32)).astype("<u8").tobytes()
    prefix, length = _container(MAGIC_SEQUENCE, sections, checksums, kv.nbytes, 8)
    out = bytearray(length)
    out[:len(prefix)] = prefix
    out[len(prefix):] = _pool_bytes(kv)
    return bytes(out)


def import_sequence(cache, seq_id, data, *, extra_key=None) -> None:
    """Add ``seq_id`` to ``cache`` from :func:`export_sequence` bytes, all or nothing.

    The layer, head, dim, dtype and page-size geometry, the window and the
    sink tokens must equal the cache's. Pages are taken from the cache's free
    queue (least recently freed first, evicting cached prefixes as an append
    would). With prefix caching on both sides and the same hash function,
    the hash chain comes along and the sequence's full pages become cached.

    The bytes are not trusted (see the module notes): the page table must
    cover exactly what its length, window and sinks say, and the hash chain
    must be salted with this cache's digest of ``extra_key`` and follow from
    the kept token (or block) ids, hashed again here. So bytes cannot plant
    K/V under another tenant's salt; their K/V for their own token ids are
    taken as given (nothing can check them) and, cached under ``extra_key``,
    serve that tenant's matching prompts.

    Parameters
    ----------
    cache : pagedkv.KVCache
    seq_id : int
    data : bytes-like
    extra_key : str, bytes, int or None
        The salt the sequence was added with (``add_sequence``'s
        ``extra_key``). Where the chain is dropped (another hash function,
        or no prefix caching in the source), the sequence's later pages are
        salted with it.

    Raises
    ------
    SnapshotError
        ``data`` is damaged, forged, not an exported sequence, or of another
        geometry; or its chain was salted with another ``extra_key``.
    OutOfPagesError
        The cache has fewer free pages than the sequence holds (or fewer
        pages in all); nothing changed.
    ValueError
        ``seq_id`` already exists or is outside int64.
    TypeError
        ``seq_id`` is not an integer.
    """
    seq_id = checked_int(seq_id, "seq_id", -2**63, 2**63 - 1)
    view = memoryview(data).cast("B")
    parsed = _parse(lambda offset, length: bytes(view[offset:offset + length]), len(view), MAGIC_SEQUENCE,
                    "the exported sequence")
    num_pages = parsed.checksums.shape[0]
    source = _read_config(parsed.section("config"), None, parsed.version)
    target = cache._config()
    for key in ("num_layers", "num_kv_heads", "head_dim", "page_size", "dtype", "window", "sink_tokens",
                "layer_attention"):
        if source[key] != target[key]:
            raise SnapshotError(f"section 'config': the sequence has {key} {source[key]!r}, this cache "
                                f"{target[key]!r}; a sequence moves only between caches of the same geometry")
    shape = _pool_shape(source, num_pages)
    pool_dtype = _pool_dtype(source)
    expected = int(np.prod(shape, dtype=object)) * pool_dtype.itemsize
    if parsed.pages_length != expected:
        raise SnapshotError(f"section 'pages': {parsed.pages_length} bytes, expected {expected}")
    tables = _read_tables(parsed.section("tables"), num_pages)
    if len(tables) != 1 or tables[0][1]["pages"].shape[0] != num_pages:
        raise SnapshotError("section 'tables': expected one sequence holding every exported page")
    hashes = None
    if "hashes" in parsed.sections:
        hashes = _read_hashes(parsed.section("hashes"), 1)[0]
        if not (target["prefix_caching"] and source["prefix_hash"] == target["prefix_hash"]):
            hashes = None  # this cache hashes otherwise (or not at all): the chain would not match
    start = parsed.pages_offset
    kv = np.frombuffer(view, dtype=pool_dtype, count=expected // pool_dtype.itemsize,
                       offset=start).reshape(shape) if expected else np.zeros(shape, dtype=pool_dtype)
    kv = np.ascontiguousarray(kv)
    _check_pages(kv, parsed.checksums, [(seq_id, tables[0][1])], "exported")
    if seq_id in cache:
        raise ValueError(f"Invalid value of seq_id: sequence {seq_id} already exists")
    from pagedkv_c._kv_cache import StateError

    try:
        cache._import_sequence_state(seq_id, tables[0][1], hashes, kv, extra_key)
    except StateError as exc:  # the sequence's own fields do not fit this cache, or its chain is forged
        raise SnapshotError(f"section {exc.section!r}: {exc}") from None
