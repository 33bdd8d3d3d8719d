"""Prefix caching: chained 128-bit page hashes and the hash -> page index.

Every full page of a sequence gets a hash chained on its parent's,
``h_i = H(h_{i-1} || s || content_i)``, where ``s`` is a 128-bit digest of
the request's ``extra_key`` (a per-tenant salt, zeros without one) and
``content_i`` is the page's token ids (int32, little-endian) or, for
requests that arrive as external block hash ids, the pair (block id, page
index inside the block). Equal hashes therefore mean equal content *and*
equal history, as in vLLM's automatic prefix caching
(vllm/v1/core/kv_cache_utils.py, ``hash_block_tokens``) and SGLang's
RadixAttention, and two tenants with different salts never share a page.

Hashed bytes (all integers little-endian; ``parent`` is zeros for the first page):

========================  ================================================
token-keyed page          ``parent.lo, parent.hi, salt.lo, salt.hi``
(32 + 4 * page_size B)    (uint64 each), then the page's ``page_size``
                          token ids (int32 each)
block-keyed page (49 B)   ``parent.lo, parent.hi, salt.lo, salt.hi``
                          (uint64 each), the block id (int64), the page's
                          index inside its block (uint32), the pages per
                          block (uint32: the same id over blocks of another
                          size is other content), then the domain tag byte
                          ``0x42`` (``b"B"``)
salt digest ``s``         ``H(b"pagedkv-salt\\x00" + t + value)`` with the
                          type tag ``t`` = ``b"s"`` (str, UTF-8), ``b"b"``
                          (bytes) or ``b"i"`` (int, decimal ASCII)
group mix ``m_g``         ``H(b"pagedkv-group\\x00" + g)``, ``g`` the page
(page groups only)        group's number (uint32): with more than one page
                          group (``KVCache(..., layer_attention=...)``),
                          group ``g``'s chains use the salt ``s XOR m_g``
                          (both halves) instead of ``s``
========================  ================================================

Page groups. A cache with more than one page group (per-layer attention
settings) keeps one hash chain per group for every sequence, each under its
own salt ``s XOR m_g``, so that one index holds the full pages of every
group: equal tokens in two groups give two hashes, and a group only ever
finds its own pages (a page holds the K/V of its own group's layers only).
``H`` is the cache's hash function for ``m_g`` too (XXH3-128 or truncated
SHA-256), and ``m_g`` is never zero in practice, so no group's chain equals a
cache's chain without groups. Finding two salts whose XOR is ``m_g XOR m_h``
is a 128-bit birthday problem, as hard as a collision of the page hash
itself (the token ids compared on every hit do not tell groups apart).

The domain of a page is part of its input: a token-keyed input is a whole
number of 4-byte words (32 + 4 * page_size bytes), a block-keyed input is
49 bytes, one more than a multiple of four, ending in the tag. No token-keyed
input can therefore equal a block-keyed input, whatever the token ids (-1 and
the int32 extremes included), block ids, salts or page sizes. On top of the
hash, a block-keyed lookup never accepts a page registered by a token-keyed
sequence and a token-keyed lookup never accepts a page without token ids, so
no page is shared between the two kinds of request.

Hash functions (``H``):

``xxh3_128`` (default)
    xxHash XXH3, 128-bit, seed 0 (https://github.com/Cyan4973/xxHash), in C
    in the core (``xxh3.h``, written from the xxHash specification; the same
    values as ``XXH3_128bits`` and the Python ``xxhash`` package's
    ``xxh3_128_intdigest``). The chance that any two of
    ``n`` distinct pages collide is about ``n**2 / 2**129`` (below 1e-20 for
    a billion pages), but XXH3 is not designed to resist an adversary who
    crafts collisions on purpose.
``sha256``
    SHA-256 (hashlib), truncated to its first 128 bits: collision resistant
    against adversaries; use it for untrusted multi-tenant traffic. About an
    order of magnitude slower, one hashlib call per page.

A hit never returns a wrong page for token-keyed requests whatever the hash:
the index keeps every cached page's token ids and compares them on each hit.
Pages keyed by external block ids carry no tokens, so for those the 128-bit
hash is the guard.
"""
import hashlib
import numbers

import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memcpy, memset
from pagedkv_c._types cimport page_id_t, int32_t, int64_t, NO_PAGE
from pagedkv_c._checks cimport check_int
from pagedkv_c._checks import checked_int

cnp.import_array()

cdef extern from "huge_alloc.h":
    void* pkv_huge_alloc(size_t n) noexcept nogil
    void pkv_huge_free(void* p) noexcept nogil

cdef extern from "xxh3.h":
    void pkv_xxh3_128(const void* data, size_t length, uint64_t* lo, uint64_t* hi) noexcept nogil

