# KVCache: paged K/V storage for many sequences and layers over one pool array.
cimport cython
from pagedkv_c._types cimport int32_t, int64_t, page_id_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._prefix cimport PrefixIndex
from pagedkv_c._page_table cimport PageTable
from pagedkv_c._lock cimport CacheLock


cdef class KVCache:
    cdef readonly object kv               # ndarray (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
    cdef readonly PagePool pool           # allocator over page ids 0 .. num_pages-1
    cdef readonly int32_t num_layers
    cdef readonly int32_t num_kv_heads
    cdef readonly int32_t head_dim
    cdef readonly int32_t page_size       # tokens per page
    cdef object _window                   # None or int, in tokens
    cdef readonly int64_t sink_tokens     # in tokens
    cdef dict _tables                     # seq_id (int) -> PageTable
    cdef CacheLock _lock                  # serializes every call that reads or changes page tables
    cdef char* _data                      # kv's buffer
    cdef Py_ssize_t _row_bytes            # bytes of one token's K (or V): num_kv_heads * head_dim * itemsize
    cdef Py_ssize_t _page_bytes           # bytes of one page in one layer: 2 * page_size * row_bytes
    cdef Py_ssize_t _layer_bytes          # bytes of one layer: num_pages * page_bytes
    # Counters reported by stats().
    cdef int64_t _pages_peak              # most pages in use at once, in pages
    cdef int64_t _evictions               # page-table entries released by the window
    cdef int64_t _cow_copies              # pages copied on write
    cdef int64_t _tokens_appended         # tokens reserved by append over the cache's life
    cdef PrefixIndex _prefix              # prefix cache, or None when disabled
    cdef int64_t _prefix_queries          # prompt tokens looked up, in tokens
    cdef int64_t _prefix_hits             # prompt tokens served from cached pages, in tokens

    cdef object _table(self, object seq_id)
    cdef list _tables_for(self, object seq_ids)
    cdef void _copy_page(self, int32_t src, int32_t dst) noexcept nogil
    cdef void _note_usage(self) noexcept nogil
    cdef int64_t _match_prefix(self, PageTable table, const int32_t* prompt, int64_t prompt_len,
                               int64_t num_hashable) except -1
    cdef int64_t _serve_prefix(self, PageTable table, const int32_t* prompt, int64_t prompt_len,
                               int64_t servable, page_id_t* hit) except -1
    cdef int _register_full_pages(self, PageTable table) except -1
    cdef PageTable _new_table(self)
