"""KV events of the prefix cache: the bounded C log, the drained events and their encoding.

The core records one event per page that enters the prefix index
(``BlockStored``), per cached page that leaves it (``BlockRemoved``: evicted
when the allocator hands the page out again, or dropped from the index
because its content is about to change) and per reset of the index
(``AllBlocksCleared``), in the order they happen, into a bounded C log
(``kv_events.h``). A drain hands the log's records over as a
:class:`KVEvents` (no copy), which converts them to Python tuples or encodes
them, without the GIL, as vLLM's ``KVEventBatch`` (``kv_events_msgpack.h``;
:mod:`pagedkv.events` documents the wire format). The event kinds and fields
are those of vLLM's KV events (``vllm/distributed/kv_events.py``).
"""
cimport cython
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF
from libc.stdlib cimport free
from libc.stdint cimport INT64_MAX, uint8_t
from pagedkv_c._checks cimport check_int

cdef extern from "kv_events_msgpack.h":
    size_t pkv_kv_events_encode_bound(int64_t num_units, int64_t num_events, int64_t num_tokens,
                                      size_t medium_len) noexcept nogil
    size_t pkv_kv_events_encode(const pkv_kv_unit* units, int64_t num_units, int64_t num_events,
                                const int32_t* tokens, int64_t page_size, double ts, int64_t rank,
                                const char* medium, size_t medium_len, int64_t window, int hash_bytes,
                                uint8_t* out) noexcept nogil

cdef extern from "populate.h":
    size_t PKV_OS_PAGE
    void* pkv_page_alloc(size_t n) noexcept nogil
    void pkv_page_free(void* p) noexcept nogil
    int pkv_populate_write(void* p, size_t n) noexcept nogil

cdef extern from "Python.h":
    int PyBuffer_FillInfo(Py_buffer* view, object exporter, void* buf, Py_ssize_t length, int readonly,
                          int flags) except -1
    # Raw forms: the payload is encoded into a new bytes object and shrunk in place.
    PyObject* _bytes_new "PyBytes_FromStringAndSize"(const char* data, Py_ssize_t size) except NULL
    char* _bytes_data "PyBytes_AS_STRING"(PyObject* b) noexcept
    int _PyBytes_Resize(PyObject** b, Py_ssize_t size) except -1

HASH_FORMATS = ("int", "bytes")


cdef class KVEventLog:
    """Bounded, ordered log of prefix-cache events of one :class:`KVCache`.

    Made by ``KVCache(..., enable_kv_events=True)``; drained by
    :meth:`KVCache.take_kv_events`.

    Parameters
    ----------
    capacity : int
        Most events kept between two drains, ``1 <= capacity <= 2**31``. The
        log grows by doubling (16 bytes per page event and 16 or 32 more
        per event as vLLM counts them, plus ``4 * page_size`` bytes of
        token ids per stored page that has them).
    page_size : int
        Tokens per page, ``>= 1``.

    Notes
    -----
    A full log drops new events and counts them; recording never blocks.
    """

    def __cinit__(self, capacity, page_size):
        # Named as KVCache names them: the log is made by the cache.
        self.log.capacity = check_int(capacity, "kv_events_capacity", 1, 2**31)
        self.log.page_size = check_int(page_size, "page_size", 1, 2**31 - 1)
        pkv_kv_events_reset(&self.log)  # no open event

    def __dealloc__(self):
        pkv_kv_events_free(&self.log)

    @property
    def capacity(self):
        """Most page events kept between two drains (int)."""
        return self.log.capacity

    @property
    def num_pending(self):
        """Page events recorded since the last drain (int)."""
        return self.log.count

    @property
    def total_recorded(self):
        """Page events recorded over the cache's life (int), dropped ones excluded."""
        return pkv_kv_events_total_recorded(&self.log)

    @property
    def total_dropped(self):
        """Page events dropped because the log was full, over the cache's life (int)."""
        return self.log.total_dropped

    cdef object take(self):
        """The recorded events as a :class:`KVEvents` and the number dropped; the log starts empty."""
        cdef KVEvents out = KVEvents.__new__(KVEvents)
        out.page_size = self.log.page_size
        out.num_dropped = self.log.dropped
        pkv_kv_events_close(&self.log)
        if self.log.count:
            out.num_records = self.log.count
            out.num_units = self.log.num_units
            out.num_tokens = self.log.num_tokens
            out.num_events = self.log.num_events
            out.num_pages_stored = self.log.num_stored
            out.num_pages_removed = self.log.num_removed
            pkv_kv_events_detach(&self.log, &out.units, &out.allocated, &out.tokens, &out.token_allocated)
            out.log = self
        else:
            pkv_kv_events_reset(&self.log)
        return out, out.num_dropped