ALGORITHMS = {"xxh3_128": HASH_XXH3_128, "sha256": HASH_SHA256}
# Shared zero-length buffers of a new SequenceHashes (never written: every
# write goes through reserve_*, which replaces them first).
_NO_HASHES = np.zeros((0, 2), dtype=np.uint64)
_NO_TOKENS = np.zeros(0, dtype=np.int32)
_MASK64 = (1 << 64) - 1
# Domain tag of pages keyed by external block ids: the last of their 49
# hashed bytes (token-keyed inputs are a multiple of 4 bytes long).
cdef uint64_t _BLOCK_TAG = 0x42
# Bytes hashed per block-keyed page: parent, salt, block id, index, pages per block, tag.
cdef enum:
    BLOCK_INPUT_BYTES = 49


def xxh3_in_c():
    """Whether XXH3-128 runs in C: always True.

    Kept for :func:`pagedkv.build_info`; builds before XXH3 was part of the
    core fell back to the Python ``xxhash`` package without ``xxhash.h``.
    """
    return True


def xxh3_128_intdigest(const unsigned char[::1] data not None):
    """XXH3-128 (seed 0) of a byte string, computed by the core's C code.

    Parameters
    ----------
    data : bytes-like, shape (n,), C-contiguous
        The input; any length in bytes, 0 included.

    Returns
    -------
    int
        The 128-bit digest ``hi * 2**64 + lo``, equal to
        ``xxhash.xxh3_128_intdigest(data)``.

    Notes
    -----
    The hash function of prefix caching's ``"xxh3_128"`` page hashes; see
    the module notes. Algorithm: the xxHash specification
    (https://github.com/Cyan4973/xxHash, doc/xxhash_spec.md).
    """
    cdef uint64_t lo = 0, hi = 0
    cdef Py_ssize_t length = data.shape[0]
    cdef const unsigned char* start = &data[0] if length > 0 else NULL
    with nogil:
        pkv_xxh3_128(start, <size_t>length, &lo, &hi)
    return (int(hi) << 64) | int(lo)


cdef hash128 _hash_bytes(int algorithm, const char* data, Py_ssize_t length) except *:
    """H(data) as two little-endian 64-bit halves."""
    cdef hash128 h
    if algorithm == HASH_XXH3_128:
        pkv_xxh3_128(data, length, &h.lo, &h.hi)
        return h
    digest = hashlib.sha256(data[:length]).digest()
    h.lo = int.from_bytes(digest[0:8], "little")
    h.hi = int.from_bytes(digest[8:16], "little")
    return h


cdef hash128 hash_salt(int algorithm, object extra_key) except *:
    """Digest of a request's salt: None -> zeros; str, bytes or int -> H(tagged bytes).

    The tag keeps types apart: 1, "1" and b"1" are three different salts.
    """
    cdef hash128 h
    if extra_key is None:
        h.lo = 0
        h.hi = 0
        return h
    if isinstance(extra_key, str):
        raw = b"s" + extra_key.encode("utf-8")
    elif isinstance(extra_key, (bytes, bytearray)):
        raw = b"b" + bytes(extra_key)
    elif isinstance(extra_key, numbers.Integral) and not isinstance(extra_key, (bool, np.bool_)):
        raw = b"i" + str(int(extra_key)).encode("ascii")  # NumPy integers salt as their value
    else:
        raise TypeError(
            f"Invalid type of extra_key: expected str, bytes, int or None, got {type(extra_key).__name__}"
        )
    raw = b"pagedkv-salt\x00" + raw
    return _hash_bytes(algorithm, raw, len(raw))


cdef hash128 hash_group_mix(int algorithm, int64_t group) except *:
    """The mix ``m_g`` of page group ``group``'s salts: ``H(b"pagedkv-group\\x00" + uint32 little-endian g)``."""
    raw = b"pagedkv-group\x00" + int(group).to_bytes(4, "little")
    return _hash_bytes(algorithm, raw, len(raw))


cdef int hash_token_pages(int algorithm, hash128 parent, hash128 salt, const int32_t* tokens,
                          Py_ssize_t page_size, Py_ssize_t num_pages, hash128* out) except -1:
    """Chained hashes of ``num_pages`` full pages of token ids.

    Page i hashes the bytes ``parent.lo, parent.hi, salt.lo, salt.hi`` (uint64
    little-endian) followed by its ``page_size`` token ids (int32
    little-endian), where ``parent`` is the previous page's hash (see the
    module notes for the layout and its domain tag).
    """
    cdef Py_ssize_t length = 32 + 4 * page_size
    cdef char* buffer = <char*>malloc(length)
    cdef Py_ssize_t i
    if buffer == NULL:
        raise MemoryError()
    try:
        memcpy(buffer + 16, &salt, 16)
        for i in range(num_pages):
            memcpy(buffer, &parent, 16)
            _write_token_content(buffer, tokens + i * page_size, page_size)
            if algorithm == HASH_XXH3_128:
                pkv_xxh3_128(buffer, length, &parent.lo, &parent.hi)
            else:
                parent = _hash_bytes(algorithm, buffer, length)
            out[i] = parent
    finally:
        free(buffer)
    return 0


