"""PageStore: the K/V bytes of every page, and the loops that copy them.

One C-contiguous pool array holds every K/V byte:
``kv.shape == (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)``,
index 0 of axis 2 = K, 1 = V, so ``kv[layer]`` is FlashInfer's NHD paged
layout and one page id addresses the same page in every layer (as in vLLM).
The store knows bytes and slots only: which page belongs to whom is the page
tables' business (``_page_group``), and its callers validate slots and page
ids before they reach these loops.
"""
import numpy as np

cimport numpy as cnp
from libc.string cimport memcpy

cnp.import_array()

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
                         const char* keys, const char* values) noexcept nogil:
        """Scatter ``num_tokens`` K and V rows of one layer into their slots; -1 skips a row.

        Slots were checked by the caller (``-1 <= slot < num_pages * page_size``).
        On x86-64 the rows go out with non-temporal stores (``stream_copy.h``):
        a decode step writes one row per sequence into lines no cache holds.
        """
        cdef char* layer_base = self.data + layer * self.layer_bytes
        cdef Py_ssize_t v_offset = self.page_size * self.row_bytes
        cdef Py_ssize_t t
        cdef int64_t slot, page, offset
        cdef char* dst
        for t in range(num_tokens):
            slot = slots[t]
            if slot < 0:
                continue
            page = slot // self.page_size
            offset = slot - page * self.page_size
            dst = layer_base + page * self.page_bytes + offset * self.row_bytes
            pkv_stream_copy(dst, keys + t * self.row_bytes, self.row_bytes)
            pkv_stream_copy(dst + v_offset, values + t * self.row_bytes, self.row_bytes)
        pkv_stream_fence()

    cdef void gather_rows(self, int64_t layer, const page_id_t* page_ids, const pos_t* firsts,
                          Py_ssize_t num_pages, int64_t length, char* keys, char* values,
                          pos_t* positions) noexcept nogil:
        """Copy the rows below ``length`` of the listed pages of one layer out, in list order.

        Page ``i`` holds positions ``firsts[i] ..``; ``keys`` and ``values``
        receive one row per position, ``positions`` its position.
        """
        cdef char* layer_base = self.data + layer * self.layer_bytes
        cdef Py_ssize_t i, row = 0
        cdef int64_t t, count
        cdef const char* src
        for i in range(num_pages):
            count = min(<int64_t>self.page_size, length - firsts[i])
            src = layer_base + <Py_ssize_t>page_ids[i] * self.page_bytes
            memcpy(keys + row * self.row_bytes, src, count * self.row_bytes)
            memcpy(values + row * self.row_bytes, src + self.page_size * self.row_bytes, count * self.row_bytes)
            for t in range(count):
                positions[row + t] = firsts[i] + t
            row += count

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
                           object dtype) except -1:
    """Raise MemoryError naming ``num_pages`` when one layer of the pool would pass ``2**63 - 1`` bytes.

    Byte offsets into a layer are Py_ssize_t, also with ``num_layers=0`` (which allocates nothing).
    """
    layer_bytes = (<object>num_pages) * 2 * page_size * num_kv_heads * head_dim * dtype.itemsize  # Python ints: no overflow
    if layer_bytes > 2**63 - 1:
        raise MemoryError(
            f"Invalid value of num_pages: one layer of the pool would take {layer_bytes} bytes, "
            f"more than 2**63 - 1; use fewer pages, heads or a smaller page_size or head_dim"
        )
    return 0


cdef PageStore new_page_store(int32_t num_layers, int64_t num_pages, int32_t page_size, int32_t num_kv_heads,
                              int32_t head_dim, object dtype):
    """A zeroed pool of the given geometry (sizes checked by the caller).

    Raises MemoryError naming ``num_pages`` when one layer would pass
    ``2**63 - 1`` bytes or the array cannot be allocated.
    """
    cdef PageStore store = PageStore.__new__(PageStore)
    check_layer_bytes(num_pages, page_size, num_kv_heads, head_dim, dtype)
    # np.zeros maps untouched pages lazily: a large pool costs memory only as it fills.
    shape = (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)
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
    store.row_bytes = <Py_ssize_t>num_kv_heads * head_dim * dtype.itemsize
    store.page_bytes = 2 * <Py_ssize_t>page_size * store.row_bytes
    store.layer_bytes = <Py_ssize_t>num_pages * store.page_bytes
    store.adopt(kv)
    return store
