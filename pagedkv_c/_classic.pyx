"""PagedKVCache: the classic single-stream, token-indexed paged KV store.

This is the design pagedkv started from: one stream of tokens, each with one
key vector and one value vector of length ``dim``, stored in fixed-size pages
of ``page_size`` tokens. At most ``max_pages`` pages are resident; when a token
needs a page that is not resident and all ``max_pages`` are, the page that
became resident first is evicted (FIFO). For many sequences and layers use
``pagedkv.KVCache`` instead.
"""
import sys

import numpy as np

cimport numpy as cnp
from libc.string cimport memcpy, memset
from pagedkv_c._types cimport page_id_t, int32_t, int64_t, uint8_t, NO_PAGE, sat_add
from pagedkv_c._checks cimport check_int, check_array, check_float_array, as_int_array
from pagedkv_c._pool cimport PagePool
from pagedkv_c._page_map cimport PageMap
from pagedkv_c._lock cimport CacheLock

cnp.import_array()

cdef extern from "Python.h":
    bint PyLong_CheckExact(object)
    long long PyLong_AsLongLongAndOverflow(object, int*) except? -1

_INT64_MAX = 2**63 - 1
_INT32_MAX = 2**31 - 1
_MAX_PAGES = 2**31 - 2  # page ids are int32 (see PagePool)


cdef inline int64_t _token_index(object token_idx, str name) except? -1:
    """Return a token index as int64 >= 0; exact ints take a fast path."""
    cdef int overflow = 0
    cdef long long value
    if PyLong_CheckExact(token_idx):
        value = PyLong_AsLongLongAndOverflow(token_idx, &overflow)
        if overflow == 0 and value >= 0:
            return value
    return check_int(token_idx, name, 0, _INT64_MAX)


cdef inline Py_ssize_t _run_length(const int64_t* token_idxs, Py_ssize_t start, Py_ssize_t n,
                                   int64_t token, Py_ssize_t room) noexcept nogil:
    """Length (>= 1) of the run token, token + 1, ... at ``token_idxs[start:]``, at most ``room``.

    Compares ``token_idxs[j] - k`` with ``token`` so that nothing overflows
    near the int64 limit (token indices are >= 0).
    """
    cdef Py_ssize_t run = 1
    while run < room and start + run < n and token_idxs[start + run] - run == token:
        run += 1
    return run