cdef class KVEvents:
    """Prefix-cache KV events drained from a cache, in the order they happened.

    Returned by :meth:`pagedkv.KVCache.take_kv_events`; cannot be created
    directly. ``len(events)`` is the number of events as vLLM counts them:
    consecutive pages stored for one sequence form one ``BlockStored``,
    consecutive removals one ``BlockRemoved``.

    Attributes
    ----------
    num_records : int
        Page-level records (a ``BlockStored`` of k pages counts k).
    num_pages_stored, num_pages_removed : int
        Pages that entered, and cached pages that left, the prefix cache.
    num_dropped : int
        Events the cache's log dropped (it was full) before this drain.
    page_size : int
        Tokens per page.
    """

    def __cinit__(self):
        self.units = NULL
        self.tokens = NULL

    def __dealloc__(self):
        if self.log is not None:
            pkv_kv_events_give_back(&self.log.log, self.units, self.allocated, self.tokens, self.token_allocated)
        else:
            free(self.units)
            free(self.tokens)

    def __len__(self):
        return self.num_events

    def __iter__(self):
        return iter(self.tolist())

    def __repr__(self):
        return (f"KVEvents({self.num_events} events: {self.num_pages_stored} pages stored, "
                f"{self.num_pages_removed} removed, {self.num_dropped} dropped before)")

    def tolist(self):
        """The events as Python tuples tagged by vLLM's event names.

        Returns
        -------
        list of tuple
            ``("BlockStored", block_hashes, parent_block_hash, token_ids,
            block_size)``: ``block_hashes`` the 128-bit hashes (Python ints,
            ``hi << 64 | lo``, as ``PrefixIndex.page_hash`` gives them) of
            consecutive pages of one sequence, ``parent_block_hash`` the hash
            of the page before the first (None for a sequence's first page),
            ``token_ids`` their ``len(block_hashes) * page_size`` token ids
            (empty for pages keyed by external block ids, which carry none),
            ``block_size`` the page size in tokens;
            ``("BlockRemoved", block_hashes)``; ``("AllBlocksCleared",)``.
        """
        cdef list events = []
        cdef list hashes
        cdef Py_ssize_t i = 0, j, n
        cdef uint64_t kind, flags
        cdef int64_t pages
        cdef int32_t* tok = self.tokens
        cdef pkv_kv_unit* u = self.units
        while i < self.num_units:
            flags = u[i].lo
            kind = flags & PKV_KV_KIND_MASK
            pages = <int64_t>u[i].hi
            i += 1
            if kind == PKV_KV_CLEARED:
                events.append(("AllBlocksCleared",))
                continue
            parent = None
            if kind == PKV_KV_STORED and flags & PKV_KV_HAS_PARENT:
                parent = (int(u[i].hi) << 64) | int(u[i].lo)
                i += 1
            hashes = [(int(u[j].hi) << 64) | int(u[j].lo) for j in range(i, i + pages)]
            i += pages
            if kind == PKV_KV_REMOVED:
                events.append(("BlockRemoved", hashes))
                continue
            ids = []
            if flags & PKV_KV_HAS_TOKENS:
                n = pages * self.page_size
                ids = [tok[j] for j in range(n)]
                tok += n
            events.append(("BlockStored", hashes, parent, ids, self.page_size))
        return events

    def encode(self, double ts, *, data_parallel_rank=0, window=None, medium="CPU", hash_format="int"):
        """Encode the events as one vLLM ``KVEventBatch`` (MessagePack), without the GIL.

        Parameters
        ----------
        ts : float
            Batch timestamp, seconds since the epoch.
        data_parallel_rank : int
            Rank written in the batch, ``0 <= data_parallel_rank < 2**63``.
        window : int or None
            The cache's sliding window in tokens (``0 <= window < 2**63``),
            or None for full attention: sets ``kv_cache_spec_kind`` and
            ``kv_cache_spec_sliding_window``.
        medium : str
            Storage tier named in every event (UTF-8).
        hash_format : str
            ``"int"`` (the low 64 bits of each 128-bit page hash, vLLM's
            integer form) or ``"bytes"`` (the 16-byte big-endian hash).

        Returns
        -------
        bytes
            ``[ts, events, data_parallel_rank]``; see :mod:`pagedkv.events`
            for the fields.

        Raises
        ------
        ValueError
            An argument out of range or an unknown ``hash_format``.
        TypeError
            ``medium`` is not a str, or ``data_parallel_rank`` or ``window``
            is not an integer (a bool or a float is refused).
        """
        cdef _EncodeOptions options = _EncodeOptions(data_parallel_rank, window, medium, hash_format)
        cdef size_t bound = self._encode_bound(options)
        # Encoded straight into a new bytes object, which nothing else sees
        # until it is returned, then shrunk to length in place.
        cdef PyObject* raw = _bytes_new(NULL, <Py_ssize_t>bound)
        cdef size_t length = self._encode_into(ts, options, <uint8_t*>_bytes_data(raw))
        _PyBytes_Resize(&raw, <Py_ssize_t>length)  # on failure it frees raw and raises MemoryError
        payload = <object>raw  # a second reference; the one _bytes_new made is dropped next
        Py_DECREF(payload)
        return payload

    cdef size_t _encode_bound(self, _EncodeOptions options) noexcept:
        """Most bytes :meth:`_encode_into` writes."""
        return pkv_kv_events_encode_bound(self.num_units, self.num_events, self.num_tokens, options.medium_len)

    cdef size_t _encode_into(self, double ts, _EncodeOptions options, uint8_t* out) noexcept:
        """Encode into ``out`` (``_encode_bound`` bytes) without the GIL; returns the bytes written."""
        cdef size_t length
        with nogil:
            length = pkv_kv_events_encode(self.units, self.num_units, self.num_events, self.tokens, self.page_size,
                                          ts, options.rank, options.medium_chars, options.medium_len,
                                          options.window_tokens, options.as_bytes, out)
        return length


