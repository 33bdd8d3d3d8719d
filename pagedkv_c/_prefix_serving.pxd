# PrefixServer: prefix caching over the PrefixIndex (match and serve a prompt's cached pages,
# register pages as they fill), its counters and its KV events.
cimport cython
from pagedkv_c._types cimport int32_t, int64_t, page_id_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._prefix cimport PrefixIndex, SequenceHashes, hash128, pkv_index_insert
from pagedkv_c._page_table cimport PageTable
from pagedkv_c._kv_events cimport KVEventLog

# Buckets of the prefix-hit histogram: 0 tokens, <= 2**4 .. 2**20 tokens, more (PREFIX_HIT_BUCKETS).
cdef enum:
    NUM_PREFIX_HIT_BUCKETS = 19


cdef class PrefixServer:
    cdef readonly PrefixIndex index       # hash -> cached page
    cdef PagePool pool
    cdef int32_t page_size                # tokens per page
    cdef object window                    # the cache's window: None or int, in tokens
    cdef KVEventLog events                # prefix-cache KV event log, or None when disabled
    cdef object group_mix                 # uint64 (num_groups, 2): each page group's salt mix, or None (one group)
    # Counters reported by KVCache.stats(), since construction.
    cdef int64_t queries                  # prompt tokens looked up, in tokens
    cdef int64_t hits                     # prompt tokens served from cached pages, in tokens
    cdef int64_t hit_counts[NUM_PREFIX_HIT_BUCKETS]  # lookups per hit-length bucket

    cdef SequenceHashes new_hashes(self, object extra_key, object prompt, object blocks, int64_t pages_per_block,
                                   int64_t num_pages)
    cdef SequenceHashes _salted_hashes(self, hash128 salt, object prompt, object blocks, int64_t pages_per_block,
                                       int64_t num_pages)
    cdef list new_group_hashes(self, object extra_key, object prompt, object blocks, int64_t pages_per_block,
                               int64_t num_pages)
    @cython.final  # per lookup and per page: a direct call within the module
    cdef int64_t match(self, PageTable table, const int32_t* prompt, int64_t prompt_len) except -1
    @cython.final
    cdef int64_t _serve(self, PageTable table, const int32_t* prompt, int64_t prompt_len,
                        int64_t servable, page_id_t* hit) except -1
    @cython.final
    cdef int64_t _lookup(self, PageTable table, const int32_t* prompt, int64_t servable, page_id_t* hit) except -1
    @cython.final
    cdef int _take(self, PageTable table, const page_id_t* hit, int64_t m, int64_t first_window) except -1
    cdef int64_t match_groups(self, list tables, const int32_t* prompt, int64_t prompt_len) except -1
    cdef int check_groups(self, list group_tables, dict prefix_state) except -1
    cdef void note_hit(self, int64_t tokens) noexcept nogil
    @cython.final
    cdef int register_full_pages(self, PageTable table) except -1
    cdef int reserve_tokens(self, list tables, const int64_t* counts) except -1
    cdef int record_tokens(self, list tables, list first_positions, const int64_t* counts, object ids) except -1
    cdef int64_t leading_hits(self, SequenceHashes hashes, const int32_t* tokens, int64_t servable) except -1
    # Inline (body here): registration calls it once per page of every prompt, the tier once per fetched page.
    cdef inline void index_page(self, SequenceHashes hashes, int64_t logical, page_id_t page_id) noexcept:
        """Index ``page_id`` under the hash of logical page ``logical`` of ``hashes``, with its token ids.

        Nothing happens when another page is cached under that hash already.
        """
        cdef Py_ssize_t t, ps = self.page_size
        if pkv_index_insert(&self.index.ix, hashes.chain[logical].lo, hashes.chain[logical].hi, page_id) \
                and not hashes.external:
            for t in range(ps):
                self.index.tokens[page_id, t] = hashes.token_ids[logical * ps + t]
            self.index.has_tokens[page_id] = 1
    cdef bint reset(self) except -1
    cdef dict stats(self, bint with_metrics)
    cdef dict event_stats(self)
    cdef dict counters(self)
    cdef int check_registered(self, dict tables, dict prefix_state) except -1


cdef PrefixServer new_prefix_server(PagePool pool, int32_t page_size, object window, object algorithm,
                                    bint enable_kv_events, int64_t kv_events_capacity, int32_t num_groups=*)


cdef inline int64_t servable_pages(int64_t prompt_len, int64_t page_size, int64_t num_hashable) noexcept nogil:
    """Pages of a prompt that prefix caching may serve: its full pages but never the last token's, at most
    ``num_hashable`` (the pages whose hash can be computed)."""
    return min((prompt_len - 1) // page_size if prompt_len > 0 else 0, num_hashable)
