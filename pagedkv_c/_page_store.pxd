# PageStore: the K/V bytes of every page (the pool array) and the copy loops over them.
cimport cython
from pagedkv_c._types cimport page_id_t, pos_t, int32_t, int64_t


cdef class PageStore:
    cdef readonly object kv               # ndarray (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
    cdef char* data                       # kv's buffer
    cdef int32_t num_layers
    cdef int32_t num_kv_heads
    cdef int32_t head_dim
    cdef int32_t page_size                # tokens per page
    cdef int32_t num_pages
    cdef Py_ssize_t row_bytes             # bytes of one token's K (or V): num_kv_heads * head_dim * itemsize
    cdef Py_ssize_t page_bytes            # bytes of one page in one layer: 2 * page_size * row_bytes
    cdef Py_ssize_t layer_bytes           # bytes of one layer: num_pages * page_bytes
    cdef int32_t format                   # page format (page_formats.h: pkv_format)
    cdef Py_ssize_t head_row_bytes        # bytes of one head row in that format

    cdef int adopt(self, object kv) except -1
    @cython.final  # per page of the copy loops: a direct call within the module
    cdef void copy_page(self, page_id_t src, page_id_t dst) noexcept nogil
    cdef void copy_pages(self, const page_id_t* sources, const page_id_t* destinations,
                         Py_ssize_t n) noexcept nogil
    cdef void store_rows(self, int64_t layer, const int64_t* slots, Py_ssize_t num_tokens,
                         const char* keys, const char* values, int32_t input_kind) noexcept nogil
    cdef void gather_rows(self, int64_t layer, const page_id_t* page_ids, const pos_t* firsts,
                          Py_ssize_t num_pages, int64_t length, char* keys, char* values,
                          pos_t* positions, int32_t output_kind) noexcept nogil
    cdef void _decode_token(self, const char* src, char* out, int32_t output_kind) noexcept nogil
    cdef void write_page(self, page_id_t page_id, const char* body) noexcept nogil
    cdef void fence(self) noexcept nogil


cdef int check_layer_bytes(int64_t num_pages, int32_t page_size, int32_t num_kv_heads, int32_t head_dim,
                           str kv_dtype) except -1
cdef PageStore new_page_store(int32_t num_layers, int64_t num_pages, int32_t page_size, int32_t num_kv_heads,
                              int32_t head_dim, str kv_dtype)
