# TierLink: a KVCache's side of a shared prefix tier (pagedkv.tiers): lookup, install, offload.
from pagedkv_c._types cimport int64_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._page_table cimport PageTable
from pagedkv_c._page_store cimport PageStore
from pagedkv_c._prefix_serving cimport PrefixServer
from pagedkv_c._seals cimport SealTracker
from pagedkv_c._lock cimport CacheLock


cdef class TierLink:
    cdef readonly object tier             # the tier (pagedkv.tiers.RedisTier or alike)
    cdef PagePool pool
    cdef PageStore store
    cdef PrefixServer prefix
    cdef SealTracker seals
    cdef CacheLock lock                   # the cache's lock: lookup counts local hits under it
    cdef int64_t hits                     # prompt tokens served from the tier, in tokens

    cdef object lookup(self, PageTable table, object prompt, int64_t prompt_len)
    cdef int64_t install(self, PageTable table, object fetched, int64_t num_local) except -1
    cdef int offload(self, object cache) except -1


cdef TierLink new_tier_link(object tier, PagePool pool, PageStore store, PrefixServer prefix, SealTracker seals,
                            CacheLock lock, object dtype)
cdef int check_tier(object tier, object enable_prefix_caching, object window) except -1
