"""The snapshot container: header, section table, metadata sections, page checksums, pages.

What every snapshot file is, whatever it holds (the layout is described in
:mod:`pagedkv.snapshot`): encoding and decoding of named arrays, the checks a
reader runs before it trusts a byte of a section, and the file I/O (atomic
replace, positional reads and writes shared by two threads). Which sections a
``KVCache`` or a ``PagedKVCache`` stores, and what they mean, is for
:mod:`pagedkv.snapshot` and :mod:`pagedkv._snapshot_classic`.
"""
from __future__ import annotations

import os
import struct
import tempfile
import threading
from typing import Any

import numpy as np

from pagedkv_c._file_io import start_writeback
from pagedkv_c._prefix import xxh3_128_intdigest

FORMAT_VERSION = 2  # written (pagedkv.snapshot documents it)
OLDEST_FORMAT_VERSION = 1  # the oldest version read: versions OLDEST_FORMAT_VERSION .. FORMAT_VERSION load
MAGIC_CACHE = b"PKVSNAP\x00"
MAGIC_SEQUENCE = b"PKVSEQ\x00\x00"
MAGIC_CLASSIC = b"PKVCLAS\x00"
_KINDS = {MAGIC_CACHE: "KVCache snapshot", MAGIC_SEQUENCE: "exported sequence", MAGIC_CLASSIC: "PagedKVCache snapshot"}
_HEADER = struct.Struct("<8sIIIIQQ16s")  # 56 bytes, then the header checksum (u64)
_HEADER_BYTES = 64
_ENTRY = struct.Struct("<16sQQQ")
_PAGE_ALIGN = 4096
_DTYPES = {1: np.dtype("<i4"), 2: np.dtype("<i8"), 3: np.dtype("<u8"), 4: np.dtype("u1")}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}
_MASK64 = (1 << 64) - 1
# Sections of each kind of file, in order ("?" marks an optional one).
_LAYOUTS = {
    MAGIC_CACHE: ("config", "counters", "pool", "?prefix", "tables", "?hashes", "sealed", "checksums", "pages"),
    MAGIC_SEQUENCE: ("config", "tables", "?hashes", "checksums", "pages"),
    MAGIC_CLASSIC: ("config", "counters", "state", "checksums", "pages"),
}


class SnapshotError(ValueError):
    """A snapshot file or exported sequence is damaged, truncated or of an unknown format.

    The message names the section (and for a page its id and the sequences
    holding it). Raised before anything is built or changed.
    """
    __module__ = "pagedkv.snapshot"  # its public home: tracebacks and pickles name it there


def _checksum(data) -> int:
    """Low 64 bits of XXH3-128 of a bytes-like object (the core's C implementation)."""
    view = memoryview(data).cast("B")
    return xxh3_128_intdigest(view) & _MASK64


# ---------------------------------------------------------------- metadata
def _encode(arrays: dict[str, Any]) -> bytes:
    """Serialize named arrays (int32/int64/uint64/uint8, ints as 0-d int64) into a metadata section."""
    out = bytearray()
    for name, value in arrays.items():
        if isinstance(value, str):
            value = np.frombuffer(value.encode("ascii"), dtype=np.uint8)
        array = np.asarray(np.asarray(value, dtype=np.int64) if isinstance(value, (int, bool, np.integer))
                           else value, order="C")  # (ascontiguousarray would make a scalar 1-D)
        dtype = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
        code = _CODES[np.dtype(dtype.str)]
        raw = name.encode("ascii")
        out += struct.pack("<HBB", len(raw), code, array.ndim) + raw
        out += bytes(-len(out) % 8)
        out += struct.pack(f"<{array.ndim}Q", *array.shape)
        out += array.astype(_DTYPES[code], copy=False).tobytes()
        out += bytes(-len(out) % 8)
    return bytes(out)


