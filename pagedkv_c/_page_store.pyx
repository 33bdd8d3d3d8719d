"""PageStore: the K/V bytes of every page, and the loops that copy them.

One C-contiguous pool array holds every K/V byte:
``kv.shape == (num_layers, num_pages, 2, page_size, num_kv_heads, row_items)``,
index 0 of axis 2 = K, 1 = V, so ``kv[layer]`` is FlashInfer's NHD paged
layout and one page id addresses the same page in every layer (as in vLLM).
The last axis is one head row in the page format (``page_formats.h``):
``head_dim`` float32 or float16 values, ``head_dim`` bfloat16 bit patterns
(uint16), or the bytes of an int8 or int4 row with its scales (uint8). Only
stores and gathers look inside a row; every other page operation copies or
hashes bytes.
The store knows bytes and slots only: which page belongs to whom is the page
tables' business (``_page_group``), and its callers validate slots and page
ids before they reach these loops.
"""
import numpy as np

cimport numpy as cnp
from libc.string cimport memcpy

cnp.import_array()

cdef extern from "page_formats.h":
    int64_t pkv_row_bytes(int32_t fmt, int64_t head_dim) noexcept nogil
    void pkv_encode_row(int32_t fmt, int32_t kind, const void* src, int64_t head_dim, unsigned char* dst,
                        float* scratch) noexcept nogil
    void pkv_decode_row(int32_t fmt, const unsigned char* src, int64_t head_dim, float* x) noexcept nogil
    unsigned short pkv_fmt_f2h(float f) noexcept nogil
    unsigned short pkv_fmt_f2bf(float f) noexcept nogil

# Page formats, in the order of page_formats.h's pkv_format; inputs and outputs of
# stores and gathers in the order of its pkv_input.
PAGE_FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")
ROW_KINDS = ("float32", "float16", "bfloat16")
# Largest head_dim of the quantized formats (their encoders work on one row on the stack).
MAX_QUANTIZED_HEAD_DIM = 256


def format_layout(str kv_dtype, int head_dim):
    """The pool's element dtype and items per head row for a page format.

    Parameters
    ----------
    kv_dtype : str
        One of :data:`PAGE_FORMATS`.
    head_dim : int
        Values per head row, ``>= 1``.

    Returns
    -------
    (numpy.dtype, int)
        float32 or float16 and ``head_dim`` for float pages; uint16 and
        ``head_dim`` for bfloat16 (bit patterns); uint8 and the row's bytes
        for int8 and int4 (``pkv_row_bytes``).
    """
    cdef int32_t fmt = PAGE_FORMATS.index(kv_dtype)
    if fmt == 0:
        return np.dtype(np.float32), head_dim
    if fmt == 1:
        return np.dtype(np.float16), head_dim
    if fmt == 2:
        return np.dtype(np.uint16), head_dim
    return np.dtype(np.uint8), int(pkv_row_bytes(fmt, head_dim))


cdef extern from "stream_copy.h":
    void pkv_stream_copy(char* dst, const char* src, size_t n) noexcept nogil
    void pkv_stream_fence() noexcept nogil


