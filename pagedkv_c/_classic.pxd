# PagedKVCache: the classic single-stream KV store, indexed by token, whose
# oldest resident page is evicted (FIFO) when the page limit is reached.
from pagedkv_c._types cimport page_id_t, int32_t, int64_t, uint8_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._page_map cimport PageMap
from pagedkv_c._lock cimport CacheLock


cdef class PagedKVCache:
    cdef readonly int32_t max_pages       # page limit of the cache (in pages)
    cdef readonly Py_ssize_t dim          # length of one key or value vector (in elements)
    cdef readonly Py_ssize_t page_size    # tokens per page
    cdef readonly object dtype            # numpy.dtype of the pool (a native floating type)
    cdef readonly int64_t evictions       # pages evicted since construction (in pages)
    cdef int _type_num                    # NumPy type number of dtype, for the fast input checks
    cdef Py_ssize_t _row_bytes            # bytes of one key (= of one value): dim * itemsize
    cdef Py_ssize_t _half_page_bytes      # bytes of the K (or the V) half of a page: page_size * _row_bytes
    cdef int64_t _num_tokens              # tokens present (in tokens)
    cdef int64_t _hits                    # tokens that get/get_many found present, since construction
    cdef int64_t _misses                  # tokens that get/get_many found absent, since construction
    cdef CacheLock _lock                  # held for the whole of every call that reads or changes the state

    cdef PagePool _pool                   # hands out page ids 0 .. max_pages-1
    cdef PageMap _page_map                # logical page index -> page id of every resident page
    cdef object _kv                       # ndarray (max_pages, 2, page_size, dim), dtype: the pool, 0 = K, 1 = V
    cdef char* _kv_data                   # data pointer of _kv
    cdef uint8_t[:, ::1] _present         # shape (max_pages, page_size): 1 if the slot holds a token
    cdef int32_t[::1] _page_num_tokens    # shape (max_pages,): tokens present per page id
    # Resident pages in insertion order: a ring of max_pages entries starting
    # at _ring_head (oldest, next to evict) holding _num_resident pages.
    cdef int64_t[::1] _ring_logical_page  # shape (max_pages,): logical page index
    cdef page_id_t[::1] _ring_page_id     # shape (max_pages,): page id of the same entry
    cdef int32_t _ring_head
    cdef int32_t _num_resident

    # C-level interface (the GIL is not needed; arguments are validated).
    cdef page_id_t page_for_write(self, int64_t logical_page) noexcept nogil
    cdef void write_token(self, page_id_t page_id, Py_ssize_t offset,
                          const char* key, const char* value) noexcept nogil
    cdef bint read_token(self, page_id_t page_id, Py_ssize_t offset,
                         char* key, char* value) noexcept nogil
    cdef void put_rows(self, const int64_t* token_idxs, Py_ssize_t n,
                       const char* keys, const char* values) noexcept nogil
    cdef Py_ssize_t get_rows(self, const int64_t* token_idxs, Py_ssize_t n,
                             char* keys, char* values, uint8_t* present) noexcept nogil

    # Validation helpers (with the GIL, before any state changes).
    cdef object _vector(self, object arr, str name)
    cdef object _matrix(self, object arr, str name, Py_ssize_t num_rows)
    cdef object _token_array(self, object token_idxs)
    cdef tuple _check_out(self, object out, object tokens)
    cdef object _resident_logical_pages(self)
    cdef int _check_state(self) except -1

    cdef object __weakref__               # lets a metrics collector hold the cache weakly
