"""Page checksums of the page values a shared tier writes and reads (pagedkv.tiers).

A page value's body holds one page's K/V of every layer, layer after layer, each
layer's bytes as laid out in the pool (K then V): the layout of a pool of one page.
The checksum is the project's page checksum (``page_checksum.h``, the one
``KVCache(page_checksums=True)`` records and ``pagedkv_c._checksum.page_checksums``
computes): for each layer XXH3-128 of its bytes as a 16-byte canonical digest, then
the low 64 bits of XXH3-128 over the digests. Both functions run in C without the
GIL, one call for many pages, so the tier's writer and fetch threads do not hold up
the thread that decodes.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc

from pagedkv_c._checks cimport as_int_array, check_array, check_int, invalid
from pagedkv_c._checksum cimport pkv_page_checksum

cnp.import_array()

__all__ = ["body_checksums", "record_checksums"]


def record_checksums(records, body_offset, num_layers, page_bytes):
    """Page checksum of the body in each row of a record buffer.

    Parameters
    ----------
    records : numpy.ndarray
        uint8, shape ``[n, record_bytes]``, C-contiguous: one page per row,
        its body (``num_layers * page_bytes`` bytes: layer after layer, each
        the page's K then V as in the pool) at ``body_offset``.
    body_offset : int
        Byte offset of the body in a row, ``>= 0``.
    num_layers : int
        Layers in a body, ``>= 0``.
    page_bytes : int
        Bytes of one layer of the page (K and V), ``>= 0``.

    Returns
    -------
    numpy.ndarray
        uint64, shape ``[n]``: ``out[i]`` equals ``page_checksums`` of the
        row's body seen as a pool of one page.

    Raises
    ------
    TypeError
        ``records`` is not a uint8 ndarray, an integer argument is not an int.
    ValueError
        ``records`` is not 2-D or not C-contiguous; the body does not fit in
        a row.
    """
    rows = check_array(records, "records", np.uint8, (-1, -1))
    cdef int64_t layers = check_int(num_layers, "num_layers", 0, 2**31 - 1)
    cdef int64_t layer_bytes = check_int(page_bytes, "page_bytes", 0, 2**40)
    cdef int64_t row_bytes = rows.shape[1]
    cdef int64_t offset = check_int(body_offset, "body_offset", 0, max(row_bytes - layers * layer_bytes, 0))
    if offset + layers * layer_bytes > row_bytes:
        raise ValueError(f"{invalid('value', 'records')}: expected rows of at least {offset + layers * layer_bytes} "
                         f"bytes (a body of {layers} x {layer_bytes} at {offset}), got {row_bytes}")
    cdef int64_t n = rows.shape[0], i
    out = np.empty(n, dtype=np.uint64)
    cdef uint64_t* sums = <uint64_t*>cnp.PyArray_DATA(out)
    cdef const uint8_t* base = <const uint8_t*>cnp.PyArray_DATA(rows)
    cdef uint8_t* scratch = <uint8_t*>malloc(16 * max(layers, 1))
    if scratch == NULL:
        raise MemoryError()
    with nogil:
        for i in range(n):
            sums[i] = pkv_page_checksum(base + i * row_bytes + offset, <size_t>layer_bytes, <size_t>layer_bytes,
                                        layers, 0, scratch)
    free(scratch)
    return out


def body_checksums(values, offsets, num_layers, page_bytes):
    """Page checksum of the body of each value, read where the value lies (no copy).

    Parameters
    ----------
    values : sequence of bytes-like
        ``[n]`` objects with a contiguous buffer (bytes, bytearray,
        memoryview), each exactly ``offsets[i] + num_layers * page_bytes``
        bytes long.
    offsets : sequence of int, shape ``[n]``
        Byte offset of each body in its value, ``>= 0``.
    num_layers, page_bytes : int
        As for :func:`record_checksums`.

    Returns
    -------
    numpy.ndarray
        uint64, shape ``[n]``.

    Raises
    ------
    TypeError
        A value without a contiguous byte buffer; arguments of the wrong type.
    ValueError
        ``offsets`` of another length than ``values``, negative, or a value
        of another length than its offset plus the body.
    """
    cdef int64_t layers = check_int(num_layers, "num_layers", 0, 2**31 - 1)
    cdef int64_t layer_bytes = check_int(page_bytes, "page_bytes", 0, 2**40)
    cdef object starts = as_int_array(offsets, "offsets", np.int64)
    cdef int64_t n = len(values), i
    if starts.shape[0] != n:
        raise ValueError(f"{invalid('length', 'offsets')}: expected {n} (one per value), got {starts.shape[0]}")
    cdef const int64_t* start_data = <const int64_t*>cnp.PyArray_DATA(starts)
    cdef int64_t body = layers * layer_bytes
    cdef const unsigned char[::1] view
    cdef uint64_t* sums
    cdef uint8_t* scratch
    views = []
    cdef const uint8_t** bodies = <const uint8_t**>malloc(max(n, 1) * sizeof(uint8_t*))
    if bodies == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            view = memoryview(values[i]).cast("B")
            if start_data[i] < 0 or view.shape[0] != start_data[i] + body:
                raise ValueError(f"{invalid('value', 'values')}: expected value {i} to hold its body of {body} "
                                 f"bytes at offset {start_data[i]} exactly, got {view.shape[0]} bytes")
            views.append(view)  # keeps the buffer alive while C reads it
            bodies[i] = &view[0] + start_data[i] if view.shape[0] else NULL
        out = np.empty(n, dtype=np.uint64)
        sums = <uint64_t*>cnp.PyArray_DATA(out)
        scratch = <uint8_t*>malloc(16 * max(layers, 1))
        if scratch == NULL:
            raise MemoryError()
        with nogil:
            for i in range(n):
                sums[i] = pkv_page_checksum(bodies[i], <size_t>layer_bytes, <size_t>layer_bytes, layers, 0, scratch)
        free(scratch)
    finally:
        free(bodies)
    return out