cdef int hash_block_pages(int algorithm, hash128 parent, hash128 salt, const int64_t* block_ids,
                          Py_ssize_t pages_per_block, Py_ssize_t first_page, Py_ssize_t num_pages,
                          hash128* out) except -1:
    """Chained hashes of pages keyed by external block ids.

    Global page g lies in block ``g // pages_per_block`` at index ``j = g %
    pages_per_block``; it hashes 49 bytes: ``parent, salt`` (as above), the
    block id (int64), ``j`` and ``pages_per_block`` (uint32 each) and the
    domain tag byte 0x42 (see the
    module notes: no token-keyed input has that length). ``block_ids`` is
    indexed from the first block; pages ``first_page .. first_page +
    num_pages - 1`` are hashed, chained on ``parent``.
    """
    cdef char buffer[56]
    cdef Py_ssize_t i
    cdef Py_ssize_t block = first_page // pages_per_block
    cdef uint32_t j = <uint32_t>(first_page % pages_per_block)
    cdef bint fast = algorithm == HASH_XXH3_128
    memcpy(buffer + 16, &salt, 16)
    for i in range(num_pages):
        memcpy(buffer, &parent, 16)
        _write_block_content(buffer, block_ids[block], j, <uint32_t>pages_per_block)
        if fast:
            pkv_xxh3_128(buffer, BLOCK_INPUT_BYTES, &parent.lo, &parent.hi)
        else:
            parent = _hash_bytes(algorithm, buffer, BLOCK_INPUT_BYTES)
        out[i] = parent
        j += 1
        if j == pages_per_block:
            j = 0
            block += 1
    return 0


cdef inline void _write_token_content(char* buffer, const int32_t* tokens, Py_ssize_t page_size) noexcept nogil:
    """Bytes 32 .. 32 + 4 * page_size - 1 of a token-keyed page's hashed input."""
    memcpy(buffer + 32, tokens, 4 * page_size)


cdef inline void _write_block_content(char* buffer, int64_t block_id, uint32_t j,
                                      uint32_t pages_per_block) noexcept nogil:
    """Bytes 32 .. 55 of a block-keyed page's input (bytes 32 .. 48 are hashed).

    Bytes 40 .. 47 (j, pages per block) and 48 .. 55 (the tag, padding) are
    written as uint64s: 4-byte stores read back by the hash's 8-byte loads
    would defeat store-to-load forwarding and stall every page
    (little-endian, as above).
    """
    cdef uint64_t index_and_size = (<uint64_t>pages_per_block << 32) | j
    cdef uint64_t tag = _BLOCK_TAG
    memcpy(buffer + 32, &block_id, 8)
    memcpy(buffer + 40, &index_and_size, 8)
    memcpy(buffer + 48, &tag, 8)


cdef bytes _head_bytes(object parent, object salt):
    parent = checked_int(parent, "parent", 0, 2**128 - 1)
    salt = checked_int(salt, "salt", 0, 2**128 - 1)
    return (parent & _MASK64).to_bytes(8, "little") + (parent >> 64).to_bytes(8, "little") + \
        (salt & _MASK64).to_bytes(8, "little") + (salt >> 64).to_bytes(8, "little")


def token_page_input(parent, salt, token_ids):
    """The bytes hashed for a token-keyed page (the writer the hash chain uses).

    Parameters
    ----------
    parent, salt : int
        128-bit previous page hash and salt digest (``hi << 64 | lo``), in
        ``[0, 2**128)``.
    token_ids : sequence of int, shape ``[page_size]``
        int32 token ids, ``page_size >= 1``.

    Returns
    -------
    bytes
        ``32 + 4 * page_size`` bytes, laid out as in the module notes.
    """
    cdef object tokens = np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64))
    if tokens.ndim != 1 or tokens.shape[0] < 1:
        raise ValueError(f"Invalid shape of token_ids: expected (page_size,) with page_size >= 1, got {tokens.shape}")
    if tokens.min() < -2**31 or tokens.max() > 2**31 - 1:
        raise ValueError("Invalid value of token_ids: expected int32 values")
    cdef int32_t[::1] view = tokens.astype(np.int32)
    cdef Py_ssize_t page_size = view.shape[0]
    cdef bytearray buffer = bytearray(_head_bytes(parent, salt) + bytes(4 * page_size))
    _write_token_content(<char*>buffer, &view[0], page_size)
    return bytes(buffer)


