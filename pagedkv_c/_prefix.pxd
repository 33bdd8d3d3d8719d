# Prefix caching: chained 128-bit page hashes, the hash -> page index, and
# the per-sequence hash chain.
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from pagedkv_c._types cimport page_id_t, int32_t, int64_t, pkv_page_record
from pagedkv_c._kv_events cimport pkv_kv_events


cdef struct hash128:
    uint64_t lo
    uint64_t hi


cdef enum HashAlgorithm:
    HASH_XXH3_128 = 0   # xxHash XXH3, 128-bit: fast, not collision resistant against an adversary
    HASH_SHA256 = 1     # SHA-256 truncated to 128 bits: for untrusted multi-tenant traffic


cdef int hash_token_pages(int algorithm, hash128 parent, hash128 salt, const int32_t* tokens,
                          Py_ssize_t page_size, Py_ssize_t num_pages, hash128* out) except -1
cdef int hash_block_pages(int algorithm, hash128 parent, hash128 salt, const int64_t* block_ids,
                          Py_ssize_t pages_per_block, Py_ssize_t first_page, Py_ssize_t num_pages,
                          hash128* out) except -1
cdef hash128 hash_salt(int algorithm, object extra_key) except *
cdef hash128 hash_group_mix(int algorithm, int64_t group) except *


cdef extern from "prefix_index.h":
    # The index operations, inlined by every module that loops over pages.
    ctypedef struct pkv_index_slot:
        uint32_t lo32                    # hash, low 32 bits (pick the home slot, filter matches)
        int32_t page                     # page id, or NO_PAGE for an empty slot
    ctypedef struct pkv_index:
        pkv_index_slot* slots            # (mask + 1,)
        int64_t mask                     # capacity - 1
        pkv_page_record* pages           # (num_pages,) per-page records, shared with the allocator
        int64_t num_cached               # pages in the index
        int64_t evictions                # cached pages dropped because the allocator reused them
        pkv_kv_events* events            # KV event log of every removal, or NULL (kv_events.h)
    bint pkv_index_is_cached(const pkv_index* ix, int32_t page) noexcept nogil
    void pkv_index_prefetch(const pkv_index* ix, uint64_t lo) noexcept nogil
    void pkv_index_prefetch_page(const pkv_index* ix, int32_t page) noexcept nogil
    int32_t pkv_index_find(const pkv_index* ix, uint64_t lo, uint64_t hi) noexcept nogil
    bint pkv_index_insert(pkv_index* ix, uint64_t lo, uint64_t hi, int32_t page) noexcept nogil
    void pkv_index_remove(pkv_index* ix, int32_t page) noexcept nogil
    void pkv_index_evict(pkv_index* ix, int32_t page) noexcept nogil


cdef class PrefixIndex:
    cdef readonly int32_t num_pages
    cdef readonly int32_t page_size      # tokens per page
    cdef readonly int algorithm          # a HashAlgorithm
    # Open-addressing table (linear probing, backward-shift deletion), power-of-two
    # capacity >= 4 * num_pages, so at most a quarter full; 8-byte slots, eight per cache line.
    # ix points into the arrays below, which own the per-page records.
    cdef pkv_index ix
    cdef object page_records             # uint64 array (num_pages, 4) holding ix.pages
    cdef uint8_t[:] page_cached          # (num_pages,) views of the record fields:
    cdef uint8_t[:] has_tokens           #   cached flag, 1 if tokens[page] holds its token ids
    cdef int32_t[:, ::1] tokens          # (num_pages, page_size) token ids, compared on every hit

    cdef bint tokens_match(self, page_id_t page_id, const int32_t* tokens) noexcept nogil
    # Snapshots: validate, then apply, an exported index state (_export_state).
    cdef int _check_state(self, dict state) except -1
    cdef int _apply_state(self, dict state) except -1


cdef class SequenceHashes:
    cdef hash128 salt                    # digest of the request's extra_key (zeros without one)
    cdef bint external                   # hashes come from external block ids, not tokens
    cdef object chain_array              # uint64 (capacity, 2): owns chain
    cdef hash128* chain                  # (capacity,) chained hash of each full logical page
    cdef int64_t chain_capacity
    cdef int64_t num_hashed              # leading logical pages with a computed hash
    cdef int64_t num_hashable            # leading logical pages whose hash can be computed
    # External sequences: the block ids (int64, C-contiguous) their hashes come from.
    cdef object block_ids
    cdef int64_t pages_per_block
    cdef int32_t[::1] token_ids          # (capacity,) token ids known for positions 0 .. num_known-1
    cdef int64_t num_known               # positions with a known token id
    cdef int64_t num_registered          # leading logical pages already offered to the index

    cdef int reserve_tokens(self, int64_t n) except -1
    cdef int reserve_hashes(self, int64_t n) except -1
    cdef void _set_chain(self, object array)
    cdef hash128 _last_hash(self) noexcept nogil
    cdef int extend_hashes(self, int algorithm, int32_t page_size) except -1
    cdef int set_external(self, object block_ids, int64_t pages_per_block, int64_t num_pages) except -1
    cdef int hash_upto(self, int algorithm, int64_t n) except -1
    cdef void truncate(self, int64_t new_len, int32_t page_size) noexcept nogil
    cdef SequenceHashes copy(self)
