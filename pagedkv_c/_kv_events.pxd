# KV events of the prefix cache: the C log (kv_events.h), its owner and the drained events.
from libc.stdint cimport uint8_t, uint64_t
from pagedkv_c._types cimport int32_t, int64_t


cdef extern from "kv_events.h":
    ctypedef struct pkv_kv_unit:
        uint64_t lo                      # a page hash (low 64 bits), or a header's kind | flags
        uint64_t hi                      # its high 64 bits, or a header's number of pages
    ctypedef struct pkv_kv_events:
        pkv_kv_unit* units               # (allocated,) headers, parents and page hashes
        int32_t* tokens                  # (token_allocated,) token ids of stored pages
        int64_t allocated
        int64_t token_allocated
        int64_t capacity                 # most page records kept between two drains
        int64_t count                    # page records kept
        int64_t num_units                # units used
        int64_t num_tokens               # token ids kept
        int64_t page_size                # token ids per stored page
        int64_t open                     # header of the event a page may extend, or -1
        uint64_t open_flags              # its flags, PKV_KV_NO_EVENT when none is open
        int64_t open_pages               # its pages so far (its header holds them once closed)
        int64_t num_events               # events kept (as vLLM counts them)
        int64_t num_stored               # stored page records in closed events
        int64_t num_removed              # removed page records in closed events
        int64_t dropped                  # records dropped since the last drain
        int64_t total_dropped            # records dropped over the log's life
    enum:
        PKV_KV_STORED
        PKV_KV_REMOVED
        PKV_KV_CLEARED
        PKV_KV_KIND_MASK
        PKV_KV_HAS_PARENT
        PKV_KV_HAS_TOKENS
    void pkv_kv_events_stored(pkv_kv_events* ev, uint64_t lo, uint64_t hi, const uint64_t* parent,
                              const int32_t* tokens, int continues) noexcept nogil
    void pkv_kv_events_stored_run(pkv_kv_events* ev, const uint64_t* hashes, int64_t n, const uint64_t* parent,
                                  const int32_t* tokens, int continues) noexcept nogil
    void pkv_kv_events_close(pkv_kv_events* ev) noexcept nogil
    void pkv_kv_events_removed(pkv_kv_events* ev, uint64_t lo, uint64_t hi) noexcept nogil
    void pkv_kv_events_cleared(pkv_kv_events* ev) noexcept nogil
    int64_t pkv_kv_events_total_recorded(const pkv_kv_events* ev) noexcept nogil
    void pkv_kv_events_reset(pkv_kv_events* ev) noexcept nogil
    void pkv_kv_events_detach(pkv_kv_events* ev, pkv_kv_unit** units, int64_t* allocated,
                              int32_t** tokens, int64_t* token_allocated) noexcept nogil
    void pkv_kv_events_give_back(pkv_kv_events* ev, pkv_kv_unit* units, int64_t allocated,
                                 int32_t* tokens, int64_t token_allocated) noexcept nogil
    void pkv_kv_events_free(pkv_kv_events* ev) noexcept nogil


cdef class KVEventLog:
    cdef pkv_kv_events log               # the C log; KVCache points its prefix index at it

    cdef object take(self)


cdef class _EncodeOptions:      # checked options of an encoding
    cdef bytes medium_utf8
    cdef const char* medium_chars
    cdef size_t medium_len
    cdef int64_t rank, window_tokens
    cdef int as_bytes


cdef class KVEvents:
    cdef pkv_kv_unit* units              # (num_units,) owned: given back to the log (or freed) with the object
    cdef int32_t* tokens                 # (num_tokens,) token ids of stored pages, owned likewise
    cdef int64_t allocated, token_allocated  # their allocated lengths
    cdef int64_t num_units, num_tokens   # units and token ids used
    cdef KVEventLog log                  # the log the buffers return to
    cdef readonly int64_t num_records    # page-level records (a BlockStored of k pages is k of them)
    cdef readonly int64_t page_size      # tokens per page
    cdef readonly int64_t num_dropped    # events the log dropped before this drain
    cdef readonly int64_t num_pages_stored   # pages that entered the prefix cache
    cdef readonly int64_t num_pages_removed  # cached pages that left it
    cdef int64_t num_events              # events as vLLM counts them (len())

    cdef size_t _encode_bound(self, _EncodeOptions options) noexcept
    cdef size_t _encode_into(self, double ts, _EncodeOptions options, uint8_t* out) noexcept