cdef class PagedKVCache:
    """Single-stream paged KV store indexed by token, with FIFO page eviction.

    Token ``t`` lives in logical page ``t // page_size`` at offset
    ``t % page_size``. Logical pages are mapped to physical pages of one
    NumPy pool; at most ``max_pages`` pages are resident at once.

    Parameters
    ----------
    max_pages : int
        Page limit, ``1 <= max_pages <= 2**31 - 2`` (in pages).
    dim : int
        Length of each key and each value vector, ``1 <= dim <= 2**31 - 1``
        (in elements).
    page_size : int, default 64
        Tokens per page, ``1 <= page_size <= 2**31 - 1`` (in tokens). The
        default, 64, differs from ``KVCache``'s default of 16.
    dtype : numpy dtype, default numpy.float32
        Element type of the pool: a native floating type (float16, float32,
        float64). Inputs of other numeric types are cast to it, and values
        come back in it: ``0.1`` stored in float32 reads back as
        ``numpy.float32(0.1)``, which is 0.10000000149011612, not 0.1.

    Raises
    ------
    TypeError
        An argument is not an integer, or ``dtype`` is not a native floating
        dtype.
    ValueError
        ``max_pages``, ``dim`` or ``page_size`` is out of range, or the pool
        would exceed the address space.

    Attributes
    ----------
    max_pages, dim, page_size : int
        As given.
    dtype : numpy.dtype
        As given, normalised with ``numpy.dtype``.
    evictions : int
        Pages evicted since construction (in pages). ``clear()`` does not
        count as an eviction and does not reset it.
    resident_pages : numpy.ndarray
        Logical page indices of the resident pages, oldest first (int64).
    num_resident_pages : int
        Number of resident pages (in pages).
    nbytes : int
        Size of the pool array (in bytes).

    ``len(cache)`` is the number of tokens present, ``t in cache`` whether
    token ``t`` is present, and iterating the cache gives the present token
    indices in ascending order. ``stats()`` returns the hit, miss and
    eviction counters.

    Notes
    -----
    Memory: one pool array of shape ``(max_pages, 2, page_size, dim)``
    (index 0 of axis 1 = keys, 1 = values; FlashInfer's NHD page layout with
    one head), ``max_pages * page_size`` presence bytes, and a hash map from
    logical page index to page id (``pagedkv_c._page_map.PageMap``), so any
    non-negative int64 token index can be used. Page ids come from a
    ``PagePool`` of ``max_pages`` pages.

    Eviction: resident pages form a FIFO ring in the order they became
    resident. When ``put`` needs a page that is not resident and
    ``max_pages`` pages are, the oldest resident page is evicted: all of its
    tokens are dropped and its page id is reused in place for the new logical
    page (the cache owns it alone, so there is no allocator round trip).
    Overwriting a token of a resident page does not change the order.

    Presence: a slot is present only once written. The other slots of a
    resident page, and every slot of a page that is not resident, are absent.

    Batch calls (``put_many``, ``get_many``) validate all of their input, then
    run in C without the GIL.

    *Threads.* A cache may be shared by threads. Every call converts and
    checks its arguments first, then holds an internal lock for the part
    that reads or changes the cache (the C copy loops included), so calls
    from several threads run one after another and each sees the cache
    before or after another call, never halfway. A call made on the same
    thread while one of the cache's calls is running (from a finalizer that
    the garbage collector runs inside that call, or from a callback) raises
    RuntimeError instead of waiting forever for a lock its own thread holds.

    *Copies.* A cache cannot be pickled or copied (``pickle``,
    ``copy.copy``, ``copy.deepcopy`` raise TypeError). To copy one, read
    ``get_many(list(cache))`` and ``put_many`` the rows into a new cache.
    """

    def __cinit__(self, max_pages, dim, page_size=64, dtype=np.float32):
        cdef int32_t num_pages = <int32_t>check_int(max_pages, "max_pages", 1, _MAX_PAGES)
        cdef Py_ssize_t vector_len = <Py_ssize_t>check_int(dim, "dim", 1, _INT32_MAX)
        cdef Py_ssize_t tokens_per_page = <Py_ssize_t>check_int(page_size, "page_size", 1, _INT32_MAX)
        if dtype is None:
            raise TypeError("Invalid value of dtype: expected a floating NumPy dtype, got None")
        try:
            pool_dtype = np.dtype(dtype)
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"Invalid value of dtype: expected a floating NumPy dtype, got {dtype!r}"
            ) from exc
        if pool_dtype.kind != "f" or not pool_dtype.isnative:
            raise TypeError(
                f"Invalid value of dtype: expected a native floating NumPy dtype "
                f"(float16, float32, float64), got {pool_dtype}"
            )
        pool_bytes = num_pages * 2 * tokens_per_page * vector_len * pool_dtype.itemsize
        if pool_bytes > sys.maxsize:
            raise ValueError(
                f"Invalid value of max_pages * page_size * dim: the pool would take "
                f"{pool_bytes} bytes, more than the address space allows"
            )
        self.max_pages = num_pages
        self.dim = vector_len
        self.page_size = tokens_per_page
        self.dtype = pool_dtype
        self.evictions = 0
        self._type_num = pool_dtype.num
        self._row_bytes = vector_len * pool_dtype.itemsize
        self._half_page_bytes = tokens_per_page * self._row_bytes
        self._num_tokens = 0
        self._hits = 0
        self._misses = 0
        self._lock = CacheLock("PagedKVCache", "make the call after the running call returns")
        self._pool = PagePool(num_pages)
        self._page_map = PageMap(num_pages)
        # np.zeros: the operating system hands out zeroed memory lazily, so
        # untouched pages cost no time or resident memory.
        self._kv = np.zeros((num_pages, 2, tokens_per_page, vector_len), dtype=pool_dtype)
        self._kv_data = <char*>cnp.PyArray_DATA(<cnp.ndarray>self._kv)
        self._present = np.zeros((num_pages, tokens_per_page), dtype=np.uint8)
        self._page_num_tokens = np.zeros(num_pages, dtype=np.int32)
        self._ring_logical_page = np.full(num_pages, -1, dtype=np.int64)
        self._ring_page_id = np.full(num_pages, NO_PAGE, dtype=np.int32)
        self._ring_head = 0
        self._num_resident = 0

    # ------------------------------------------------------------------ C API
    # Counters are updated as `self.x = self.x + 1`, not `self.x += 1`: with the
    # debug build's nonecheck on, Cython rejects in-place operators on attributes
    # in nogil code.
    cdef page_id_t page_for_write(self, int64_t logical_page) noexcept nogil:
        """Return the page id of ``logical_page``, making it resident if needed.

        A new page gets an empty presence row. If ``max_pages`` pages are
        resident, the oldest is evicted first and its page id reused.
        """
        cdef page_id_t page_id = self._page_map.lookup(logical_page)
        if page_id != NO_PAGE:
            return page_id
        cdef int32_t tail
        if self._num_resident == self.max_pages:
            # Full ring: the oldest entry's position is also the next tail
            # position, so the new page takes it over and the head moves on.
            page_id = self._ring_page_id[self._ring_head]
            self._page_map.remove(self._ring_logical_page[self._ring_head])
            self._num_tokens = self._num_tokens - self._page_num_tokens[page_id]
            self.evictions = sat_add(self.evictions, 1)
            self._ring_logical_page[self._ring_head] = logical_page
            self._ring_head = self._ring_head + 1
            if self._ring_head == self.max_pages:
                self._ring_head = 0
        else:
            self._pool.take(&page_id, 1)
            tail = self._ring_head + self._num_resident
            if tail >= self.max_pages:
                tail -= self.max_pages
            self._ring_logical_page[tail] = logical_page
            self._ring_page_id[tail] = page_id
            self._num_resident = self._num_resident + 1
        memset(&self._present[page_id, 0], 0, self.page_size)
        self._page_num_tokens[page_id] = 0
        self._page_map.insert(logical_page, page_id)
        return page_id

    cdef void write_token(self, page_id_t page_id, Py_ssize_t offset,
                          const char* key, const char* value) noexcept nogil:
        """Copy one key and one value (``_row_bytes`` each) into a resident page."""
        cdef char* key_dst = (self._kv_data + 2 * <Py_ssize_t>page_id * self._half_page_bytes
                              + offset * self._row_bytes)
        memcpy(key_dst, key, self._row_bytes)
        memcpy(key_dst + self._half_page_bytes, value, self._row_bytes)
        if not self._present[page_id, offset]:
            self._present[page_id, offset] = 1
            self._page_num_tokens[page_id] += 1
            self._num_tokens = self._num_tokens + 1

    cdef bint read_token(self, page_id_t page_id, Py_ssize_t offset,
                         char* key, char* value) noexcept nogil:
        """Copy one token out if present (``page_id`` may be NO_PAGE); return whether it was."""
        if page_id == NO_PAGE or not self._present[page_id, offset]:
            return False
        cdef const char* key_src = (self._kv_data + 2 * <Py_ssize_t>page_id * self._half_page_bytes
                                    + offset * self._row_bytes)
        memcpy(key, key_src, self._row_bytes)
        memcpy(value, key_src + self._half_page_bytes, self._row_bytes)
        return True

    cdef void put_rows(self, const int64_t* token_idxs, Py_ssize_t n,
                       const char* keys, const char* values) noexcept nogil:
        """Store ``n`` tokens in order, exactly as ``n`` calls of ``put`` would.

        Runs of consecutive token indices within one page are copied with one
        ``memcpy`` for their keys and one for their values.
        """
        cdef Py_ssize_t i = 0, run, slot
        cdef Py_ssize_t offset
        cdef int64_t token, logical_page
        cdef int64_t last_logical_page = -1
        cdef page_id_t page_id = NO_PAGE
        cdef char* key_dst
        while i < n:
            token = token_idxs[i]
            logical_page = token // self.page_size
            offset = token - logical_page * self.page_size
            # Consecutive tokens usually share a page. The cached page id stays
            # valid: evictions happen only inside page_for_write, which also
            # refreshes the cache.
            if logical_page != last_logical_page:
                page_id = self.page_for_write(logical_page)
                last_logical_page = logical_page
            run = _run_length(token_idxs, i, n, token, self.page_size - offset)
            key_dst = self._kv_data + 2 * <Py_ssize_t>page_id * self._half_page_bytes + offset * self._row_bytes
            memcpy(key_dst, keys + i * self._row_bytes, run * self._row_bytes)
            memcpy(key_dst + self._half_page_bytes, values + i * self._row_bytes, run * self._row_bytes)
            for slot in range(offset, offset + run):
                if not self._present[page_id, slot]:
                    self._present[page_id, slot] = 1
                    self._page_num_tokens[page_id] += 1
                    self._num_tokens = self._num_tokens + 1
            i += run

    cdef Py_ssize_t get_rows(self, const int64_t* token_idxs, Py_ssize_t n,
                             char* keys, char* values, uint8_t* present) noexcept nogil:
        """Copy ``n`` tokens out; absent tokens get zero rows and ``present`` 0.

        Returns the number of tokens found present.

        Runs of consecutive present tokens within one page are copied with one
        ``memcpy`` for their keys and one for their values.
        """
        cdef Py_ssize_t i = 0, run, num_present, found = 0
        cdef Py_ssize_t offset
        cdef int64_t token, logical_page
        cdef int64_t last_logical_page = -1
        cdef page_id_t page_id = NO_PAGE
        cdef const char* key_src
        while i < n:
            token = token_idxs[i]
            logical_page = token // self.page_size
            offset = token - logical_page * self.page_size
            if logical_page != last_logical_page:
                page_id = self._page_map.lookup(logical_page)
                last_logical_page = logical_page
            if page_id == NO_PAGE or not self._present[page_id, offset]:
                present[i] = 0
                memset(keys + i * self._row_bytes, 0, self._row_bytes)
                memset(values + i * self._row_bytes, 0, self._row_bytes)
                i += 1
                continue
            run = _run_length(token_idxs, i, n, token, self.page_size - offset)
            num_present = 1
            while num_present < run and self._present[page_id, offset + num_present]:
                num_present += 1
            key_src = self._kv_data + 2 * <Py_ssize_t>page_id * self._half_page_bytes + offset * self._row_bytes
            memcpy(keys + i * self._row_bytes, key_src, num_present * self._row_bytes)
            memcpy(values + i * self._row_bytes, key_src + self._half_page_bytes, num_present * self._row_bytes)
            memset(present + i, 1, num_present)
            i += num_present
            found += num_present
        return found

    # ------------------------------------------------------------- validation
    cdef object _vector(self, object arr, str name):
        """``arr`` as a C-contiguous (dim,) array of dtype; ndarrays that already are pass through."""
        cdef cnp.ndarray a
        if cnp.PyArray_CheckExact(arr):
            a = <cnp.ndarray>arr
            if (cnp.PyArray_NDIM(a) == 1 and cnp.PyArray_DIMS(a)[0] == self.dim
                    and cnp.PyArray_TYPE(a) == self._type_num and cnp.PyArray_ISCARRAY_RO(a)):
                return a
        return check_float_array(arr, name, (self.dim,), self.dtype, "(dim,)")

    cdef object _matrix(self, object arr, str name, Py_ssize_t num_rows):
        """``arr`` as a C-contiguous (num_rows, dim) array of dtype."""
        cdef cnp.ndarray a
        if cnp.PyArray_CheckExact(arr):
            a = <cnp.ndarray>arr
            if (cnp.PyArray_NDIM(a) == 2 and cnp.PyArray_DIMS(a)[0] == num_rows
                    and cnp.PyArray_DIMS(a)[1] == self.dim
                    and cnp.PyArray_TYPE(a) == self._type_num and cnp.PyArray_ISCARRAY_RO(a)):
                return a
        return check_float_array(arr, name, (num_rows, self.dim), self.dtype, "(len(token_idxs), dim)")

    cdef object _token_array(self, object token_idxs):
        """``token_idxs`` as a C-contiguous int64 array, every entry checked >= 0."""
        cdef cnp.ndarray a
        if (cnp.PyArray_CheckExact(token_idxs)
                and cnp.PyArray_NDIM(<cnp.ndarray>token_idxs) == 1
                and cnp.PyArray_TYPE(<cnp.ndarray>token_idxs) == cnp.NPY_INT64
                and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>token_idxs)):
            a = <cnp.ndarray>token_idxs
        else:
            a = as_int_array(token_idxs, "token_idxs", np.int64)
        cdef const int64_t* tokens = <const int64_t*>cnp.PyArray_DATA(a)
        cdef Py_ssize_t i, n = cnp.PyArray_DIMS(a)[0]
        cdef Py_ssize_t first_negative = -1
        with nogil:
            for i in range(n):
                if tokens[i] < 0:
                    first_negative = i
                    break
        if first_negative >= 0:
            raise ValueError(
                f"Invalid value of token_idxs: expected 0 <= token index <= {_INT64_MAX}, "
                f"got token_idxs[{first_negative}] = {tokens[first_negative]}"
            )
        return a

    # ------------------------------------------------------------- Python API
    def put(self, token_idx, key, value):
        """Store the key and value of one token, evicting the oldest page if needed.

        Parameters
        ----------
        token_idx : int
            Token index, ``0 <= token_idx <= 2**63 - 1``.
        key, value : array-like, shape ``(dim,)``
            Integer or floating numbers, cast to ``dtype``. Exactly 1-D: a
            ``(1, dim)`` array is rejected, not reshaped. Both are copied.

        Raises
        ------
        TypeError
            ``token_idx`` is not an integer (bools and floats included), or
            ``key``/``value`` is not numeric.
        ValueError
            ``token_idx`` is negative, or ``key``/``value`` does not have
            shape ``(dim,)``.
        RuntimeError
            Called re-entrantly (see *Threads* in the class notes).

        Notes
        -----
        Nothing is stored or evicted when an error is raised. Re-putting a
        present token overwrites it without changing the eviction order.
        """
        cdef int64_t token = _token_index(token_idx, "token_idx")
        cdef cnp.ndarray key_arr = self._vector(key, "key")
        cdef cnp.ndarray value_arr = self._vector(value, "value")
        cdef int64_t logical_page = token // self.page_size
        cdef page_id_t page_id
        self._lock.acquire()
        page_id = self.page_for_write(logical_page)
        self.write_token(page_id, token - logical_page * self.page_size,
                         <const char*>cnp.PyArray_DATA(key_arr),
                         <const char*>cnp.PyArray_DATA(value_arr))
        self._lock.release()

    def get(self, token_idx):
        """Return copies of the key and value of one token, or None if absent.

        Parameters
        ----------
        token_idx : int
            Token index, ``0 <= token_idx <= 2**63 - 1``.

        Returns
        -------
        tuple of numpy.ndarray or None
            ``(key, value)``, each a fresh array of shape ``(dim,)`` and dtype
            ``dtype`` that does not alias the cache; None when the token was
            never put, or its page has been evicted or cleared.

        Raises
        ------
        TypeError, ValueError
            ``token_idx`` is not an integer, or is negative.
        RuntimeError
            Called re-entrantly (see *Threads* in the class notes).

        Notes
        -----
        Counts one hit (token present) or one miss (absent) in ``stats()``.
        """
        cdef int64_t token = _token_index(token_idx, "token_idx")
        cdef int64_t logical_page = token // self.page_size
        cdef Py_ssize_t offset = token - logical_page * self.page_size
        cdef page_id_t page_id
        cdef cnp.npy_intp length = self.dim
        cdef cnp.ndarray key, value
        self._lock.acquire()
        try:
            page_id = self._page_map.lookup(logical_page)
            if page_id == NO_PAGE or not self._present[page_id, offset]:
                self._misses = sat_add(self._misses, 1)
                return None
            key = <cnp.ndarray>cnp.PyArray_EMPTY(1, &length, self._type_num, 0)
            value = <cnp.ndarray>cnp.PyArray_EMPTY(1, &length, self._type_num, 0)
            self.read_token(page_id, offset, <char*>cnp.PyArray_DATA(key), <char*>cnp.PyArray_DATA(value))
            self._hits = sat_add(self._hits, 1)
        finally:
            self._lock.release()
        return key, value

    def put_many(self, token_idxs, keys, values):
        """Store many tokens in one call, as a loop of ``put`` in the given order.

        Parameters
        ----------
        token_idxs : sequence of int or numpy.ndarray of integers, shape ``(n,)``
            Token indices, each ``>= 0``. Duplicates are allowed: the last
            occurrence wins, as in a loop.
        keys, values : array-like, shape ``(n, dim)``
            Integer or floating numbers, cast to ``dtype``; row ``i`` belongs
            to ``token_idxs[i]``. For an empty batch an empty list will do.

        Raises
        ------
        TypeError
            ``token_idxs`` is not a 1-D sequence of integers, or
            ``keys``/``values`` is not numeric.
        ValueError
            A token index is negative or exceeds int64, or ``keys``/``values``
            does not have shape ``(n, dim)``.
        RuntimeError
            Called re-entrantly (see *Threads* in the class notes).

        Notes
        -----
        The whole batch is validated before anything is stored, so a failing
        call stores and evicts nothing. Pages are made resident and evicted in
        token order, exactly as the equivalent loop of ``put`` would, even when
        the batch spans more than ``max_pages`` pages. Fast path: int64
        ``token_idxs`` and C-contiguous ``keys``/``values`` of ``dtype`` are
        read in place; other inputs are converted first. The copy runs in C
        without the GIL, under the cache's lock.
        """
        cdef cnp.ndarray tokens = self._token_array(token_idxs)
        cdef Py_ssize_t n = cnp.PyArray_DIMS(tokens)[0]
        cdef cnp.ndarray key_rows = self._matrix(keys, "keys", n)
        cdef cnp.ndarray value_rows = self._matrix(values, "values", n)
        cdef const int64_t* token_ptr = <const int64_t*>cnp.PyArray_DATA(tokens)
        cdef const char* key_ptr = <const char*>cnp.PyArray_DATA(key_rows)
        cdef const char* value_ptr = <const char*>cnp.PyArray_DATA(value_rows)
        self._lock.acquire()
        with nogil:
            self.put_rows(token_ptr, n, key_ptr, value_ptr)
        self._lock.release()

    def get_many(self, token_idxs, out=None):
        """Return the keys and values of many tokens, as a loop of ``get``.

        Parameters
        ----------
        token_idxs : sequence of int or numpy.ndarray of integers, shape ``(n,)``
            Token indices, each ``>= 0``; duplicates allowed.
        out : tuple of 3 numpy.ndarray or None
            Optional ``(keys, values, present)`` to write into instead of
            allocating: C-contiguous, writeable, shapes ``(n, dim)``,
            ``(n, dim)``, ``(n,)`` and dtypes ``dtype``, ``dtype``, bool,
            overlapping neither one another nor ``token_idxs``. Reusing
            buffers avoids the allocation, and the first-touch page faults
            of fresh outputs, in a decode loop.

        Returns
        -------
        keys : numpy.ndarray, shape ``(n, dim)``, dtype ``dtype``
            Row ``i`` is the key of ``token_idxs[i]``, or all zeros when that
            token is absent.
        values : numpy.ndarray, shape ``(n, dim)``, dtype ``dtype``
            Likewise for the values.
        present : numpy.ndarray, shape ``(n,)``, dtype bool
            Whether ``token_idxs[i]`` is present (where ``get`` would not
            return None).

        Raises
        ------
        TypeError, ValueError
            ``token_idxs`` is not a 1-D sequence of non-negative int64
            integers, or ``out`` is not as described; nothing is written.
        RuntimeError
            Called re-entrantly (see *Threads* in the class notes).

        Notes
        -----
        The outputs do not alias the cache. The copy runs in C without the
        GIL, under the cache's lock. Each of the ``n`` lookups counts as one
        hit or one miss in ``stats()``.
        """
        cdef cnp.ndarray tokens = self._token_array(token_idxs)
        cdef cnp.npy_intp dims[2]
        dims[0] = cnp.PyArray_DIMS(tokens)[0]
        dims[1] = self.dim
        cdef cnp.ndarray keys, values, present
        if out is None:
            keys = <cnp.ndarray>cnp.PyArray_EMPTY(2, dims, self._type_num, 0)
            values = <cnp.ndarray>cnp.PyArray_EMPTY(2, dims, self._type_num, 0)
            present = <cnp.ndarray>cnp.PyArray_EMPTY(1, dims, cnp.NPY_BOOL, 0)
        else:
            keys, values, present = self._check_out(out, tokens)
        cdef const int64_t* token_ptr = <const int64_t*>cnp.PyArray_DATA(tokens)
        cdef char* key_ptr = <char*>cnp.PyArray_DATA(keys)
        cdef char* value_ptr = <char*>cnp.PyArray_DATA(values)
        cdef uint8_t* present_ptr = <uint8_t*>cnp.PyArray_DATA(present)
        cdef Py_ssize_t found
        self._lock.acquire()
        with nogil:
            found = self.get_rows(token_ptr, dims[0], key_ptr, value_ptr, present_ptr)
        self._hits = sat_add(self._hits, found)
        self._misses = sat_add(self._misses, dims[0] - found)
        self._lock.release()
        return keys, values, present

    cdef tuple _check_out(self, object out, object tokens):
        """Validate the ``out`` argument of get_many; return its three arrays.

        The arrays must not overlap one another or ``tokens`` (the token
        indices must not change while rows are written).
        """
        cdef Py_ssize_t num_rows = len(tokens)
        if not isinstance(out, tuple) or len(out) != 3:
            raise TypeError(
                f"Invalid type of out: expected a tuple (keys, values, present), got {type(out).__name__}"
            )
        keys = check_array(out[0], "out[0]", self.dtype, (num_rows, self.dim))
        values = check_array(out[1], "out[1]", self.dtype, (num_rows, self.dim))
        present = check_array(out[2], "out[2]", np.bool_, (num_rows,))
        for name, arr in (("out[0]", keys), ("out[1]", values), ("out[2]", present)):
            if not arr.flags.writeable:
                raise ValueError(f"Invalid value of {name}: expected a writeable array, got a read-only one")
        arrays = (tokens, keys, values, present)
        for i in range(4):
            for j in range(i + 1, 4):
                if np.may_share_memory(arrays[i], arrays[j]):
                    raise ValueError(
                        "Invalid value of out: expected three arrays that overlap neither one "
                        "another nor token_idxs"
                    )
        return keys, values, present

    def __contains__(self, token_idx):
        """Whether a token is present (``get`` would not return None).

        Not counted as a hit or a miss in ``stats()``.

        Raises
        ------
        TypeError, ValueError
            ``token_idx`` is not an integer, or is negative.
        RuntimeError
            Called re-entrantly (see *Threads* in the class notes).
        """
        cdef int64_t token = _token_index(token_idx, "token_idx")
        cdef int64_t logical_page = token // self.page_size
        cdef page_id_t page_id
        cdef bint found
        self._lock.acquire()
        page_id = self._page_map.lookup(logical_page)
        found = page_id != NO_PAGE and self._present[page_id, token - logical_page * self.page_size] != 0
        self._lock.release()
        return found

    def __len__(self):
        """Number of tokens present (in tokens)."""
        self._lock.acquire()
        cdef int64_t num_tokens = self._num_tokens
        self._lock.release()
        return num_tokens

    def __iter__(self):
        """Iterate over the indices of the present tokens, in ascending order.

        Yields
        ------
        int
            Token indices ``t`` with ``t in cache``, each once, smallest
            first. The indices are collected when iteration starts: later
            calls (which may evict pages) do not change what is yielded.

        Raises
        ------
        RuntimeError
            Called re-entrantly (see *Threads* in the class notes).
        """
        cdef cnp.ndarray logical, page_ids, order
        cdef int32_t i
        self._lock.acquire()
        try:
            logical = self._resident_logical_pages()
            page_ids = np.empty(self._num_resident, dtype=np.int32)
            for i in range(self._num_resident):
                page_ids[i] = self._ring_page_id[(self._ring_head + i) % self.max_pages]
            order = np.argsort(logical, kind="stable")
            pages, offsets = np.nonzero(np.asarray(self._present)[page_ids[order]])
            tokens = logical[order][pages] * self.page_size + offsets
        finally:
            self._lock.release()
        return iter(tokens.tolist())

    cdef object _resident_logical_pages(self):
        """Logical page indices of the resident pages, oldest first (the caller holds the lock)."""
        cdef cnp.npy_intp length = self._num_resident
        cdef cnp.ndarray out = <cnp.ndarray>cnp.PyArray_EMPTY(1, &length, cnp.NPY_INT64, 0)
        cdef int64_t* view = <int64_t*>cnp.PyArray_DATA(out)
        cdef int32_t i
        for i in range(self._num_resident):
            view[i] = self._ring_logical_page[(self._ring_head + i) % self.max_pages]
        return out

    @property
    def resident_pages(self):
        """Logical page indices of the resident pages, oldest first (read-only).

        numpy.ndarray of int64, shape ``(num_resident_pages,)``, a fresh
        copy: logical page ``p`` covers tokens ``p * page_size .. (p + 1) *
        page_size - 1``. The order is the eviction order: entry 0 is the page
        evicted next once the cache is full. A page is resident from the
        first ``put`` into it until it is evicted or the cache is cleared,
        even if only some of its slots were written.
        """
        self._lock.acquire()
        try:
            return self._resident_logical_pages()
        finally:
            self._lock.release()

    @property
    def num_resident_pages(self):
        """Number of resident pages (int, in pages), at most ``max_pages``."""
        return self._num_resident

    def stats(self):
        """Usage counters since construction.

        Returns
        -------
        dict
            ``hits``: token lookups by ``get`` and ``get_many`` that found
            the token present (each row of a ``get_many`` is one lookup);
            ``misses``: such lookups that found it absent (never put, or its
            page evicted or cleared); ``in`` tests and iteration count as
            neither. ``evictions``: pages evicted (in pages; ``clear`` is not
            an eviction). ``num_tokens``: tokens present. ``num_resident_pages``:
            resident pages. ``max_pages``: the page limit (capacity in pages).
            ``capacity_tokens``: ``max_pages * page_size``. ``clear()``
            resets none of the counters.

        Raises
        ------
        RuntimeError
            Called re-entrantly (see *Threads* in the class notes).
        """
        self._lock.acquire()
        cdef int64_t hits = self._hits, misses = self._misses, evictions = self.evictions
        cdef int64_t num_tokens = self._num_tokens
        cdef int32_t num_resident = self._num_resident
        self._lock.release()
        return {
            "hits": hits,
            "misses": misses,
            "evictions": evictions,
            "num_tokens": num_tokens,
            "num_resident_pages": num_resident,
            "max_pages": self.max_pages,
            "capacity_tokens": self.max_pages * self.page_size,
        }

    def clear(self):
        """Drop every token and release every page (not counted as evictions).

        The pages return to the page pool in eviction order; ``evictions``
        keeps its value.

        Raises
        ------
        RuntimeError
            Called re-entrantly (see *Threads* in the class notes).
        """
        cdef int32_t i
        self._lock.acquire()
        for i in range(self._num_resident):
            self._pool.decref_one(self._ring_page_id[(self._ring_head + i) % self.max_pages])
        self._page_map.remove_all()
        self._ring_head = 0
        self._num_resident = 0
        self._num_tokens = 0
        self._lock.release()

    @property
    def nbytes(self):
        """Size of the pool array (in bytes): ``max_pages * 2 * page_size * dim * itemsize``."""
        return self._kv.nbytes

    def check_invariants(self):
        """Verify the cache's state; raise AssertionError naming the first problem.

        Checks: the page pool and page map are consistent on their own; the
        FIFO ring, the page map and the pool agree on which pages are resident
        (each resident page id distinct, allocated once, mapped from its
        logical page); per-page and total token counts equal the presence
        bits of the resident pages.

        Raises
        ------
        RuntimeError
            Called re-entrantly (see *Threads* in the class notes).
        """
        self._lock.acquire()
        try:
            self._check_state()
        finally:
            self._lock.release()

    cdef int _check_state(self) except -1:
        """The checks of check_invariants (the caller holds the lock)."""
        self._pool.check_invariants()
        self._page_map.check_invariants()
        if not 0 <= self._num_resident <= self.max_pages:
            raise AssertionError(f"{self._num_resident} resident pages, limit {self.max_pages}")
        if not 0 <= self._ring_head < self.max_pages:
            raise AssertionError(f"ring head {self._ring_head} out of range")
        if self._pool.num_free != self.max_pages - self._num_resident:
            raise AssertionError(
                f"pool has {self._pool.num_free} free pages, expected {self.max_pages - self._num_resident}"
            )
        if len(self._page_map) != self._num_resident:
            raise AssertionError(
                f"page map holds {len(self._page_map)} pages, ring holds {self._num_resident}"
            )
        present = np.asarray(self._present)
        seen_pages = set()
        seen_logical = set()
        total = 0
        cdef int32_t i, ring_index
        for i in range(self._num_resident):
            ring_index = (self._ring_head + i) % self.max_pages
            logical_page = self._ring_logical_page[ring_index]
            page_id = self._ring_page_id[ring_index]
            if logical_page < 0 or logical_page in seen_logical:
                raise AssertionError(f"ring entry {i}: bad or repeated logical page {logical_page}")
            if page_id < 0 or page_id >= self.max_pages or page_id in seen_pages:
                raise AssertionError(f"ring entry {i}: bad or repeated page id {page_id}")
            seen_logical.add(logical_page)
            seen_pages.add(page_id)
            if self._pool.ref_count(page_id) != 1:
                raise AssertionError(f"page {page_id} has ref count {self._pool.ref_count(page_id)}, expected 1")
            if self._page_map.lookup(logical_page) != page_id:
                raise AssertionError(
                    f"logical page {logical_page} maps to {self._page_map.lookup(logical_page)}, ring says {page_id}"
                )
            filled = int(present[page_id].sum())
            if present[page_id].max(initial=0) > 1:
                raise AssertionError(f"page {page_id} has a presence byte other than 0/1")
            if filled != self._page_num_tokens[page_id]:
                raise AssertionError(
                    f"page {page_id} has {filled} present slots but counts {self._page_num_tokens[page_id]}"
                )
            total += filled
        if total != self._num_tokens:
            raise AssertionError(f"{total} tokens present in resident pages, but the count is {self._num_tokens}")
        return 0

    def __reduce__(self):
        raise TypeError(
            "PagedKVCache cannot be pickled or copied: its pool is not serialised. To copy its "
            "contents, read them with get_many(list(cache)) (iterating the cache gives the present "
            "token indices) and put_many() them into a new PagedKVCache"
        )

    def __reduce_ex__(self, protocol):
        return self.__reduce__()

    def __repr__(self):
        return (
            f"PagedKVCache(max_pages={self.max_pages}, dim={self.dim}, page_size={self.page_size}, "
            f"dtype={self.dtype}, tokens={self._num_tokens}, num_resident_pages={self._num_resident}, "
            f"evictions={self.evictions})"
        )

    # -------------------------------------------------------------- snapshots
    def save(self, path):
        """Write a snapshot of the cache to ``path``, atomically.

        The snapshot holds the configuration, the resident pages in FIFO
        eviction order with their logical pages and present slots, the
        order of the free pages, the hit, miss and eviction counters, and
        the K/V bytes of every page with a checksum per page. Format and
        atomicity: see :mod:`pagedkv.snapshot`.

        Raises
        ------
        OSError
            The file cannot be written; an existing file is left as it was.
        """
        from pagedkv.snapshot import save_classic
        save_classic(self, path)

    @classmethod
    def load(cls, path):
        """Read a snapshot written by :meth:`save`; later calls answer as the saved cache would.

        Raises
        ------
        pagedkv.SnapshotError
            The file is damaged, truncated, of another kind, or of an unknown
            or newer format version; nothing is built.
        """
        from pagedkv.snapshot import load_classic
        return load_classic(path)

    def _config(self):
        """The construction arguments (dict: max_pages, dim, page_size, dtype name)."""
        return {"max_pages": int(self.max_pages), "dim": int(self.dim), "page_size": int(self.page_size),
                "dtype": str(self.dtype)}

    def _export_state(self):
        """Everything but the K/V bytes as plain arrays and ints (for snapshots).

        Returns
        -------
        dict
            ``logical_pages`` int64 ``(n,)`` and ``page_ids`` int32 ``(n,)``:
            the resident pages, oldest (next evicted) first; ``free_queue``
            int32: the free pages in hand-out order; ``present`` uint8
            ``(max_pages, page_size)``; ``hits``, ``misses``, ``evictions``.
        """
        self._lock.acquire()
        try:
            return _classic_state(self)
        finally:
            self._lock.release()

    def _snapshot(self, kv_out):
        """State (as :meth:`_export_state`) and a copy of the pool into ``kv_out``, in one hold of the lock.

        ``kv_out`` must have the pool's dtype and shape ``(max_pages, 2,
        page_size, dim)``, be C-contiguous, writeable and apart from the pool;
        fault it in beforehand: the copy (without the GIL) runs under the
        lock, and other calls wait for it. Returns the state dict, of the
        same moment as the bytes. Raises TypeError or ValueError for a
        ``kv_out`` that does not fit.
        """
        cdef size_t nbytes = <size_t>self._kv.nbytes
        cdef char* dst
        if not isinstance(kv_out, np.ndarray):
            raise TypeError(f"Invalid type of kv_out: expected a numpy.ndarray, got {type(kv_out).__name__}")
        if kv_out.dtype != self._kv.dtype or kv_out.shape != self._kv.shape:
            raise ValueError(f"Invalid shape of kv_out: expected {self._kv.dtype} {self._kv.shape}, "
                             f"got {kv_out.dtype} {kv_out.shape}")
        if not (kv_out.flags.c_contiguous and kv_out.flags.writeable) or np.may_share_memory(kv_out, self._kv):
            raise ValueError("Invalid layout of kv_out: expected a C-contiguous, writeable array apart from the pool")
        dst = <char*>cnp.PyArray_DATA(kv_out)
        self._lock.acquire()
        try:
            state = _classic_state(self)
            with nogil:
                memcpy(dst, self._kv_data, nbytes)
            return state
        finally:
            self._lock.release()

    def _restore_state(self, dict state):
        """Make this new, empty cache the one ``state`` (from ``_export_state``) describes.

        Everything is checked first: distinct resident pages and logical
        pages, a free queue of exactly the other pages, presence bytes 0 or
        1, counters in ``[0, 2**63)``. Raises ValueError naming the problem
        (nothing changed), RuntimeError when the cache is not new.
        """
        logical, page_ids, free_queue, present = (state["logical_pages"], state["page_ids"], state["free_queue"],
                                                  state["present"])
        n = page_ids.shape[0] if page_ids.ndim == 1 else -1
        if (logical.dtype != np.int64 or logical.shape != (n,) or page_ids.dtype != np.int32 or n > self.max_pages
                or present.dtype != np.uint8 or present.shape != (self.max_pages, self.page_size)):
            raise ValueError("Invalid shape of the classic cache state: expected logical_pages int64 (n,), page_ids "
                             f"int32 (n,) with n <= {self.max_pages}, present uint8 ({self.max_pages}, {self.page_size})")
        if n and (logical.min() < 0 or logical.max() > _INT64_MAX // self.page_size
                  or np.unique(logical).shape[0] != n):
            raise ValueError("Invalid value of logical_pages: expected distinct logical pages in range")
        if present.size and present.max() > 1:
            raise ValueError("Invalid value of present: expected presence bytes 0 or 1")
        for name in ("hits", "misses", "evictions"):
            if not 0 <= state[name] < 2**63:
                raise ValueError(f"Invalid value of {name}: expected 0 <= {name} < 2**63, got {state[name]}")
        refs = np.zeros(self.max_pages, dtype=np.int32)
        if n and (page_ids.min() < 0 or page_ids.max() >= self.max_pages):
            raise ValueError(f"Invalid value of page_ids: expected page ids in [0, {self.max_pages - 1}]")
        np.add.at(refs, page_ids, 1)
        if (refs > 1).any():
            raise ValueError(f"Invalid value of page_ids: page {int(np.flatnonzero(refs > 1)[0])} is resident twice")
        self._pool._check_state(refs, free_queue)
        cdef int32_t i
        cdef const int64_t[::1] logical_view = np.ascontiguousarray(logical)
        cdef const int32_t[::1] id_view = np.ascontiguousarray(page_ids)
        self._lock.acquire()
        try:
            if self._num_resident or self._pool.num_free != self.max_pages:
                raise RuntimeError("PagedKVCache._restore_state needs a new, empty cache")
            self._pool._apply_state(refs, np.ascontiguousarray(free_queue))
            np.copyto(np.asarray(self._present), present)
            counts = present.sum(axis=1, dtype=np.int64)
            for i in range(n):
                self._ring_logical_page[i] = logical_view[i]
                self._ring_page_id[i] = id_view[i]
                self._page_map.insert(logical_view[i], id_view[i])
                self._page_num_tokens[id_view[i]] = <int32_t>counts[id_view[i]]
            self._ring_head = 0
            self._num_resident = <int32_t>n
            self._num_tokens = int(counts[page_ids].sum()) if n else 0
            self._hits = state["hits"]
            self._misses = state["misses"]
            self.evictions = state["evictions"]
        finally:
            self._lock.release()

    def _pool_array(self):
        """The pool array (max_pages, 2, page_size, dim) itself, for snapshots."""
        return self._kv


cdef dict _classic_state(PagedKVCache cache):
    """The dict of ``PagedKVCache._export_state``; the caller holds the cache's lock."""
    cdef int32_t i
    page_ids = np.empty(cache._num_resident, dtype=np.int32)
    for i in range(cache._num_resident):
        page_ids[i] = cache._ring_page_id[(cache._ring_head + i) % cache.max_pages]
    return {"logical_pages": cache._resident_logical_pages(), "page_ids": page_ids,
            "free_queue": cache._pool.free_pages(), "present": np.array(cache._present, copy=True),
            "hits": int(cache._hits), "misses": int(cache._misses), "evictions": int(cache.evictions)}