def block_page_input(parent, salt, block_id, index_in_block, pages_per_block):
    """The bytes hashed for a block-keyed page (the writer the hash chain uses).

    Parameters
    ----------
    parent, salt : int
        As in :func:`token_page_input`.
    block_id : int
        Block id in ``[-2**63, 2**64)``: a uint64 id hashes as the int64 with
        the same 64 bits, as in ``KVCache.add_sequence``.
    index_in_block : int
        Index of the page inside its block, ``0 <= index_in_block < 2**31``.
    pages_per_block : int
        Pages per block (``block_tokens // page_size``), ``1 <= pages_per_block
        < 2**31``.

    Returns
    -------
    bytes
        49 bytes, laid out as in the module notes.
    """
    cdef char buffer[56]
    value = checked_int(block_id, "block_id", -2**63, 2**64 - 1)  # an int64 or uint64 id
    cdef uint32_t j = <uint32_t>check_int(index_in_block, "index_in_block", 0, 2**31 - 1)
    cdef int64_t block = value - 2**64 if value >= 2**63 else value
    cdef uint32_t per_block = <uint32_t>check_int(pages_per_block, "pages_per_block", 1, 2**31 - 1)
    head = _head_bytes(parent, salt)
    memcpy(buffer, <const char*>head, 32)
    _write_block_content(buffer, block, j, per_block)
    return buffer[:BLOCK_INPUT_BYTES]


def salt_digest(algorithm, extra_key):
    """The 128-bit digest ``s`` of a request's ``extra_key`` (``hi << 64 | lo``; 0 for None).

    ``algorithm`` is ``"xxh3_128"`` or ``"sha256"``. Raises TypeError for a
    salt of another type than str, bytes, int or None.
    """
    cdef hash128 h = hash_salt(ALGORITHMS[algorithm], extra_key)
    return (int(h.hi) << 64) | int(h.lo)


def _zeros_line_aligned(Py_ssize_t rows, Py_ssize_t cols):
    """Zeroed uint64 array (rows, cols) starting on a 64-byte boundary.

    NumPy guarantees only 16-byte alignment; 32-byte records on such a base
    would straddle two cache lines every other page.
    """
    raw = np.zeros(rows * cols + 8, dtype=np.uint64)
    cdef size_t misalignment = (<size_t>cnp.PyArray_DATA(raw)) % 64  # a multiple of 8
    cdef Py_ssize_t skip = <Py_ssize_t>((64 - misalignment) % 64) // 8
    return raw[skip:skip + rows * cols].reshape(rows, cols)


