# State export, check and restore of a KVCache: snapshots (pagedkv.snapshot) and sequence moves.
from pagedkv_c._types cimport int64_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._page_table cimport PageTable
from pagedkv_c._page_group cimport PageGroup
from pagedkv_c._page_store cimport PageStore
from pagedkv_c._prefix_serving cimport PrefixServer
from pagedkv_c._seals cimport SealTracker
from pagedkv_c._lock cimport CacheLock


# Counters of the cache as a whole, reported by KVCache.stats() and carried by snapshots.
cdef struct CacheCounters:
    int64_t pages_peak                    # most pages in use at once, in pages
    int64_t tokens_appended               # tokens reserved by append over the cache's life
    int64_t sequences_added               # sequences created by add_sequence and fork
    int64_t out_of_pages                  # OutOfPagesError raised by append


cdef inline void note_usage(CacheCounters* counters, PagePool pool) noexcept nogil:
    """Raise the peak of pages in use to the pool's current use."""
    cdef int64_t in_use = pool.num_pages - pool.q.num_free
    if in_use > counters.pages_peak:
        counters.pages_peak = in_use


cdef dict state_of(PagePool pool, list groups, PrefixServer prefix, const CacheCounters* counters,
                   dict config)
cdef tuple snapshot(object kv_out, PageStore store, PagePool pool, list groups, PrefixServer prefix,
                    SealTracker seals, const CacheCounters* counters, dict config, CacheLock lock)
cdef int restore_state(dict state, PagePool pool, list groups, PrefixServer prefix, CacheCounters* counters,
                       dict config) except -1
cdef tuple export_sequence(PageTable table, PageStore store)
cdef int import_sequence(object seq_id, dict table_state, object hash_state, object kv, object extra_key,
                         PagePool pool, PageGroup group, PrefixServer prefix, SealTracker seals, PageStore store,
                         CacheCounters* counters, CacheLock lock) except -1
