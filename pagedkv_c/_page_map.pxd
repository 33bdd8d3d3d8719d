# PageMap: open-addressing hash map from logical page index (int64, >= 0) to
# page id (int32), for page tables whose logical pages are sparse (any
# non-negative int64 token index may be used, so a dense array indexed by
# logical page cannot work).
from pagedkv_c._types cimport page_id_t, int64_t


cdef class PageMap:
    cdef readonly Py_ssize_t capacity   # most entries the map may hold at once
    cdef Py_ssize_t _num_entries        # live entries, 0 .. capacity
    cdef Py_ssize_t _mask               # table length - 1 (the length is a power of two >= 2 * capacity)
    cdef int _shift                     # 64 - log2(table length), for Fibonacci hashing
    cdef int64_t[::1] _keys             # shape (table length,): logical page index, EMPTY_KEY if unused
    cdef page_id_t[::1] _values         # shape (table length,): page id stored with the key beside it

    # C-level interface. Callers keep keys >= 0 and never insert a key that is
    # present or more than `capacity` keys.
    cdef Py_ssize_t home_slot(self, int64_t logical_page) noexcept nogil
    cdef Py_ssize_t find_slot(self, int64_t logical_page) noexcept nogil   # -1 if absent
    cdef page_id_t lookup(self, int64_t logical_page) noexcept nogil
    cdef void insert(self, int64_t logical_page, page_id_t page_id) noexcept nogil
    cdef bint remove(self, int64_t logical_page) noexcept nogil
    cdef void remove_all(self) noexcept nogil