def _decode(section: str, data: bytes) -> dict[str, np.ndarray]:
    """Parse a metadata section; every length is checked against the section before use."""
    arrays: dict[str, np.ndarray] = {}
    pos, end = 0, len(data)

    def fail(what: str) -> SnapshotError:
        """A SnapshotError naming the section, ``what`` is wrong and the byte offset reached."""
        return SnapshotError(f"section {section!r}: {what} at byte {pos}")

    while pos < end:
        if end - pos < 4:
            raise fail("truncated entry header")
        name_length, code, ndim = struct.unpack_from("<HBB", data, pos)
        if code not in _DTYPES or ndim > 4:
            raise fail(f"unknown dtype code {code} or ndim {ndim}")
        name_end = pos + 4 + name_length
        shape_at = name_end + (-name_end % 8)
        if shape_at + 8 * ndim > end:
            raise fail("truncated entry")
        try:
            name = data[pos + 4:name_end].decode("ascii")
        except UnicodeDecodeError:
            raise fail("non-ASCII entry name") from None
        shape = struct.unpack_from(f"<{ndim}Q", data, shape_at)
        count = 1
        for extent in shape:
            count *= extent
        dtype = _DTYPES[code]
        start = shape_at + 8 * ndim
        if count * dtype.itemsize > end - start:  # Python ints: no overflow
            raise fail(f"entry {name!r} of shape {shape} runs past the section's {end} bytes")
        if name in arrays:
            raise fail(f"entry {name!r} appears twice")
        try:  # an empty entry may claim any extents (e.g. (0, 2**63)), more than NumPy can shape
            arrays[name] = np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape).astype(
                dtype.newbyteorder("="))
        except ValueError:
            raise fail(f"entry {name!r} has a shape {shape} no array can have") from None
        pos = start + count * dtype.itemsize
        pos += -pos % 8
    return arrays


class _Section:
    """Typed access to a decoded metadata section; a missing or mistyped entry raises SnapshotError."""

    def __init__(self, name: str, arrays: dict[str, np.ndarray]):
        self.name = name
        self.arrays = arrays

    def error(self, text: str) -> SnapshotError:
        """A SnapshotError naming this section and ``text``."""
        return SnapshotError(f"section {self.name!r}: {text}")

    def array(self, key: str, dtype, ndim: int, shape: tuple | None = None) -> np.ndarray:
        """Entry ``key`` checked to be ``dtype`` with ``ndim`` dimensions and, where ``shape``
        gives an extent (None: any), that extent; raises SnapshotError otherwise."""
        value = self.arrays.get(key)
        if value is None:
            raise self.error(f"entry {key!r} is missing")
        if value.dtype != np.dtype(dtype) or value.ndim != ndim or (shape is not None and any(
                want is not None and have != want for have, want in zip(value.shape, shape))):
            raise self.error(f"entry {key!r} is {value.dtype} {value.shape}, expected {np.dtype(dtype)} "
                             f"{shape if shape is not None else f'{ndim}-D'}")
        return value

    def int(self, key: str, low: int = 0, high: int = 2**63 - 1) -> int:
        """Scalar int64 entry ``key`` checked to lie in ``[low, high]``; raises SnapshotError otherwise."""
        value = int(self.array(key, np.int64, 0))
        if not low <= value <= high:
            raise self.error(f"entry {key!r} is {value}, expected {low} <= {key} <= {high}")
        return value

    def text(self, key: str, allowed: tuple[str, ...]) -> str:
        """ASCII entry ``key`` (uint8 bytes) checked to be one of ``allowed``; raises SnapshotError otherwise."""
        raw = self.array(key, np.uint8, 1).tobytes()
        value = raw.decode("ascii", errors="replace")
        if value not in allowed:
            raise self.error(f"entry {key!r} is {value!r}, expected one of {allowed}")
        return value