@cython.auto_pickle(False)  # a pickle would forge medium_chars, a pointer into medium_utf8
cdef class _EncodeOptions:
    """The checked options of an encoding (see :meth:`KVEvents.encode`)."""

    def __cinit__(self, data_parallel_rank, window, medium, hash_format):
        if hash_format not in HASH_FORMATS:
            raise ValueError(f"Invalid value of hash_format: expected one of {HASH_FORMATS}, got {hash_format!r}")
        if not isinstance(medium, str):
            raise TypeError(f"Invalid type of medium: expected str, got {type(medium).__name__}")
        self.rank = check_int(data_parallel_rank, "data_parallel_rank", 0, INT64_MAX)
        self.window_tokens = -1 if window is None else check_int(window, "window", 0, INT64_MAX)
        self.medium_utf8 = medium.encode("utf-8")
        self.medium_chars = self.medium_utf8
        self.medium_len = len(self.medium_utf8)
        self.as_bytes = hash_format == "bytes"


@cython.auto_pickle(False)  # a pickle would forge the address of the memory it frees
cdef class _ArenaChunk:
    """One allocation of a :class:`PayloadArena`, freed with the last payload that points into it."""
    cdef uint8_t* data
    cdef size_t size, used        # bytes allocated, bytes handed out (from the start)
    cdef Py_ssize_t live          # payloads pointing into it

    def __dealloc__(self):
        pkv_page_free(self.data)


