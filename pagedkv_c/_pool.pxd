# PagePool: free-list page allocator with per-page ref counts.
from pagedkv_c._types cimport page_id_t, int32_t, int64_t, pkv_page_record
from libc.stdint cimport uint32_t
from pagedkv_c._prefix cimport PrefixIndex


cdef extern from "page_pool.h":
    # The allocator's single-page operations, inlined by every module that loops over pages.
    ctypedef struct pkv_free_queue:
        char* rec                     # (num_pages,) records, 1 << rec_shift bytes apart
        int64_t rec_shift
        int32_t* ring                 # (mask + 1,) page ids at ring[position & mask]
        int64_t mask                  # ring capacity - 1
        int64_t head                  # absolute positions: entries live in [head, tail)
        int64_t tail
        int32_t num_free              # pages in the queue
        int64_t num_cached_free       # queued pages still findable by prefix hash (metrics)
    pkv_page_record* pkv_rec(const pkv_free_queue* q, int32_t page) noexcept nogil
    void pkv_queue_remove(pkv_free_queue* q, int32_t page) noexcept nogil
    void pkv_queue_push(pkv_free_queue* q, int32_t page) noexcept nogil
    int32_t pkv_queue_pop(pkv_free_queue* q) noexcept nogil
    void pkv_queue_prefetch(const pkv_free_queue* q, int64_t ahead) noexcept nogil
    void pkv_prefetch_record(const pkv_free_queue* q, int32_t page) noexcept nogil
    int32_t pkv_ref(const pkv_free_queue* q, int32_t page) noexcept nogil
    void pkv_set_ref(pkv_free_queue* q, int32_t page, int32_t count) noexcept nogil
    void pkv_incref(pkv_free_queue* q, int32_t page) noexcept nogil
    int32_t pkv_drop_ref(pkv_free_queue* q, int32_t page) noexcept nogil
    int32_t pkv_decref(pkv_free_queue* q, int32_t page) noexcept nogil


cdef class PagePool:
    cdef readonly int32_t num_pages   # pages in the pool; ids are 0 .. num_pages-1
    # Free queue and ref counts (see page_pool.h): a FIFO ring of page ids with
    # lazy deletion, and one 16-byte record per page [queue position, ref count].
    # q.num_free is the number of pages in the queue.
    cdef pkv_free_queue q
    cdef object _records              # q.rec: int64 (num_pages, 2) allocator records, or the
                                      # prefix index's uint64 (num_pages, 4) shared records
    cdef object _ring                 # int32 array (capacity,): q.ring
    cdef int32_t[:] _ref_count        # shape (num_pages,): references per page, 0 = free (a view of _records)
    # Scratch for planning a batch before mutating: references a planned call
    # would drop per page. All zeros between calls.
    cdef int32_t[::1] _pending        # shape (num_pages,)
    # Prefix cache over this pool (set by attach_prefix; it shares q.rec), or
    # None. A cached page handed out again by take loses its hash (eviction).
    cdef readonly PrefixIndex prefix
    # Name of the structure whose page tables own this pool's references
    # ("KVCache"), or None for a standalone pool. The public allocate, free
    # and incref refuse to run on an owned pool: they would desynchronise it.
    cdef readonly object owner
    # Duplicate detection in batch calls without clearing a mark array: a page
    # was seen in the current call iff _seen_stamp[page] == _stamp.
    cdef uint32_t[::1] _seen_stamp    # shape (num_pages,)
    cdef uint32_t _stamp              # stamp of the current call, never 0
    # Set by an owning KVCache whose seals have no consumer (no checksums, no
    # sealed-page log): take clears a page's seal flag while its record is hot,
    # so the append does not walk its new pages again to unseal them.
    cdef bint clear_seal_on_take

    # C-level interface (single-page operations: the pkv_* functions on q above).
    # Callers check capacity and page validity first.
    cdef void take(self, page_id_t* out, Py_ssize_t n) noexcept nogil
    cdef int32_t decref_one(self, page_id_t page_id) noexcept nogil
    cdef bint ids_valid(self, const page_id_t* ids, Py_ssize_t n, bint forbid_duplicates) noexcept nogil
    cdef object _checked_ids(self, object page_ids, bint forbid_duplicates)
    cdef int _check_unowned(self, str method) except -1
    cdef int attach_prefix(self, PrefixIndex index) except -1
    # Snapshots: validate, then apply, an exported allocator state (_export_state).
    cdef int _check_state(self, object ref_counts, object free_queue) except -1
    cdef void _apply_state(self, const int32_t[::1] ref_counts, const int32_t[::1] free_queue) noexcept

    # Counters since construction, for metrics (KVCache.stats, pagedkv.metrics).
    cdef readonly int64_t num_taken           # pages handed out of the free queue by take (in pages)
    cdef readonly int64_t num_reused_in_place # window pages a ring reused without the free queue (in pages)
