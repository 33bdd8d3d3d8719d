"""PagePool: the page allocator of pagedkv.

Pages are integer ids ``0 .. num_pages-1``; a page's bytes live elsewhere (in
the pool array of a cache), the allocator only tracks ownership. Every page
has a ref count: 0 means free, ``n >= 1`` means ``n`` page-table entries (or
other owners) reference it.
"""
import numpy as np

cimport numpy as cnp
from pagedkv_c._types cimport (sat_add, page_id_t, int32_t, pkv_page_record, PKV_ALLOCATOR_RECORD_SHIFT,
                               PKV_SHARED_RECORD_SHIFT)
from pagedkv_c._checks cimport check_int, as_int_array
from pagedkv_c._prefix cimport (pkv_index, pkv_index_is_cached, pkv_index_evict,
                                pkv_index_prefetch_page)

cnp.import_array()

_INT32_MAX = 2**31 - 2
# Largest ref count of a page (int32).
cdef int32_t _MAX_REF_COUNT = 2**31 - 1
# Pages ahead whose prefix-index slots take() prefetches while evicting.
cdef Py_ssize_t _EVICT_PREFETCH_DISTANCE = 16
# Queue entries ahead whose page records take() prefetches while popping.
cdef Py_ssize_t _POP_PREFETCH_DISTANCE = 48


class OutOfPagesError(MemoryError):
    """The pool has fewer free pages than a call needs.

    Raised before any state changes: the call that raised it left the pool,
    and every cache built on it, exactly as they were.
    """


