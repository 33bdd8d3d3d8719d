# KVCache: paged K/V storage for many sequences and layers; the coordinator of the units below.
from pagedkv_c._types cimport int32_t, int64_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._lock cimport CacheLock
from pagedkv_c._page_store cimport PageStore
from pagedkv_c._page_group cimport PageGroup
from pagedkv_c._prefix_serving cimport PrefixServer
from pagedkv_c._seals cimport SealTracker
from pagedkv_c._tier_link cimport TierLink
from pagedkv_c._kv_state cimport CacheCounters


cdef class KVCache:
    cdef readonly PagePool pool           # allocator over page ids 0 .. num_pages-1
    cdef readonly int32_t num_layers
    cdef readonly int32_t num_kv_heads
    cdef readonly int32_t head_dim
    cdef readonly int32_t page_size       # tokens per page
    cdef object _window                   # None or int, in tokens
    cdef readonly int64_t sink_tokens     # in tokens
    cdef CacheLock _lock                  # serializes every call that reads or changes page tables
    cdef PageStore _store                 # the pool array (K/V bytes) and its layout
    cdef str _kv_dtype                    # the page format (PAGE_FORMATS)
    cdef PageGroup _group                 # the page tables of group 0 (the only group of a uniform cache)
    cdef list _groups                     # PageGroup per group, [_group] for a uniform cache
    cdef readonly int32_t num_groups      # page groups (1: one attention setting for every layer)
    cdef tuple _layer_group               # per layer: its group
    cdef tuple _layer_slot                # per layer: its index in its group = its slot on axis 0 of the pool
    cdef tuple _layer_settings            # per layer: its AttentionSetting
    cdef object _layer_attention          # the layer_attention given (tuple of AttentionSetting), or None
    cdef object _chunk_size               # chunk size of a uniform chunked cache, else None
    cdef PrefixServer _prefix             # prefix caching, or None when disabled
    cdef SealTracker _seals               # seal flags, page checksums, sealed-page log
    cdef TierLink _tier                   # the shared tier, or None
    cdef CacheCounters _counters          # cache-wide counters of stats()
    cdef object __weakref__               # lets a metrics collector hold the cache weakly

    cdef int _offload_sealed(self) except -1
    cdef str _over_pool_text(self, object seq_ids, object counts)
    cdef list _tables_of_groups(self, object seq_ids)
    cdef list _all_tables(self)
    cdef int _refuse_groups(self, str feature) except -1
    cdef object _append_groups(self, object seq_ids, object counts, int64_t total, bint want_slots, object ids)
    cdef str _groups_out_of_pages_text(self, list tables, object counts, int64_t total, Py_ssize_t batch)
    cdef int _gather_rows(self, int64_t layer, int32_t[::1] page_ids, int64_t[::1] firsts, Py_ssize_t num_pages,
                          int64_t length, object keys, object values, int64_t[::1] positions,
                          int32_t output_kind) except -1