# --------------------------------------------------------------- container
def _container(magic: bytes, sections: list[tuple[str, Any]], page_checksums_bytes: bytes,
               page_bytes: int, align: int) -> tuple[bytes, int]:
    """Header, section table and metadata for ``sections`` followed by ``checksums`` and ``pages``.

    Returns the bytes to write before the pages and the file length. The
    pages (``page_bytes`` long) follow, aligned to ``align`` bytes.
    """
    metadata = [(tag, bytes(payload)) for tag, payload in sections] + [("checksums", page_checksums_bytes)]
    num_sections = len(metadata) + 1
    offset = _HEADER_BYTES + num_sections * _ENTRY.size
    table = bytearray()
    for tag, payload in metadata:
        table += _ENTRY.pack(tag.encode("ascii"), offset, len(payload), _checksum(payload))
        offset += len(payload)
    pages_offset = offset + (-offset % align)
    table += _ENTRY.pack(b"pages", pages_offset, page_bytes, _checksum(page_checksums_bytes))
    file_length = pages_offset + page_bytes
    head = _HEADER.pack(magic, FORMAT_VERSION, _HEADER_BYTES, num_sections, 0, file_length,
                        _checksum(table), bytes(16))
    head += struct.pack("<Q", _checksum(head))
    prefix = bytearray(head + table)
    for _, payload in metadata:
        prefix += payload
    prefix += bytes(pages_offset - len(prefix))
    return bytes(prefix), file_length


class _Parsed:
    """A verified container: its metadata sections and where its pages lie."""

    def __init__(self, magic: bytes, sections: dict[str, dict[str, np.ndarray]], checksums: np.ndarray,
                 pages_offset: int, pages_length: int, version: int = FORMAT_VERSION):
        self.magic = magic
        self.version = version
        self.sections = sections
        self.checksums = checksums
        self.pages_offset = pages_offset
        self.pages_length = pages_length

    def section(self, name: str) -> _Section:
        """The metadata section ``name`` (its arrays and integers, checksum already verified)."""
        return _Section(name, self.sections[name])


def _parse(read, size: int, expected: bytes, source: str) -> _Parsed:
    """Read and verify everything but the page bytes of a container of ``size`` bytes.

    ``read(offset, length)`` returns bytes. Checks, in order: length, magic,
    version, header checksum, section table (checksum, tags, order,
    contiguity, zero padding, ``file_length`` equal to ``size``), then every
    metadata section's checksum and the page checksum table.
    """
    if size < _HEADER_BYTES:
        raise SnapshotError(f"section 'header': {source} is truncated ({size} bytes, a header needs {_HEADER_BYTES})")
    head = read(0, _HEADER_BYTES)
    magic, version, header_bytes, num_sections, zero, file_length, table_checksum, reserved = _HEADER.unpack_from(head)
    if magic != expected:
        kind = _KINDS.get(magic)
        raise SnapshotError(f"section 'header': {source} is "
                            f"{'a ' + kind if kind else 'not a pagedkv file (bad magic ' + repr(magic) + ')'}, "
                            f"expected a {_KINDS[expected]}")
    if version > FORMAT_VERSION:
        raise SnapshotError(f"section 'header': format version {version} is newer than this pagedkv reads "
                            f"({FORMAT_VERSION}); upgrade pagedkv to load it")
    if version < OLDEST_FORMAT_VERSION:
        raise SnapshotError(f"section 'header': unknown format version {version} (this pagedkv reads "
                            f"{OLDEST_FORMAT_VERSION} to {FORMAT_VERSION})")
    if struct.unpack_from("<Q", head, 56)[0] != _checksum(head[:56]):
        raise SnapshotError("section 'header': checksum mismatch (the header is damaged)")
    layout = _LAYOUTS[expected]
    if header_bytes != _HEADER_BYTES or zero or reserved != bytes(16) or not 2 <= num_sections <= len(layout):
        raise SnapshotError(f"section 'header': invalid header fields (header_bytes {header_bytes}, "
                            f"{num_sections} sections)")
    if file_length != size:
        raise SnapshotError(f"section 'header': {source} is {size} bytes but its header says {file_length} "
                            f"({'truncated' if size < file_length else 'bytes appended after the end'})")
    table_end = _HEADER_BYTES + num_sections * _ENTRY.size
    if table_end > size:
        raise SnapshotError("section 'table': the section table runs past the end of the file")
    table = read(_HEADER_BYTES, table_end - _HEADER_BYTES)
    if _checksum(table) != table_checksum:
        raise SnapshotError("section 'table': checksum mismatch (the section table is damaged)")
    entries = [_ENTRY.unpack_from(table, i * _ENTRY.size) for i in range(num_sections)]
    tags = [entry[0].rstrip(b"\x00").decode("ascii", errors="replace") for entry in entries]
    wanted = [name.lstrip("?") for name in layout]
    position = 0
    for tag in tags:
        while position < len(layout) and layout[position].startswith("?") and wanted[position] != tag:
            position += 1
        if position >= len(layout) or wanted[position] != tag:
            raise SnapshotError(f"section {tag!r}: unexpected section (expected the order {wanted})")
        position += 1
    missing = [name for name in layout[position:] if not name.startswith("?")]
    if missing:
        raise SnapshotError(f"section {missing[0]!r}: missing")
    offset = table_end
    sections: dict[str, dict[str, np.ndarray]] = {}
    checksums = None
    for tag, (_, start, length, checksum) in zip(tags, entries):
        if tag == "pages":
            if start < offset or start - offset >= _PAGE_ALIGN or start + length != size:
                raise SnapshotError(f"section 'pages': lies at [{start}, {start + length}), expected it to start "
                                    f"within {_PAGE_ALIGN} bytes after byte {offset} and end at {size}")
            if start > offset and any(read(offset, start - offset)):
                raise SnapshotError("section 'pages': the padding before it is not zeros (damaged)")
            if checksums is None or checksum != _checksum(checksums):
                raise SnapshotError("section 'pages': checksum of the page checksum table does not match")
            return _Parsed(expected, sections, checksums, start, length, version)
        if start != offset or length > size - start:
            raise SnapshotError(f"section {tag!r}: lies at [{start}, {start + length}), expected it to start at "
                                f"{offset} inside the file's {size} bytes")
        data = read(start, length)
        if _checksum(data) != checksum:
            raise SnapshotError(f"section {tag!r}: checksum mismatch (the section is damaged)")
        if tag == "checksums":
            if length % 8:
                raise SnapshotError(f"section 'checksums': {length} bytes is not a whole number of uint64")
            checksums = np.frombuffer(data, dtype="<u8").astype(np.uint64)
        else:
            sections[tag] = _decode(tag, data)
        offset = start + length
    raise SnapshotError("section 'pages': missing")  # unreachable: the layout ends with pages


