# KVCache: paged K/V storage for many sequences and layers over one pool array.
cimport cython
from pagedkv_c._types cimport int32_t, int64_t, page_id_t
from libc.stdint cimport uint8_t, uint64_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._prefix cimport PrefixIndex, SequenceHashes
from pagedkv_c._page_table cimport PageTable
from pagedkv_c._lock cimport CacheLock
from pagedkv_c._kv_events cimport KVEventLog
from pagedkv_c._prefix cimport pkv_index


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

# Buckets of the prefix-hit histogram: 0 tokens, <= 2**4 .. 2**20 tokens, more (PREFIX_HIT_BUCKETS).
cdef enum:
    NUM_PREFIX_HIT_BUCKETS = 19


cdef class KVCache:
    cdef readonly object kv               # ndarray (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
    cdef readonly PagePool pool           # allocator over page ids 0 .. num_pages-1
    cdef readonly int32_t num_layers
    cdef readonly int32_t num_kv_heads
    cdef readonly int32_t head_dim
    cdef readonly int32_t page_size       # tokens per page
    cdef object _window                   # None or int, in tokens
    cdef readonly int64_t sink_tokens     # in tokens
    cdef dict _tables                     # seq_id (int) -> PageTable
    cdef CacheLock _lock                  # serializes every call that reads or changes page tables
    cdef char* _data                      # kv's buffer
    cdef Py_ssize_t _row_bytes            # bytes of one token's K (or V): num_kv_heads * head_dim * itemsize
    cdef Py_ssize_t _page_bytes           # bytes of one page in one layer: 2 * page_size * row_bytes
    cdef Py_ssize_t _layer_bytes          # bytes of one layer: num_pages * page_bytes
    # Counters reported by stats().
    cdef int64_t _pages_peak              # most pages in use at once, in pages
    cdef int64_t _evictions               # page-table entries released by the window
    cdef int64_t _cow_copies              # pages copied on write
    cdef int64_t _tokens_appended         # tokens reserved by append over the cache's life
    cdef PrefixIndex _prefix              # prefix cache, or None when disabled
    cdef int64_t _prefix_queries          # prompt tokens looked up, in tokens
    cdef int64_t _prefix_hits             # prompt tokens served from cached pages, in tokens
    cdef KVEventLog _kv_events            # prefix-cache KV event log, or None when disabled

    cdef object _table(self, object seq_id)
    cdef list _tables_for(self, object seq_ids)
    cdef void _copy_page(self, int32_t src, int32_t dst) noexcept nogil
    cdef void _note_usage(self) noexcept nogil
    cdef int64_t _match_prefix(self, PageTable table, const int32_t* prompt, int64_t prompt_len,
                               int64_t num_hashable) except -1
    cdef int64_t _serve_prefix(self, PageTable table, const int32_t* prompt, int64_t prompt_len,
                               int64_t servable, page_id_t* hit) except -1
    cdef int _register_full_pages(self, PageTable table) except -1
    cdef int _check_registered(self, dict tables, dict prefix) except -1
    # Shared tier (pagedkv.tiers): sealed pages go to it, add_sequence fetches from it.
    cdef object _tier                     # the tier, or None
    cdef int64_t _tier_hits               # prompt tokens served from the tier, in tokens
    cdef object _tier_lookup(self, PageTable table, object prompt, int64_t prompt_len)
    cdef int64_t _tier_install(self, PageTable table, object fetched, int64_t num_local) except -1
    cdef int _offload_sealed(self) except -1
    cdef PageTable _new_table(self)

    # ---- Sealed pages (docs/page_integrity.md): full pages whose K/V is complete in every layer.
    cdef object _sealed_array             # uint8 (num_pages,): 1 while the page is sealed (a strided
                                          # view of the seal flags in the pool's page records)
    cdef object _checksum_array           # uint64 (num_pages,): checksum recorded at the seal, or None
    cdef uint64_t* _checksums             # its data; NULL unless page_checksums=True
    cdef uint8_t* _digest_scratch         # (16 * num_layers,) bytes for pkv_page_checksum (malloc)
    cdef page_id_t* _seal_buffer          # pages an append will seal, listed before it changes anything
    cdef Py_ssize_t _seal_capacity        # entries of _seal_buffer
    cdef pkv_index* _ix                   # the prefix index's C struct, or NULL without prefix caching
    cdef const int32_t* _index_tokens     # (num_pages, page_size) token ids kept by the index, or NULL
    cdef pkv_sealed_log _log              # sealed-page log, allocated while _log_enabled
    cdef bint _log_enabled
    cdef int64_t _pages_sealed            # seals over the cache's life, in pages
    cdef bint _log_without_checksums      # the log's consumer computes checksums itself (the shared tier)
    cdef int64_t _log_drops_reported      # the log's num_dropped already returned by _take_sealed_copies

    cdef int _init_sealing(self, bint page_checksums) except -1
    cdef void _update_seal_on_take(self) noexcept
    # final: called once per page in the append and removal loops (a direct, inlinable call, no vtable)
    @cython.final
    cdef bint _seal_page(self, page_id_t page_id) noexcept nogil
    cdef int64_t _seal_table(self, PageTable table) noexcept nogil
    @cython.final
    cdef void _unseal_page(self, page_id_t page_id) noexcept nogil
    cdef Py_ssize_t _list_seals(self, list tables, const int64_t* counts) except -1
    cdef void _after_append_seals(self, list tables, const int64_t* counts, Py_ssize_t num_listed)

    # Metrics (stats(), pagedkv.metrics): plain counters updated where the event happens.
    cdef int64_t _num_out_of_pages        # OutOfPagesError raised by append
    cdef int64_t _sequences_added         # sequences created by add_sequence and fork
    cdef int64_t _prefix_hit_counts[NUM_PREFIX_HIT_BUCKETS]  # prefix lookups per hit-length bucket
    cdef object __weakref__               # lets a metrics collector hold the cache weakly
    cdef void _note_prefix_hit(self, int64_t tokens) noexcept nogil
