# Scalar types and sentinels shared by every module of the core.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t, INT64_MAX

# Page ids are int32: FlashInfer's page-table arrays (indptr, indices,
# last_page_len) are int32, so a wider id could not be exported without a copy.
ctypedef int32_t page_id_t

# Token positions and slots are int64: a slot is page_id * page_size + offset,
# which overflows int32 for pools of more than 2**31 tokens (vLLM's slot
# mapping is int64 for the same reason).
ctypedef int64_t pos_t
ctypedef int64_t slot_t

# "No page": empty page-table entry, end of a free-queue walk, padding in vLLM
# block tables.
cdef enum:
    NO_PAGE = -1

# Padding slot in a slot mapping: the token is not stored (vLLM's convention).
cdef enum:
    PAD_SLOT = -1


cdef extern from "page_record.h":
    # One 32-byte record per page, shared by the allocator's free queue and
    # the prefix index; a pool without an index keeps only the allocator's
    # first 16 bytes (see page_record.h).
    ctypedef struct pkv_page_record:
        int64_t qpos                  # allocator: absolute position of the live queue entry, or -1
        int32_t ref                   # allocator: ref count; 0 = free (queued)
        uint8_t cached                # prefix index: 1 while findable by its hash
        uint8_t has_tokens            # prefix index: 1 when the token ids are kept for hit checks
        uint8_t sealed                # KVCache: 1 while the page is sealed
        uint64_t lo                   # prefix index: hash while cached, low 64 bits
        uint64_t hi                   #   and high 64 bits
    # log2 of the record stride: the allocator's 16 bytes alone, or the whole record.
    int PKV_ALLOCATOR_RECORD_SHIFT
    int PKV_SEALED_OFFSET             # byte offset of the seal flag in a record
    int PKV_SHARED_RECORD_SHIFT


# Counters (in tokens, pages, calls) hold at INT64_MAX instead of wrapping: a
# snapshot may start them anywhere in [0, 2**63), and a wrapped, negative
# counter would make the next snapshot unloadable.
cdef inline int64_t sat_add(int64_t counter, int64_t amount) noexcept nogil:
    """``counter + amount`` (both >= 0), or INT64_MAX where the sum would not fit."""
    return counter + amount if amount <= INT64_MAX - counter else INT64_MAX
