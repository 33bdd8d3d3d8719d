# Scalar types and sentinels shared by every module of the core.
from libc.stdint cimport int32_t, int64_t, uint8_t

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
