# KV events of the prefix cache: the C log (kv_events.h), its owner and the drained events.
from libc.stdint cimport uint8_t, uint64_t
from pagedkv_c._types cimport int32_t, int64_t


cdef extern from "kv_events.h":
    ctypedef struct pkv_kv_event:
        uint64_t lo                      # the page's hash, low 64 bits
        uint64_t hi                      #   and high 64 bits
        uint64_t parent_lo               # stored: the previous page's hash, when has_parent
        uint64_t parent_hi
        int64_t token_offset             # stored with tokens: index of its first id in tokens
        uint8_t kind                     # PKV_KV_STORED, PKV_KV_REMOVED or PKV_KV_CLEARED
        uint8_t has_parent
        uint8_t has_tokens
        uint8_t continues                # stored: next page of the sequence of the record before
    ctypedef struct pkv_kv_events:
        pkv_kv_event* records            # (allocated,)
        int32_t* tokens                  # (token_allocated,) token ids of stored records
        int64_t allocated
        int64_t token_allocated
        int64_t capacity                 # most records kept between two drains
        int64_t count                    # records kept
        int64_t num_tokens               # token ids kept
        int64_t page_size                # token ids per stored page
        int64_t dropped                  # records dropped since the last drain
        int64_t total_recorded           # records kept over the log's life
        int64_t total_dropped            # records dropped over the log's life
    enum:
        PKV_KV_STORED
        PKV_KV_REMOVED
        PKV_KV_CLEARED
    void pkv_kv_events_stored(pkv_kv_events* ev, uint64_t lo, uint64_t hi, const uint64_t* parent,
                              const int32_t* tokens, int continues) noexcept nogil
    void pkv_kv_events_removed(pkv_kv_events* ev, uint64_t lo, uint64_t hi) noexcept nogil
    void pkv_kv_events_cleared(pkv_kv_events* ev) noexcept nogil
    void pkv_kv_events_reset(pkv_kv_events* ev) noexcept nogil
    void pkv_kv_events_detach(pkv_kv_events* ev, pkv_kv_event** records, int64_t* allocated,
                              int32_t** tokens, int64_t* token_allocated) noexcept nogil
    void pkv_kv_events_give_back(pkv_kv_events* ev, pkv_kv_event* records, int64_t allocated,
                                 int32_t* tokens, int64_t token_allocated) noexcept nogil
    void pkv_kv_events_free(pkv_kv_events* ev) noexcept nogil


cdef class KVEventLog:
    cdef pkv_kv_events log               # the C log; KVCache points its prefix index at it

    cdef object take(self)


cdef class KVEvents:
    cdef pkv_kv_event* records           # (num_records,) owned: given back to the log (or freed) with the object
    cdef int32_t* tokens                 # token ids of stored records, owned likewise
    cdef int64_t allocated, token_allocated  # their allocated lengths
    cdef KVEventLog log                  # the log the buffers return to
    cdef readonly int64_t num_records    # page-level records (a BlockStored of k pages is k of them)
    cdef readonly int64_t page_size      # tokens per page
    cdef readonly int64_t num_dropped    # events the log dropped before this drain
    cdef readonly int64_t num_pages_stored   # pages that entered the prefix cache
    cdef readonly int64_t num_pages_removed  # cached pages that left it
    cdef int64_t num_events              # events after grouping (len())