cdef class PageStore:
    """The pool array of a :class:`~pagedkv_c._kv_cache.KVCache` and its byte layout (internal).

    Made by :func:`new_page_store`; ``kv`` is the array itself, shape
    ``(num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)``.
    """

    cdef int adopt(self, object kv) except -1:
        """Take ``kv`` (checked by the caller: pool dtype and shape, C-contiguous) as the pool array."""
        self.kv = kv
        self.data = <char*>cnp.PyArray_DATA(kv)
        return 0

    cdef void copy_page(self, page_id_t src, page_id_t dst) noexcept nogil:
        """Copy one page's K and V in every layer (copy-on-write)."""
        cdef Py_ssize_t layer
        cdef char* base
        for layer in range(self.num_layers):
            base = self.data + layer * self.layer_bytes
            memcpy(base + dst * self.page_bytes, base + src * self.page_bytes, self.page_bytes)

    cdef void copy_pages(self, const page_id_t* sources, const page_id_t* destinations,
                         Py_ssize_t n) noexcept nogil:
        """Copy page ``sources[i]`` onto ``destinations[i]`` in every layer, for ``i < n``."""
        cdef Py_ssize_t i
        for i in range(n):
            self.copy_page(sources[i], destinations[i])

    cdef void store_rows(self, int64_t layer, const int64_t* slots, Py_ssize_t num_tokens,
                         const char* keys, const char* values, int32_t input_kind) noexcept nogil:
        """Scatter ``num_tokens`` K and V rows of one layer into their slots; -1 skips a row.

        Slots were checked by the caller (``-1 <= slot < num_pages * page_size``).
        ``input_kind`` is the element type of ``keys`` and ``values`` (a
        ``pkv_input``: 0 float32, 1 float16, 2 bfloat16 bits), rows of
        ``num_kv_heads * head_dim`` values. When it is the pool's own float
        format the rows are copied; otherwise each head row is encoded
        (converted, rotated and quantized as the format says).
        On x86-64 copied rows go out with non-temporal stores
        (``stream_copy.h``): a decode step writes one row per sequence into
        lines no cache holds.
        """
        cdef char* layer_base = self.data + layer * self.layer_bytes
        cdef Py_ssize_t v_offset = self.page_size * self.row_bytes
        cdef Py_ssize_t t, h
        cdef int64_t slot, page, offset
        cdef char* dst
        cdef Py_ssize_t in_row = self.head_dim * (4 if input_kind == 0 else 2)
        cdef float scratch[256]
        cdef bint copy = input_kind == self.format  # float32, float16 and bfloat16 rows of the page's type
        for t in range(num_tokens):
            slot = slots[t]
            if slot < 0:
                continue
            page = slot // self.page_size
            offset = slot - page * self.page_size
            dst = layer_base + page * self.page_bytes + offset * self.row_bytes
            if copy:
                pkv_stream_copy(dst, keys + t * self.row_bytes, self.row_bytes)
                pkv_stream_copy(dst + v_offset, values + t * self.row_bytes, self.row_bytes)
                continue
            for h in range(self.num_kv_heads):
                pkv_encode_row(self.format, input_kind, keys + (t * self.num_kv_heads + h) * in_row,
                               self.head_dim, <unsigned char*>(dst + h * self.head_row_bytes), scratch)
                pkv_encode_row(self.format, input_kind, values + (t * self.num_kv_heads + h) * in_row,
                               self.head_dim, <unsigned char*>(dst + v_offset + h * self.head_row_bytes), scratch)
        if copy:
            pkv_stream_fence()

    cdef void gather_rows(self, int64_t layer, const page_id_t* page_ids, const pos_t* firsts,
                          Py_ssize_t num_pages, int64_t length, char* keys, char* values,
                          pos_t* positions, int32_t output_kind) noexcept nogil:
        """Copy the rows below ``length`` of the listed pages of one layer out, in list order.

        Page ``i`` holds positions ``firsts[i] ..``; ``keys`` and ``values``
        receive one row per position (``num_kv_heads * head_dim`` values of
        ``output_kind``, a ``pkv_input``: decoded unless it is the pool's own
        float format), ``positions`` its position.
        """
        cdef char* layer_base = self.data + layer * self.layer_bytes
        cdef Py_ssize_t i, row = 0, h
        cdef int64_t t, count
        cdef const char* src
        cdef Py_ssize_t out_row = self.num_kv_heads * self.head_dim * (4 if output_kind == 0 else 2)
        for i in range(num_pages):
            count = min(<int64_t>self.page_size, length - firsts[i])
            src = layer_base + <Py_ssize_t>page_ids[i] * self.page_bytes
            if output_kind == self.format:
                memcpy(keys + row * self.row_bytes, src, count * self.row_bytes)
                memcpy(values + row * self.row_bytes, src + self.page_size * self.row_bytes, count * self.row_bytes)
            else:
                for t in range(count):
                    self._decode_token(src + t * self.row_bytes, keys + (row + t) * out_row, output_kind)
                    self._decode_token(src + (self.page_size + t) * self.row_bytes, values + (row + t) * out_row,
                                       output_kind)
            for t in range(count):
                positions[row + t] = firsts[i] + t
            row += count

    cdef void _decode_token(self, const char* src, char* out, int32_t output_kind) noexcept nogil:
        """Decode one token's ``num_kv_heads`` head rows into values of ``output_kind``."""
        cdef float scratch[256]
        cdef Py_ssize_t h, j, n = self.head_dim
        cdef const unsigned char* row
        cdef float x = 0.0
        for h in range(self.num_kv_heads):
            row = <const unsigned char*>(src + h * self.head_row_bytes)
            if self.format >= 3:  # quantized: head_dim <= 256 (checked when the cache was made)
                pkv_decode_row(self.format, row, n, scratch)
            for j in range(n):
                if self.format >= 3:
                    x = scratch[j]
                elif self.format == 0:
                    x = (<const float*>row)[j]
                else:
                    pkv_decode_row(self.format, row + 2 * j, 1, &x)  # one float16 or bfloat16 value
                if output_kind == 0:
                    (<float*>out)[h * n + j] = x
                elif output_kind == 1:
                    (<unsigned short*>out)[h * n + j] = pkv_fmt_f2h(x)
                else:
                    (<unsigned short*>out)[h * n + j] = pkv_fmt_f2bf(x)

    cdef void write_page(self, page_id_t page_id, const char* body) noexcept nogil:
        """Copy one page's bytes of every layer (``num_layers * page_bytes``, layer by layer) into the pool.

        Non-temporal stores, as :meth:`store_rows`; call :meth:`fence` after the last page.
        """
        cdef Py_ssize_t layer
        for layer in range(self.num_layers):
            pkv_stream_copy(self.data + layer * self.layer_bytes + page_id * self.page_bytes,
                            body + layer * self.page_bytes, self.page_bytes)

    cdef void fence(self) noexcept nogil:
        """Order the non-temporal stores of :meth:`write_page` before what follows."""
        pkv_stream_fence()