cdef class PrefixIndex:
    """Hash -> page index of the cached full pages of one pool.

    A page is *cached* when it is findable by its hash. It stays cached while
    sequences hold it and after its ref count drops to 0 (it then waits in
    the pool's free queue), until the allocator hands it out again, which
    evicts it. The table uses open addressing with linear probing over
    power-of-two capacity at least four times the pool (at most a quarter
    full: 32 to 64 bytes of table per page), one 8-byte slot per entry
    (the low 32 bits of the hash, which pick the home slot and filter
    matches, and the page id; the full 128 bits are compared in the
    page's 32-byte record, which the pool's allocator shares), and
    backward-shift deletion (no tombstones). The
    sparse table keeps probe runs short, which matters most for deletion:
    it scans to the end of the run and moves entries back. Removal finds
    a page's entry from its home slot (pages do not record their slot, so
    moving an entry touches nothing else), and batch callers prefetch
    slots ahead of use, which overlaps the cache misses of a table larger
    than the CPU caches.

    Parameters
    ----------
    num_pages : int
        Pages of the pool.
    page_size : int
        Tokens per page.
    algorithm : str
        ``"xxh3_128"`` or ``"sha256"`` (see the module notes).

    Raises
    ------
    ValueError
        An unknown ``algorithm``, ``num_pages`` or ``page_size`` below 1, or
        more than ``2**30`` pages.
    MemoryError
        The table cannot be allocated.
    """

    def __cinit__(self, num_pages, page_size, str algorithm="xxh3_128"):
        self.ix.slots = NULL
        num_pages = <int32_t>check_int(num_pages, "num_pages", 1, 2**31 - 1)
        page_size = <int32_t>check_int(page_size, "page_size", 1, 2**31 - 1)
        if algorithm not in ALGORITHMS:
            raise ValueError(
                f"Invalid value of prefix_hash: expected one of {sorted(ALGORITHMS)}, got {algorithm!r}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self.algorithm = ALGORITHMS[algorithm]
        cdef Py_ssize_t capacity = 16, i
        while capacity < 4 * <Py_ssize_t>num_pages:
            capacity *= 2
        if capacity > 2**32:  # the low 32 bits of a hash pick its home slot
            raise ValueError(
                f"Invalid value of num_pages: prefix caching supports at most 2**30 pages, got {num_pages}"
            )
        try:
            # One 32-byte pkv_page_record per row (page_record.h): the allocator's
            # queue position and ref count, cached at byte 12, has_tokens at 13,
            # then lo, hi. The pool of a KVCache adopts these records.
            self.page_records = _zeros_line_aligned(num_pages, 4)
            self.tokens = np.zeros((num_pages, page_size), dtype=np.int32)
        except (ValueError, MemoryError) as exc:
            raise MemoryError(
                f"Invalid value of num_pages: the prefix index of {num_pages} pages of {page_size} tokens "
                f"cannot be allocated; use fewer pages"
            ) from exc
        self.page_cached = self.page_records.view(np.uint8)[:, 12]
        self.has_tokens = self.page_records.view(np.uint8)[:, 13]
        self.ix.mask = capacity - 1
        self.ix.pages = <pkv_page_record*>cnp.PyArray_DATA(self.page_records)
        self.ix.num_cached = 0
        self.ix.evictions = 0
        self.ix.slots = <pkv_index_slot*>pkv_huge_alloc(capacity * sizeof(pkv_index_slot))
        if self.ix.slots == NULL:
            raise MemoryError(
                f"Invalid value of num_pages: the prefix index table of {capacity} slots "
                f"({capacity * sizeof(pkv_index_slot)} bytes) cannot be allocated; use fewer pages"
            )
        for i in range(capacity):
            self.ix.slots[i].page = NO_PAGE

    def __dealloc__(self):
        pkv_huge_free(self.ix.slots)

    @property
    def algorithm_name(self):
        """Name of the hash function."""
        return "xxh3_128" if self.algorithm == HASH_XXH3_128 else "sha256"

    @property
    def num_cached(self):
        """Pages findable by hash (int, in pages)."""
        return self.ix.num_cached

    @property
    def evictions(self):
        """Cached pages dropped because the allocator handed them out again (int, in pages)."""
        return self.ix.evictions

    cdef bint tokens_match(self, page_id_t page_id, const int32_t* tokens) noexcept nogil:
        cdef Py_ssize_t t
        if not self.has_tokens[page_id]:
            return False
        for t in range(self.page_size):
            if self.tokens[page_id, t] != tokens[t]:
                return False
        return True

    def cached_pages(self):
        """Ids of the pages findable by hash (int64 array, increasing)."""
        return np.flatnonzero(np.asarray(self.page_cached))

    def page_hash(self, page_id):
        """The 128-bit hash of a cached page as a Python int (``hi << 64 | lo``), or None."""
        cdef int32_t p = <int32_t>page_id
        if p < 0 or p >= self.num_pages:
            raise ValueError(f"Invalid value of page_id: expected 0 <= page_id < {self.num_pages}, got {page_id}")
        if not pkv_index_is_cached(&self.ix, p):
            return None
        return (int(self.ix.pages[p].hi) << 64) | int(self.ix.pages[p].lo)

    def token_table(self):
        """The token ids kept per page for hit verification.

        Returns a writable int32 view of shape ``(num_pages, page_size)``;
        rows of pages that are not cached are meaningless.
        """
        return np.asarray(self.tokens)

    def check_invariants(self):
        """Verify the index: every cached page is found by its hash and nothing else is."""
        cdef Py_ssize_t i, count = 0
        cdef hash128 h
        for i in range(self.ix.mask + 1):
            if self.ix.slots[i].page != NO_PAGE:
                count += 1
                page_id = self.ix.slots[i].page
                if not self.page_cached[page_id]:
                    raise AssertionError(f"slot {i} names page {page_id}, which is not marked cached")
                h.lo = self.ix.pages[page_id].lo
                h.hi = self.ix.pages[page_id].hi
                if <uint32_t>h.lo != self.ix.slots[i].lo32:
                    raise AssertionError(f"slot {i} of page {page_id} disagrees with the page's hash")
                if pkv_index_find(&self.ix, h.lo, h.hi) != page_id:
                    raise AssertionError(f"cached page {page_id} is not found by its hash")
        cached = int(np.count_nonzero(np.asarray(self.page_cached)))
        if count != self.ix.num_cached or count != cached:
            raise AssertionError(f"prefix index holds {count} pages, {cached} marked cached, expected {self.ix.num_cached}")

    # --------------------------------------------------- state export / restore
    def _export_state(self):
        """The index as plain arrays (for snapshots), pages in increasing id order.

        Returns
        -------
        dict
            ``pages`` int32 ``(n,)`` cached page ids; ``hashes`` uint64
            ``(n, 2)`` their hashes (lo, hi); ``has_tokens`` uint8 ``(n,)``;
            ``tokens`` int32 ``(n, page_size)`` kept token ids (rows of pages
            without tokens are zeros); ``evictions`` int.
        """
        pages = np.flatnonzero(np.asarray(self.page_cached)).astype(np.int32)
        records = np.asarray(self.page_records)
        has_tokens = np.asarray(self.has_tokens)[pages].copy()
        tokens = np.asarray(self.tokens)[pages] * (has_tokens[:, None] != 0)
        return {"pages": pages, "hashes": np.ascontiguousarray(records[pages, 2:4]),
                "has_tokens": has_tokens, "tokens": tokens.astype(np.int32), "evictions": int(self.ix.evictions)}

    cdef int _check_state(self, dict state) except -1:
        """Raise ValueError unless ``state`` (as from _export_state) is a consistent index."""
        pages, hashes, has_tokens, tokens = state["pages"], state["hashes"], state["has_tokens"], state["tokens"]
        n = pages.shape[0] if pages.ndim == 1 else -1
        if (pages.dtype != np.int32 or n < 0 or hashes.dtype != np.uint64 or hashes.shape != (n, 2)
                or has_tokens.dtype != np.uint8 or has_tokens.shape != (n,)
                or tokens.dtype != np.int32 or tokens.shape != (n, self.page_size)):
            raise ValueError("Invalid shape of the prefix index: expected pages int32 (n,), hashes uint64 (n, 2), "
                             f"has_tokens uint8 (n,), tokens int32 (n, {self.page_size})")
        if n and (pages.min() < 0 or pages.max() >= self.num_pages or (np.diff(pages) <= 0).any()):
            raise ValueError(f"Invalid value of the prefix index pages: expected increasing page ids in "
                             f"[0, {self.num_pages - 1}]")
        if n and ((has_tokens > 1).any()):
            raise ValueError("Invalid value of the prefix index has_tokens: expected 0 or 1")
        if n > 1 and np.unique(hashes, axis=0).shape[0] != n:
            raise ValueError("Invalid value of the prefix index hashes: two cached pages have the same hash")
        if not 0 <= state["evictions"] < 2**63:
            raise ValueError(f"Invalid value of the prefix index evictions: got {state['evictions']}")
        return 0

    cdef int _apply_state(self, dict state) except -1:
        """Rebuild the index from ``state`` (checked by _check_state first).

        Slots are filled in page id order, so a probe run may be laid out
        differently than before the snapshot; finds and inserts answer the
        same (hashes are distinct).
        """
        cdef Py_ssize_t i
        cdef const int32_t[::1] pages = state["pages"]
        cdef const uint64_t[:, ::1] hashes = state["hashes"]
        cdef const uint8_t[::1] has_tokens = state["has_tokens"]
        for i in range(self.ix.mask + 1):
            self.ix.slots[i].page = NO_PAGE
        for i in range(self.num_pages):
            self.ix.pages[i].cached = 0
            self.ix.pages[i].has_tokens = 0
            self.ix.pages[i].lo = 0
            self.ix.pages[i].hi = 0
        self.ix.num_cached = 0
        for i in range(pages.shape[0]):
            pkv_index_insert(&self.ix, hashes[i, 0], hashes[i, 1], pages[i])
            self.ix.pages[pages[i]].has_tokens = has_tokens[i]
        if pages.shape[0]:
            np.asarray(self.tokens)[np.asarray(pages)] = state["tokens"]
        self.ix.evictions = state["evictions"]
        return 0


cdef class SequenceHashes:
    """Hash chain of one sequence: known token ids and per-page hashes.

    Token-keyed sequences extend the chain as their token ids become known
    (prompt at creation, ``token_ids`` passed to appends). Sequences keyed by
    external block ids know all their page contents at creation, but hash
    them lazily (``hash_upto``), a batch at a time inside the loops that
    match and register pages: a chain of hashes is a chain of dependent
    arithmetic, which then overlaps those loops' memory accesses.
    """

    def __cinit__(self):
        # Empty until reserved: callers size them at once for the prompt.
        self.chain_array = _NO_HASHES
        self.chain = NULL
        self.chain_capacity = 0
        self.token_ids = _NO_TOKENS
        self.num_hashed = 0
        self.num_hashable = 0
        self.block_ids = None
        self.pages_per_block = 0
        self.num_known = 0
        self.num_registered = 0
        self.external = False
        self.salt.lo = 0
        self.salt.hi = 0

    cdef int reserve_tokens(self, int64_t n) except -1:
        cdef int64_t capacity = self.token_ids.shape[0]
        if n <= capacity:
            return 0
        capacity = max(capacity, 16)
        while capacity < n:
            capacity *= 2
        grown = np.zeros(capacity, dtype=np.int32)
        if self.num_known:
            grown[:self.num_known] = np.asarray(self.token_ids)[:self.num_known]
        self.token_ids = grown
        return 0

    cdef int reserve_hashes(self, int64_t n) except -1:
        cdef int64_t capacity = self.chain_capacity
        if n <= capacity:
            return 0
        capacity = max(capacity, 4)
        while capacity < n:
            capacity *= 2
        grown = np.zeros((capacity, 2), dtype=np.uint64)  # rows past num_hashed are never read
        if self.num_hashed:
            memcpy(cnp.PyArray_DATA(grown), self.chain, self.num_hashed * sizeof(hash128))
        self._set_chain(grown)
        return 0

    cdef hash128 _last_hash(self) noexcept nogil:
        """Hash of the last hashed page: the parent of the next one (zeros before the first)."""
        cdef hash128 parent
        parent.lo = 0
        parent.hi = 0
        if self.num_hashed:
            parent = self.chain[self.num_hashed - 1]
        return parent

    cdef void _set_chain(self, object array):
        """Adopt ``array`` (uint64, C-contiguous, shape (capacity, 2)) as the chain's storage."""
        self.chain_array = array
        self.chain = <hash128*>cnp.PyArray_DATA(array)
        self.chain_capacity = array.shape[0]

    cdef int extend_hashes(self, int algorithm, int32_t page_size) except -1:
        """Hash every full page whose token ids are all known (token-keyed only)."""
        if self.external:
            return 0
        cdef int64_t target = self.num_known // page_size
        if target <= self.num_hashed:
            return 0
        self.reserve_hashes(target)
        cdef Py_ssize_t n = <Py_ssize_t>(target - self.num_hashed)
        hash_token_pages(algorithm, self._last_hash(), self.salt, &self.token_ids[self.num_hashed * page_size],
                         page_size, n, self.chain + self.num_hashed)
        self.num_hashed = target
        self.num_hashable = target
        return 0

    cdef int set_external(self, object block_ids, int64_t pages_per_block, int64_t num_pages) except -1:
        """Key the sequence by external block ids (int64, C-contiguous): ``num_pages`` hashable pages."""
        self.external = True
        self.block_ids = block_ids
        self.pages_per_block = pages_per_block
        # No chain storage yet: hash_upto grows it to the pages actually hashed (a match stops at
        # its first miss), so a prompt of many blocks allocates nothing in proportion to its length.
        self.num_hashable = num_pages
        return 0

    cdef int hash_upto(self, int algorithm, int64_t n) except -1:
        """Compute the hashes of pages up to ``min(n, num_hashable)`` (external sequences only)."""
        if n > self.num_hashable:
            n = self.num_hashable
        if not self.external or n <= self.num_hashed:
            return 0
        self.reserve_hashes(n)  # a restored chain holds only its computed hashes
        hash_block_pages(algorithm, self._last_hash(), self.salt, <const int64_t*>cnp.PyArray_DATA(self.block_ids),
                         self.pages_per_block, self.num_hashed, n - self.num_hashed,
                         self.chain + self.num_hashed)
        self.num_hashed = n
        return 0

    cdef void truncate(self, int64_t new_len, int32_t page_size) noexcept nogil:
        """Forget tokens at and after ``new_len`` and the hashes of pages they touch."""
        cdef int64_t pages = new_len // page_size
        if self.num_known > new_len:
            self.num_known = new_len
        if self.num_hashed > pages:
            self.num_hashed = pages
        if self.num_hashable > pages:
            self.num_hashable = pages
        if self.num_registered > pages:
            self.num_registered = pages

    cdef SequenceHashes copy(self):
        cdef SequenceHashes other = SequenceHashes.__new__(SequenceHashes)
        other.salt = self.salt
        other.external = self.external
        other._set_chain(self.chain_array.copy())
        other.token_ids = np.asarray(self.token_ids).copy()
        other.num_hashed = self.num_hashed
        other.num_hashable = self.num_hashable
        other.block_ids = self.block_ids
        other.pages_per_block = self.pages_per_block
        other.num_known = self.num_known
        other.num_registered = self.num_registered
        return other

    # --------------------------------------------------- state export / restore
    def _export_state(self):
        """The hash chain as plain values (for snapshots).

        Returns
        -------
        dict
            ``salt`` uint64 ``(2,)``; ``external`` bool; ``chain`` uint64
            ``(num_hashed, 2)``; ``token_ids`` int32 ``(num_known,)``;
            ``block_ids`` int64 ``(num_blocks,)`` (empty unless external);
            ``pages_per_block``, ``num_hashable``, ``num_registered`` ints.
        """
        return {
            "salt": np.array([self.salt.lo, self.salt.hi], dtype=np.uint64),
            "external": bool(self.external),
            "chain": np.asarray(self.chain_array)[:self.num_hashed].copy(),
            "token_ids": np.asarray(self.token_ids)[:self.num_known].copy(),
            "block_ids": (np.asarray(self.block_ids).copy() if self.block_ids is not None
                          else np.zeros(0, dtype=np.int64)),
            "pages_per_block": int(self.pages_per_block),
            "num_hashable": int(self.num_hashable),
            "num_registered": int(self.num_registered),
        }

    @staticmethod
    def _from_state(dict state, int32_t page_size, int64_t length, int algorithm):
        """A chain rebuilt from ``state`` (as from _export_state) of a sequence of ``length`` tokens.

        Every stored hash is computed again with ``algorithm`` (a
        HashAlgorithm) from the salt and the kept token ids (or block ids)
        and must equal the stored one: a chain is never taken on trust.

        Raises ValueError, building nothing, when the values are inconsistent
        (counts out of range, more pages than the token or block ids cover,
        which a later hash would read past, or a hash that does not follow
        from its page's content and salt).
        """
        salt, chain, token_ids, block_ids = state["salt"], state["chain"], state["token_ids"], state["block_ids"]
        if (salt.dtype != np.uint64 or salt.shape != (2,) or chain.dtype != np.uint64 or chain.ndim != 2
                or chain.shape[1] != 2 or token_ids.dtype != np.int32 or token_ids.ndim != 1
                or block_ids.dtype != np.int64 or block_ids.ndim != 1):
            raise ValueError("Invalid shape of a hash chain: expected salt uint64 (2,), chain uint64 (n, 2), "
                             "token_ids int32 (k,), block_ids int64 (b,)")
        cdef bint external = state["external"]
        cdef int64_t num_hashed = chain.shape[0], num_known = token_ids.shape[0]
        cdef int64_t num_hashable = state["num_hashable"], num_registered = state["num_registered"]
        cdef int64_t per_block = state["pages_per_block"]
        if external:
            if not (1 <= per_block < 2**31 and num_hashable <= block_ids.shape[0] * per_block):
                raise ValueError(f"Invalid value of a hash chain: {num_hashable} hashable pages but "
                                 f"{block_ids.shape[0]} blocks of {per_block} pages")
        elif per_block != 0 or block_ids.shape[0] or num_hashable != num_hashed or num_hashed > num_known // page_size:
            raise ValueError(f"Invalid value of a hash chain: {num_hashed} hashed pages, {num_hashable} hashable, "
                             f"{num_known} known tokens of {page_size} per page")
        if not (0 <= num_hashed <= num_hashable and 0 <= num_registered <= num_hashable
                and num_registered <= length // page_size):
            raise ValueError(f"Invalid value of a hash chain: {num_hashed} hashed, {num_hashable} hashable and "
                             f"{num_registered} registered pages for a sequence of {length} tokens")
        cdef SequenceHashes out = SequenceHashes.__new__(SequenceHashes)
        out.salt.lo = salt[0]
        out.salt.hi = salt[1]
        out.external = external
        out.reserve_hashes(num_hashed)  # hash_upto grows it: the file bounds every allocation
        cdef object recomputed = out.chain_array
        cdef object tokens
        cdef hash128 parent
        parent.lo = 0
        parent.hi = 0
        if num_hashed:
            if external:
                blocks = np.ascontiguousarray(block_ids)
                hash_block_pages(algorithm, parent, out.salt, <const int64_t*>cnp.PyArray_DATA(blocks),
                                 per_block, 0, num_hashed, out.chain)
            else:
                tokens = np.ascontiguousarray(token_ids[:num_hashed * page_size])
                hash_token_pages(algorithm, parent, out.salt, <const int32_t*>cnp.PyArray_DATA(tokens),
                                 page_size, num_hashed, out.chain)
            wrong = np.flatnonzero((np.asarray(recomputed)[:num_hashed] != chain).any(axis=1))
            if wrong.size:
                raise ValueError(f"Invalid value of a hash chain: the hash of page {int(wrong[0])} does not follow "
                                 f"from the salt and the page's {'block ids' if external else 'token ids'}"
                                 + (f" (and {wrong.size - 1} more pages)" if wrong.size > 1 else ""))
        out.num_hashed = num_hashed
        out.num_hashable = num_hashable
        out.reserve_tokens(num_known)
        if num_known:
            np.asarray(out.token_ids)[:num_known] = token_ids
        out.num_known = num_known
        out.num_registered = num_registered
        if external:
            out.block_ids = np.ascontiguousarray(block_ids)
            out.pages_per_block = per_block
        return out
