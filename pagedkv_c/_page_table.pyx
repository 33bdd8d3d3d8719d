"""PageTable: one sequence's map from logical page index to page id.

Positions ``[k * page_size, (k + 1) * page_size)`` of a sequence live in its
logical page ``k``. Without a window every logical page is held. With a
sliding window of ``W`` tokens and ``S`` sink tokens, the table holds:

* the sink pages, logical pages ``0 .. ceil(S / page_size) - 1``, pinned for
  the sequence's lifetime (StreamingLLM attention sinks, Xiao et al. 2023);
* the window pages, a contiguous run of logical pages kept in a ring buffer.

Release rule (vLLM's sliding-window manager works the same way):
an append of ``T >= 1`` tokens starting at position ``n0`` first releases
every window page whose positions are all ``< n0 - W + 1``, then takes new
pages. A released page whose ref count drops to 0 is reused in place for the
pages the same call needs, without a round trip through the free queue.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport INT64_MAX
from libc.stdlib cimport malloc, free
from pagedkv_c._types cimport sat_add, page_id_t, pos_t, slot_t, int32_t, int64_t, NO_PAGE
from pagedkv_c._pool cimport (PagePool, pkv_free_queue, pkv_decref, pkv_drop_ref, pkv_incref,
                              pkv_prefetch_record, pkv_queue_push, pkv_ref, pkv_set_ref)
from pagedkv_c._prefix cimport pkv_index_is_cached, pkv_index_remove
from pagedkv_c._checks cimport check_int
from pagedkv_c._checks import check_sink_window

from pagedkv_c._pool import OutOfPagesError

cnp.import_array()

# Window value meaning "no window" (full attention).
cdef int64_t NO_WINDOW = INT64_MAX
# Initial ring capacity of a table without a window; it doubles as needed.
cdef Py_ssize_t _INITIAL_RING = 8
# Pages ahead whose allocator records drop_tail prefetches.
cdef Py_ssize_t _RELEASE_PREFETCH_DISTANCE = 16
# Largest sequence length, window and sink length, in tokens: positions plus a
# page or a window stay below 2**63, and attention accepts the same limit.
cdef int64_t MAX_POSITION = 2**62
# Largest ref count of a page (the allocator's counts are int32).
cdef int32_t _MAX_REF = 2**31 - 1
# Passed by the structure that owns a pool (KVCache) to build its tables on it.
cdef object _OWNER_KEY = object()


cdef object owner_key():
    """The key that lets the owner of a pool build page tables on it (see PageTable)."""
    return _OWNER_KEY


cdef inline int64_t _ceil_div(int64_t a, int64_t b) noexcept nogil:
    return (a + b - 1) // b


cdef int32_t[::1] _NO_SINKS = np.empty(0, dtype=np.int32)


cdef class PageTable:
    """Logical page index -> page id map of one sequence, over a shared PagePool.

    Parameters
    ----------
    pool : PagePool
        Allocator shared by all sequences; page ids come from it.
    page_size : int
        Tokens per page, ``1 <= page_size <= 2**31 - 1``.
    window : int or None
        Sliding window ``W`` in tokens, ``1 <= W <= 2**62``: the query at
        position ``p`` attends to keys ``[p - W + 1, p]``. None means full
        attention (no page is ever released).
    sink_tokens : int
        Attention-sink tokens ``0 <= S <= 2**62``: positions ``[0, S)`` stay
        attended and their pages pinned. Only with a window: ``S > 0``
        without one raises ValueError.

    Raises
    ------
    RuntimeError
        ``pool`` belongs to a ``KVCache`` (``pool.owner`` is set): its pages
        are taken only through the cache's sequences.
    TypeError, ValueError
        A size is not an integer or out of its range.

    Notes
    -----
    The window pages form a ring whose decode capacity is
    ``ceil((W - 1) / page_size) + 1`` pages; it grows (doubling) while an
    append longer than the window is in flight, because the appended tokens'
    own queries need all of it. After an append of ``T`` tokens the table
    holds at most ``ceil((W + T - 2) / page_size) + 1`` window pages plus
    ``ceil(S / page_size)`` sink pages (never more than the pool has).

    A sequence is at most ``2**62`` tokens long: positions, slots (``page_id
    * page_size + offset < 2**62``) and window bounds then fit int64.

    This class keeps page ids only; the K/V bytes and copy-on-write copies
    are the owning cache's job.
    """

    def __cinit__(self, PagePool pool not None, page_size, window=None, sink_tokens=0, *, _owner_key=None):
        if pool.owner is not None and _owner_key is not _OWNER_KEY:
            raise RuntimeError(
                f"PageTable cannot be built on the pool of a {pool.owner}: its pages are taken and "
                f"released only through the {pool.owner}'s sequences (the pool is read-only)"
            )
        self.pool = pool
        self.page_size = <int32_t>check_int(page_size, "page_size", 1, 2**31 - 1)
        cdef int64_t w = NO_WINDOW
        if window is not None:
            w = check_int(window, "window", 1, MAX_POSITION)
        self._window = w
        self.sink_tokens = check_int(sink_tokens, "sink_tokens", 0, MAX_POSITION)
        if w == NO_WINDOW and self.sink_tokens:
            check_sink_window(window, self.sink_tokens)
        self.num_sink_pages = 0
        if w != NO_WINDOW:
            # A sequence never holds more pages than the pool: sink pages past
            # that are never reached (and would not fit int32).
            self.num_sink_pages = <int32_t>min(_ceil_div(self.sink_tokens, self.page_size),
                                               <int64_t>pool.num_pages)
        # Without sink pages every table shares one empty array (no allocation).
        self.sinks = np.full(self.num_sink_pages, NO_PAGE, dtype=np.int32) if self.num_sink_pages else _NO_SINKS
        cdef Py_ssize_t wanted = _INITIAL_RING, capacity = 1
        if w != NO_WINDOW:
            wanted = min(<Py_ssize_t>(_ceil_div(w - 1, self.page_size) + 1), 1 << 16)
        while capacity < wanted:  # a power of two: ring indices wrap with a mask
            capacity *= 2
        self.ring = np.full(capacity, NO_PAGE, dtype=np.int32)  # entries past ring_count are never read
        self.ring_mask = capacity - 1
        self.length = 0
        self.sink_count = 0
        self.ring_head = 0
        self.ring_count = 0
        self.ring_first = self.num_sink_pages

    # ------------------------------------------------------------------ C API
    cdef int64_t num_logical(self) noexcept nogil:
        """Logical pages spanned by the sequence, held or released."""
        return _ceil_div(self.length, self.page_size)

    cdef Py_ssize_t num_held(self) noexcept nogil:
        return self.sink_count + self.ring_count

    cdef Py_ssize_t num_to_release(self, int64_t num_new_tokens) noexcept nogil:
        """Window pages an append of ``num_new_tokens`` releases first (release rule)."""
        if num_new_tokens == 0 or self._window == NO_WINDOW:
            return 0
        cdef int64_t bound = self.length - self._window + 1
        if bound <= 0:
            return 0
        # Logical pages below bound // page_size hold only positions < bound.
        cdef int64_t released = bound // self.page_size - self.ring_first
        if released <= 0:
            return 0
        return <Py_ssize_t>min(released, <int64_t>self.ring_count)

    cdef page_id_t pop_oldest(self) noexcept nogil:
        """Remove the oldest window page from the ring and return it."""
        cdef page_id_t page_id = self.ring[self.ring_head]
        self.ring_head = (self.ring_head + 1) & self.ring_mask
        self.ring_count -= 1
        self.ring_first += 1
        return page_id

    cdef int reserve(self, Py_ssize_t num_new_pages) except -1:
        """Grow the ring (doubling) so that ``num_new_pages`` more pages fit.

        Called while planning, so that pushing pages later cannot fail.
        """
        cdef Py_ssize_t capacity = self.ring.shape[0]
        cdef Py_ssize_t wanted = self.ring_count + num_new_pages
        cdef Py_ssize_t i
        cdef int32_t[::1] grown
        if wanted <= capacity:
            return 0
        while capacity < wanted:
            capacity *= 2
        grown = np.full(capacity, NO_PAGE, dtype=np.int32)
        for i in range(self.ring_count):
            grown[i] = self.ring_page(i)
        self.ring = grown
        self.ring_mask = capacity - 1
        self.ring_head = 0
        return 0

    cdef void replace_last(self, page_id_t page_id) noexcept nogil:
        """Swap the page of the newest held logical page (copy-on-write)."""
        if self.ring_count > 0:
            self.ring[(self.ring_head + self.ring_count - 1) & self.ring_mask] = page_id
        else:
            self.sinks[self.sink_count - 1] = page_id

    cdef bint last_page_is_partial(self) noexcept nogil:
        """True when the next token lands in an already-held page."""
        return self.length % self.page_size != 0

    cdef Py_ssize_t pages_needed(self, int64_t num_new_tokens) noexcept nogil:
        """New logical pages an append of ``num_new_tokens`` spans."""
        return <Py_ssize_t>(_ceil_div(self.length + num_new_tokens, self.page_size) - self.num_logical())

    cdef void write_slots(self, int64_t first_pos, int64_t num_tokens, slot_t* out) noexcept nogil:
        """Slot mapping of positions ``first_pos .. first_pos + num_tokens - 1`` (all held)."""
        cdef int64_t pos = first_pos
        cdef int64_t end = first_pos + num_tokens
        cdef int64_t logical, offset, run, t
        cdef slot_t base
        cdef Py_ssize_t k = 0
        while pos < end:
            logical = pos // self.page_size
            offset = pos - logical * self.page_size
            run = min(<int64_t>self.page_size - offset, end - pos)
            base = <slot_t>self.page_at(logical) * self.page_size + offset
            for t in range(run):
                out[k] = base + t
                k += 1
            pos += run

    cdef void export(self, page_id_t* indices, pos_t* positions) noexcept nogil:
        """Write held page ids and their first positions in logical order."""
        cdef Py_ssize_t i
        for i in range(self.sink_count):
            indices[i] = self.sinks[i]
            positions[i] = <pos_t>i * self.page_size
        cdef Py_ssize_t base = self.sink_count
        for i in range(self.ring_count):
            indices[base + i] = self.ring[(self.ring_head + i) & self.ring_mask]
            positions[base + i] = (self.ring_first + i) * self.page_size

    cdef int64_t min_truncate_len(self) noexcept nogil:
        """Smallest length above the sink pages that keeps a full window cached.

        Truncating to ``new_len`` with ``sink_pages * page_size < new_len <
        min_truncate_len()`` would leave the next query without keys the
        window already released. 0 when nothing was released.
        """
        if self._window == NO_WINDOW or self.ring_first <= self.num_sink_pages:
            return 0
        return self.ring_first * self.page_size + self._window - 1

    cdef void drop_tail(self, int64_t new_len) noexcept nogil:
        """Release the pages past ``new_len`` tokens, newest first, and set the length.

        The caller validated ``new_len`` (see min_truncate_len).
        """
        cdef int64_t keep = _ceil_div(new_len, self.page_size)
        cdef pkv_free_queue* q = &self.pool.q
        while self.ring_count > 0 and self.ring_first + self.ring_count > keep:
            if self.ring_count > _RELEASE_PREFETCH_DISTANCE:
                # Released pages' records are scattered: load a few ahead.
                pkv_prefetch_record(q, self.ring_page(self.ring_count - 1 - _RELEASE_PREFETCH_DISTANCE))
            pkv_decref(q, self.pop_newest())
        while self.ring_count == 0 and self.sink_count > keep:
            pkv_decref(&self.pool.q, self.pop_newest())
        if self.ring_count == 0:
            self.ring_head = 0
            self.ring_first = max(<int64_t>self.num_sink_pages, keep)
        self.length = new_len
        if self.hashes is not None:
            self.hashes.truncate(new_len, self.page_size)

    cdef int copy_from(self, PageTable other) except -1:
        """Make this (empty) table share every page of ``other`` (ref counts +1).

        Raises ValueError, changing nothing, when a page already has the
        largest ref count, ``2**31 - 1``.
        """
        cdef Py_ssize_t j
        cdef page_id_t shared
        for j in range(other.num_held()):
            shared = other.sinks[j] if j < other.sink_count else other.ring_page(j - other.sink_count)
            if pkv_ref(&self.pool.q, shared) >= _MAX_REF:
                raise ValueError(
                    f"Invalid value of the forked sequence: expected pages with fewer than 2**31 - 1 "
                    f"references (the int32 ref count limit), got page {shared} with {_MAX_REF}"
                )
        self.sinks = np.asarray(other.sinks).copy()
        self.ring = np.asarray(other.ring).copy()
        self.ring_mask = other.ring_mask
        self.sink_count = other.sink_count
        self.ring_head = other.ring_head
        self.ring_count = other.ring_count
        self.ring_first = other.ring_first
        self.length = other.length
        if other.hashes is not None:
            self.hashes = other.hashes.copy()
        cdef Py_ssize_t i
        for i in range(self.sink_count):
            pkv_incref(&self.pool.q, self.sinks[i])
        for i in range(self.ring_count):
            pkv_incref(&self.pool.q, self.ring_page(i))
        return 0

    cdef int adopt(self, const page_id_t* sink_pages, Py_ssize_t num_sink,
                   const page_id_t* window_pages, int64_t first_window, Py_ssize_t num_window,
                   int64_t num_logical_pages) except -1:
        """Start an empty table on cached pages (prefix caching).

        The table spans ``num_logical_pages`` full pages and holds sink pages
        ``0 .. num_sink-1`` plus window pages ``first_window ..
        first_window + num_window - 1``; pages between them, which no future
        query needs, are not held. The caller set the ref counts.
        """
        self.reserve(num_window)
        cdef Py_ssize_t i
        for i in range(num_sink):
            self.sinks[i] = sink_pages[i]
        self.sink_count = <int32_t>num_sink
        self.ring_head = 0
        self.ring_first = max(first_window, <int64_t>self.num_sink_pages)
        for i in range(num_window):
            self.ring[i] = window_pages[i]
        self.ring_count = num_window
        self.length = num_logical_pages * self.page_size
        return 0

    # ------------------------------------------------------------- Python API
    @property
    def window(self):
        """Sliding window in tokens, or None for full attention."""
        return None if self._window == NO_WINDOW else self._window

    @property
    def seq_len(self):
        """Tokens appended so far, released ones included (= the next position)."""
        return self.length

    @property
    def num_pages(self):
        """Pages the table holds (sink + window pages)."""
        return self.num_held()

    def pages(self):
        """Held pages in logical order.

        Returns
        -------
        page_ids : numpy.ndarray
            int32, shape ``(num_pages,)``.
        first_positions : numpy.ndarray
            int64, shape ``(num_pages,)``: first token position of each page.
        """
        n = self.num_held()
        ids = np.empty(n, dtype=np.int32)
        pos = np.empty(n, dtype=np.int64)
        self.export(<page_id_t*>cnp.PyArray_DATA(ids), <pos_t*>cnp.PyArray_DATA(pos))
        return ids, pos

    def append(self, num_tokens):
        """Reserve slots for the next ``num_tokens`` tokens.

        Releases out-of-window pages first, then copies the last page if it is
        shared and will be written (copy-on-write), then takes new pages.

        Parameters
        ----------
        num_tokens : int
            Tokens to append, ``0 <= num_tokens <= 2**62 - seq_len``.

        Returns
        -------
        slot_mapping : numpy.ndarray
            int64, shape ``(num_tokens,)``: ``page_id * page_size + offset``.
        cow_pairs : numpy.ndarray
            int32, shape ``(k, 2)`` with k in {0, 1}: (source, destination)
            page whose contents the owner must copy before writing.

        Raises
        ------
        OutOfPagesError
            The pool cannot supply the pages; nothing changed.
        ValueError
            ``num_tokens`` negative or past the 2**62-token length limit.
        """
        cdef int64_t n = check_int(num_tokens, "num_tokens", 0, MAX_POSITION - self.length)
        slots = np.empty(n, dtype=np.int64)
        cow = np.empty((2, 1), dtype=np.int32)
        cdef Py_ssize_t num_cow = 0, num_released = 0
        append_batch(self.pool, [self], &n, <slot_t*>cnp.PyArray_DATA(slots),
                     <page_id_t*>cnp.PyArray_DATA(cow), (<page_id_t*>cnp.PyArray_DATA(cow)) + 1,
                     &num_cow, &num_released)
        return slots, cow[:, :num_cow].T.copy()

    def truncate(self, new_len):
        """Keep the first ``new_len`` tokens, releasing later pages newest first.

        Raises
        ------
        ValueError
            ``new_len`` is outside ``[0, seq_len]``, or with a window, the
            next query at ``new_len`` would need keys the window already
            released. Nothing changes.
        """
        cdef int64_t n = check_int(new_len, "new_len", 0, self.length)
        self.check_truncate(n)
        self.drop_tail(n)

    cdef int check_truncate(self, int64_t new_len) except -1:
        """Raise ValueError, changing nothing, unless the table can be truncated to ``new_len``
        (``0 <= new_len <= length``, checked by the caller): with a window, the query at
        ``new_len`` must not need keys the window already released."""
        cdef int64_t low = self.min_truncate_len()
        cdef int64_t sink_end = <int64_t>self.num_sink_pages * self.page_size
        if new_len > sink_end and new_len < low:
            raise ValueError(
                f"Invalid value of new_len: the window of {self._window} tokens already released keys that a "
                f"query at position {new_len} needs; expected "
                f"{'new_len == 0' if sink_end == 0 else f'new_len <= {sink_end}'} or "
                f"{low} <= new_len <= {self.length}, got {new_len}"
            )
        return 0

    def fork(self):
        """Return a new table sharing every page of this one (ref counts +1).

        Raises
        ------
        ValueError
            A page already has ``2**31 - 1`` references (the int32 ref count
            limit); nothing changes.
        """
        cdef PageTable child = PageTable(self.pool, self.page_size, self.window, self.sink_tokens,
                                         _owner_key=_OWNER_KEY)
        child.copy_from(self)
        return child

    def release(self):
        """Release every page (newest first) and reset the length to 0."""
        self.drop_tail(0)

    def __repr__(self):
        return (f"PageTable(seq_len={self.length}, num_pages={self.num_held()}, "
                f"page_size={self.page_size}, window={self.window}, sink_tokens={self.sink_tokens})")

    # --------------------------------------------------- state export / restore
    def _export_state(self):
        """The table as plain values (for snapshots).

        Returns
        -------
        dict
            ``length`` (tokens), ``sink_count`` (sink pages held),
            ``ring_first`` (logical index of the oldest window page),
            ``ring_capacity`` (pages the ring holds before it grows) and
            ``pages`` int32 ``(num_held,)``: sink pages, then window pages
            oldest first. The ring's start inside its buffer is not kept: a
            restored ring starts at index 0, which changes no result.
        """
        ids, _ = self.pages()
        return {"length": int(self.length), "sink_count": int(self.sink_count),
                "ring_first": int(self.ring_first), "ring_capacity": int(self.ring.shape[0]), "pages": ids}

    cdef int _check_state(self, dict state) except -1:
        """Raise ValueError unless ``state`` is a table this (empty) table's window, sinks and pool can reach.

        The held pages must cover exactly what the release rule leaves (see
        DESIGN.md, "Page tables and the sliding window"): with ``logical =
        ceil(length / page_size)`` logical pages and ``S`` sink pages, the
        sink pages ``0 .. min(S, logical) - 1``, then window pages from
        ``ring_first`` up to the last logical page (``ring_first +
        ring_count == max(S, logical)``), where ``ring_first`` is at least
        ``S`` and at most the page of the oldest position the next query
        attends to (``length - window + 1``; nothing is released without a
        window). How many older pages are still held is not fixed: a chunk
        longer than the window keeps its pages until the next append. Checks
        the geometry only; the ref counts of the pages are the owner's to
        check across tables.
        """
        cdef int64_t length = state["length"], sink_count = state["sink_count"]
        cdef int64_t ring_first = state["ring_first"], capacity = state["ring_capacity"]
        pages = state["pages"]
        if pages.dtype != np.int32 or pages.ndim != 1:
            raise ValueError(f"Invalid shape of pages: expected int32 (n,), got {pages.dtype} {pages.shape}")
        cdef int64_t num_pages = pages.shape[0]
        cdef int64_t ring_count = num_pages - sink_count
        cdef int64_t logical = _ceil_div(length, self.page_size) if 0 <= length <= MAX_POSITION else -1
        cdef int64_t num_sink = self.num_sink_pages
        cdef int64_t oldest = 0
        if logical < 0:
            raise ValueError(f"Invalid value of length: expected 0 <= length <= 2**62, got {length}")
        if sink_count != min(num_sink, logical) or ring_count < 0:
            raise ValueError(f"Invalid value of sink_count: expected the {min(num_sink, logical)} sink pages of "
                             f"{length} tokens, got {sink_count} (of {num_pages} pages held)")
        if self._window == NO_WINDOW:
            if ring_first != 0 or ring_count != logical:
                raise ValueError(f"Invalid value of pages: a sequence without a window holds all its "
                                 f"{logical} pages, got {ring_count} from logical page {ring_first}")
        else:
            # The next query, at position length, attends back to length - window + 1.
            oldest = max(num_sink, max(length - self._window + 1, <int64_t>0) // self.page_size)
            if ring_first < num_sink or ring_first + ring_count != max(logical, num_sink) or ring_first > oldest:
                raise ValueError(f"Invalid value of ring_first: {ring_count} window pages from logical page "
                                 f"{ring_first} do not cover a sequence of {length} tokens (expected window pages "
                                 f"from a logical page in [{num_sink}, {oldest}] to logical page "
                                 f"{max(logical, num_sink) - 1})")
        cdef int64_t largest = max(<int64_t>self.ring.shape[0], 4 * (<int64_t>self.pool.num_pages + 16))
        if capacity < max(ring_count, <int64_t>1) or capacity > largest or capacity & (capacity - 1):
            raise ValueError(f"Invalid value of ring_capacity: expected a power of two in "
                             f"[{max(ring_count, <int64_t>1)}, {largest}], got {capacity}")
        if num_pages and (pages.min() < 0 or pages.max() >= self.pool.num_pages):
            raise ValueError(f"Invalid value of pages: expected page ids in [0, {self.pool.num_pages - 1}]")
        return 0

    cdef int _apply_state(self, dict state) except -1:
        """Set length, sink pages and ring from ``state`` (checked by _check_state); ref counts untouched."""
        cdef const int32_t[::1] pages = state["pages"]
        cdef int32_t sink_count = <int32_t>state["sink_count"]
        cdef Py_ssize_t i
        self.ring = np.full(state["ring_capacity"], NO_PAGE, dtype=np.int32)
        self.ring_mask = self.ring.shape[0] - 1
        for i in range(sink_count):
            self.sinks[i] = pages[i]
        self.sink_count = sink_count
        for i in range(pages.shape[0] - sink_count):
            self.ring[i] = pages[sink_count + i]
        self.ring_head = 0
        self.ring_count = pages.shape[0] - sink_count
        self.ring_first = state["ring_first"]
        self.length = state["length"]
        return 0


cdef int append_batch(PagePool pool, list tables, const int64_t* num_tokens,
                      slot_t* slots_out, page_id_t* cow_src, page_id_t* cow_dst,
                      Py_ssize_t* num_cow, Py_ssize_t* num_released) except -1:
    """Reserve slots for several tables sharing ``pool``, all or nothing.

    Order of work: (1) every table releases its out-of-window pages; pages
    that reach ref count 0 are kept aside for in-place reuse; (2) each table,
    in order, takes the pages it needs, its own released pages first, then
    the free queue (where the other tables' unused released pages went); a
    partial last page that is still shared gets a fresh copy
    (copy-on-write; the caller copies the bytes from ``cow_src[i]`` to
    ``cow_dst[i]``). The plan is simulated on ref counts first, so
    OutOfPagesError leaves everything unchanged.

    ``num_tokens`` has one entry per table; ``slots_out`` receives
    ``sum(num_tokens)`` slots in table order (NULL: no slot mapping wanted); ``cow_src``/``cow_dst`` need
    room for one entry per table.
    """
    cdef Py_ssize_t num_tables = len(tables)
    cdef Py_ssize_t b, i, r, k, new_pages, into_sinks
    cdef PageTable table
    cdef page_id_t page_id, old

    # ---- 0. work space and ring room; may raise, changes nothing visible.
    cdef int64_t total_released = 0
    for b in range(num_tables):
        table = <PageTable>tables[b]
        r = table.num_to_release(num_tokens[b])
        total_released += r
        new_pages = table.pages_needed(num_tokens[b])
        into_sinks = min(new_pages, <Py_ssize_t>(table.num_sink_pages - table.sink_count))
        table.reserve(table.ring_count - r + new_pages - into_sinks)
    cdef _Scratch scratch = _Scratch(num_tables, total_released)

    # ---- 1. plan on ref counts (see _plan_pages).
    cdef int64_t available = 0
    cdef int64_t needed = _plan_pages(pool, tables, num_tokens, scratch, &available)
    if needed > available:
        raise OutOfPagesError(_out_of_pages_text(pool, tables, num_tokens, scratch, needed, available))
    scratch.ensure_taken(needed)

    # ---- 2. execute; nothing below can fail.
    cdef Py_ssize_t num_spare = 0
    for b in range(num_tables):
        table = <PageTable>tables[b]
        scratch.spare_start[b] = num_spare
        for i in range(table.num_to_release(num_tokens[b])):
            page_id = table.pop_oldest()
            if pkv_drop_ref(&pool.q, page_id) == 0:
                if pool.prefix is not None and pkv_index_is_cached(&pool.prefix.ix, page_id):
                    pkv_queue_push(&pool.q, page_id)  # stays findable until handed out again
                else:
                    scratch.spare[num_spare] = page_id
                    num_spare += 1
    scratch.spare_start[num_tables] = num_spare
    num_released[0] = <Py_ssize_t>total_released

    # Each table reuses its own released pages in place; the others join the
    # free queue.
    cdef Py_ssize_t cursor = 0
    for b in range(num_tables):
        scratch.own[b] = min(scratch.need[b], scratch.spare_start[b + 1] - scratch.spare_start[b])
        for i in range(scratch.own[b]):
            page_id = scratch.spare[scratch.spare_start[b] + i]
            pkv_set_ref(&pool.q, page_id, 1)
            scratch.taken[cursor + i] = page_id
        pool.num_reused_in_place = sat_add(pool.num_reused_in_place, scratch.own[b])
        cursor += scratch.need[b]
    for b in range(num_tables):
        for i in range(scratch.spare_start[b] + scratch.own[b], scratch.spare_start[b + 1]):
            pkv_queue_push(&pool.q, scratch.spare[i])

    cdef int64_t slot_offset = 0
    cdef Py_ssize_t pairs = 0
    cursor = 0
    for b in range(num_tables):
        table = <PageTable>tables[b]
        pool.take(scratch.taken + cursor + scratch.own[b], scratch.need[b] - scratch.own[b])
        k = cursor
        if scratch.copy[b]:
            old = table.page_at(table.num_logical() - 1)
            table.replace_last(scratch.taken[k])
            pkv_drop_ref(&pool.q, old)  # stays >= 1: the page was shared
            cow_src[pairs] = old
            cow_dst[pairs] = scratch.taken[k]
            pairs += 1
            k += 1
        elif num_tokens[b] and table.last_page_is_partial() and pool.prefix is not None:
            old = table.page_at(table.num_logical() - 1)
            if pkv_index_is_cached(&pool.prefix.ix, old):
                pkv_index_remove(&pool.prefix.ix, old)  # its content is about to change
        while k < cursor + scratch.need[b]:
            table.push_page(scratch.taken[k])
            k += 1
        cursor += scratch.need[b]
        if slots_out != NULL:
            table.write_slots(table.length, num_tokens[b], slots_out + slot_offset)
        table.length += num_tokens[b]
        slot_offset += num_tokens[b]
    num_cow[0] = pairs
    return 0


cdef int64_t _plan_pages(PagePool pool, list tables, const int64_t* num_tokens, _Scratch scratch,
                         int64_t* available_out) except -1:
    """Plan an append on ref counts, changing nothing: the releases of all tables, then per table
    copy-on-write and new pages, in the order execution follows. Fills ``scratch.copy`` and
    ``scratch.need``; returns the pages needed and sets ``available_out`` to the free pages
    plus those the releases free. Counts must keep every length within MAX_POSITION."""
    cdef Py_ssize_t num_tables = len(tables)
    cdef Py_ssize_t b, i
    cdef PageTable table
    cdef page_id_t page_id
    cdef int32_t[:] refs = pool._ref_count
    cdef int32_t[::1] pending = pool._pending
    cdef int64_t available = pool.q.num_free
    cdef int64_t needed = 0
    for b in range(num_tables):
        table = <PageTable>tables[b]
        for i in range(table.num_to_release(num_tokens[b])):
            page_id = table.ring_page(i)
            pending[page_id] += 1
            if refs[page_id] == pending[page_id]:
                available += 1
    for b in range(num_tables):
        table = <PageTable>tables[b]
        scratch.copy[b] = False
        scratch.need[b] = 0
        if num_tokens[b] == 0:
            continue
        if table.last_page_is_partial():
            page_id = table.page_at(table.num_logical() - 1)
            if refs[page_id] - pending[page_id] > 1:
                scratch.copy[b] = True
                scratch.need[b] += 1
                pending[page_id] += 1
        scratch.need[b] += table.pages_needed(num_tokens[b])
        needed += scratch.need[b]
    for b in range(num_tables):  # clear the scratch counts, same walk
        table = <PageTable>tables[b]
        for i in range(table.num_to_release(num_tokens[b])):
            pending[table.ring_page(i)] = 0
        if scratch.copy[b]:
            pending[table.page_at(table.num_logical() - 1)] = 0
    available_out[0] = available
    return needed


cdef tuple pages_needed_for(PagePool pool, list tables, const int64_t* num_tokens):
    """``(needed, available)`` of an append of ``num_tokens`` to ``tables``, as append_batch
    plans it, changing nothing (for messages; lengths must stay within MAX_POSITION)."""
    cdef _Scratch scratch = _Scratch(len(tables), 0)
    cdef int64_t available = 0
    cdef int64_t needed = _plan_pages(pool, tables, num_tokens, scratch, &available)
    return needed, available


cdef str _plural(int64_t count, str noun, str nouns=None):
    return f"{count} {noun if count == 1 else (nouns or noun + 's')}"


cdef str _out_of_pages_text(PagePool pool, list tables, const int64_t* num_tokens, _Scratch scratch,
                            int64_t needed, int64_t available):
    """Message of append_batch's OutOfPagesError: what was asked, what is free, what to do."""
    cdef Py_ssize_t b
    cdef int64_t num_asked = 0, num_seqs = 0, num_copies = 0
    for b in range(len(tables)):
        num_asked += num_tokens[b]
        num_seqs += num_tokens[b] > 0
        num_copies += scratch.copy[b]
    cdef PageTable first = <PageTable>tables[0]
    cdef bint windowed = first._window != NO_WINDOW
    text = (f"Cannot append {_plural(num_asked, 'token')} to {_plural(num_seqs, 'sequence')}: "
            f"they need {_plural(needed, 'new page')} of {first.page_size} tokens")
    if num_copies:
        text += (f" (including {_plural(num_copies, 'copy-on-write copy', 'copy-on-write copies')} "
                 f"of a shared last page)")
    text += f", but only {pool.q.num_free} of the {pool.num_pages} pages {'is' if pool.q.num_free == 1 else 'are'} free"
    if pool.prefix is not None:
        cached_free = int(np.count_nonzero((np.asarray(pool._ref_count) == 0)
                                           & (np.asarray(pool.prefix.page_cached) != 0)))
        if cached_free:
            text += f" ({cached_free} of them hold cached prefixes, taken back as needed)"
    if windowed:
        text += f", plus {available - pool.q.num_free} that the window releases in this call"
    text += (f". Nothing was changed. Free pages by removing or truncating sequences "
             f"(remove_sequence, truncate), or create the cache with num_pages >= "
             f"{pool.num_pages + needed - available}")
    if windowed:
        text += ", or append fewer tokens per call (the window releases earlier pages between appends)"
    else:
        text += " or with a sliding window (window=W), which releases the pages that leave it"
    return text + "."


cdef class _Scratch:
    """Per-call work arrays of append_batch (one malloc'd block), freed with the object."""
    cdef Py_ssize_t* need         # (num_tables,) pages each table takes (copy + new)
    cdef Py_ssize_t* own          # (num_tables,) of those, its own released pages
    cdef Py_ssize_t* spare_start  # (num_tables + 1,) offsets into spare per table
    cdef bint* copy               # (num_tables,) table copies its shared last page
    cdef page_id_t* spare         # (num_released,) released pages that reached ref count 0
    cdef page_id_t* taken         # (total needed,) pages handed to the tables, in table order
    cdef char* block              # holds need, own, spare_start, copy and spare

    def __cinit__(self, Py_ssize_t num_tables, int64_t num_released):
        cdef Py_ssize_t rows = num_tables + 1
        # Widest type first, so that every array is aligned.
        self.block = <char*>malloc(3 * rows * sizeof(Py_ssize_t) + rows * sizeof(bint)
                                   + (num_released + 1) * sizeof(page_id_t))
        self.taken = NULL
        if self.block == NULL:
            raise MemoryError()
        self.need = <Py_ssize_t*>self.block
        self.own = self.need + rows
        self.spare_start = self.own + rows
        self.copy = <bint*>(self.spare_start + rows)
        self.spare = <page_id_t*>(self.copy + rows)

    cdef int ensure_taken(self, int64_t num_pages) except -1:
        self.taken = <page_id_t*>malloc((num_pages + 1) * sizeof(page_id_t))
        if self.taken == NULL:
            raise MemoryError()
        return 0

    def __dealloc__(self):
        free(self.block)
        free(self.taken)