cdef int check_layer_bytes(int64_t num_pages, int32_t page_size, int32_t num_kv_heads, int32_t head_dim,
                           str kv_dtype) except -1:
    """Raise MemoryError naming ``num_pages`` when one layer of the pool would pass ``2**63 - 1`` bytes.

    Byte offsets into a layer are Py_ssize_t, also with ``num_layers=0`` (which allocates nothing).
    """
    dtype, row_items = format_layout(kv_dtype, head_dim)
    layer_bytes = (<object>num_pages) * 2 * page_size * num_kv_heads * row_items * dtype.itemsize  # Python ints
    if layer_bytes > 2**63 - 1:
        raise MemoryError(
            f"Invalid value of num_pages: one layer of the pool would take {layer_bytes} bytes, "
            f"more than 2**63 - 1; use fewer pages, heads or a smaller page_size or head_dim"
        )
    return 0


cdef PageStore new_page_store(int32_t num_layers, int64_t num_pages, int32_t page_size, int32_t num_kv_heads,
                              int32_t head_dim, str kv_dtype):
    """A zeroed pool of the given geometry and page format (sizes and format checked by the caller).

    Raises MemoryError naming ``num_pages`` when one layer would pass
    ``2**63 - 1`` bytes or the array cannot be allocated.
    """
    cdef PageStore store = PageStore.__new__(PageStore)
    check_layer_bytes(num_pages, page_size, num_kv_heads, head_dim, kv_dtype)
    dtype, row_items = format_layout(kv_dtype, head_dim)
    # np.zeros maps untouched pages lazily: a large pool costs memory only as it fills.
    shape = (num_layers, num_pages, 2, page_size, num_kv_heads, row_items)
    try:
        kv = np.zeros(shape, dtype=dtype)
    except (ValueError, MemoryError) as exc:  # NumPy: "array is too big" or no memory
        raise MemoryError(
            f"Invalid value of num_pages: a pool of shape {shape} ({np.prod(shape, dtype=object) * dtype.itemsize} "
            f"bytes) cannot be allocated; use fewer pages, layers or heads"
        ) from exc
    store.num_layers = num_layers
    store.num_kv_heads = num_kv_heads
    store.head_dim = head_dim
    store.page_size = page_size
    store.num_pages = <int32_t>num_pages
    store.format = <int32_t>PAGE_FORMATS.index(kv_dtype)
    store.head_row_bytes = <Py_ssize_t>row_items * dtype.itemsize
    store.row_bytes = <Py_ssize_t>num_kv_heads * store.head_row_bytes
    store.page_bytes = 2 * <Py_ssize_t>page_size * store.row_bytes
    store.layer_bytes = <Py_ssize_t>num_pages * store.page_bytes
    store.adopt(kv)
    return store
