# KV events of the prefix cache: the C log (kv_events.h) and its owner.
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
    void pkv_kv_events_free(pkv_kv_events* ev) noexcept nogil


cdef class KVEventLog:
    cdef pkv_kv_events log               # the C log; KVCache points its prefix index at it

    cdef tuple take(self)