def _write_all(write, data) -> None:
    """Call ``write(view)`` (returning the bytes written) until all of ``data`` is written: a raw write may be partial."""
    view = memoryview(data)
    done = 0
    while done < len(view):
        done += write(view[done:])


def _read_from_file(f):
    """``read(offset, length) -> bytes`` over the open file ``f``; a short read raises SnapshotError."""
    def read(offset: int, length: int) -> bytes:
        """``length`` bytes of the file from byte ``offset``."""
        f.seek(offset)
        data = f.read(length)
        if len(data) != length:
            raise SnapshotError(f"section at byte {offset}: the file changed while it was read (short read)")
        return data
    return read


def _readinto(f, offset: int, target: np.ndarray) -> None:
    """Fill ``target``'s bytes from the file at ``offset`` (a contiguous array)."""
    view = memoryview(target.reshape(-1).view(np.uint8)) if target.size else memoryview(b"")
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise SnapshotError("section 'pages': the file ended early while reading pages")
        done += n


def _atomic_write(path, parts, finish=None, check=None) -> None:
    """Write the buffers ``parts`` to ``path`` atomically (temp file, fsync, rename, fsync the directory).

    ``path`` is only ever replaced by a rename, never opened for writing: a
    process that mapped the old file (``load(mmap=True)``) keeps its bytes.
    A callable part is called with the open (unbuffered) file and writes its own bytes.

    ``finish(fd)``, if given, runs after the parts are written and before
    the fsync (to overwrite a placeholder at the start of the file).
    ``check(temp_path)``, if given, runs after the fsync and before the
    rename; an exception from any of them removes the temporary file and
    leaves ``path`` as it was.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb", buffering=0) as f:
            for part in parts:
                if callable(part):  # writes its own bytes
                    part(f)
                    continue
                view = memoryview(part).cast("B") if not isinstance(part, bytes) else part
                written = 0
                while written < len(view):  # a raw write may be partial
                    written += f.write(view[written:])
            if finish is not None:
                finish(f.fileno())
            os.fsync(f.fileno())
        if check is not None:
            check(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
    """Make a rename in ``directory`` durable (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _pool_bytes(kv: np.ndarray):
    """The pool's bytes as a flat buffer (no copy), or b"" when it is empty."""
    return memoryview(kv.reshape(-1).view(np.uint8)) if kv.size else b""


#: Bytes written between two requests to start their write-back to the disk.
_WRITEBACK_BYTES = 32 << 20


def _each_run(runs: list, work, threads: int) -> None:
    """Call ``work(run)`` once for every run, the runs taken in file order.

    With two threads the calling thread and a helper thread each take the
    next run from a shared queue and do all of its work (read and hash, or
    hash and write), so neither hands a run to the other or waits for it
    between runs; the first error stops both and is raised here once the
    helper has finished.
    """
    if threads == 1 or len(runs) < 2:
        for run in runs:
            work(run)
        return
    queue = iter(runs)
    lock = threading.Lock()
    errors: list[BaseException] = []
    stop = [False]  # set when the calling thread leaves (also on an interrupt while it waits)

    def worker() -> None:
        """Do runs until the queue is empty, a thread failed or the calling thread left."""
        while True:
            with lock:
                run = None if errors or stop[0] else next(queue, None)
            if run is None:
                return
            try:
                work(run)
            except BaseException as exc:  # re-raised in the calling thread
                with lock:
                    errors.append(exc)
                return

    helper = threading.Thread(target=worker, name="pagedkv-snapshot", daemon=True)
    helper.start()
    try:
        worker()
    finally:
        stop[0] = True
        helper.join()
    if errors:
        raise errors[0]


def _positional_reader(f):
    """``read_at(view, offset)``: fill ``view`` with the file's bytes from ``offset``; callable from two threads.

    ``os.preadv`` where the platform has it (the threads read at once, the
    file position untouched); elsewhere a seek and reads under a lock. A file
    that ends early raises SnapshotError.
    """
    fd = f.fileno()
    preadv = getattr(os, "preadv", None)
    lock = threading.Lock()

    def fill(view: memoryview, offset: int, read) -> None:
        """Fill ``view`` by calls of ``read(rest_of_view, file_offset)``, each returning the bytes read."""
        done = 0
        while done < len(view):
            n = read(view[done:], offset + done)
            if not n:
                raise SnapshotError(f"section 'pages': the file ended early while reading pages (at byte "
                                    f"{offset + done})")
            done += n

    def read_at(view: memoryview, offset: int) -> None:
        """Fill ``view`` from byte ``offset`` of the file."""
        if preadv is not None:
            fill(view, offset, lambda rest, at: preadv(fd, [rest], at))
            return
        with lock:
            f.seek(offset)
            fill(view, offset, lambda rest, at: f.readinto(rest))

    return read_at


def _positional_writer(f):
    """``write_at(view, offset)``: write ``view`` at byte ``offset`` of the file; callable from two threads.

    One write at a time (a lock): ``os.pwrite`` where the platform has it,
    else a seek and writes. Each time ``_WRITEBACK_BYTES`` more are written
    the kernel is asked to start writing them to the disk
    (:func:`pagedkv_c._file_io.start_writeback`, Linux only), so the disk
    works while later runs are written and the final fsync has little left
    to wait for.
    """
    fd = f.fileno()
    pwrite = getattr(os, "pwrite", None)
    lock = threading.Lock()
    unflushed = [None]  # first byte written since the last write-back request

    def write_at(view: memoryview, offset: int) -> None:
        """Write all of ``view`` from byte ``offset`` of the file."""
        with lock:
            if pwrite is None:
                f.seek(offset)
                _write_all(f.write, view)
            else:
                done = 0
                while done < len(view):
                    done += pwrite(fd, view[done:], offset + done)
            end = offset + len(view)
            if unflushed[0] is None:
                unflushed[0] = offset
            if end - unflushed[0] >= _WRITEBACK_BYTES:
                start_writeback(fd, unflushed[0], end - unflushed[0])
                unflushed[0] = end

    return write_at
