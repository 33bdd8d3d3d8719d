"""SealTracker: the seal life cycle of pages, their checksums and the sealed-page log.

A page is *sealed* once it is full and its K/V complete in every layer (see
``KVCache.seal`` and docs/page_integrity.md). The seal is decided here, in
one place, and that one hook serves three consumers: page checksums
(``KVCache.verify_pages``), snapshots (the seal flags and checksums they
carry) and the sealed-page log that the shared tier drains. The seal flag
itself lives in the pool's page record (``page_record.h``), so the allocator
can clear it while the record is hot.
"""
import numpy as np

cimport cython
cimport numpy as cnp
from libc.stdint cimport INT64_MAX
from libc.stdlib cimport malloc, free, realloc
from pagedkv_c._types cimport sat_add, pkv_page_record, PKV_SEALED_OFFSET
from pagedkv_c._pool cimport pkv_rec
from pagedkv_c._prefix cimport pkv_index_is_cached
from pagedkv_c._checks cimport check_array, check_int
from pagedkv_c._checksum cimport pkv_page_checksum, pkv_page_checksums

cnp.import_array()


class BadPage:
    """A sealed page whose bytes no longer match the checksum recorded at its seal.

    Attributes
    ----------
    page_id : int
        The page (its K/V in every layer).
    expected : int
        Checksum recorded at the seal (uint64 value).
    actual : int
        Checksum of the page's bytes now.
    seq_ids : list of int
        Sequences holding the page (empty for a free page kept by prefix caching).
    """
    __slots__ = ("page_id", "expected", "actual", "seq_ids")

    def __init__(self, page_id, expected, actual, seq_ids):
        self.page_id = page_id
        self.expected = expected
        self.actual = actual
        self.seq_ids = seq_ids

    def __eq__(self, other):
        if not isinstance(other, BadPage):
            return NotImplemented
        return (self.page_id, self.expected, self.actual, self.seq_ids) == \
            (other.page_id, other.expected, other.actual, other.seq_ids)

    __hash__ = None

    def __repr__(self):
        return (f"BadPage(page_id={self.page_id}, expected={self.expected:#018x}, "
                f"actual={self.actual:#018x}, seq_ids={self.seq_ids})")


class PageCheckReport:
    """Result of :meth:`KVCache.verify_pages`: pages checked and pages found changed.

    Falsy when every checked page matched its recorded checksum, so
    ``if report: ...`` reads "if corruption was found".

    Attributes
    ----------
    num_pages_checked : int
        Sealed pages whose checksum was recomputed, in pages.
    bad_pages : list of BadPage
        Pages whose checksum differs, in increasing page id order.
    """
    __slots__ = ("num_pages_checked", "bad_pages")

    def __init__(self, num_pages_checked, bad_pages):
        self.num_pages_checked = num_pages_checked
        self.bad_pages = bad_pages

    def __bool__(self):
        return bool(self.bad_pages)

    def __repr__(self):
        return f"PageCheckReport(num_pages_checked={self.num_pages_checked}, bad_pages={self.bad_pages})"


