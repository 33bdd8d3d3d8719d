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
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF
from libc.stdlib cimport free
from libc.stdint cimport uint8_t

cdef extern from "kv_events_msgpack.h":
    size_t pkv_kv_events_encode_bound(int64_t num_units, int64_t num_events, int64_t num_tokens,
                                      size_t medium_len) noexcept nogil
    size_t pkv_kv_events_encode(const pkv_kv_unit* units, int64_t num_units, int64_t num_events,
                                const int32_t* tokens, int64_t page_size, double ts, int64_t rank,
                                const char* medium, size_t medium_len, int64_t window, int hash_bytes,
                                uint8_t* out) noexcept nogil

cdef extern from "Python.h":
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

    def __cinit__(self, int64_t capacity, int64_t page_size):
        if not 1 <= capacity <= 2**31:
            raise ValueError(f"Invalid value of kv_events_capacity: expected 1 <= kv_events_capacity <= 2**31, "
                             f"got {capacity}")
        if page_size < 1:
            raise ValueError(f"Invalid value of page_size: expected >= 1, got {page_size}")
        self.log.capacity = capacity
        self.log.page_size = page_size
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
            ``medium`` is not a str.
        """
        if hash_format not in HASH_FORMATS:
            raise ValueError(f"Invalid value of hash_format: expected one of {HASH_FORMATS}, got {hash_format!r}")
        if not isinstance(medium, str):
            raise TypeError(f"Invalid type of medium: expected str, got {type(medium).__name__}")
        for name, value in (("data_parallel_rank", data_parallel_rank), ("window", window)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63):
                raise ValueError(f"Invalid value of {name}: expected an int in [0, 2**63), got {value!r}")
        cdef bytes medium_utf8 = medium.encode("utf-8")
        cdef const char* medium_chars = medium_utf8
        cdef size_t medium_len = len(medium_utf8)
        cdef int64_t rank = data_parallel_rank
        cdef int64_t window_tokens = -1 if window is None else window
        cdef int as_bytes = hash_format == "bytes"
        cdef size_t bound = pkv_kv_events_encode_bound(self.num_units, self.num_events, self.num_tokens, medium_len)
        cdef size_t length
        # Encoded straight into a new bytes object, which nothing else sees
        # until it is returned, then shrunk to length in place.
        cdef PyObject* raw = _bytes_new(NULL, <Py_ssize_t>bound)
        cdef uint8_t* out = <uint8_t*>_bytes_data(raw)
        with nogil:
            length = pkv_kv_events_encode(self.units, self.num_units, self.num_events, self.tokens, self.page_size,
                                          ts, rank, medium_chars, medium_len, window_tokens, as_bytes, out)
        _PyBytes_Resize(&raw, <Py_ssize_t>length)  # on failure it frees raw and raises MemoryError
        payload = <object>raw  # a second reference; the one _bytes_new made is dropped next
        Py_DECREF(payload)
        return payload