cdef class PagePool:
    """Free-list page allocator with ref counts over page ids ``0 .. num_pages-1``.

    Parameters
    ----------
    num_pages : int
        Number of pages, ``1 <= num_pages <= 2**31 - 2`` (page ids are int32,
        as FlashInfer's page tables require).

    Raises
    ------
    TypeError
        ``num_pages`` is not an integer.
    ValueError
        ``num_pages`` out of range.
    MemoryError
        The per-page records (24 bytes per page, plus a ring of 8 to 16
        bytes per page) cannot be allocated.

    Notes
    -----
    Free pages wait in a free queue with O(1) pop from the head, push to the
    tail, and removal of any page from the middle. Allocation order: **least
    recently freed first**. Freed pages join the tail, allocation pops the
    head; initially pages are handed out in id order 0, 1, 2, ... The O(1)
    middle removal exists for prefix caching: a free page that still holds a
    cached prefix stays in the queue and can be taken back out when a later
    request matches it. vLLM's ``FreeKVCacheBlockQueue``
    (vllm/v1/core/kv_cache_utils.py) keeps the same order in a doubly linked
    list; here the queue is a FIFO ring of page ids with lazy deletion (a
    page's record holds the position of its live entry), which lets
    allocation prefetch the pages it pops next instead of chasing links
    (see ``page_pool.h``). Each page has one 16-byte record: queue position
    and ref count. A prefix index over the pool extends every record to 32
    bytes with the page's hash and cached flag (``page_record.h``).

    Every batch call is all-or-nothing: it validates everything first and
    raises before changing anything.

    *Threads.* A standalone pool may be shared by threads without a lock of
    its own: ``allocate``, ``free`` and ``incref`` make their final check
    and their change in C with the GIL held and no Python code in between,
    so no other thread, and no finalizer run by the garbage collector, can
    change the pool between the check and the change; the GIL serialises
    the calls. (Converting the arguments may run Python code, so the check
    that counts is repeated in C just before the change.)

    *Copies.* A pool cannot be pickled or copied (``pickle``,
    ``copy.copy``, ``copy.deepcopy`` raise TypeError): its pages' owners
    live outside it.

    Attributes
    ----------
    owner : str or None
        ``"KVCache"`` for the pool of a :class:`pagedkv.KVCache`, whose page
        tables hold the references: there the pool is read-only (``num_free``,
        ``ref_count``, ``free_pages``, ``check_invariants``) and ``allocate``,
        ``free`` and ``incref`` raise RuntimeError. None for a standalone pool.
    num_taken : int
        Pages handed out of the free queue since construction (in pages),
        by ``allocate`` and by the caches built on the pool.
    num_reused_in_place : int
        Window pages that a sequence's ring reused in place since
        construction, without passing through the free queue (in pages).
    """

    def __cinit__(self, num_pages):
        cdef int32_t n = <int32_t>check_int(num_pages, "num_pages", 1, _INT32_MAX)
        self.num_pages = n
        cdef Py_ssize_t capacity = 16
        while capacity < 2 * <Py_ssize_t>n:  # see page_pool.h: compaction stays rare
            capacity *= 2
        try:
            # The allocator's 16 bytes of a pkv_page_record per row (page_record.h).
            self._records = np.zeros((n, 2), dtype=np.int64)
            self._ring = np.empty(capacity, dtype=np.int32)
            self._pending = np.zeros(n, dtype=np.int32)
            self._seen_stamp = np.zeros(n, dtype=np.uint32)
        except (ValueError, MemoryError) as exc:
            raise MemoryError(
                f"Invalid value of num_pages: the allocator's records of {n} pages "
                f"({24 * <object>n + 4 * capacity} bytes) cannot be allocated; use fewer pages"
            ) from exc
        self.q.rec = <char*>cnp.PyArray_DATA(self._records)
        self.q.rec_shift = PKV_ALLOCATOR_RECORD_SHIFT
        self.q.ring = <int32_t*>cnp.PyArray_DATA(self._ring)
        self.q.mask = capacity - 1
        self._ref_count = self._records.view(np.int32)[:, 2]
        cdef int32_t i
        # Pages 0, 1, ..., n-1 queued at positions 0 .. n-1.
        for i in range(n):
            self.q.ring[i] = i
            pkv_rec(&self.q, i).qpos = i
        self.q.head = 0
        self.q.tail = n
        self.q.num_free = n
        self.q.num_cached_free = 0
        self.num_taken = 0
        self.num_reused_in_place = 0
        self._stamp = 0
        self.owner = None

    # ------------------------------------------------------------------ C API
    # Counters are updated as `self.x = self.x + 1`, not `self.x += 1`: with the
    # debug build's nonecheck on, Cython rejects in-place operators on attributes
    # in nogil code.
    cdef void take(self, page_id_t* out, Py_ssize_t n) noexcept nogil:
        """Pop ``n`` pages into ``out`` with ref count 1 (caller checked capacity).

        Popped pages that still held a cached prefix are evicted from the
        prefix index in a second pass that prefetches the index slots of the
        pages a few places ahead (the index is larger than the CPU caches).
        Popping prefetches the records of the pages it pops next. With
        ``clear_seal_on_take`` the popped pages' seal flags are cleared.
        """
        cdef Py_ssize_t i
        cdef page_id_t page_id
        self.num_taken = sat_add(self.num_taken, n)
        for i in range(min(n, _POP_PREFETCH_DISTANCE)):
            pkv_queue_prefetch(&self.q, i)
        for i in range(n):
            pkv_queue_prefetch(&self.q, _POP_PREFETCH_DISTANCE)
            page_id = pkv_queue_pop(&self.q)
            pkv_set_ref(&self.q, page_id, 1)
            if self.clear_seal_on_take:
                pkv_rec(&self.q, page_id).sealed = 0
            out[i] = page_id
        if self.prefix is None:
            return
        # The pages' records (queue position, ref count and hash share one)
        # were loaded by the pops; the index slots are prefetched D pages ahead.
        cdef pkv_index* ix = &self.prefix.ix
        cdef Py_ssize_t d = _EVICT_PREFETCH_DISTANCE
        for i in range(min(n, d)):
            pkv_index_prefetch_page(ix, out[i])
        for i in range(n):
            if i + d < n:
                pkv_index_prefetch_page(ix, out[i + d])
            if pkv_index_is_cached(ix, out[i]):
                pkv_index_evict(ix, out[i])

    cdef int attach_prefix(self, PrefixIndex index) except -1:
        """Put a prefix index over this pool; the pool adopts the index's page records.

        The allocator's and the index's fields of a page then share one
        32-byte record (page_record.h), so evicting a page as it is handed
        out, or taking a reference on a prefix hit, touches one cache line.
        Called once, before any page holds a hash.

        Raises
        ------
        ValueError
            The index covers a different number of pages.
        RuntimeError
            The pool already has a prefix index.
        """
        if self.prefix is not None:
            raise RuntimeError("the pool already has a prefix index")
        if index.num_pages != self.num_pages:
            raise ValueError(
                f"Invalid value of index: expected a prefix index of {self.num_pages} pages, "
                f"got {index.num_pages}"
            )
        cdef pkv_page_record* records = index.ix.pages
        cdef int32_t i
        for i in range(self.num_pages):
            records[i].qpos = pkv_rec(&self.q, i).qpos
            records[i].ref = pkv_rec(&self.q, i).ref
        self._records = index.page_records
        self.q.rec = <char*>records
        self.q.rec_shift = PKV_SHARED_RECORD_SHIFT
        self._ref_count = self._records.view(np.int32)[:, 2]
        self.prefix = index
        return 0

    cdef int32_t decref_one(self, page_id_t page_id) noexcept nogil:
        """Drop one reference; a page reaching 0 joins the free queue's tail."""
        return pkv_decref(&self.q, page_id)

    cdef bint ids_valid(self, const page_id_t* ids, Py_ssize_t n, bint forbid_duplicates) noexcept nogil:
        """Whether every id is in range and allocated (and, if asked, listed once)."""
        cdef Py_ssize_t i
        cdef page_id_t page_id
        self._stamp = self._stamp + 1
        if self._stamp == 0:  # wrapped around: forget every old stamp
            self._seen_stamp[:] = 0
            self._stamp = 1
        for i in range(n):
            page_id = ids[i]
            if page_id < 0 or page_id >= self.num_pages or self._ref_count[page_id] == 0:
                return False
            if forbid_duplicates:
                if self._seen_stamp[page_id] == self._stamp:
                    return False
                self._seen_stamp[page_id] = self._stamp
        return True

    # ------------------------------------------------------------- Python API
    @property
    def num_free(self):
        """Number of free pages (int, in pages)."""
        return self.q.num_free

    def allocate(self, n):
        """Take ``n`` free pages, least recently freed first.

        Parameters
        ----------
        n : int
            Number of pages, ``0 <= n <= num_pages``.

        Returns
        -------
        numpy.ndarray
            int32, shape ``(n,)``: the page ids, each now with ref count 1.

        Raises
        ------
        TypeError
            ``n`` is not an integer.
        ValueError
            ``n`` is negative or larger than ``num_pages``.
        OutOfPagesError
            Fewer than ``n`` pages are free; nothing is allocated.
        RuntimeError
            The pool belongs to a ``KVCache`` (see :attr:`owner`).
        """
        self._check_unowned("allocate")
        cdef cnp.npy_intp count = <cnp.npy_intp>check_int(n, "n", 0, self.num_pages)
        # The output first: from the capacity check to the last pop no Python
        # code may run (see Threads in the class notes).
        cdef cnp.ndarray out = <cnp.ndarray>cnp.PyArray_EMPTY(1, &count, cnp.NPY_INT32, 0)
        if count > self.q.num_free:
            raise OutOfPagesError(
                f"Cannot allocate {count} pages: only {self.q.num_free} of the {self.num_pages} pages "
                f"{'is' if self.q.num_free == 1 else 'are'} free. Nothing was allocated. Free pages you no longer need (free), or create "
                f"the pool with num_pages >= {self.num_pages + count - self.q.num_free}."
            )
        self.take(<page_id_t*>cnp.PyArray_DATA(out), count)
        return out

    cdef int _check_unowned(self, str method) except -1:
        if self.owner is not None:
            raise RuntimeError(
                f"PagePool.{method} cannot be used on the pool of a {self.owner}: its page tables "
                f"hold the references; use the {self.owner} methods instead (this pool is read-only)"
            )
        return 0

    cdef object _checked_ids(self, object page_ids, bint forbid_duplicates):
        """Validate page ids: in range, allocated, optionally distinct.

        Fast path: a valid, writeable, C-contiguous int32 ndarray (what
        ``allocate`` returns) is checked in one C pass, with the GIL held, and
        returned as is. Anything else, and any invalid input, takes the NumPy
        path below, which converts the input and raises the error that names
        the first problem.
        """
        cdef cnp.ndarray fast
        if (cnp.PyArray_CheckExact(page_ids) and cnp.PyArray_NDIM(<cnp.ndarray>page_ids) == 1
                and cnp.PyArray_TYPE(<cnp.ndarray>page_ids) == cnp.NPY_INT32
                and cnp.PyArray_ISCARRAY(<cnp.ndarray>page_ids)):
            fast = <cnp.ndarray>page_ids
            if self.ids_valid(<const page_id_t*>cnp.PyArray_DATA(fast),
                              cnp.PyArray_DIMS(fast)[0], forbid_duplicates):
                return fast
        cdef object ids = as_int_array(page_ids, "page_ids", np.int64)
        if ids.size == 0:
            return ids.astype(np.int32)
        cdef long long lo = ids.min()
        cdef long long hi = ids.max()
        if lo < 0 or hi >= self.num_pages:
            bad = int(ids[(ids < 0) | (ids >= self.num_pages)][0])
            raise ValueError(
                f"Invalid value of page_ids: expected page ids in [0, {self.num_pages - 1}], got {bad}"
            )
        ids = ids.astype(np.int32)
        refs = np.asarray(self._ref_count)[ids]
        if (refs == 0).any():
            bad = int(ids[refs == 0][0])
            raise ValueError(f"Invalid value of page_ids: page {bad} is not allocated (ref count 0)")
        if forbid_duplicates and ids.size > 1:
            uniq, counts = np.unique(ids, return_counts=True)
            if (counts > 1).any():
                raise ValueError(
                    f"Invalid value of page_ids: page {int(uniq[counts > 1][0])} is listed more than once"
                )
        # The checks above ran Python code, during which another thread or a
        # finalizer may have changed the pool: check again in C as the last
        # step, so that the caller's change follows a check with nothing between.
        if not self.ids_valid(<const page_id_t*>cnp.PyArray_DATA(ids), ids.shape[0], forbid_duplicates):
            return self._checked_ids(ids, forbid_duplicates)
        return ids

    def free(self, page_ids):
        """Drop one reference to each page; pages reaching ref count 0 become free.

        Parameters
        ----------
        page_ids : sequence of int or numpy.ndarray of integers, shape ``(n,)``
            Allocated pages, each listed at most once.

        Raises
        ------
        ValueError
            A page id is out of range, not allocated, or listed twice; nothing
            is freed.
        TypeError
            ``page_ids`` is not a 1-D sequence of integers.
        RuntimeError
            The pool belongs to a ``KVCache`` (see :attr:`owner`).

        Notes
        -----
        Pages reaching ref count 0 join the tail of the free queue in the order
        given, so the first page listed is the first to be handed out again.
        """
        self._check_unowned("free")
        cdef cnp.ndarray ids = self._checked_ids(page_ids, True)
        cdef const page_id_t* ids_ptr = <const page_id_t*>cnp.PyArray_DATA(ids)
        cdef Py_ssize_t i
        for i in range(cnp.PyArray_DIMS(ids)[0]):  # with the GIL: see Threads in the class notes
            self.decref_one(ids_ptr[i])

    def incref(self, page_ids):
        """Add one reference to each listed page (a page listed k times gains k).

        Parameters
        ----------
        page_ids : sequence of int or numpy.ndarray of integers, shape ``(n,)``
            Allocated pages.

        Raises
        ------
        ValueError
            A page id is out of range or not allocated, or a page would pass
            ``2**31 - 1`` references (the int32 ref count limit, counting
            every time the page is listed); nothing changes.
        TypeError
            ``page_ids`` is not a 1-D sequence of integers.
        RuntimeError
            The pool belongs to a ``KVCache`` (see :attr:`owner`).
        """
        self._check_unowned("incref")
        cdef cnp.ndarray ids_array = self._checked_ids(page_ids, False)
        cdef const page_id_t* ids = <const page_id_t*>cnp.PyArray_DATA(ids_array)
        cdef Py_ssize_t i, n = cnp.PyArray_DIMS(ids_array)[0], bad = -1
        cdef int32_t page_id, most = 0
        # With the GIL (see Threads in the class notes): the check and the
        # change run with no Python code between them.
        # Common case: no listed page is within n references of the limit,
        # so no page can pass it, however often it is listed.
        for i in range(n):
            if self._ref_count[ids[i]] > most:
                most = self._ref_count[ids[i]]
        if n <= _MAX_REF_COUNT - most:
            for i in range(n):
                self._ref_count[ids[i]] += 1
        else:
            # Count each page's new references in the scratch first: a
            # page may be listed many times, and nothing may change on
            # failure.
            for i in range(n):
                page_id = ids[i]
                if self._pending[page_id] >= _MAX_REF_COUNT - self._ref_count[page_id]:
                    bad = i
                    break
                self._pending[page_id] += 1
            if bad < 0:
                for i in range(n):
                    page_id = ids[i]
                    self._ref_count[page_id] += self._pending[page_id]
                    self._pending[page_id] = 0
            else:
                for i in range(bad):
                    self._pending[ids[i]] = 0
        if bad >= 0:
            raise ValueError(
                f"Invalid value of page_ids: page {ids[bad]} would pass 2**31 - 1 references, the "
                f"limit of the int32 ref count (it has {self._ref_count[ids[bad]]})"
            )

    def _set_ref_count_for_tests(self, page_id, count):
        """Set the ref count of an allocated page (tests of the int32 ref count limit).

        Reaching ``2**31 - 1`` through ``incref`` takes 2**31 increments
        (tens of seconds); this puts a page next to the limit directly.
        ``count`` is in ``[1, 2**31 - 1]``, so the page stays allocated and
        the allocator's invariants hold. Raises ValueError for a free page
        or a count out of range, RuntimeError on the pool of a ``KVCache``.
        """
        self._check_unowned("_set_ref_count_for_tests")
        cdef int32_t p = <int32_t>check_int(page_id, "page_id", 0, self.num_pages - 1)
        cdef int32_t n = <int32_t>check_int(count, "count", 1, _MAX_REF_COUNT)
        if self._ref_count[p] == 0:
            raise ValueError(f"Invalid value of page_id: page {p} is not allocated (ref count 0)")
        self._ref_count[p] = n

    def ref_count(self, page_id):
        """Return the ref count of one page (0 = free).

        Raises
        ------
        TypeError, ValueError
            ``page_id`` is not an integer in ``[0, num_pages)``.
        """
        cdef int32_t p = <int32_t>check_int(page_id, "page_id", 0, self.num_pages - 1)
        return self._ref_count[p]

    def free_pages(self):
        """Return the free queue in hand-out order (int32 array, shape ``(num_free,)``)."""
        # No Python code between reading num_free and filling the array (see Threads).
        cdef cnp.npy_intp num_free = self.q.num_free
        cdef cnp.ndarray out = <cnp.ndarray>cnp.PyArray_EMPTY(1, &num_free, cnp.NPY_INT32, 0)
        cdef int32_t* view = <int32_t*>cnp.PyArray_DATA(out)
        cdef int64_t a
        cdef int32_t page_id
        cdef Py_ssize_t i = 0
        for a in range(self.q.head, self.q.tail):
            page_id = self.q.ring[a & self.q.mask]
            if pkv_rec(&self.q, page_id).qpos == a and i < num_free:
                view[i] = page_id
                i += 1
        return out

    def check_invariants(self):
        """Verify the allocator's state; raise AssertionError naming the first bad page.

        Checks: the free queue's live entries (see ``page_pool.h``) are
        exactly ``num_free`` pages, each once; every page is either free (ref
        count 0, queued exactly once) or allocated (ref count >= 1, not
        queued); the ring holds no more entries than its capacity.
        """
        cdef int32_t n = self.num_pages
        seen = np.zeros(n, dtype=np.int8)
        cdef int64_t a, qpos
        cdef int32_t page_id
        cdef Py_ssize_t live = 0
        if not 0 <= self.q.tail - self.q.head <= self.q.mask + 1:
            raise AssertionError(f"free queue spans {self.q.tail - self.q.head} entries, capacity {self.q.mask + 1}")
        for a in range(self.q.head, self.q.tail):
            page_id = self.q.ring[a & self.q.mask]
            if page_id < 0 or page_id >= n:
                raise AssertionError(f"free queue holds invalid page id {page_id}")
            if pkv_rec(&self.q, page_id).qpos == a:
                if seen[page_id]:
                    raise AssertionError(f"page {page_id} is in the free queue twice")
                seen[page_id] = 1
                live += 1
        if live != self.q.num_free:
            raise AssertionError(f"free queue holds {live} pages but num_free is {self.q.num_free}")
        cdef int32_t p
        for p in range(n):
            qpos = pkv_rec(&self.q, p).qpos
            if self._ref_count[p] < 0:
                raise AssertionError(f"page {p} has negative ref count {self._ref_count[p]}")
            if self._ref_count[p] == 0 and not seen[p]:
                raise AssertionError(f"page {p} has ref count 0 but is not in the free queue")
            if self._ref_count[p] > 0 and seen[p]:
                raise AssertionError(f"page {p} has ref count {self._ref_count[p]} but is in the free queue")
            if not seen[p] and qpos != -1:
                raise AssertionError(f"page {p} is not queued but records queue position {qpos}")
        # The metrics counter of queued pages still findable by prefix hash (page_pool.h).
        cdef int64_t cached_free = 0
        for p in range(n):
            if seen[p] and pkv_rec(&self.q, p).cached:
                cached_free += 1
        if cached_free != self.q.num_cached_free:
            raise AssertionError(
                f"{cached_free} free pages are cached but num_cached_free is {self.q.num_cached_free}"
            )

    @property
    def num_cached_free(self):
        """Free pages still findable by prefix hash (int, in pages); 0 without a prefix index."""
        return self.q.num_cached_free

    def __reduce__(self):
        raise TypeError(
            "PagePool cannot be pickled or copied: the owners of its pages live outside it. "
            "Create a new PagePool(num_pages); free_pages() and ref_count() report this one's state"
        )

    def __reduce_ex__(self, protocol):
        return self.__reduce__()

    def __repr__(self):
        return f"PagePool(num_pages={self.num_pages}, num_free={self.q.num_free})"

    # --------------------------------------------------- state export / restore
    def _export_state(self):
        """The allocator's state as plain arrays (for snapshots).

        Returns
        -------
        ref_counts : numpy.ndarray
            int32, shape ``(num_pages,)``: references per page, 0 = free.
        free_queue : numpy.ndarray
            int32, shape ``(num_free,)``: the free pages in hand-out order
            (least recently freed first), which decides what later
            allocations return and which cached prefixes they evict.
        """
        return np.asarray(self._ref_count).copy(), self.free_pages()

    cdef int _check_state(self, object ref_counts, object free_queue) except -1:
        """Raise ValueError unless the arrays are a consistent allocator state.

        ``ref_counts``: int32 ``(num_pages,)``, every count in ``[0, 2**31 - 1]``;
        ``free_queue``: int32 ``(k,)``, exactly the pages with ref count 0, each once.
        """
        if ref_counts.dtype != np.int32 or ref_counts.shape != (self.num_pages,):
            raise ValueError(f"Invalid shape of ref_counts: expected int32 ({self.num_pages},), "
                             f"got {ref_counts.dtype} {ref_counts.shape}")
        if free_queue.dtype != np.int32 or free_queue.ndim != 1:
            raise ValueError(f"Invalid shape of free_queue: expected int32 (k,), got {free_queue.dtype} {free_queue.shape}")
        if ref_counts.size and ref_counts.min() < 0:
            bad = int(np.flatnonzero(ref_counts < 0)[0])
            raise ValueError(f"Invalid value of ref_counts: page {bad} has ref count {int(ref_counts[bad])}")
        if free_queue.size and (free_queue.min() < 0 or free_queue.max() >= self.num_pages):
            bad = int(free_queue[(free_queue < 0) | (free_queue >= self.num_pages)][0])
            raise ValueError(f"Invalid value of free_queue: expected page ids in [0, {self.num_pages - 1}], got {bad}")
        queued = np.bincount(free_queue, minlength=self.num_pages) if free_queue.size else np.zeros(self.num_pages, np.int64)
        if (queued > 1).any():
            raise ValueError(f"Invalid value of free_queue: page {int(np.flatnonzero(queued > 1)[0])} is queued twice")
        wrong = np.flatnonzero((queued == 1) != (ref_counts == 0))
        if wrong.size:
            p = int(wrong[0])
            raise ValueError(f"Invalid value of free_queue: page {p} has ref count {int(ref_counts[p])} "
                             f"but is {'' if queued[p] else 'not '}in the free queue")
        return 0

    cdef void _apply_state(self, const int32_t[::1] ref_counts, const int32_t[::1] free_queue) noexcept:
        """Set ref counts and the free queue (checked by _check_state first)."""
        cdef int32_t p
        cdef Py_ssize_t i
        for p in range(self.num_pages):
            pkv_rec(&self.q, p).qpos = -1
            pkv_set_ref(&self.q, p, ref_counts[p])
        for i in range(free_queue.shape[0]):
            self.q.ring[i] = free_queue[i]
            pkv_rec(&self.q, free_queue[i]).qpos = i
        self.q.head = 0
        self.q.tail = free_queue.shape[0]
        self.q.num_free = <int32_t>free_queue.shape[0]
        self.q.num_cached_free = 0  # the owner recounts it once the prefix index is restored
