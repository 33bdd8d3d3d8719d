"""Page checksums of the page values a shared tier writes and reads (pagedkv.tiers).

A page value's body holds one page's K/V of every layer, layer after layer, each
layer's bytes as laid out in the pool (K then V): the layout of a pool of one page.
The checksum is the project's page checksum (``page_checksum.h``, the one
``KVCache(page_checksums=True)`` records and ``pagedkv_c._checksum.page_checksums``
computes): for each layer XXH3-128 of its bytes as a 16-byte canonical digest, then
the low 64 bits of XXH3-128 over the digests. The checksums run in C without the
GIL, so the tier's writer and fetch threads do not hold up the thread that decodes:
``record_checksums`` for many pages in one call (the writer),
``PageValueChecker`` for one fetched value at a time (its header, page hash, token
ids and checksum), right after the value arrived from the socket.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp

from pagedkv_c._checks cimport check_array, check_int, invalid
from pagedkv_c._checksum cimport pkv_page_checksum

cnp.import_array()

__all__ = ["PageValueChecker", "record_checksums"]


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


cdef inline uint64_t _load64_le(const uint8_t* p) noexcept nogil:
    """A little-endian uint64 at ``p``, assembled byte by byte (any host, any alignment)."""
    cdef uint64_t x = 0
    cdef int i
    for i in range(7, -1, -1):
        x = (x << 8) | p[i]
    return x


cdef class PageValueChecker:
    """Verify page values received into the rows of a buffer, one row at a time, right after it arrived.

    Each row must hold one page value of the expected length (see
    ``pagedkv.tiers._format``): a header equal to ``expected_header`` except
    for its page hash, which must equal the row's requested hash, and its
    checksum; for token-keyed pages the row's token ids (little-endian int32);
    then the body, whose page checksum must equal the one the header states.
    Checking a row right after the socket wrote it reads the body while it is
    still in the CPU caches; the checksum runs in C without the GIL.

    Parameters
    ----------
    records : numpy.ndarray
        uint8, shape ``[n, value_bytes]``, C-contiguous: row ``i`` receives
        the value of page ``i``. ``value_bytes`` is the header, the token ids
        (if any) and ``num_layers * page_bytes`` of body.
    expected_header : bytes
        The header every value must carry (its page hash and checksum fields
        are ignored: the hash is compared with ``page_hashes``, the checksum
        with the body's).
    hash_offset, checksum_offset : int
        Byte offsets of the 16-byte page hash and the 8-byte checksum in the
        header.
    page_hashes : numpy.ndarray
        uint64, shape ``[n, 2]``: (lo, hi) of each requested page hash.
    token_ids : numpy.ndarray or None
        int32, shape ``[n, page_size]``: the prompt's tokens of each page, or
        None for block-keyed pages (the values carry none).
    num_layers, page_bytes : int
        Layers of a body and bytes of one layer of the page (K and V).

    Attributes
    ----------
    checksums : numpy.ndarray
        uint64, shape ``[n]``: the page checksum of each row that passed
        :meth:`check` (other entries undefined).

    Raises
    ------
    TypeError, ValueError
        An array of the wrong dtype, shape or layout; rows of another length
        than the header, token ids and body; offsets outside the header.
    """

    cdef object _records, _hashes, _tokens, _head
    cdef readonly object checksums
    cdef const uint8_t* _base
    cdef const uint8_t* _expected
    cdef const uint8_t* _hash_bytes
    cdef const uint8_t* _token_bytes
    cdef uint64_t* _sums
    cdef uint8_t* _scratch
    cdef Py_ssize_t _n, _row_bytes, _head_bytes, _tokens_per_row, _body_offset, _hash_at, _checksum_at
    cdef int64_t _layers, _layer_bytes

    def __cinit__(self, records, bytes expected_header, hash_offset, checksum_offset, page_hashes, token_ids,
                  num_layers, page_bytes):
        self._scratch = NULL
        rows = check_array(records, "records", np.uint8, (-1, -1))
        self._n = rows.shape[0]
        self._row_bytes = rows.shape[1]
        self._layers = check_int(num_layers, "num_layers", 0, 2**31 - 1)
        self._layer_bytes = check_int(page_bytes, "page_bytes", 0, 2**40)
        self._head_bytes = len(expected_header)
        self._hash_at = check_int(hash_offset, "hash_offset", 0, max(self._head_bytes - 16, 0))
        self._checksum_at = check_int(checksum_offset, "checksum_offset", 0, max(self._head_bytes - 8, 0))
        if self._head_bytes < 24 or (self._hash_at < self._checksum_at + 8 and self._checksum_at < self._hash_at + 16):
            raise ValueError(f"{invalid('value', 'expected_header')}: expected a header holding the 16-byte hash "
                             f"at {self._hash_at} and the 8-byte checksum at {self._checksum_at} apart, "
                             f"got {self._head_bytes} bytes")
        hashes = check_array(page_hashes, "page_hashes", np.uint64, (self._n, 2))
        self._hashes = np.ascontiguousarray(hashes, dtype="<u8")  # compared as the header's little-endian bytes
        self._tokens_per_row = 0
        self._tokens = None
        if token_ids is not None:
            tokens = check_array(token_ids, "token_ids", np.int32, (self._n, -1))
            self._tokens_per_row = tokens.shape[1]
            self._tokens = np.ascontiguousarray(tokens, dtype="<i4")
        self._body_offset = self._head_bytes + 4 * self._tokens_per_row
        if self._row_bytes != self._body_offset + self._layers * self._layer_bytes:
            raise ValueError(f"{invalid('shape', 'records')}: expected rows of {self._body_offset} + "
                             f"{self._layers} x {self._layer_bytes} bytes, got {self._row_bytes}")
        self._records = rows
        self._head = expected_header
        self._base = <const uint8_t*>cnp.PyArray_DATA(rows)
        self._expected = <const uint8_t*>(<char*>expected_header)
        self._hash_bytes = <const uint8_t*>cnp.PyArray_DATA(self._hashes)
        self._token_bytes = <const uint8_t*>cnp.PyArray_DATA(self._tokens) if self._tokens is not None else NULL
        self.checksums = np.zeros(self._n, dtype=np.uint64)
        self._sums = <uint64_t*>cnp.PyArray_DATA(self.checksums)
        self._scratch = <uint8_t*>malloc(16 * max(self._layers, 1))
        if self._scratch == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self._scratch)

    @property
    def body_offset(self):
        """Byte offset of the body in a row (int)."""
        return self._body_offset

    def check(self, row):
        """Whether row ``row`` holds a valid value of its page (header, hash, token ids, checksum).

        Parameters
        ----------
        row : int
            ``0 <= row < n``.

        Returns
        -------
        bool
            True when every check passed (its checksum is then in
            ``checksums[row]``). A False says nothing about which check
            failed: ``pagedkv.tiers._format.check_value`` tells.

        Raises
        ------
        ValueError
            ``row`` out of range.
        """
        cdef Py_ssize_t i = check_int(row, "row", 0, self._n - 1)
        cdef const uint8_t* value = self._base + i * self._row_bytes
        cdef Py_ssize_t a = min(self._hash_at, self._checksum_at), b
        cdef Py_ssize_t a_end = a + (16 if a == self._hash_at else 8)
        cdef Py_ssize_t c = max(self._hash_at, self._checksum_at)
        cdef Py_ssize_t c_end = c + (16 if c == self._hash_at else 8)
        cdef uint64_t actual
        # Header bytes around the hash and checksum fields, then the hash, then the token ids.
        if (memcmp(value, self._expected, a) != 0 or memcmp(value + a_end, self._expected + a_end, c - a_end) != 0
                or memcmp(value + c_end, self._expected + c_end, self._head_bytes - c_end) != 0
                or memcmp(value + self._hash_at, self._hash_bytes + 16 * i, 16) != 0):
            return False
        if self._tokens_per_row and memcmp(value + self._head_bytes, self._token_bytes + 4 * i * self._tokens_per_row,
                                           4 * self._tokens_per_row) != 0:
            return False
        with nogil:
            actual = pkv_page_checksum(value + self._body_offset, <size_t>self._layer_bytes,
                                       <size_t>self._layer_bytes, self._layers, 0, self._scratch)
        if actual != _load64_le(value + self._checksum_at):
            return False
        self._sums[i] = actual
        return True