# Never in a reference cycle (it refers only to its chunk): untracked by the cycle collector,
# whose clearing would drop the chunk before __dealloc__ could count the payload gone.
@cython.no_gc
@cython.auto_pickle(False)  # a copy would point into the chunk without being counted in it
cdef class EncodedBatch:
    """An encoded ``KVEventBatch`` that a :class:`PayloadArena` holds: a read-only bytes-like object.

    Supports the buffer protocol (``memoryview``, ``bytes(batch)``, ZeroMQ
    sends without a copy) and ``len``. Cannot be created directly.
    """
    cdef _ArenaChunk chunk
    cdef size_t offset, length

    def __init__(self):
        raise TypeError("EncodedBatch cannot be created directly: PayloadArena.encode makes them")

    def __getbuffer__(self, Py_buffer* view, int flags):
        if self.chunk is None:  # made by EncodedBatch.__new__, bypassing __init__
            raise BufferError("this EncodedBatch holds no payload")
        PyBuffer_FillInfo(view, self, self.chunk.data + self.offset, <Py_ssize_t>self.length, 1, flags)

    def __releasebuffer__(self, Py_buffer* view):
        pass

    def __len__(self):
        return self.length

    def __dealloc__(self):
        if self.chunk is not None:
            self.chunk.live -= 1
            if self.chunk.live == 0:
                self.chunk.used = 0  # nothing points into it: the next payloads reuse its (warm) memory


cdef size_t _MIN_CHUNK_BYTES = 2 << 20
cdef size_t _MAX_CHUNK_BYTES = 64 << 20
cdef size_t _BATCHES_PER_CHUNK = 8


cdef _ArenaChunk _new_chunk(size_t size):
    """A page-aligned chunk of ``size`` bytes rounded up to whole pages, not yet faulted in.

    Whole pages keep ``used`` (a multiple of 64) at most ``size`` after any payload."""
    cdef _ArenaChunk chunk = _ArenaChunk.__new__(_ArenaChunk)
    size = (size + PKV_OS_PAGE - 1) & ~(PKV_OS_PAGE - 1)
    chunk.data = <uint8_t*>pkv_page_alloc(size)
    if chunk.data == NULL:
        raise MemoryError(f"cannot allocate {size} bytes for encoded KV events")
    chunk.size = size
    return chunk


