# PagePool: free-list page allocator with per-page ref counts.
from pagedkv_c._types cimport page_id_t, int32_t
from libc.stdint cimport uint32_t
from pagedkv_c._prefix cimport PrefixIndex


cdef extern from "page_pool.h":
    # The allocator's single-page operations, inlined by every module that loops over pages.
    ctypedef struct pkv_free_queue:
        int32_t* rec
        int32_t sentinel
        int32_t num_free
    void pkv_queue_remove(pkv_free_queue* q, int32_t page) noexcept nogil
    void pkv_queue_push(pkv_free_queue* q, int32_t page) noexcept nogil
    int32_t pkv_queue_head(const pkv_free_queue* q) noexcept nogil
    bint pkv_queue_contains(const pkv_free_queue* q, int32_t page) noexcept nogil
    int32_t pkv_ref(const pkv_free_queue* q, int32_t page) noexcept nogil
    void pkv_set_ref(pkv_free_queue* q, int32_t page, int32_t count) noexcept nogil
    void pkv_incref(pkv_free_queue* q, int32_t page) noexcept nogil
    int32_t pkv_drop_ref(pkv_free_queue* q, int32_t page) noexcept nogil
    int32_t pkv_decref(pkv_free_queue* q, int32_t page) noexcept nogil


cdef class PagePool:
    cdef readonly int32_t num_pages   # pages in the pool; ids are 0 .. num_pages-1
    # Free queue and ref counts over the records below (see page_pool.h);
    # q.num_free is the number of pages in the queue.
    cdef pkv_free_queue q
    # Per-page record [prev, next, ref count, unused] (int32, 16 bytes): the
    # fields a page operation touches share one cache line. Row num_pages is
    # the free queue's sentinel.
    cdef object _records              # int32 array (num_pages + 1, 4), q.rec points into it
    cdef int32_t[:] _ref_count        # shape (num_pages,): references per page, 0 = free
    # Free queue: an intrusive circular doubly linked list over page ids with a
    # sentinel at index num_pages. Head = next to hand out (least recently
    # freed), tail = most recently freed. A page not in the queue has both
    # links set to NO_PAGE.
    cdef int32_t[:] _prev             # shape (num_pages + 1,), a column of _records
    cdef int32_t[:] _next             # shape (num_pages + 1,), a column of _records
    # Scratch for planning a batch before mutating: references a planned call
    # would drop per page. All zeros between calls.
    cdef int32_t[::1] _pending        # shape (num_pages,)
    # Prefix cache over this pool, or None. A cached page handed out again by
    # pop_free loses its hash (eviction).
    cdef readonly PrefixIndex prefix
    # Name of the structure whose page tables own this pool's references
    # ("KVCache"), or None for a standalone pool. The public allocate, free
    # and incref refuse to run on an owned pool: they would desynchronise it.
    cdef readonly object owner
    # Duplicate detection in batch calls without clearing a mark array: a page
    # was seen in the current call iff _seen_stamp[page] == _stamp.
    cdef uint32_t[::1] _seen_stamp    # shape (num_pages,)
    cdef uint32_t _stamp              # stamp of the current call, never 0

    # C-level interface. Callers check capacity and page validity first.
    cdef page_id_t pop_free(self) noexcept nogil
    cdef void push_free(self, page_id_t page_id) noexcept nogil
    cdef void remove_free(self, page_id_t page_id) noexcept nogil
    cdef bint is_free_listed(self, page_id_t page_id) noexcept nogil
    cdef void take(self, page_id_t* out, Py_ssize_t n) noexcept nogil
    cdef void incref_one(self, page_id_t page_id) noexcept nogil
    cdef void claim(self, page_id_t page_id) noexcept nogil
    cdef int32_t decref_one(self, page_id_t page_id) noexcept nogil
    cdef int32_t drop_ref(self, page_id_t page_id) noexcept nogil
    cdef int32_t get_ref(self, page_id_t page_id) noexcept nogil
    cdef bint ids_valid(self, const page_id_t* ids, Py_ssize_t n, bint forbid_duplicates) noexcept nogil
    cdef object _checked_ids(self, object page_ids, bint forbid_duplicates)
    cdef int _check_unowned(self, str method) except -1
