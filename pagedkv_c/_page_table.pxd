# PageTable: one sequence's logical page index -> page id map, with the
# sliding window kept as a ring buffer and attention-sink pages pinned.
from pagedkv_c._types cimport page_id_t, pos_t, slot_t, int32_t, int64_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._prefix cimport SequenceHashes


cdef class PageTable:
    cdef readonly PagePool pool
    cdef readonly int32_t page_size     # tokens per page
    cdef int64_t _window                # W in tokens; NO_WINDOW for full attention
    cdef readonly int64_t sink_tokens   # S in tokens (only meaningful with a window)
    cdef int32_t num_sink_pages         # ceil(S / page_size) with a window, else 0
    cdef int64_t length                 # tokens appended so far = next position
    # Sink pages: logical pages 0 .. num_sink_pages-1, never released.
    cdef int32_t[::1] sinks             # shape (num_sink_pages,), page ids; valid up to sink_count
    cdef int32_t sink_count             # sink pages held (< num_sink_pages only while the sequence is short)
    # Ring of window pages: logical pages ring_first .. ring_first+ring_count-1,
    # stored at ring[(ring_head + i) & ring_mask]. Grows (doubling) when a
    # chunk longer than the window is in flight or without a window.
    cdef int32_t[::1] ring              # shape (capacity,), page ids; capacity is a power of two
    cdef Py_ssize_t ring_mask           # capacity - 1
    cdef Py_ssize_t ring_head           # index in ring of logical page ring_first
    cdef Py_ssize_t ring_count          # pages in the ring
    cdef int64_t ring_first             # logical index of the oldest ring page, >= num_sink_pages
    cdef SequenceHashes hashes          # prefix-caching hash chain, or None
    # Sealed pages (owner KVCache): every held logical page below this index
    # is sealed, so a seal resumes here instead of rescanning the table.
    cdef int64_t num_sealed             # in logical pages, <= length // page_size

    cdef int64_t num_logical(self) noexcept nogil
    cdef Py_ssize_t num_held(self) noexcept nogil
    # Small accessors are inline (bodies here) so that other modules' per-page
    # loops call them directly instead of through the type's vtable.
    cdef inline page_id_t page_at(self, int64_t logical) noexcept nogil:
        """Page id of a held logical page (caller checked that it is held)."""
        if logical < self.num_sink_pages:
            return self.sinks[logical]
        return self.ring[(self.ring_head + (logical - self.ring_first)) & self.ring_mask]
    cdef Py_ssize_t num_to_release(self, int64_t num_new_tokens) noexcept nogil
    cdef inline page_id_t ring_page(self, Py_ssize_t i) noexcept nogil:
        """The i-th oldest window page."""
        return self.ring[(self.ring_head + i) & self.ring_mask]
    cdef page_id_t pop_oldest(self) noexcept nogil
    cdef int reserve(self, Py_ssize_t num_new_pages) except -1
    cdef inline void push_page(self, page_id_t page_id) noexcept nogil:
        """Append a page as the next logical page (a sink page or the ring's newest).

        The caller reserved ring room first.
        """
        if self.sink_count < self.num_sink_pages:
            self.sinks[self.sink_count] = page_id
            self.sink_count += 1
            return
        self.ring[(self.ring_head + self.ring_count) & self.ring_mask] = page_id
        self.ring_count += 1
    cdef inline page_id_t pop_newest(self) noexcept nogil:
        """Remove the newest held page (ring tail, else the last sink page) and return it."""
        if self.ring_count > 0:
            self.ring_count -= 1
            return self.ring[(self.ring_head + self.ring_count) & self.ring_mask]
        self.sink_count -= 1
        return self.sinks[self.sink_count]
    cdef void replace_last(self, page_id_t page_id) noexcept nogil
    cdef bint last_page_is_partial(self) noexcept nogil
    cdef Py_ssize_t pages_needed(self, int64_t num_new_tokens) noexcept nogil
    cdef void write_slots(self, int64_t first_pos, int64_t num_tokens, slot_t* out) noexcept nogil
    cdef void export(self, page_id_t* indices, pos_t* positions) noexcept nogil
    cdef int64_t min_truncate_len(self) noexcept nogil
    cdef int check_truncate(self, int64_t new_len) except -1
    cdef void drop_tail(self, int64_t new_len) noexcept nogil
    cdef int copy_from(self, PageTable other) except -1
    cdef int adopt(self, const page_id_t* sink_pages, Py_ssize_t num_sink,
                   const page_id_t* window_pages, int64_t first_window, Py_ssize_t num_window,
                   int64_t num_logical_pages) except -1
    # Snapshots: validate, then apply, an exported table state (_export_state).
    cdef int _check_state(self, dict state) except -1
    cdef int _apply_state(self, dict state) except -1


# Batch append over several tables sharing one pool (all-or-nothing).
cdef int append_batch(PagePool pool, list tables, const int64_t* num_tokens,
                      slot_t* slots_out, page_id_t* cow_src, page_id_t* cow_dst,
                      Py_ssize_t* num_cow, Py_ssize_t* num_released) except -1
# (pages needed, pages available) of such an append, changing nothing.
cdef tuple pages_needed_for(PagePool pool, list tables, const int64_t* num_tokens)


# Key that the owner of a pool (KVCache) passes as PageTable(..., _owner_key=...)
# to build its tables on the pool it owns; anyone else gets RuntimeError.
cdef object owner_key()
