"""PrefixServer: prefix caching for a KVCache, over its PrefixIndex.

Automatic prefix caching as vLLM does it: a full page is indexed by a hash
chained on its parent's (``pagedkv_c._prefix``), a new sequence starts on the
longest run of cached pages its prompt matches (with a window: the pages the
next query can see), and a sequence's pages become findable as they fill.
This unit serves and registers pages, keeps the counters of the prefix
cache, and records its KV events (``pagedkv_c._kv_events``); the page tables
it serves into belong to the page group, the pages to the pool.

Page groups (a cache with per-layer attention settings, vLLM's hybrid KV
cache manager): every group indexes its own full pages in the one index,
under its own hash chain (salted per group, see ``pagedkv_c._prefix``).
A prompt is served ``h`` pages only when every group can start on them:
a full-attention group needs its pages ``0 .. h-1`` cached, a sliding
group (window ``W``, sink pages; a chunked group is stored, and matched,
as a window of its chunk size) only its sink pages and the pages the
query at ``h * page_size`` can see. Each group's longest servable run no
longer than a bound is found as for one group (:meth:`PrefixServer._lookup`
and ``_longest``), the bound becomes the minimum over groups, until it
holds for every group; then each group adopts its own pages.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport uint64_t, INT64_MAX
from libc.stdlib cimport malloc, free
from libc.string cimport memset
from pagedkv_c._types cimport sat_add
from pagedkv_c._pool cimport pkv_incref, pkv_queue_remove, pkv_ref, pkv_set_ref
from pagedkv_c._prefix cimport (hash_salt, hash_group_mix, pkv_index_find, pkv_index_is_cached,
                                pkv_index_prefetch, pkv_index_remove)
from pagedkv_c._kv_events cimport pkv_kv_events_stored_run, pkv_kv_events_cleared, pkv_kv_events_total_recorded

cnp.import_array()

# Lookups ahead whose prefix-index slot is prefetched in batch loops (a loop
# step is short: 8 was too close to hide a memory miss, 32 is; replay 0.60 -> 0.56 s).
cdef Py_ssize_t _PREFETCH_DISTANCE = 32
# Pages hashed at a time by those loops when a sequence's hashes are computed lazily.
cdef Py_ssize_t _HASH_BATCH = 8
# Largest ref count of a page (int32).
cdef int32_t _MAX_REF_COUNT = 2**31 - 1
# Upper bounds (in tokens) of the prefix-hit histogram's buckets: a lookup
# served h tokens lands in the first bucket with h <= bound, past the last
# bound in an overflow bucket (NUM_PREFIX_HIT_BUCKETS counts in all).
PREFIX_HIT_BUCKETS = (0,) + tuple(2**k for k in range(4, 21))


cdef class PrefixServer:
    """Prefix caching of a KVCache (internal; made by :func:`new_prefix_server`).

    Callers hold the cache's lock around every method.
    """

    cdef SequenceHashes new_hashes(self, object extra_key, object prompt, object blocks, int64_t pages_per_block,
                                   int64_t num_pages):
        """The hash chain of a new sequence salted by ``extra_key``.

        From ``prompt`` (int32 token ids, hashed now), from ``blocks`` (int64
        external block ids covering ``num_pages`` pages of ``pages_per_block``
        each, hashed lazily) or empty (neither given: token ids that appends
        bring are hashed as they fill pages).
        """
        return self._salted_hashes(hash_salt(self.index.algorithm, extra_key), prompt, blocks, pages_per_block,
                                   num_pages)

    cdef list new_group_hashes(self, object extra_key, object prompt, object blocks, int64_t pages_per_block,
                               int64_t num_pages):
        """One hash chain per page group, as :meth:`new_hashes`, group ``g``'s salted by ``s XOR m_g``.

        ``s`` is the digest of ``extra_key``, ``m_g`` the group's mix (see
        ``pagedkv_c._prefix``): equal pages of two groups get different hashes.
        """
        cdef hash128 base = hash_salt(self.index.algorithm, extra_key), salt
        cdef const uint64_t[:, ::1] mix = self.group_mix
        cdef list out = []
        cdef Py_ssize_t g
        for g in range(mix.shape[0]):
            salt.lo = base.lo ^ mix[g, 0]
            salt.hi = base.hi ^ mix[g, 1]
            out.append(self._salted_hashes(salt, prompt, blocks, pages_per_block, num_pages))
        return out

    cdef SequenceHashes _salted_hashes(self, hash128 salt, object prompt, object blocks, int64_t pages_per_block,
                                       int64_t num_pages):
        """Body of :meth:`new_hashes` with the salt digest given."""
        cdef SequenceHashes hashes = SequenceHashes()
        cdef int64_t prompt_len
        hashes.salt = salt
        if prompt is not None:
            prompt_len = prompt.shape[0]
            hashes.reserve_tokens(prompt_len)
            if prompt_len:
                np.asarray(hashes.token_ids)[:prompt_len] = prompt
            hashes.num_known = prompt_len
            hashes.extend_hashes(self.index.algorithm, self.page_size)
        elif blocks is not None:
            # Hashed lazily while matching and registering (see SequenceHashes), so
            # keep a copy: the caller may reuse its array for the next request.
            hashes.set_external(blocks.copy(), pages_per_block, num_pages)
        return hashes

    cdef int64_t match(self, PageTable table, const int32_t* prompt, int64_t prompt_len) except -1:
        """Start ``table`` on the cached pages its prompt matches; return the tokens served.

        At most ``(prompt_len - 1) // page_size`` pages are served, so the last
        prompt token is always computed. Without a window the served pages
        are the longest run of hits from the start. With a window W and sink
        pages, serving m pages needs only the sink pages and the pages that
        the query at position ``m * page_size`` can see, so the largest m for
        which those are all cached wins, and only they are taken. The lookup
        is counted in the hit histogram.
        """
        cdef int64_t ps = self.page_size
        cdef int64_t servable = servable_pages(prompt_len, ps, table.hashes.num_hashable)
        cdef int64_t served
        if servable <= 0:
            self.queries = sat_add(self.queries, prompt_len)
            table.hashes.num_registered = 0
            self.note_hit(0)
            return 0
        cdef page_id_t* hit = <page_id_t*>malloc(servable * sizeof(page_id_t))
        if hit == NULL:
            raise MemoryError()
        try:
            served = self._serve(table, prompt, prompt_len, servable, hit)
        finally:
            free(hit)
        self.note_hit(served)
        return served

    cdef int64_t _serve(self, PageTable table, const int32_t* prompt, int64_t prompt_len,
                        int64_t servable, page_id_t* hit) except -1:
        """Body of :meth:`match` over ``servable >= 1`` pages, ``hit`` a scratch of that length."""
        cdef int64_t first_window = 0
        cdef int64_t lead = self._lookup(table, prompt, servable, hit)
        cdef int64_t m = _longest(table, hit, lead, servable, &first_window)
        self.queries = sat_add(self.queries, prompt_len)
        self.hits = sat_add(self.hits, m * self.page_size)
        table.hashes.num_registered = m
        if m == 0:
            return 0
        self._take(table, hit, m, first_window)
        return m * self.page_size

    cdef int64_t _lookup(self, PageTable table, const int32_t* prompt, int64_t servable, page_id_t* hit) except -1:
        """Look the first ``servable`` pages of ``table``'s chain up; return the leading run of hits.

        ``hit[k]`` is the cached page that may serve logical page ``k``, or -1.
        Without a window the lookups stop at the first miss (``hit`` is
        unset past it): only the leading run counts.
        """
        cdef PrefixIndex index = self.index
        cdef SequenceHashes hashes = table.hashes
        cdef int64_t ps = self.page_size
        cdef int64_t k, lead = 0
        cdef page_id_t page_id
        cdef bint windowed = table._window != INT64_MAX
        for k in range(servable):
            _look_ahead(index, hashes, k, servable)
            page_id = pkv_index_find(&index.ix, hashes.chain[k].lo, hashes.chain[k].hi)
            if page_id != -1:
                if prompt != NULL:
                    if not index.tokens_match(page_id, prompt + k * ps):
                        page_id = -1  # a hash collision: never serve a page whose tokens differ
                elif index.has_tokens[page_id]:
                    page_id = -1  # a token-keyed page never serves a block-keyed request
                if page_id != -1 and pkv_ref(&self.pool.q, page_id) == _MAX_REF_COUNT:
                    page_id = -1  # its int32 ref count is full: compute rather than share
            hit[k] = page_id
            if page_id == -1 and not windowed:
                break  # without a window only the leading run counts
        while lead < servable and hit[lead] != -1:
            lead += 1
        return lead

    cdef int _take(self, PageTable table, const page_id_t* hit, int64_t m, int64_t first_window) except -1:
        """Start ``table`` on ``m >= 1`` pages: its sink pages and window pages ``first_window .. m-1`` of
        ``hit`` (as ``_longest`` chose them), taking a reference to each."""
        cdef int64_t num_sink = min(<int64_t>table.num_sink_pages, m)
        cdef int64_t num_window = m - first_window
        cdef int64_t k
        if num_window < 0:
            num_window = 0
        for k in range(num_sink):
            _take_cached(self.pool, hit[k])
        for k in range(first_window, first_window + num_window):
            _take_cached(self.pool, hit[k])
        table.adopt(&hit[0], num_sink, &hit[first_window] if num_window else NULL,
                    first_window, num_window, m)
        return 0

    cdef int64_t match_groups(self, list tables, const int32_t* prompt, int64_t prompt_len) except -1:
        """:meth:`match` for a sequence's new tables of every page group (group 0's first): the tokens served.

        Serves the largest ``h`` (at most the servable pages) that every
        group can start on: each group's longest run no longer than the
        bound (``_longest``) becomes the bound's new value, the minimum over
        groups, until every group serves it (a sliding group's need depends
        on ``h``, so the bound is taken again). Each group then adopts its
        own pages; a sliding group only those it still needs (the others
        stay cached and free). Counted as one lookup of ``h * page_size``
        tokens.
        """
        cdef Py_ssize_t num_groups = len(tables), g
        cdef int64_t ps = self.page_size
        cdef PageTable table = <PageTable>tables[0]
        cdef int64_t servable = servable_pages(prompt_len, ps, table.hashes.num_hashable)
        cdef int64_t h = 0, bound, m
        for g in range(1, num_groups):
            servable = min(servable, servable_pages(prompt_len, ps, (<PageTable>tables[g]).hashes.num_hashable))
        if servable <= 0:
            self.queries = sat_add(self.queries, prompt_len)
            for g in range(num_groups):
                (<PageTable>tables[g]).hashes.num_registered = 0
            self.note_hit(0)
            return 0
        cdef page_id_t* hit = <page_id_t*>malloc(num_groups * servable * sizeof(page_id_t))
        cdef int64_t* lead = <int64_t*>malloc(2 * num_groups * sizeof(int64_t))
        cdef int64_t* first_window
        if hit == NULL or lead == NULL:
            free(hit)
            free(lead)
            raise MemoryError()
        first_window = lead + num_groups
        try:
            for g in range(num_groups):
                lead[g] = self._lookup(<PageTable>tables[g], prompt, servable, hit + g * servable)
            h = servable
            while True:  # the bound only decreases: at most servable + 1 rounds
                bound = h
                for g in range(num_groups):
                    m = _longest(<PageTable>tables[g], hit + g * servable, lead[g], bound, &first_window[g])
                    h = min(h, m)
                if h == bound:  # every group serves h (first_window is each group's for h)
                    break
            self.queries = sat_add(self.queries, prompt_len)
            self.hits = sat_add(self.hits, h * ps)
            for g in range(num_groups):
                (<PageTable>tables[g]).hashes.num_registered = h
            if h:
                for g in range(num_groups):
                    self._take(<PageTable>tables[g], hit + g * servable, h, first_window[g])
        finally:
            free(hit)
            free(lead)
        self.note_hit(h * ps)
        return h * ps

    cdef void note_hit(self, int64_t tokens) noexcept nogil:
        """Count one prefix lookup that served ``tokens`` in the prefix-hit histogram."""
        cdef Py_ssize_t bucket = 0
        cdef int64_t bound = 16
        if tokens > 0:
            bucket = 1
            while bucket < NUM_PREFIX_HIT_BUCKETS - 1 and tokens > bound:
                bound <<= 1
                bucket += 1
        self.hit_counts[bucket] = sat_add(self.hit_counts[bucket], 1)

    cdef int register_full_pages(self, PageTable table) except -1:
        """Index the sequence's newly full, held pages whose hash is known."""
        cdef SequenceHashes hashes = table.hashes
        cdef PrefixIndex index = self.index
        if hashes is None:
            return 0
        hashes.extend_hashes(index.algorithm, self.page_size)
        cdef int64_t upto = min(table.length // self.page_size, hashes.num_hashable)
        cdef int64_t k
        cdef page_id_t page_id
        cdef int64_t run_first = 0, run_end = 0  # KV events: pages [run_first, run_end) stored in a row
        for k in range(hashes.num_registered, upto):
            _look_ahead(index, hashes, k, upto)
            if k < table.num_sink_pages:
                if k >= table.sink_count:
                    continue
            elif k < table.ring_first or k >= table.ring_first + table.ring_count:
                continue  # released by the window, or not held
            page_id = table.page_at(k)
            if pkv_index_is_cached(&index.ix, page_id):
                continue
            self.index_page(hashes, k, page_id)
            if self.events is not None and pkv_index_is_cached(&index.ix, page_id):  # inserted
                if k != run_end:
                    _record_stored_run(self.events, hashes, run_first, run_end, self.page_size)
                    run_first = k
                run_end = k + 1
        if self.events is not None:
            _record_stored_run(self.events, hashes, run_first, run_end, self.page_size)
        if upto > hashes.num_registered:
            hashes.num_registered = upto
        return 0

    cdef int reserve_tokens(self, list tables, const int64_t* counts) except -1:
        """Grow the token buffers of the token-keyed chains for the ``counts`` tokens an append brings.

        Called before the append changes anything: nothing may fail after it.
        """
        cdef PageTable table
        cdef Py_ssize_t i
        for i in range(len(tables)):
            table = <PageTable>tables[i]
            if table.hashes is not None and not table.hashes.external:
                table.hashes.reserve_tokens(table.length + counts[i])
        return 0

    cdef int record_tokens(self, list tables, list first_positions, const int64_t* counts, object ids) except -1:
        """Note the token ids of appended tokens in each token-keyed hash chain.

        ``ids`` (int32, ``sum(counts)``, or None) lists the appended tokens in
        table order; table ``b`` appended at ``first_positions[b]``. A token
        that differs from what the chain assumed (a prompt token that the
        caller replaced) cuts the chain's hashes back to the page before it.
        Tokens after a gap of unknown ids are not recorded: the chain stops
        there.
        """
        cdef Py_ssize_t b, t
        cdef int64_t offset = 0, n0, pos
        cdef PageTable table
        cdef SequenceHashes hashes
        cdef int32_t[::1] new_ids
        if ids is None:
            return 0
        new_ids = ids
        for b in range(len(tables)):
            table = <PageTable>tables[b]
            hashes = table.hashes
            n0 = first_positions[b]
            if hashes is not None and not hashes.external and hashes.num_known >= n0:
                for t in range(counts[b]):
                    pos = n0 + t
                    if pos < hashes.num_known and hashes.token_ids[pos] != new_ids[offset + t]:
                        hashes.truncate(pos, self.page_size)
                    hashes.token_ids[pos] = new_ids[offset + t]
                    if pos + 1 > hashes.num_known:
                        hashes.num_known = pos + 1
            offset += counts[b]
        return 0

    cdef int64_t leading_hits(self, SequenceHashes hashes, const int32_t* tokens, int64_t servable) except -1:
        """Leading pages of a prompt (up to ``servable``) that :meth:`match` would serve without a window.

        ``tokens`` are the prompt's token ids, or NULL for block-keyed hashes.
        """
        cdef PrefixIndex index = self.index
        cdef int64_t first = 0, ps = self.page_size
        cdef page_id_t page_id
        while first < servable:
            _look_ahead(index, hashes, first, servable)
            page_id = pkv_index_find(&index.ix, hashes.chain[first].lo, hashes.chain[first].hi)
            if page_id == -1 or pkv_ref(&self.pool.q, page_id) == _MAX_REF_COUNT:
                break
            if (not index.tokens_match(page_id, tokens + first * ps) if tokens != NULL
                    else index.has_tokens[page_id]):
                break
            first += 1
        return first

    cdef bint reset(self) except -1:
        """Empty the index when every page is free (see ``KVCache.reset_prefix_cache``); whether it did."""
        cdef int32_t page_id
        if self.pool.q.num_free != self.pool.num_pages:
            return False
        self.index.ix.events = NULL  # one AllBlocksCleared stands for every removal
        for page_id in range(self.pool.num_pages):
            if pkv_index_is_cached(&self.index.ix, page_id):
                pkv_index_remove(&self.index.ix, page_id)
        self.pool.q.num_cached_free = 0  # every page is free, and none is cached now
        if self.events is not None:
            self.index.ix.events = &self.events.log
            pkv_kv_events_cleared(&self.events.log)
        return True

    cdef dict stats(self, bint with_metrics):
        """The prefix-caching entries of ``KVCache.stats``."""
        hit_counts = tuple([self.hit_counts[j] for j in range(NUM_PREFIX_HIT_BUCKETS)])
        extra = {
            "prefix_queries": self.queries,
            "prefix_hits": self.hits,
            "prefix_hit_rate": (<double>self.hits) / self.queries if self.queries else 0.0,
            "prefix_cached_pages": self.index.num_cached,
            "prefix_evictions": self.index.evictions,
            "prefix_cached_free_pages": self.pool.q.num_cached_free,
            "prefix_lookups": sum(hit_counts),
        }
        if with_metrics:
            extra["prefix_hit_histogram"] = hit_counts
        return extra

    cdef dict event_stats(self):
        """The KV event entries of ``KVCache.stats``: empty without KV events."""
        if self.events is None:
            return {}
        return {"kv_events_recorded": pkv_kv_events_total_recorded(&self.events.log),
                "kv_events_dropped": self.events.log.total_dropped}

    cdef dict counters(self):
        """The counters a snapshot carries: ``prefix_queries``, ``prefix_hits`` and ``prefix_hit_counts``."""
        return {"prefix_queries": int(self.queries), "prefix_hits": int(self.hits),
                "prefix_hit_counts": np.array([self.hit_counts[j] for j in range(NUM_PREFIX_HIT_BUCKETS)],
                                              dtype=np.int64)}

    cdef int check_registered(self, dict tables, dict prefix_state) except -1:
        """Raise ValueError unless every cached page a sequence holds as a full page is indexed
        under that sequence's hash of the page (a hit on it then serves what the chain says).
        Registered or not: a held page the sequence registers later would otherwise stay indexed
        under another hash. Only a partial last page (after a truncate) may keep an older entry.

        ``tables`` maps a sequence id to ``(checked PageTable with its hashes, checked table state)``;
        ``prefix_state`` is the checked state of the index.
        """
        cdef PageTable table
        cdef SequenceHashes hashes
        cdef int64_t upto, logical, first, ps = self.page_size
        cdef Py_ssize_t i, sink_count, row
        cdef const int32_t[::1] pages
        cdef int64_t[::1] index_of = np.full(self.pool.num_pages, -1, dtype=np.int64)
        cdef const int32_t[::1] cached = np.ascontiguousarray(prefix_state["pages"], dtype=np.int32)
        cdef const uint64_t[:, ::1] stored = np.ascontiguousarray(prefix_state["hashes"], dtype=np.uint64)
        for i in range(cached.shape[0]):
            index_of[cached[i]] = i
        for key, (table, table_state) in tables.items():
            hashes = table.hashes
            upto = <int64_t>table_state["length"] // ps  # the full pages
            if upto <= 0:
                continue
            pages = np.ascontiguousarray(table_state["pages"], dtype=np.int32)
            sink_count = table_state["sink_count"]
            first = table_state["ring_first"]
            for i in range(pages.shape[0]):
                logical = i if i < sink_count else first + (i - sink_count)  # increasing
                if logical >= upto:
                    break
                row = index_of[pages[i]]
                if row >= 0 and (logical >= hashes.num_hashed or stored[row, 0] != hashes.chain[logical].lo
                                 or stored[row, 1] != hashes.chain[logical].hi):
                    raise ValueError(f"Invalid value of the prefix index hashes: page {pages[i]}, held "
                                     f"by sequence {key} as logical page {logical}, is indexed under "
                                     f"another hash than the sequence's chain gives it")
        return 0

    cdef int check_groups(self, list group_tables, dict prefix_state) except -1:
        """Raise ValueError unless the page groups' hash chains agree with each other and the index.

        ``group_tables`` lists, per page group, a dict of sequence id ->
        ``(checked PageTable with its hashes, checked table state)``, every
        group with the same sequences. Checks, for every group,
        :meth:`check_registered` (the group's held cached pages are indexed
        under the group's chain) and that each sequence's chains are salted
        by one digest: group ``g``'s salt is ``s XOR m_g`` with the same ``s``.
        """
        cdef const uint64_t[:, ::1] mix = self.group_mix
        cdef Py_ssize_t g
        cdef PageTable table
        cdef SequenceHashes first, hashes
        for g in range(len(group_tables)):
            self.check_registered(group_tables[g], prefix_state)
        for key, (table, _) in group_tables[0].items():
            first = table.hashes
            for g in range(1, len(group_tables)):
                hashes = (<PageTable>group_tables[g][key][0]).hashes
                if (hashes.salt.lo ^ mix[g, 0] != first.salt.lo ^ mix[0, 0]
                        or hashes.salt.hi ^ mix[g, 1] != first.salt.hi ^ mix[0, 1]):
                    raise ValueError(f"Invalid value of the hash chain salts: sequence {key} has a chain in page "
                                     f"group {g} salted for another request than its chain in group 0")
        return 0


cdef PrefixServer new_prefix_server(PagePool pool, int32_t page_size, object window, object algorithm,
                                    bint enable_kv_events, int64_t kv_events_capacity, int32_t num_groups=1):
    """Prefix caching over ``pool`` with hash ``algorithm`` (a name of ``pagedkv_c._prefix.ALGORITHMS``).

    With ``num_groups > 1`` (page groups) the server keeps each group's salt
    mix (``pagedkv_c._prefix.hash_group_mix``) for :meth:`PrefixServer.new_group_hashes`.

    The index adopts the pool's page records. With ``enable_kv_events`` the
    index records its KV events in a log of ``kv_events_capacity`` page
    records. Arguments checked by the caller.
    """
    cdef PrefixServer server = PrefixServer.__new__(PrefixServer)
    server.pool = pool
    server.page_size = page_size
    server.window = window
    server.index = PrefixIndex(pool.num_pages, page_size, algorithm)
    server.group_mix = None
    cdef hash128 mix
    cdef int32_t g
    if num_groups > 1:
        server.group_mix = np.zeros((num_groups, 2), dtype=np.uint64)
        for g in range(num_groups):
            mix = hash_group_mix(server.index.algorithm, g)
            server.group_mix[g, 0] = mix.lo
            server.group_mix[g, 1] = mix.hi
    pool.attach_prefix(server.index)
    memset(server.hit_counts, 0, sizeof(server.hit_counts))
    server.events = None
    if enable_kv_events:
        server.events = KVEventLog(kv_events_capacity, page_size)
        server.index.ix.events = &server.events.log
    return server


cdef inline int64_t _longest(PageTable table, const page_id_t* hit, int64_t lead, int64_t bound,
                             int64_t* first_window) noexcept:
    """The most pages, at most ``bound``, that ``table`` can start on given its lookups ``hit`` (see
    ``PrefixServer._lookup``, ``lead`` the leading run of hits).

    Without a window: the leading run. With a window W and sink pages,
    serving m pages needs only the sink pages and the pages that the query
    at position ``m * page_size`` can see: the largest such m whose pages
    are all cached wins, and ``first_window`` receives the first window page
    it needs (0 without a window).
    """
    cdef int64_t ps = table.page_size, num_sink_pages = table.num_sink_pages
    cdef int64_t window = table._window
    cdef int64_t k, m = 0, run = 0, low
    if window == INT64_MAX:
        first_window[0] = 0
        return min(lead, bound)
    first_window[0] = num_sink_pages
    for k in range(bound):
        run = run + 1 if hit[k] != -1 else 0
        # Serving k + 1 pages: the next query sits at (k + 1) * ps.
        low = max(num_sink_pages, max(0, (k + 1) * ps - window + 1) // ps)
        if lead >= min(num_sink_pages, k + 1) and (low >= k + 1 or run >= k + 1 - low):
            m = k + 1
            first_window[0] = low
    return m


cdef inline int _look_ahead(PrefixIndex index, SequenceHashes hashes, int64_t k, int64_t end) except -1:
    """Before page ``k`` of a loop over pages ``< end``: make sure the hashes up to
    ``_PREFETCH_DISTANCE`` pages ahead are computed (lazily hashed sequences), and
    start loading the index slot of that page (the index outgrows the CPU caches:
    this overlaps the misses of the next lookups)."""
    cdef int64_t ahead = k + _PREFETCH_DISTANCE
    if ahead >= hashes.num_hashed:
        hashes.hash_upto(index.algorithm, ahead + _HASH_BATCH)
    if ahead < end:
        pkv_index_prefetch(&index.ix, hashes.chain[ahead].lo)
    return 0


cdef int _take_cached(PagePool pool, page_id_t page_id) except -1:
    """Take a reference to a matched cached page, pulling it off the free queue if idle."""
    if pkv_ref(&pool.q, page_id) == 0:
        pkv_queue_remove(&pool.q, page_id)  # O(1) removal from the middle of the queue
        pkv_set_ref(&pool.q, page_id, 1)
    else:
        pkv_incref(&pool.q, page_id)
    return 0


cdef inline void _record_stored_run(KVEventLog events, SequenceHashes hashes, int64_t first, int64_t end,
                                    int32_t page_size) noexcept:
    """Record the KV event of logical pages ``[first, end)`` of ``hashes`` entering the prefix index (one copy)."""
    if end > first:
        pkv_kv_events_stored_run(&events.log, <const uint64_t*>&hashes.chain[first], end - first,
                                 <const uint64_t*>&hashes.chain[first - 1] if first > 0 else NULL,
                                 NULL if hashes.external else &hashes.token_ids[first * page_size], 0)
