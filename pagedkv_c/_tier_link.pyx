"""TierLink: a KVCache's side of a shared prefix tier (``pagedkv.tiers``).

Three moments: :meth:`TierLink.lookup` asks the tier, without the cache's
lock, for the prompt pages after the local prefix hits; :meth:`TierLink.install`
copies the verified pages it returned into new pages, under the lock, and
indexes them; :meth:`TierLink.offload` tells the tier's writer thread that
sealed pages wait in the sealed-page log (``_seals``). Faults of the tier are
misses, never errors.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint8_t, uint64_t
from pagedkv_c._types cimport page_id_t, int32_t
from pagedkv_c._prefix cimport SequenceHashes
from pagedkv_c._prefix_serving cimport servable_pages
from pagedkv_c._checks cimport check_int, check_array

cnp.import_array()


cdef class TierLink:
    """The tier of a KVCache and the tokens it served (internal; made by :func:`new_tier_link`)."""

    cdef object lookup(self, PageTable table, object prompt, int64_t prompt_len):
        """Fetch from the tier the prompt's pages after its leading local hits.

        The local hits are counted under the lock, the fetch runs without it.
        Returns ``(first, records, count, body_offset, checksums)``: the
        logical page of the first fetched page and the tier's verified values
        of the pages from there, checked here so that :meth:`install` cannot
        fail; or None. The table (new, not yet visible) gets ring room for all
        of them.
        """
        cdef SequenceHashes hashes = table.hashes
        cdef int64_t ps = self.store.page_size
        cdef int64_t servable = servable_pages(prompt_len, ps, hashes.num_hashable)
        cdef int64_t first = 0, n = 0
        cdef const int32_t* tokens = <const int32_t*>cnp.PyArray_DATA(prompt) if prompt is not None else NULL
        if servable <= 0:
            return None
        self.lock.acquire()
        try:
            first = self.prefix.leading_hits(hashes, tokens, servable)  # what match serves without a window
            n = min(servable - first, <int64_t>self.pool.q.num_free)
        finally:
            self.lock.leave()
        if n <= 0:
            return None
        hashes.hash_upto(self.prefix.index.algorithm, first + n)
        page_hashes = np.asarray(hashes.chain_array)[first:first + n].copy()
        token_rows = prompt[first * ps:(first + n) * ps].reshape(n, ps) if prompt is not None else None
        fetched = self.tier._fetch(page_hashes, token_rows)
        if fetched is None:
            return None
        # What install hands to C: checked here, without the lock, so the install cannot fail.
        records, count, body_offset, checksums = fetched
        count = check_int(count, "count", 0, n)
        body_offset = check_int(body_offset, "body_offset", 0, 2**40)
        check_array(records, "records", np.uint8, (n, body_offset + self.store.num_layers * self.store.page_bytes))
        check_array(checksums, "checksums", np.uint64, (n,))
        if count == 0:
            return None
        table.reserve(first + count)
        return first, records, count, body_offset, checksums

    cdef int64_t install(self, PageTable table, object fetched, int64_t num_local) except -1:
        """Put the fetched pages that follow the ``num_local`` local hits into new pages.

        ``fetched`` is what :meth:`lookup` returned: the first fetched
        logical page, the tier's verified values (uint8 rows, checked there)
        with each page's body at ``body_offset``, their count and their page
        checksums. Each body is copied into every layer of a page taken from
        the free queue (one C loop over pages and layers, without the GIL), the
        page is indexed under its hash (and token ids), appended to the table
        and sealed. Takes at most the free pages; none when the local hits no
        longer end where the fetch began (a gap). Returns the tokens added.
        """
        cdef int64_t first = fetched[0]
        cdef object records = fetched[1]
        cdef Py_ssize_t count = fetched[2]
        cdef Py_ssize_t body_offset = fetched[3]
        cdef const uint64_t[::1] checksums = fetched[4]
        cdef SequenceHashes hashes = table.hashes
        cdef int64_t ps = self.store.page_size
        cdef Py_ssize_t skip = num_local - first, r, i
        cdef Py_ssize_t row_bytes = records.shape[1]
        cdef const uint8_t* body
        cdef page_id_t page_id
        if skip < 0 or table.length != num_local * ps or table.num_held() != num_local:
            return 0
        r = min(count - skip, <Py_ssize_t>self.pool.q.num_free)
        if r <= 0:
            return 0
        cdef object pages = np.empty(r, dtype=np.int32)
        cdef int32_t[::1] page_view = pages
        self.pool.take(&page_view[0], r)
        body = <const uint8_t*>cnp.PyArray_DATA(records) + skip * row_bytes + body_offset
        with nogil:  # non-temporal stores, as store's: no read of the destination lines, no eviction
            for i in range(r):
                self.seals.unseal_page(page_view[i])  # a page still in the sealed-page log leaves it before it is written
                self.store.write_page(page_view[i], <const char*>body + i * row_bytes)
            self.store.fence()
        for i in range(r):
            page_id = page_view[i]
            self.prefix.index_page(hashes, num_local + i, page_id)
            table.push_page(page_id)
            # Complete in every layer: sealed now, and not logged (the tier holds it); the
            # tier verified the body's checksum, the page's own.
            self.seals.seal_written(page_id, checksums[skip + i])
        table.length += r * ps
        hashes.num_registered = num_local + r
        self.hits += r * ps
        return r * ps

    cdef int offload(self, object cache) except -1:
        """Tell the tier that the call just sealed pages of ``cache``: its writer thread copies them out.

        Called after the lock is released. The writer takes the pages from the
        log and copies their bytes in one hold of the lock
        (``KVCache._take_sealed_copies``, in C without the GIL), then makes the
        headers and checksums and sends them: this thread does no per-page
        work and never waits on the network.
        """
        if self.seals.has_pending():  # most decode steps seal nothing
            self.tier._offload_notify(cache)
        return 0


cdef TierLink new_tier_link(object tier, PagePool pool, PageStore store, PrefixServer prefix, SealTracker seals,
                            CacheLock lock, object dtype):
    """Attach ``tier`` (checked by :func:`check_tier`) to a cache of ``store``'s layout and ``dtype``.

    The tier says how many sealed pages may wait for its writer; the
    sealed-page log is started with that capacity (more are not logged), and
    without checksums: the tier's writer thread computes them on its copies.
    Raises what the tier's ``_attach`` raises (a tier serving caches of
    another layout: ValueError).
    """
    cdef TierLink link = TierLink.__new__(TierLink)
    waiting = tier._attach(store.num_layers, store.num_kv_heads, store.head_dim, store.page_size, dtype,
                           prefix.index.algorithm_name)
    entries = check_int(max(1, min(pool.num_pages, waiting, 2**24)), "capacity", 1, 2**24)
    lock.acquire()
    try:
        seals.enable_log(True, entries)
    finally:
        lock.leave()
    seals.log_without_checksums = True
    link.tier = tier
    link.pool = pool
    link.store = store
    link.prefix = prefix
    link.seals = seals
    link.lock = lock
    return link


cdef int check_tier(object tier, object enable_prefix_caching, object window) except -1:
    """A tier needs prefix caching and full attention; it must be a tier object."""
    if not all(hasattr(tier, name) for name in ("_attach", "_fetch", "_offload_notify")):
        raise TypeError(f"Invalid type of tier: expected a tier such as pagedkv.tiers.RedisTier, "
                        f"got {type(tier).__name__}")
    if not enable_prefix_caching:
        raise ValueError("Invalid value of tier: a shared tier needs enable_prefix_caching=True")
    if window is not None:
        raise ValueError(f"Invalid value of tier: a shared tier needs full attention (window=None), got window={window}")
    return 0
