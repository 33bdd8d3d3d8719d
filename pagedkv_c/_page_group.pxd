# PageGroup: the page tables of one group of layers (one attention setting) over a shared pool.
from pagedkv_c._types cimport page_id_t, slot_t, int32_t, int64_t
from pagedkv_c._pool cimport PagePool
from pagedkv_c._page_table cimport PageTable


cdef class PageTableView:
    cdef readonly object indptr
    cdef readonly object indices
    cdef readonly object last_page_len
    cdef readonly object page_positions
    cdef readonly object seq_lens
    cdef readonly int32_t page_size


cdef class PageGroup:
    cdef PagePool pool                    # the pool every group of the cache draws from
    cdef int32_t page_size                # tokens per page
    cdef object window                    # None or int, in tokens
    cdef int64_t sink_tokens              # in tokens
    cdef object setting                   # the AttentionSetting of the group's layers (chunks stored as a window)
    cdef tuple layers                     # the group's layers, ascending; pool slot i holds layers[i]
    cdef dict tables                      # seq_id (int) -> PageTable, in insertion order
    # Counters reported by KVCache.stats(), since construction.
    cdef int64_t evictions                # page-table entries released by the window
    cdef int64_t cow_copies               # pages copied on write

    cdef PageTable new_table(self)
    cdef PageTable table(self, object seq_id, str name=*)
    cdef list tables_for(self, object seq_ids)
    cdef int reserve(self, list tables, const int64_t* counts, slot_t* slots,
                     page_id_t* cow_src, page_id_t* cow_dst, Py_ssize_t* num_cow) except -1
    cdef PageTableView view(self, list tables)
    cdef int count_references(self, object counts) except -1
    cdef str over_pool_text(self, list tables, object counts)


cdef PageGroup new_page_group(PagePool pool, int32_t page_size, object window, int64_t sink_tokens)
cdef object seq_key(object seq_id, str name=*)
cdef int64_t cached_tokens(PageTable table) noexcept
