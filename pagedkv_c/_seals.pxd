# SealTracker: the seal life cycle of pages, their checksums and the sealed-page log.
cimport cython
from libc.stdint cimport uint8_t, uint64_t
from pagedkv_c._types cimport int32_t, int64_t, page_id_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._page_table cimport PageTable
from pagedkv_c._page_store cimport PageStore
from pagedkv_c._prefix cimport PrefixIndex, pkv_index


cdef extern from "sealed_log.h":
    # Bounded log of sealed pages for a consumer that copies them out (see sealed_log.h).
    ctypedef struct pkv_sealed_log:
        int64_t capacity                  # entries that can wait at once
        int64_t head, tail                # absolute positions: pending entries in [head, tail)
        int64_t num_logged                # entries ever appended
        int64_t num_dropped               # seals not logged because the log was full
        int64_t num_withdrawn             # entries withdrawn: their page was written again first
    int pkv_sealed_log_init(pkv_sealed_log* log, int64_t capacity, int64_t page_size, int64_t num_pages) noexcept nogil
    void pkv_sealed_log_free(pkv_sealed_log* log) noexcept nogil
    void pkv_sealed_log_push(pkv_sealed_log* log, int32_t page, uint64_t hash_lo, uint64_t hash_hi,
                             const int32_t* token_ids, uint64_t checksum) noexcept nogil
    void pkv_sealed_log_withdraw(pkv_sealed_log* log, int32_t page) noexcept nogil
    void pkv_sealed_log_clear(pkv_sealed_log* log) noexcept nogil
    int64_t pkv_sealed_log_count(const pkv_sealed_log* log) noexcept nogil
    void pkv_sealed_log_drain(pkv_sealed_log* log, int32_t* page_ids, uint64_t* hashes,
                              int32_t* token_ids, uint64_t* checksums) noexcept nogil


cdef extern from "sealed_copy.h":
    # Drain the sealed-page log and copy the pages out in one step (the shared tier's offload).
    int64_t pkv_sealed_log_take_copies(pkv_sealed_log* log, const uint8_t* pool, size_t layer_stride,
                                       size_t page_bytes, int64_t num_layers, int64_t max_pages,
                                       int discard_rest, uint8_t* records, size_t record_bytes,
                                       size_t token_offset, size_t body_offset, uint64_t* hashes,
                                       int64_t* num_discarded) noexcept nogil


cdef class SealTracker:
    cdef PagePool pool
    cdef PageStore store                  # the pool's bytes: checksums and copies read them
    cdef int32_t page_size
    cdef object sealed_array              # uint8 (num_pages,): 1 while the page is sealed (a strided
                                          # view of the seal flags in the pool's page records)
    cdef object checksum_array            # uint64 (num_pages,): checksum recorded at the seal, or None
    cdef uint64_t* checksums              # its data; NULL unless page_checksums=True
    cdef uint8_t* digest_scratch          # (16 * num_layers,) bytes for pkv_page_checksum (malloc)
    cdef page_id_t* seal_buffer           # pages an append will seal, listed before it changes anything
    cdef Py_ssize_t seal_capacity         # entries of seal_buffer
    cdef pkv_index* ix                    # the prefix index's C struct, or NULL without prefix caching
    cdef const int32_t* index_tokens      # (num_pages, page_size) token ids kept by the index, or NULL
    cdef pkv_sealed_log log               # sealed-page log, allocated while log_enabled
    cdef bint log_enabled
    cdef int64_t pages_sealed             # seals over the cache's life, in pages
    cdef bint log_without_checksums       # the log's consumer computes checksums itself (the shared tier)
    cdef int64_t log_drops_reported       # the log's num_dropped already returned by take_copies

    cdef void update_seal_on_take(self) noexcept
    # final: called once per page in the append and removal loops (a direct, inlinable call, no vtable)
    @cython.final
    cdef bint seal_page(self, page_id_t page_id) noexcept nogil
    @cython.final
    cdef void unseal_page(self, page_id_t page_id) noexcept nogil
    cdef int64_t seal_table(self, PageTable table) noexcept nogil
    cdef Py_ssize_t list_seals(self, list tables, const int64_t* counts) except -1
    cdef void after_append(self, list tables, const int64_t* counts, Py_ssize_t num_listed)
    cdef void seal_written(self, page_id_t page_id, uint64_t checksum) noexcept nogil
    cdef bint has_pending(self) noexcept
    cdef object verify(self, list held, object tables)
    cdef int enable_log(self, bint enabled, int64_t entries) except -1
    cdef tuple take_pages(self)
    cdef dict log_stats(self)
    cdef dict state(self)
    cdef tuple checked_state(self, object sealed, object checksums, object pages_sealed)
    cdef void apply_state(self, tuple checked, dict tables)
    cdef tuple checked_copy_targets(self, object records, Py_ssize_t token_offset, Py_ssize_t body_offset,
                                    object page_hashes)
    cdef tuple take_copies(self, object rows, object hashes, Py_ssize_t token_offset, Py_ssize_t body_offset,
                           bint discard_rest)
    cdef int check_invariants(self) except -1


cdef SealTracker new_seal_tracker(PagePool pool, PageStore store, PrefixIndex prefix, bint page_checksums)