cdef class SealTracker:
    """Seal flags, page checksums and the sealed-page log of a KVCache (internal; see :func:`new_seal_tracker`).

    Callers hold the cache's lock around every method.
    """

    def __dealloc__(self):
        free(self.digest_scratch)
        free(self.seal_buffer)
        if self.log_enabled:
            pkv_sealed_log_free(&self.log)

    cdef void update_seal_on_take(self) noexcept:
        """Let take clear seal flags itself while no checksum or log entry must go with them."""
        self.pool.clear_seal_on_take = self.checksums == NULL and not self.log_enabled

    @cython.final
    cdef bint seal_page(self, page_id_t page_id) noexcept nogil:
        """Seal one page unless it is sealed: flag, checksum, log. True if newly sealed."""
        cdef uint64_t checksum = 0
        cdef pkv_page_record* record
        cdef bint logged
        if pkv_rec(&self.pool.q, page_id).sealed:
            return False
        pkv_rec(&self.pool.q, page_id).sealed = 1
        self.pages_sealed = sat_add(self.pages_sealed, 1)
        logged = self.log_enabled and self.ix != NULL and pkv_index_is_cached(self.ix, page_id)
        if self.checksums != NULL or (logged and not self.log_without_checksums):
            checksum = pkv_page_checksum(<const uint8_t*>self.store.data, <size_t>self.store.layer_bytes,
                                         <size_t>self.store.page_bytes, self.store.num_layers, page_id,
                                         self.digest_scratch)
        if self.checksums != NULL:
            self.checksums[page_id] = checksum
        if logged:
            record = &self.ix.pages[page_id]
            pkv_sealed_log_push(&self.log, page_id, record.lo, record.hi,
                                self.index_tokens + <Py_ssize_t>page_id * self.page_size
                                if record.has_tokens else NULL,
                                checksum)
        return True

    @cython.final
    cdef void unseal_page(self, page_id_t page_id) noexcept nogil:
        """The page is about to be written again: clear its seal (and withdraw its log entry)."""
        if pkv_rec(&self.pool.q, page_id).sealed:
            pkv_rec(&self.pool.q, page_id).sealed = 0
            if self.checksums != NULL:
                self.checksums[page_id] = 0
            if self.log_enabled:
                pkv_sealed_log_withdraw(&self.log, page_id)

    cdef int64_t seal_table(self, PageTable table) noexcept nogil:
        """Seal the held full pages of a table from its resume point on; return how many were new."""
        cdef int64_t upto = table.length // self.page_size
        cdef int64_t k, n = 0
        if upto <= table.num_sealed:
            return 0
        for k in range(table.num_sealed, min(upto, <int64_t>table.sink_count)):
            n += self.seal_page(table.sinks[k])
        for k in range(max(table.num_sealed, table.ring_first), min(upto, table.ring_first + table.ring_count)):
            n += self.seal_page(table.ring_page(k - table.ring_first))
        table.num_sealed = upto
        return n

    cdef Py_ssize_t list_seals(self, list tables, const int64_t* counts) except -1:
        """List the pages the append about to run seals, before it changes anything.

        Those are the held, full, not yet sealed pages of each sequence that
        appends at least one token. They are sealed by :meth:`after_append`
        once the append cannot fail any more, and before its copy-on-write
        copies or the caller's stores write into any page.
        """
        cdef Py_ssize_t b, n = 0, bound = 0
        cdef int64_t k, upto
        cdef PageTable table
        cdef page_id_t* grown
        for b in range(len(tables)):
            table = <PageTable>tables[b]
            upto = table.length // self.page_size
            if counts[b] > 0 and upto > table.num_sealed:
                bound += min(upto - table.num_sealed, <int64_t>table.num_held())
        if bound == 0:
            return 0
        if bound > self.seal_capacity:
            grown = <page_id_t*>realloc(self.seal_buffer, bound * sizeof(page_id_t))
            if grown == NULL:
                raise MemoryError()
            self.seal_buffer = grown
            self.seal_capacity = bound
        for b in range(len(tables)):
            table = <PageTable>tables[b]
            if counts[b] <= 0:
                continue
            upto = table.length // self.page_size
            for k in range(table.num_sealed, min(upto, <int64_t>table.sink_count)):
                if not pkv_rec(&self.pool.q, table.sinks[k]).sealed:
                    self.seal_buffer[n] = table.sinks[k]
                    n += 1
            for k in range(max(table.num_sealed, table.ring_first), min(upto, table.ring_first + table.ring_count)):
                if not pkv_rec(&self.pool.q, table.ring_page(k - table.ring_first)).sealed:
                    self.seal_buffer[n] = table.ring_page(k - table.ring_first)
                    n += 1
        return n

    cdef void after_append(self, list tables, const int64_t* counts, Py_ssize_t num_listed):
        """Seal the pages :meth:`list_seals` listed, then clear the seal of every page the append hands out slots in."""
        cdef Py_ssize_t i, b
        cdef int64_t n0, k, ps = self.page_size
        cdef PageTable table
        if num_listed:
            with nogil:
                for i in range(num_listed):
                    self.seal_page(self.seal_buffer[i])
        cdef bint taken_unsealed = self.pool.clear_seal_on_take
        for b in range(len(tables)):
            if counts[b] <= 0:
                continue
            table = <PageTable>tables[b]
            n0 = table.length - counts[b]
            if n0 // ps > table.num_sealed:
                table.num_sealed = n0 // ps
            if taken_unsealed and table._window == INT64_MAX:  # no window
                # Without a window every new page came from take, which cleared its
                # seal; only a partial last page written again after a truncate is left.
                if n0 % ps:
                    self.unseal_page(table.page_at(n0 // ps))
                continue
            # New pages (from the free queue or reused in place), a copy-on-write
            # destination, or a partial last page written again after a truncate.
            for k in range(n0 // ps, (table.length - 1) // ps + 1):
                if k < table.num_sink_pages:
                    if k < table.sink_count:
                        self.unseal_page(table.sinks[k])
                elif table.ring_first <= k < table.ring_first + table.ring_count:
                    self.unseal_page(table.ring_page(k - table.ring_first))

    cdef void seal_written(self, page_id_t page_id, uint64_t checksum) noexcept nogil:
        """Seal a page whose every layer was just written whole with verified bytes (a tier hit).

        Not logged: the bytes came from the consumer of the log. ``checksum``
        is the page's checksum, recorded with ``page_checksums``.
        """
        pkv_rec(&self.pool.q, page_id).sealed = 1
        self.pages_sealed = sat_add(self.pages_sealed, 1)
        if self.checksums != NULL:
            self.checksums[page_id] = checksum

    cdef bint has_pending(self) noexcept:
        """True when the sealed-page log holds entries (most decode steps seal nothing)."""
        return self.log_enabled and pkv_sealed_log_count(&self.log) > 0

    cdef object verify(self, list held, object tables):
        """Recompute the checksums of sealed pages; a :class:`PageCheckReport`.

        ``held`` lists the int32 page-id arrays of the sequences to check, or
        is None for every sealed page of the pool; ``tables`` (``(seq_id,
        PageTable)`` pairs) names the holders of a bad page. Needs ``checksums``.
        """
        cdef cnp.ndarray pages, actual
        cdef Py_ssize_t n
        sealed = np.asarray(self.sealed_array).view(np.bool_)
        if held is None:
            pages = np.flatnonzero(sealed).astype(np.int32)
        else:
            pages = np.unique(np.concatenate(held)) if held else np.empty(0, dtype=np.int32)
            pages = np.ascontiguousarray(pages[sealed[pages]], dtype=np.int32)
        n = pages.shape[0]
        actual = np.empty(n, dtype=np.uint64)
        with nogil:
            pkv_page_checksums(<const uint8_t*>self.store.data, <size_t>self.store.layer_bytes,
                               <size_t>self.store.page_bytes, self.store.num_layers,
                               <const int32_t*>cnp.PyArray_DATA(pages), n,
                               <uint64_t*>cnp.PyArray_DATA(actual), self.digest_scratch)
        expected = self.checksum_array[pages]
        bad = np.flatnonzero(actual != expected)
        bad_pages = []
        if bad.size:
            holders = {int(p): [] for p in pages[bad]}
            for seq_id, table in tables:
                for p in set(table.pages()[0].tolist()) & holders.keys():
                    holders[p].append(seq_id)
            bad_pages = [BadPage(int(pages[i]), int(expected[i]), int(actual[i]), holders[int(pages[i])])
                         for i in bad]
        return PageCheckReport(int(n), bad_pages)

    cdef int enable_log(self, bint enabled, int64_t entries) except -1:
        """Start or stop logging sealed pages for a consumer that copies them out (internal: the shared tier).

        The contract of ``KVCache._enable_sealed_log(enabled, capacity)``,
        which checks its arguments (the TypeError and ValueError below), holds
        the cache's lock and passes ``capacity`` as ``entries``.

        While enabled, each page sealed (see :meth:`seal`) that is in the
        prefix index at its seal is appended to a bounded log, with its
        128-bit page hash, its token ids and its checksum (computed at the
        seal even without ``page_checksums``). Pages without a prefix hash
        (prefix caching off, or a page whose hash is cached on another page)
        are not logged. Drain it with :meth:`_take_sealed_pages` after each
        call that can seal (``append``, ``seal``, ``remove_sequence``).

        Parameters
        ----------
        enabled : bool
            True starts logging (a no-op when already on), False stops it and
            discards pending entries.
        entries : int
            Entries that can wait, ``1 <= entries <= 2**24``; the log takes
            ``entries * (32 + 4 * page_size)`` bytes plus 8 per page of the
            pool. A seal that finds it full is not logged (counted as
            ``dropped`` in :meth:`_sealed_log_stats`). Default 4096.

        Raises
        ------
        TypeError
            ``enabled`` not a bool, ``capacity`` not an integer.
        ValueError
            ``capacity`` out of range.
        MemoryError
            The log cannot be allocated.
        """
        if enabled and not self.log_enabled:
            if pkv_sealed_log_init(&self.log, entries, self.page_size, self.pool.num_pages) != 0:
                raise MemoryError(f"the sealed-page log of {entries} entries cannot be allocated")
            self.log_enabled = True
        elif not enabled and self.log_enabled:
            pkv_sealed_log_free(&self.log)
            self.log_enabled = False
        self.update_seal_on_take()
        return 0

    cdef tuple take_pages(self):
        """The pages sealed since the last call, in seal order, and empty the log (internal: the shared tier).

        The contract of ``KVCache._take_sealed_pages()``, which holds the
        cache's lock.

        Returns
        -------
        page_ids : numpy.ndarray
            int32, shape ``[n]``.
        page_hashes : numpy.ndarray
            uint8, shape ``[n, 16]``: each page's 128-bit prefix hash ``h =
            hi << 64 | lo`` as ``h.to_bytes(16, "little")`` (``lo`` first),
            the value of ``prefix_index.page_hash(page_id)`` at the seal.
        token_ids : numpy.ndarray
            int32, shape ``[n, page_size]``: the page's token ids, all -1 for
            a page keyed by external block hashes (no token ids kept).
        checksums : numpy.ndarray
            uint64, shape ``[n]``: the page checksum at the seal
            (``pagedkv_c._checksum.page_checksums``).

        Raises
        ------
        RuntimeError
            The log is not enabled (see :meth:`_enable_sealed_log`).

        Notes
        -----
        The listed pages hold exactly the sealed bytes when this is called
        right after the call that sealed them: an entry whose page was
        written again (handed out by an append, including a copy-on-write
        copy in the sealing call itself) is withdrawn before it is returned.
        Copy the bytes (``kv[:, page_ids]``) before the next call that can
        hand out pages or store K/V; the checksums let the copy be verified.
        """
        cdef cnp.ndarray page_ids, hashes, token_ids, checksums
        cdef int64_t n
        if not self.log_enabled:
            raise RuntimeError("the sealed-page log is not enabled: call _enable_sealed_log(True) first")
        n = pkv_sealed_log_count(&self.log)
        page_ids = np.empty(n, dtype=np.int32)
        hashes = np.empty((n, 2), dtype=np.uint64)
        token_ids = np.empty((n, self.page_size), dtype=np.int32)
        checksums = np.empty(n, dtype=np.uint64)
        pkv_sealed_log_drain(&self.log, <int32_t*>cnp.PyArray_DATA(page_ids), <uint64_t*>cnp.PyArray_DATA(hashes),
                             <int32_t*>cnp.PyArray_DATA(token_ids), <uint64_t*>cnp.PyArray_DATA(checksums))
        return page_ids, hashes.astype("<u8").view(np.uint8).reshape(n, 16), token_ids, checksums

    cdef dict log_stats(self):
        """Counters of the sealed-page log (internal: the shared tier's metrics).

        The contract of ``KVCache._sealed_log_stats()``, which holds the
        cache's lock.

        Returns
        -------
        dict
            ``enabled`` (bool), ``capacity`` (entries), ``pending`` (entries
            waiting), ``logged`` (entries ever appended), ``dropped`` (seals
            not logged because the log was full), ``withdrawn`` (entries whose
            page was written again before the log was drained); counts are 0
            while disabled.
        """
        if not self.log_enabled:
            return {"enabled": False, "capacity": 0, "pending": 0, "logged": 0, "dropped": 0, "withdrawn": 0}
        return {"enabled": True, "capacity": self.log.capacity, "pending": pkv_sealed_log_count(&self.log),
                "logged": self.log.num_logged, "dropped": self.log.num_dropped,
                "withdrawn": self.log.num_withdrawn}

    cdef dict state(self):
        """Copies of the per-page seal flags and checksums (internal: snapshots).

        The contract of ``KVCache._sealed_state()``, which holds the cache's
        lock.

        Returns
        -------
        dict
            ``sealed``: uint8, shape ``[num_pages]``, 1 for a sealed page;
            ``checksums``: uint64, shape ``[num_pages]``, the checksum recorded
            at each sealed page's seal (0 elsewhere), or None without
            ``page_checksums``; ``pages_sealed``: seals over the cache's life
            (int, in pages).
        """
        return {
            "sealed": np.array(self.sealed_array, copy=True),
            "checksums": None if self.checksum_array is None else np.array(self.checksum_array, copy=True),
            "pages_sealed": self.pages_sealed,
        }

    cdef tuple checked_state(self, object sealed, object checksums, object pages_sealed):
        """Check the per-page seal flags and checksums from :meth:`state` for :meth:`apply_state` (internal: snapshots).

        The contract of ``KVCache._restore_sealed_state(sealed, checksums,
        pages_sealed)``, which checks them here (without the lock), then holds
        the cache's lock and applies them; returns the checked values.

        The caller restores the pool's bytes and page tables first; the
        cache takes the flags and checksums as given (verify them with
        :meth:`verify_pages`). Pending entries of the sealed-page log are
        withdrawn.

        Parameters
        ----------
        sealed : numpy.ndarray
            uint8, shape ``[num_pages]``, values 0 or 1.
        checksums : numpy.ndarray or None
            uint64, shape ``[num_pages]``, required with ``page_checksums``
            and refused without; entries of unsealed pages are ignored (set
            to 0).
        pages_sealed : int
            The seal counter, ``>= 0``.

        Raises
        ------
        TypeError, ValueError
            An array of the wrong type, dtype, shape or layout, a flag other
            than 0 or 1, ``checksums`` given (or missing) against the cache's
            ``page_checksums``, a negative counter. Nothing is changed.
        """
        flags = check_array(sealed, "sealed", np.uint8, (self.pool.num_pages,))
        if flags.size and flags.max() > 1:
            raise ValueError(f"Invalid value of sealed: expected flags 0 or 1, got {int(flags.max())}")
        values = None
        if self.checksums != NULL:
            if checksums is None:
                raise ValueError("Invalid value of checksums: expected an array, the cache records page checksums")
            values = check_array(checksums, "checksums", np.uint64, (self.pool.num_pages,))
        elif checksums is not None:
            raise ValueError("Invalid value of checksums: expected None, the cache records no page checksums")
        cdef int64_t counter = check_int(pages_sealed, "pages_sealed", 0, INT64_MAX)
        return flags, values, counter

    cdef void apply_state(self, tuple checked, dict tables):
        """Set the seal flags, checksums and counter that :meth:`checked_state` returned.

        Pending log entries are withdrawn, and every table of ``tables``
        scans its pages again at its next seal.
        """
        cdef PageTable table
        flags, values, counter = checked
        if self.log_enabled:
            pkv_sealed_log_clear(&self.log)
        np.copyto(self.sealed_array, flags)
        if self.checksums != NULL:
            np.multiply(values, flags, out=self.checksum_array, casting="unsafe")
        self.pages_sealed = counter
        for table in tables.values():
            table.num_sealed = 0  # the flags no longer follow from this table's history

    cdef tuple checked_copy_targets(self, object records, Py_ssize_t token_offset, Py_ssize_t body_offset,
                                    object page_hashes):
        """Check the arrays of :meth:`take_copies` (see ``KVCache._take_sealed_copies``); ``(rows, hashes)``."""
        cdef Py_ssize_t token_bytes = 4 * self.page_size
        cdef Py_ssize_t body_bytes = self.store.num_layers * self.store.page_bytes
        rows = check_array(records, "records", np.uint8, (-1, -1))
        cdef Py_ssize_t m = rows.shape[0], record_bytes = rows.shape[1]
        hashes = check_array(page_hashes, "page_hashes", np.uint64, (m, 2))
        for name, arr in (("records", rows), ("page_hashes", hashes)):
            if not arr.flags.writeable:
                raise ValueError(f"Invalid value of {name}: expected a writable array, got a read-only one")
        if token_offset < 0 or token_offset + token_bytes > record_bytes:
            raise ValueError(f"Invalid value of token_offset: expected 0 <= token_offset <= "
                             f"{record_bytes - token_bytes} (rows of {record_bytes} bytes), got {token_offset}")
        if body_offset < 0 or body_offset + body_bytes > record_bytes:
            raise ValueError(f"Invalid value of body_offset: expected 0 <= body_offset <= "
                             f"{record_bytes - body_bytes} (rows of {record_bytes} bytes), got {body_offset}")
        if token_offset < body_offset + body_bytes and body_offset < token_offset + token_bytes and body_bytes:
            raise ValueError(f"Invalid value of body_offset: the body ({body_bytes} bytes at {body_offset}) "
                             f"overlaps the token ids ({token_bytes} bytes at {token_offset})")
        return rows, hashes

    cdef tuple take_copies(self, object rows, object hashes, Py_ssize_t token_offset, Py_ssize_t body_offset,
                           bint discard_rest):
        """Take sealed pages from the log and copy them out, in one hold of the lock (internal: the shared tier).

        The contract of ``KVCache._take_sealed_copies(records, token_offset,
        body_offset, page_hashes, discard_rest)``, which checks the arrays
        with :meth:`checked_copy_targets` (the TypeError and ValueError below),
        then holds the cache's lock while this runs on the checked ``rows``
        and ``hashes``.

        Because the entries are taken and the bytes copied while the lock is
        held, each copy holds exactly the page's bytes at its seal (an entry
        whose page was written again was withdrawn before): the consumer
        needs no second check. Runs in C without the GIL (``sealed_copy.h``),
        so it can run on a consumer's own thread while the caller's thread
        goes on with calls that do not need the lock.

        Parameters
        ----------
        records : numpy.ndarray
            uint8, shape ``[m, record_bytes]``, C-contiguous, writable. Page
            ``k`` taken fills row ``k``: its token ids (int32 in the machine's
            byte order, ``page_size`` of them, all -1 for a page keyed by
            external block hashes) at ``token_offset``, its K/V at
            ``body_offset`` (for each layer in order the page's K then V
            bytes, ``stats()["bytes_per_page"]`` in all, as in the pool).
            Other bytes of the row are left as they are.
        token_offset, body_offset : int
            Byte offsets in a row; the two ranges must lie in the row and not
            overlap.
        page_hashes : numpy.ndarray
            uint64, shape ``[m, 2]``, C-contiguous, writable: row ``k`` gets
            page ``k``'s 128-bit prefix hash (lo, hi).
        discard_rest : bool
            Pending pages beyond the ``m`` rows leave the log uncopied (True)
            or stay pending for the next call (False, the default).

        Returns
        -------
        (int, int)
            Pages copied (rows ``0 .. n-1`` filled, in seal order) and pages
            lost since the previous call: discarded by ``discard_rest``, or
            sealed while the log was full (never logged).

        Raises
        ------
        RuntimeError
            The log is not enabled (see :meth:`_enable_sealed_log`).
        TypeError, ValueError
            An array of the wrong dtype, shape, layout or not writable, or an
            offset out of range; nothing is taken.
        """
        cdef uint8_t* out = <uint8_t*>cnp.PyArray_DATA(rows)
        cdef uint64_t* out_hashes = <uint64_t*>cnp.PyArray_DATA(hashes)
        cdef Py_ssize_t m = rows.shape[0], record_bytes = rows.shape[1]
        cdef int64_t taken = 0, discarded = 0, unlogged = 0
        if not self.log_enabled:
            raise RuntimeError("the sealed-page log is not enabled: call _enable_sealed_log(True) first")
        with nogil:
            taken = pkv_sealed_log_take_copies(
                &self.log, <const uint8_t*>self.store.data, <size_t>self.store.layer_bytes,
                <size_t>self.store.page_bytes, self.store.num_layers, m, discard_rest, out, <size_t>record_bytes,
                <size_t>token_offset, <size_t>body_offset, out_hashes, &discarded)
        unlogged = max(self.log.num_dropped - self.log_drops_reported, 0)
        self.log_drops_reported = self.log.num_dropped
        return taken, discarded + unlogged

    cdef int check_invariants(self) except -1:
        """Raise AssertionError when an unsealed page keeps a recorded checksum."""
        if self.checksums == NULL:
            return 0
        stale = np.flatnonzero((np.asarray(self.sealed_array) == 0) & (self.checksum_array != 0))
        if stale.size:
            raise AssertionError(f"page {int(stale[0])}: not sealed but keeps the checksum of a seal")
        return 0


cdef SealTracker new_seal_tracker(PagePool pool, PageStore store, PrefixIndex prefix, bint page_checksums):
    """Seal state over ``pool`` and ``store``: no page sealed, the log off.

    Made after ``prefix`` (or None) adopted the pool's page records, whose
    seal flags it views.
    """
    cdef SealTracker seals = SealTracker.__new__(SealTracker)
    seals.pool = pool
    seals.store = store
    seals.page_size = store.page_size
    records = np.asarray(pool._records).view(np.uint8)  # 16 or 32 bytes per page
    seals.sealed_array = records[:, PKV_SEALED_OFFSET]
    seals.checksum_array = None
    seals.checksums = NULL
    if page_checksums:
        seals.checksum_array = np.zeros(pool.num_pages, dtype=np.uint64)
        seals.checksums = <uint64_t*>cnp.PyArray_DATA(seals.checksum_array)
    seals.digest_scratch = <uint8_t*>malloc(16 * max(<Py_ssize_t>store.num_layers, 1))
    if seals.digest_scratch == NULL:
        raise MemoryError()
    if prefix is not None:
        seals.ix = &prefix.ix
        seals.index_tokens = &prefix.tokens[0, 0]
    seals.update_seal_on_take()
    return seals
