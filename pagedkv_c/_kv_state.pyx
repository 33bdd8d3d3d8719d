"""State of a KVCache as plain values: export, check and restore (snapshots and sequence moves).

``pagedkv.snapshot`` writes and reads these values; the K/V bytes are the
pool array itself. Everything a state says is checked before anything
changes, against the rules of each unit (allocator, page tables, prefix
index, hash chains) and across them (ref counts against page-table entries,
cached pages against their holders' hashes), so a forged or damaged state
is refused with the cache left as it was.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport INT64_MAX, INT64_MIN
from libc.string cimport memcpy
from pagedkv_c._types cimport page_id_t, sat_add
from pagedkv_c._pool import OutOfPagesError
from pagedkv_c._prefix cimport SequenceHashes, hash128, hash_salt
from pagedkv_c._prefix_serving cimport NUM_PREFIX_HIT_BUCKETS
from pagedkv_c._checks cimport check_int

cnp.import_array()


class StateError(ValueError):
    """A state given to ``KVCache._restore_state`` or ``_import_sequence_state`` is inconsistent.

    ``section`` names the part of the state at fault, as the snapshot
    section it is stored in: ``'config'``, ``'counters'``, ``'pool'``,
    ``'prefix'``, ``'tables'``, ``'hashes'`` or (an imported sequence's K/V)
    ``'pages'``.
    """

    def __init__(self, section, text):
        super().__init__(text)
        self.section = section


_COUNTER_NAMES = ("pages_peak", "evictions", "cow_copies", "tokens_appended", "prefix_queries", "prefix_hits",
                  "out_of_pages_errors", "sequences_added", "pages_allocated", "ring_reuses")


cdef dict state_of(PagePool pool, list groups, PrefixServer prefix, const CacheCounters* counters,
                   dict config):
    """Everything but the K/V bytes, as plain NumPy arrays and ints.

    The contract of ``KVCache._export_state()``, which holds the cache's lock
    and passes its units, its counters and its ``_config()``.

    Returns
    -------
    dict
        ``config`` (see ``_config``); ``counters`` (the counters of
        :meth:`stats`); ``ref_counts`` int32 ``(num_pages,)`` and
        ``free_queue`` int32 ``(num_free,)`` (hand-out order);
        ``prefix`` (the index's ``_export_state()``, or None);
        ``sequences``: a list of ``(seq_id, table state, hash chain
        state or None)`` in insertion order (page group 0's tables);
        ``group_tables``: for each further page group, a list of ``(seq_id,
        table state)`` in the same order (empty with one group);
        ``group_hashes``: with prefix caching and more than one group, for
        each further page group the hash chain states of its tables in the
        same order (empty otherwise).
    """
    cdef PageTable table
    cdef PageGroup group = groups[0]
    cdef int64_t evictions = 0, cow_copies = 0
    ref_counts, free_queue = pool._export_state()
    sequences = []
    for seq_id, table in group.tables.items():
        sequences.append((int(seq_id), table._export_state(),
                          table.hashes._export_state() if table.hashes is not None else None))
    group_tables = [[(int(seq_id), table._export_state()) for seq_id, table in (<PageGroup>g).tables.items()]
                    for g in groups[1:]]
    group_hashes = [] if prefix is None else [[table.hashes._export_state() for table in (<PageGroup>g).tables.values()]
                                              for g in groups[1:]]
    for group in groups:
        evictions = sat_add(evictions, group.evictions)
        cow_copies = sat_add(cow_copies, group.cow_copies)
    prefix_counters = prefix.counters() if prefix is not None else {
        "prefix_queries": 0, "prefix_hits": 0, "prefix_hit_counts": np.zeros(NUM_PREFIX_HIT_BUCKETS, dtype=np.int64)}
    return {
        "config": config,
        "counters": {"pages_peak": int(counters.pages_peak), "evictions": int(evictions),
                     "cow_copies": int(cow_copies), "tokens_appended": int(counters.tokens_appended),
                     "prefix_queries": prefix_counters["prefix_queries"],
                     "prefix_hits": prefix_counters["prefix_hits"],
                     "out_of_pages_errors": int(counters.out_of_pages),
                     "sequences_added": int(counters.sequences_added),
                     "pages_allocated": int(pool.num_taken),
                     "ring_reuses": int(pool.num_reused_in_place),
                     "prefix_hit_counts": prefix_counters["prefix_hit_counts"]},
        "ref_counts": ref_counts,
        "free_queue": free_queue,
        "prefix": prefix.index._export_state() if prefix is not None else None,
        "sequences": sequences,
        "group_tables": group_tables,
        "group_hashes": group_hashes,
    }


cdef tuple snapshot(object kv_out, PageStore store, PagePool pool, list groups, PrefixServer prefix,
                    SealTracker seals, const CacheCounters* counters, dict config, CacheLock lock):
    """A point-in-time copy for a snapshot: state, seal state and K/V bytes from one hold of the lock.

    The contract of ``KVCache._snapshot(kv_out)``, which passes its units, its
    counters, its ``_config()`` and its lock (taken here).

    Parameters
    ----------
    kv_out : numpy.ndarray
        Receives a copy of the pool's bytes: the pool's dtype and shape,
        C-contiguous, writeable, not overlapping the pool. Fault its
        memory in beforehand (``pagedkv_c._file_io.prefault``): the copy
        runs under the lock (without the GIL), and every other call of
        the cache waits for it.

    Returns
    -------
    tuple
        ``(state, sealed_state)`` as :meth:`_export_state` and
        :meth:`_sealed_state` return them, of the same moment as the
        bytes copied into ``kv_out``.

    Raises
    ------
    TypeError
        ``kv_out`` is not a numpy.ndarray.
    ValueError
        ``kv_out`` has another dtype, shape or layout, or overlaps the pool.
    """
    cdef size_t nbytes
    cdef char* dst
    if not isinstance(kv_out, np.ndarray):
        raise TypeError(f"Invalid type of kv_out: expected a numpy.ndarray, got {type(kv_out).__name__}")
    lock.acquire()
    try:
        kv = store.kv  # (the pool array itself changes only while the lock is held: _adopt_pool)
        if kv_out.dtype != kv.dtype or kv_out.shape != kv.shape:
            raise ValueError(f"Invalid shape of kv_out: expected {kv.dtype} {kv.shape}, "
                             f"got {kv_out.dtype} {kv_out.shape}")
        if not (kv_out.flags.c_contiguous and kv_out.flags.writeable) or np.may_share_memory(kv_out, kv):
            raise ValueError("Invalid layout of kv_out: expected a C-contiguous, writeable array "
                             "apart from the pool")
        nbytes = <size_t>kv.nbytes
        dst = <char*>cnp.PyArray_DATA(kv_out)
        state = state_of(pool, groups, prefix, counters, config)
        sealed = seals.state()
        if nbytes:
            with nogil:  # no Python code runs here, so no finalizer can queue a deferred call
                memcpy(dst, store.data, nbytes)
        return state, sealed
    finally:
        lock.leave()


cdef int restore_state(dict state, PagePool pool, list groups, PrefixServer prefix, CacheCounters* counters,
                       dict config) except -1:
    """Make this new, empty cache the one ``state`` (from ``_export_state``) describes.

    The contract of ``KVCache._restore_state(state)``, which holds the
    cache's lock, refuses a cache that is not new (RuntimeError) and passes
    its units, its counters and its ``_config()``.

    Everything is checked before anything changes: the configuration
    must equal this cache's, every table must cover exactly the pages
    its length, window and sinks say, every page's ref count must equal
    the page-table entries that hold it, the free queue must be exactly
    the pages without references, no page may be held by two page groups,
    every page group must list the same sequences with the same lengths
    (``group_tables``, absent or empty with one group), every hash chain
    (with page groups: every group's, ``group_hashes``) must follow from its
    salt and kept token (or block) ids, a sequence's chains in the groups
    must share one salt digest, and the prefix index must hold each
    registered page a sequence holds under that sequence's (group's) hash.

    Raises
    ------
    RuntimeError
        The cache is not new (it has sequences or pages in use).
    StateError
        (a ValueError) ``state`` is inconsistent; ``section`` names the
        part ('config', 'counters', 'pool', 'prefix', 'tables' or
        'hashes'), the message, for a page, its id and the sequences
        holding it. Nothing changed.
    """
    cdef PageTable table
    cdef PageGroup group = groups[0]
    cdef Py_ssize_t g
    if state["config"] != config:
        raise StateError("config", f"Invalid value of config: expected {config}, got {state['config']}")
    state_counters = state["counters"]
    if (sorted(state_counters) != sorted(_COUNTER_NAMES + ("prefix_hit_counts",))
            or not all(0 <= state_counters[k] < 2**63 for k in _COUNTER_NAMES)):
        raise StateError("counters", f"Invalid value of counters: expected {_COUNTER_NAMES} in [0, 2**63), "
                                     f"got {state_counters}")
    hit_counts = state_counters["prefix_hit_counts"]
    if (hit_counts.dtype != np.int64 or hit_counts.shape != (NUM_PREFIX_HIT_BUCKETS,)
            or (hit_counts < 0).any()):
        raise StateError("counters", f"Invalid value of counters: expected prefix_hit_counts int64 "
                                     f"({NUM_PREFIX_HIT_BUCKETS},) >= 0, got {hit_counts}")
    ref_counts = state["ref_counts"]
    try:
        pool._check_state(ref_counts, state["free_queue"])
    except ValueError as exc:
        raise StateError("pool", str(exc)) from None
    if (prefix is None) != (state["prefix"] is None):
        raise StateError("prefix", "Invalid value of prefix: the prefix index does not match prefix_caching")
    if prefix is not None:
        try:
            prefix.index._check_state(state["prefix"])
        except ValueError as exc:
            raise StateError("prefix", str(exc)) from None
    tables = {}
    held = []
    for seq_id, table_state, hash_state in state["sequences"]:
        try:
            key = check_int(seq_id, "seq_id", INT64_MIN, INT64_MAX)
        except (TypeError, ValueError) as exc:
            raise StateError("tables", str(exc)) from None
        if key in tables:
            raise StateError("tables", f"Invalid value of sequences: sequence {key} is listed twice")
        table = group.new_table()
        try:
            table._check_state(table_state)
        except ValueError as exc:
            raise StateError("tables", f"sequence {key}: {exc}") from None
        if (hash_state is None) != (prefix is None):
            raise StateError("hashes", f"Invalid value of sequence {key}: a hash chain goes with prefix "
                                       f"caching")
        if hash_state is not None:
            try:
                table.hashes = SequenceHashes._from_state(hash_state, group.page_size, table_state["length"],
                                                          prefix.index.algorithm)
            except ValueError as exc:
                raise StateError("hashes", f"sequence {key}: {exc}") from None
        tables[key] = (table, table_state)
        held.append(table_state["pages"])
    counts = np.zeros(pool.num_pages, dtype=np.int64)
    for pages in held:
        np.add.at(counts, pages, 1)
    # Further page groups: the same sequences and lengths, their own tables, pages of their own.
    extra = state.get("group_tables") or []
    if len(extra) != len(groups) - 1:
        raise StateError("tables", f"Invalid value of group_tables: expected the tables of {len(groups) - 1} "
                                   f"further page groups, got {len(extra)}")
    extra_hashes = state.get("group_hashes") or []
    if len(extra_hashes) != (len(groups) - 1 if prefix is not None else 0):
        raise StateError("hashes", f"Invalid value of group_hashes: expected the hash chains of "
                                   f"{len(groups) - 1 if prefix is not None else 0} further page groups, got "
                                   f"{len(extra_hashes)}")
    owner = np.where(counts > 0, 0, -1)
    more = []  # (group, key, table, table state)
    group_checks = [tables]  # per group: seq_id -> (table, table state), for the prefix checks
    for g in range(1, len(groups)):
        listed = extra[g - 1]
        if prefix is not None:
            if len(extra_hashes[g - 1]) != len(listed):
                raise StateError("hashes", f"Invalid value of group_hashes: page group {g} has "
                                           f"{len(extra_hashes[g - 1])} hash chains for {len(listed)} sequences")
            group_checks.append({})
        if [seq_id for seq_id, _ in listed] != list(tables):
            raise StateError("tables", f"Invalid value of group_tables: page group {g} lists sequences "
                                       f"{[seq_id for seq_id, _ in listed]}, group 0 {list(tables)}")
        mine = np.zeros(pool.num_pages, dtype=np.int64)
        for seq_id, table_state in listed:
            if table_state["length"] != tables[seq_id][1]["length"]:
                raise StateError("tables", f"sequence {seq_id}: length {table_state['length']} in page group "
                                           f"{g}, {tables[seq_id][1]['length']} in group 0")
            table = (<PageGroup>groups[g]).new_table()
            try:
                table._check_state(table_state)
            except ValueError as exc:
                raise StateError("tables", f"sequence {seq_id} in page group {g}: {exc}") from None
            if prefix is not None:
                hash_state = extra_hashes[g - 1][len(group_checks[g])]
                try:
                    table.hashes = SequenceHashes._from_state(hash_state, group.page_size, table_state["length"],
                                                              prefix.index.algorithm)
                except ValueError as exc:
                    raise StateError("hashes", f"sequence {seq_id} in page group {g}: {exc}") from None
                group_checks[g][seq_id] = (table, table_state)
            np.add.at(mine, table_state["pages"], 1)
            more.append((g, seq_id, table, table_state))
        both = np.flatnonzero((mine > 0) & (owner >= 0))
        if both.size:
            raise StateError("tables", f"Invalid value of pages: page {int(both[0])} is held by page groups "
                                       f"{int(owner[both[0]])} and {g}")
        owner[mine > 0] = g
        counts += mine
    bad = np.flatnonzero(counts != ref_counts)
    if bad.size:
        p = int(bad[0])
        holders = [k for k, (t, ts) in tables.items() if (ts["pages"] == p).any()]
        raise StateError("tables", f"Invalid value of ref_counts: page {p} has ref count {int(ref_counts[p])} "
                                   f"but {int(counts[p])} page-table entries (held by sequences {holders})")
    if prefix is not None:
        try:
            if len(groups) == 1:
                prefix.check_registered(tables, state["prefix"])
            else:
                prefix.check_groups(group_checks, state["prefix"])
        except ValueError as exc:
            raise StateError("prefix", str(exc)) from None
    # Everything checked: apply.
    pool._apply_state(ref_counts, state["free_queue"])
    if prefix is not None:
        prefix.index._apply_state(state["prefix"])
    for key, (table, table_state) in tables.items():
        table._apply_state(table_state)
        group.tables[key] = table
    for g, key, table, table_state in more:
        table._apply_state(table_state)
        (<PageGroup>groups[g]).tables[key] = table
    counters.pages_peak = state_counters["pages_peak"]
    group.evictions = state_counters["evictions"]
    group.cow_copies = state_counters["cow_copies"]
    counters.tokens_appended = state_counters["tokens_appended"]
    counters.out_of_pages = state_counters["out_of_pages_errors"]
    counters.sequences_added = state_counters["sequences_added"]
    pool.num_taken = state_counters["pages_allocated"]
    pool.num_reused_in_place = state_counters["ring_reuses"]
    if prefix is not None:
        prefix.queries = state_counters["prefix_queries"]
        prefix.hits = state_counters["prefix_hits"]
        for j in range(NUM_PREFIX_HIT_BUCKETS):
            prefix.hit_counts[j] = hit_counts[j]
        # Free pages still findable by hash (a count the queue keeps).
        pool.q.num_cached_free = int(np.count_nonzero((ref_counts == 0) & (np.asarray(prefix.index.page_cached) != 0)))
    return 0


cdef tuple export_sequence(PageTable table, PageStore store):
    """One sequence's table, hash chain and K/V (for export_sequence).

    The contract of ``KVCache._export_sequence_state(seq_id)``, which holds
    the cache's lock and passes the sequence's table (KeyError for an
    unknown ``seq_id``).

    Returns ``(table state, hash chain state or None, kv)``: the table's
    pages are renumbered ``0 .. n-1`` in logical order and ``kv`` holds
    their bytes, shape ``(num_layers, n, 2, page_size, num_kv_heads,
    head_dim)``. Raises KeyError for an unknown ``seq_id``.
    """
    table_state = table._export_state()
    pages = table_state["pages"]
    kv = np.ascontiguousarray(store.kv[:, pages])
    table_state["pages"] = np.arange(pages.shape[0], dtype=np.int32)
    hash_state = table.hashes._export_state() if table.hashes is not None else None
    return table_state, hash_state, kv


cdef int import_sequence(object seq_id, dict table_state, object hash_state, object kv, object extra_key,
                         PagePool pool, PageGroup group, PrefixServer prefix, SealTracker seals, PageStore store,
                         CacheCounters* counters, CacheLock lock) except -1:
    """Add ``seq_id`` from an exported sequence, in pages taken from the free queue.

    The contract of ``KVCache._import_sequence_state(seq_id, table_state,
    hash_state, kv, extra_key)``, which passes its units, its counters and
    its lock: the checks run without the lock, the import under it.

    ``table_state`` lists local pages ``0 .. n-1`` whose bytes are
    ``kv[:, i]``. With prefix caching the hash chain comes along when
    both caches hash alike (else the sequence starts without one), and
    the sequence's full pages become cached at once. The chain's salt
    must be this cache's digest of ``extra_key`` (the caller names the
    salt, the bytes cannot choose it) and every hash is computed again
    from the salt and the token (or block) ids.

    Raises
    ------
    StateError
        (a ValueError) The state does not fit this cache's window, sinks
        or geometry, ``kv`` is not its pages' shape, or its hash chain
        does not follow from ``extra_key`` and its ids; ``section`` names
        the part ('tables', 'pages' or 'hashes'). Nothing changed.
    ValueError
        ``seq_id`` exists. Nothing changed.
    OutOfPagesError
        Fewer than ``n`` pages are free (cached free pages count), or
        the pool has fewer than ``n`` pages; nothing changed.
    """
    cdef int64_t key = check_int(seq_id, "seq_id", INT64_MIN, INT64_MAX)
    cdef PageTable table = group.new_table()
    cdef Py_ssize_t n, i
    if not isinstance(kv, np.ndarray):
        raise TypeError(f"Invalid type of kv: expected a numpy.ndarray, got {type(kv).__name__}")
    pages = table_state["pages"]
    n = pages.shape[0] if pages.ndim == 1 else -1
    if pages.dtype != np.int32 or n < 0 or not np.array_equal(pages, np.arange(n)):
        raise StateError("tables", "Invalid value of pages: expected the local page ids 0 .. n-1 in order")
    if n > pool.num_pages:
        raise OutOfPagesError(
            f"Cannot import sequence {key}: it holds {n} pages but the pool has only {pool.num_pages} "
            f"pages in all. Nothing was changed. Create the cache with num_pages >= {n}."
        )
    try:
        table._check_state(dict(table_state, pages=np.zeros(n, dtype=np.int32)))  # geometry only
    except ValueError as exc:
        raise StateError("tables", str(exc)) from None
    expected = (store.num_layers, n) + store.kv.shape[2:]
    if kv.dtype != store.kv.dtype or kv.shape != expected:
        raise StateError("pages", f"Invalid shape of kv: expected {store.kv.dtype} {expected}, got {kv.dtype} "
                                  f"{kv.shape}")
    cdef hash128 salt = hash_salt(prefix.index.algorithm if prefix is not None else 0, extra_key)
    if prefix is not None and hash_state is not None:
        given = hash_state["salt"]
        if not (given.dtype == np.uint64 and given.shape == (2,) and int(given[0]) == salt.lo
                and int(given[1]) == salt.hi):
            raise StateError("hashes", f"Invalid value of extra_key: the sequence's hash chain was salted "
                                       f"with another extra_key than {extra_key!r}; pass the extra_key the "
                                       f"sequence was added with")
        try:
            table.hashes = SequenceHashes._from_state(hash_state, group.page_size, table_state["length"],
                                                      prefix.index.algorithm)
        except ValueError as exc:
            raise StateError("hashes", str(exc)) from None
    elif prefix is not None:
        table.hashes = SequenceHashes()
        table.hashes.salt = salt  # the pages it registers later are the caller's tenant's
    lock.acquire()
    try:
        if key in group.tables:
            raise ValueError(f"Invalid value of seq_id: sequence {key} already exists")
        if n > pool.q.num_free:
            raise OutOfPagesError(
                f"Cannot import sequence {key}: it holds {n} pages but only {pool.q.num_free} of the "
                f"{pool.num_pages} pages are free. Nothing was changed. Remove or truncate sequences "
                f"first, or create the cache with num_pages >= {pool.num_pages + n - pool.q.num_free}."
            )
        taken = np.zeros(n, dtype=np.int32)  # filled by take
        local = dict(table_state, pages=taken)
        if n:
            pool.take(<page_id_t*>cnp.PyArray_DATA(taken), n)
            for i in range(n):
                seals.unseal_page(taken[i])  # written again below
            store.kv[:, taken] = kv
        table._apply_state(local)
        group.tables[key] = table
        seals.seal_table(table)  # the imported full pages are complete in every layer
        note_usage(counters, pool)
        if table.hashes is not None:
            table.hashes.num_registered = 0  # none of the new pages is cached yet
            prefix.register_full_pages(table)
    finally:
        lock.leave()
    return 0