@cython.auto_pickle(False)  # a copy would carve payloads out of the same chunks
cdef class PayloadArena:
    """Memory for encoded KV event batches that are kept a while (for replays), handed out in order.

    Payloads are carved one after another out of large chunks, and a chunk
    whose payloads are all gone is written again from its start. A chunk
    other than the current one is freed with the last payload in it. Keeping payloads needs new memory,
    and new memory costs a page fault per page on first write: an otherwise
    idle thread can take those faults ahead of the writer with
    :meth:`populate`, which faults in the rest of the current chunk and a
    spare one, 2 MiB at a time (short holds of the kernel's memory map
    lock, which the writer's own allocations may need). Huge pages are not
    asked for: the kernel's compaction for one can stall a thread for tens
    of milliseconds, and the faults are off the writer's path anyway.
    Chunks hold about 8 of the largest batches seen, from 2 MiB to 64 MiB
    (a larger batch gets a chunk of its own).

    Not thread-safe by itself, except that :meth:`populate` may run in
    another thread than :meth:`encode` (both hold the GIL where they touch
    the arena's state).
    """
    cdef _ArenaChunk current, spare
    cdef size_t chunk_bytes       # size of the next chunk
    cdef size_t populated         # bytes of `current` known to be faulted in (from its start)

    def __cinit__(self):
        self.chunk_bytes = _MIN_CHUNK_BYTES

    def encode(self, KVEvents events not None, double ts, *, data_parallel_rank=0, window=None, medium="CPU",
               hash_format="int"):
        """Encode ``events`` as :meth:`KVEvents.encode` does, into this arena.

        Returns
        -------
        EncodedBatch
            The payload, bytes-like; its memory stays valid while it lives.

        Raises
        ------
        ValueError, TypeError
            As :meth:`KVEvents.encode`.
        MemoryError
            No memory for a new chunk.
        """
        cdef _EncodeOptions options = _EncodeOptions(data_parallel_rank, window, medium, hash_format)
        cdef size_t bound = events._encode_bound(options)
        self.chunk_bytes = min(_MAX_CHUNK_BYTES, max(self.chunk_bytes, _BATCHES_PER_CHUNK * bound))
        cdef _ArenaChunk chunk = self.current
        if chunk is None or chunk.size - chunk.used < bound:
            if self.spare is not None and self.spare.size >= bound:
                chunk, self.spare = self.spare, None
                self.populated = chunk.size
            else:
                self.spare = None  # too small for batches this large: populate() makes a new one
                chunk = _new_chunk(max(self.chunk_bytes, bound))
                self.populated = 0
            self.current = chunk
        cdef EncodedBatch payload = EncodedBatch.__new__(EncodedBatch)
        payload.offset = chunk.used
        # Counted and reserved before the encoding lets go of the GIL: a thread that drops the
        # chunk's last other payload meanwhile must not mark it empty, and populate() leaves
        # the pages being written alone.
        payload.chunk = chunk
        chunk.live += 1
        chunk.used += (bound + 63) & ~(<size_t>63)
        payload.length = events._encode_into(ts, options, chunk.data + payload.offset)
        chunk.used = payload.offset + ((payload.length + 63) & ~(<size_t>63))  # the next payload starts on a cache line
        return payload

    @property
    def needs_populate(self):
        """True when :meth:`populate` has work: no spare chunk, or part of the current one not faulted in."""
        return self.current is not None and (self.spare is None or self.populated < self.current.size)

    def populate(self):
        """Fault in the rest of the current chunk and a spare chunk, mostly without the GIL.

        Meant for a thread that is otherwise idle, while another one calls
        :meth:`encode`: the writes of later payloads then take no page fault.
        Bytes already written are not changed (``MADV_POPULATE_WRITE``);
        where the kernel lacks it, only the spare chunk is faulted in, by
        writing to it before anyone else can see it.

        Raises
        ------
        MemoryError
            No memory for the spare chunk.
        """
        cdef _ArenaChunk chunk = self.current
        cdef size_t start, i
        cdef uint8_t* data
        cdef size_t size
        if chunk is not None and self.populated < chunk.size:
            start = (chunk.used + PKV_OS_PAGE - 1) & ~(PKV_OS_PAGE - 1)  # pages being written are left alone
            data = chunk.data
            size = chunk.size
            with nogil:
                _populate(data, start, size)
            if self.current is chunk:
                self.populated = size
        if self.spare is not None or self.current is None:
            return
        chunk = _new_chunk(self.chunk_bytes)
        data = chunk.data
        size = chunk.size
        with nogil:
            if _populate(data, 0, size) != 0:
                i = 0
                while i < size:  # nobody else sees this chunk yet
                    data[i] = 0
                    i += PKV_OS_PAGE
        if self.spare is None:
            self.spare = chunk


cdef int _populate(uint8_t* data, size_t start, size_t end) noexcept nogil:
    """Fault in ``data[start:end]`` (page-aligned ``start``) 2 MiB at a time; -1 if the kernel cannot."""
    cdef size_t step
    while start < end:
        step = min(end - start, <size_t>(2 << 20))
        if pkv_populate_write(data + start, step) != 0:
            return -1
        start += step
    return 0
