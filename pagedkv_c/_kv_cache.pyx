"""KVCache: paged K/V storage for many sequences and layers.

One C-contiguous pool array holds every K/V byte:
``kv.shape == (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)``,
index 0 of axis 2 = K, 1 = V, so ``kv[layer]`` is FlashInfer's NHD paged
layout and one page id addresses the same page in every layer (as in vLLM).
"""
import numpy as np

cimport cython
cimport numpy as cnp
from libc.stdint cimport INT64_MAX, INT64_MIN
from libc.string cimport memcpy, memset
from pagedkv_c._types cimport (sat_add, page_id_t, pos_t, slot_t, int32_t, int64_t, PAD_SLOT, pkv_page_record,
                               PKV_SEALED_OFFSET)
from pagedkv_c._pool cimport PagePool, pkv_incref, pkv_queue_remove, pkv_rec, pkv_ref, pkv_set_ref
from pagedkv_c._pool import OutOfPagesError
from pagedkv_c._prefix import ALGORITHMS as _PREFIX_HASHES
from pagedkv_c._page_table cimport PageTable, append_batch, owner_key, pages_needed_for
from pagedkv_c._checks cimport check_bool, check_int, check_index, check_float_array, check_pool_dtype, as_int_array, check_array
from pagedkv_c._checks import check_sink_window
from pagedkv_c._lock cimport CacheLock
from pagedkv_c._prefix cimport (PrefixIndex, SequenceHashes, hash_salt, hash128,
                                pkv_index_find, pkv_index_insert,
                                pkv_index_is_cached, pkv_index_prefetch)
from libc.stdlib cimport malloc, free, realloc
from libc.stdint cimport uint8_t, uint64_t
from pagedkv_c._checksum cimport pkv_page_checksum, pkv_page_checksums
from pagedkv_c._prefix cimport pkv_index, pkv_index_remove
from pagedkv_c._kv_events cimport (KVEventLog, pkv_kv_events_stored_run, pkv_kv_events_cleared,
                                  pkv_kv_events_total_recorded)

cnp.import_array()

cdef extern from "stream_copy.h":
    void pkv_stream_copy(char* dst, const char* src, size_t n) noexcept nogil
    void pkv_stream_fence() noexcept nogil


_SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
# Lookups ahead whose prefix-index slot is prefetched in batch loops (a loop
# step is short: 8 was too close to hide a memory miss, 32 is; replay 0.60 -> 0.56 s).
cdef Py_ssize_t _PREFETCH_DISTANCE = 32
# Pages hashed at a time by those loops when a sequence's hashes are computed lazily.
cdef Py_ssize_t _HASH_BATCH = 8
# Largest sequence length, window and sink length, in tokens (as PageTable and attention).
cdef int64_t MAX_POSITION = 2**62
cdef int64_t MAX_NUM_PAGES = 2**31 - 2  # page ids are int32 (see PagePool)
# Largest prompt, in pages, that add_sequence takes as block ids (its chain: 16 bytes per page).
cdef int64_t MAX_EXTERNAL_PROMPT_PAGES = 2**24
# Largest number of pages one page_table call can list: indptr is int32 (CSR).
_MAX_CSR_PAGES = 2**31 - 1
# Largest ref count of a page (int32).
cdef int32_t _MAX_REF_COUNT = 2**31 - 1
# Upper bounds (in tokens) of the prefix-hit histogram's buckets: a lookup
# served h tokens lands in the first bucket with h <= bound, past the last
# bound in an overflow bucket (NUM_PREFIX_HIT_BUCKETS counts in all).
PREFIX_HIT_BUCKETS = (0,) + tuple(2**k for k in range(4, 21))


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


cdef class PageTableView:
    """Page tables of a batch of sequences, in FlashInfer's CSR form.

    Attributes
    ----------
    indptr : numpy.ndarray
        int32, shape ``[batch_size + 1]``: sequence ``b`` owns
        ``indices[indptr[b]:indptr[b + 1]]``.
    indices : numpy.ndarray
        int32, shape ``[nnz]``: page ids each sequence holds, in position
        order (sink pages first, then the window). Released pages are not
        listed.
    last_page_len : numpy.ndarray
        int32, shape ``[batch_size]``: valid tokens in each sequence's last
        page, in ``[1, page_size]`` (``((seq_len - 1) % page_size) + 1``), 0
        for an empty sequence.
    page_positions : numpy.ndarray
        int64, shape ``[nnz]``: first token position of each listed page
        (``logical_page_index * page_size``). Slot ``o`` of a listed page
        holds position ``page_positions[j] + o``, cached iff it is below the
        sequence's ``seq_lens`` entry.
    seq_lens : numpy.ndarray
        int64, shape ``[batch_size]``: tokens appended per sequence, released
        ones included (the next position).
    page_size : int
        Tokens per page.

    Notes
    -----
    The CSR triple is the paged layout of FlashInfer's
    ``BatchDecodeWithPagedKVCacheWrapper.plan`` (``paged_kv_indptr``,
    ``paged_kv_indices``, ``paged_kv_last_page_len``).
    """
    cdef readonly object indptr
    cdef readonly object indices
    cdef readonly object last_page_len
    cdef readonly object page_positions
    cdef readonly object seq_lens
    cdef readonly int32_t page_size

    @property
    def batch_size(self):
        """Number of sequences."""
        return self.seq_lens.shape[0]

    def block_tables(self, pad=-1):
        """vLLM-style block tables, indexed by logical page.

        Parameters
        ----------
        pad : int
            Value for entries without a page: logical pages a window released
            and columns past a sequence's end. Default -1.

        Returns
        -------
        numpy.ndarray
            int32, shape ``[batch_size, max_pages]`` with ``max_pages`` the
            largest ``ceil(seq_len / page_size)`` of the batch:
            ``block_tables[b, k]`` is the page holding positions
            ``[k * page_size, (k + 1) * page_size)`` of sequence ``b``, so
            ``slot = block_tables[b, pos // page_size] * page_size + pos %
            page_size`` as in vLLM's ``block_tables`` / ``slot_mapping``.
        """
        pad_value = check_int(pad, "pad", -2**31, 2**31 - 1)
        num_logical = (self.seq_lens + self.page_size - 1) // self.page_size
        width = int(num_logical.max()) if num_logical.size else 0
        out = np.full((self.batch_size, width), pad_value, dtype=np.int32)
        rows = np.repeat(np.arange(self.batch_size), np.diff(self.indptr))
        out[rows, self.page_positions // self.page_size] = self.indices
        return out

    def __repr__(self):
        return f"PageTableView(batch_size={self.batch_size}, nnz={self.indices.shape[0]}, page_size={self.page_size})"


cdef class KVCache:
    """Paged K/V storage for many sequences and layers, for LLM inference.

    Parameters
    ----------
    num_layers : int
        Transformer layers, ``>= 0`` (0 gives a page manager without K/V bytes).
    num_kv_heads : int
        KV heads per layer, ``>= 1``.
    head_dim : int
        Elements per head, ``>= 1``.
    num_pages : int
        Pages in the pool, ``>= 1``; one page id covers all layers.
    page_size : int
        Tokens per page, ``>= 1``. Default 16.
    dtype : numpy dtype
        float16 (default) or float32.
    window : int or None
        Sliding window ``W`` in tokens, ``1 <= W <= 2**62``: the query at
        position ``p`` attends to keys ``[p - W + 1, p]`` (FlashInfer
        ``window_left = W - 1``; Mistral / Hugging Face ``sliding_window =
        W``). None: full attention.
    sink_tokens : int
        Attention-sink tokens ``0 <= S <= 2**62``: positions ``[0, S)`` stay
        attended and their pages pinned (StreamingLLM, Xiao et al. 2023).
        Only with a window: ``sink_tokens > 0`` without one raises ValueError.
    enable_prefix_caching : bool
        Reuse the K/V of shared prompt prefixes across sequences (vLLM's
        automatic prefix caching): full pages are indexed by a hash chained
        on their parent's, and a new sequence starts on the longest run of
        cached pages its prompt matches. See :meth:`add_sequence`. Needs
        ``num_pages <= 2**30``, and host memory per page of 32 to 64
        bytes of index table (8-byte slots, a power of two at least four
        times the pages) and 4 bytes per token for the kept token ids; a
        page's hash and cached flag share the allocator's 32-byte page
        record.
    prefix_hash : str
        Page hash with prefix caching: ``"xxh3_128"`` (default, fast) or
        ``"sha256"`` (collision resistant, for untrusted multi-tenant
        traffic). See ``pagedkv_c._prefix`` for the hashed bytes and the
        collision risk.
    page_checksums : bool
        Record a 64-bit checksum of each page when it is sealed (its K/V
        complete in every layer; see :meth:`seal`), so that
        :meth:`verify_pages` can find pages whose bytes changed since. Costs
        8 bytes per page and one read of each sealed page's bytes. Default
        False.
    tier : pagedkv.tiers.RedisTier or None
        A prefix tier shared with other caches, processes and machines
        (needs ``enable_prefix_caching=True`` and full attention,
        ``window=None``). Each sealed page (full, its K/V complete in every
        layer: see :meth:`seal`) is copied out and written to the tier by
        the tier's writer thread; :meth:`add_sequence` fetches the prompt's pages that the
        local prefix cache lacks. Faults of the tier are misses, never errors.
        Its counters are in :meth:`stats` (``tier_*``).
    enable_kv_events : bool
        Record vLLM-style KV events of the prefix cache (a page entering
        it, a cached page leaving it, a reset) in a bounded log in the
        core; read them with :meth:`take_kv_events`, publish them with
        :class:`pagedkv.events.ZmqEventPublisher`. Needs
        ``enable_prefix_caching=True``. Default False (nothing recorded).
    kv_events_capacity : int
        Most events kept between two :meth:`take_kv_events` calls, ``1 <=
        kv_events_capacity <= 2**31`` (default 2**20); further events are
        dropped and counted. The log grows as needed up to it: 40 bytes per
        event plus ``4 * page_size`` bytes of token ids per stored page.

    Attributes
    ----------
    kv : numpy.ndarray
        The pool, C-contiguous, shape ``(num_layers, num_pages, 2, page_size,
        num_kv_heads, head_dim)``; ``kv[layer]`` is FlashInfer's NHD paged
        layout, index 0 of axis 2 is K and 1 is V.
    pool : PagePool
        The page allocator, read-only here (``pool.owner == "KVCache"``):
        ``num_free``, ``ref_count``, ``free_pages`` and ``check_invariants``
        work; ``allocate``, ``free`` and ``incref`` raise RuntimeError, as
        pages are taken and released through the sequences.

    Raises
    ------
    TypeError
        A non-integer size, a dtype other than float16/float32, or a
        ``tier`` that is not a tier object.
    ValueError
        A size out of range: ``num_layers <= 2**20``, ``num_kv_heads <=
        2**16``, ``head_dim <= 2**16``, ``page_size <= 2**20``, ``num_pages
        <= 2**31 - 2``; ``sink_tokens > 0`` without a ``window``; a ``tier``
        without prefix caching, with a window, or already serving caches of
        another layout. (``enable_prefix_caching`` and ``page_checksums``
        that are not bools raise TypeError.)
    MemoryError
        The pool array cannot be allocated, or one layer of it (``num_pages
        * 2 * page_size * num_kv_heads * head_dim * itemsize`` bytes) would
        pass ``2**63 - 1`` bytes, also with ``num_layers=0``.

    Notes
    -----
    *Cached tokens.* A sequence holds whole pages; its cached tokens are the
    positions below its length that lie in pages it holds. The window
    releases pages by the release rule of :class:`PageTable` (all positions
    out of the window of the next query, no sink position), so a held page
    may still contain positions that the window masks; attention kernels
    apply the exact mask per position.

    *Array arguments.* One rule for every method of the API (``KVCache``,
    ``PagePool``, ``PagedKVCache``, ``pagedkv.attention``): integer arguments
    (sequence ids, token ids, counts, slot mappings, page ids, offsets) accept
    any 1-D array-like of integers (list, tuple, ndarray of any integer dtype
    and layout), each value within the target type; as in NumPy indexing,
    floats (even ``2.0``), bools and object arrays raise TypeError. Floating
    arguments (``k``, ``v``, queries) accept any array-like of real numbers
    (float16, float32, float64 or integers; lists; any layout) of exactly the
    documented shape, converted to the pool dtype (float64 rounds); arrays
    of bools, complex numbers, strings or objects raise TypeError. Arrays that already have the
    target dtype and a C-contiguous layout are read in place, others are
    copied first.

    *Scalar arguments.* The same rule for one integer (a sequence id, a
    size, a length, a layer, a count): a Python int or a NumPy integer; a
    float (even ``1.0``), a bool or a string raises TypeError naming the
    argument, an integer outside its range ValueError (IndexError for
    ``layer``), never OverflowError. Sequence ids are int64. Flags
    (``return_slot_mapping``, ``metrics``) take True, False or a NumPy bool.

    *Limits.* Slots (``page_id * page_size + offset``) stay below ``2**51``;
    a sequence is at most ``2**62`` tokens long (positions, window bounds and
    ``page_positions + page_size`` then fit int64, the limit that
    :mod:`pagedkv.attention` checks); one :meth:`page_table` call lists at
    most ``2**31 - 1`` pages (int32 ``indptr``).

    *Threads.* A cache may be shared by threads: every method that reads
    or changes page tables holds an internal lock for the whole call, so
    calls from several threads run one after another; the copy loops run
    without the GIL.

    *Finalizers.* Servers often remove a request's sequence in the
    request's finalizer (``__del__``), which the garbage collector may run
    *inside* a call of this cache on the same thread (any Python allocation
    in the call can start a collection). Such a re-entrant
    :meth:`remove_sequence` is deferred: it returns at once and the sequence
    is removed when the running call returns, before any other call can
    see the cache; until then ``seq_id in cache``, ``len(cache)`` and
    ``num_sequences`` still count it. Any other method called re-entrantly
    raises RuntimeError: the running call may be halfway through changing
    the page tables, so there is no consistent state to read or change.
    Finalizers run by the collector on another thread wait for the lock
    like any other caller.

    *Copies.* A cache cannot be pickled or copied (``pickle``,
    ``copy.copy``, ``copy.deepcopy`` raise TypeError): its pages are shared
    between sequences through ref counts. :meth:`fork` makes a
    copy-on-write copy of a sequence inside the cache, and :meth:`gather`
    copies a sequence's K/V out.
    """

    def __cinit__(self, num_layers, num_kv_heads, head_dim, num_pages, page_size=16,
                  dtype=np.float16, window=None, sink_tokens=0, enable_prefix_caching=False,
                  prefix_hash="xxh3_128", page_checksums=False, tier=None, enable_kv_events=False,
                  kv_events_capacity=2**20):
        self.num_layers = <int32_t>check_int(num_layers, "num_layers", 0, 2**20)
        self.num_kv_heads = <int32_t>check_int(num_kv_heads, "num_kv_heads", 1, 2**16)
        self.head_dim = <int32_t>check_int(head_dim, "head_dim", 1, 2**16)
        self.page_size = <int32_t>check_int(page_size, "page_size", 1, 2**20)
        num_pages = check_int(num_pages, "num_pages", 1, 2**31 - 2)  # a Python int: no NumPy scalar arithmetic below
        np_dtype = check_pool_dtype(dtype, "dtype", _SUPPORTED_DTYPES)
        if window is not None:
            check_int(window, "window", 1, MAX_POSITION)
            window = int(window)
        self._window = window
        self.sink_tokens = check_int(sink_tokens, "sink_tokens", 0, MAX_POSITION)
        check_sink_window(window, self.sink_tokens)
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise TypeError(
                f"Invalid type of enable_prefix_caching: expected a bool, got {type(enable_prefix_caching).__name__}"
            )
        if not isinstance(page_checksums, (bool, np.bool_)):
            raise TypeError(f"Invalid type of page_checksums: expected a bool, got {type(page_checksums).__name__}")
        if not isinstance(prefix_hash, str):
            raise TypeError(f"Invalid type of prefix_hash: expected str, got {type(prefix_hash).__name__}")
        if prefix_hash not in _PREFIX_HASHES:
            raise ValueError(
                f"Invalid value of prefix_hash: expected one of {sorted(_PREFIX_HASHES)}, got {prefix_hash!r}"
            )
        if not isinstance(enable_kv_events, (bool, np.bool_)):
            raise TypeError(f"Invalid type of enable_kv_events: expected a bool, got {type(enable_kv_events).__name__}")
        if enable_kv_events and not enable_prefix_caching:
            raise ValueError("Invalid value of enable_kv_events: KV events report the prefix cache, "
                             "expected enable_prefix_caching=True with it")
        check_int(kv_events_capacity, "kv_events_capacity", 1, 2**31)
        # Byte offsets into a layer are Py_ssize_t, also with num_layers=0
        # (which allocates nothing).
        layer_bytes = num_pages * 2 * self.page_size * self.num_kv_heads * self.head_dim * np_dtype.itemsize
        if layer_bytes > 2**63 - 1:
            raise MemoryError(
                f"Invalid value of num_pages: one layer of the pool would take {layer_bytes} bytes, "
                f"more than 2**63 - 1; use fewer pages, heads or a smaller page_size or head_dim"
            )
        self.pool = PagePool(num_pages)
        self.pool.owner = "KVCache"
        # np.zeros maps untouched pages lazily: a large pool costs memory only as it fills.
        shape = (self.num_layers, num_pages, 2, self.page_size, self.num_kv_heads, self.head_dim)
        try:
            self.kv = np.zeros(shape, dtype=np_dtype)
        except (ValueError, MemoryError) as exc:  # NumPy: "array is too big" or no memory
            raise MemoryError(
                f"Invalid value of num_pages: a pool of shape {shape} ({np.prod(shape, dtype=object) * np_dtype.itemsize} "
                f"bytes) cannot be allocated; use fewer pages, layers or heads"
            ) from exc
        self._data = <char*>cnp.PyArray_DATA(self.kv)
        self._row_bytes = <Py_ssize_t>self.num_kv_heads * self.head_dim * np_dtype.itemsize
        self._page_bytes = 2 * <Py_ssize_t>self.page_size * self._row_bytes
        self._layer_bytes = <Py_ssize_t>num_pages * self._page_bytes
        self._tables = {}
        self._lock = CacheLock(
            "KVCache", "only remove_sequence may be called there (it is deferred until the running call returns)"
        )
        self._pages_peak = 0
        self._evictions = 0
        self._cow_copies = 0
        self._tokens_appended = 0
        self._prefix = None
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._num_out_of_pages = 0
        self._sequences_added = 0
        memset(self._prefix_hit_counts, 0, sizeof(self._prefix_hit_counts))
        if enable_prefix_caching:
            self._prefix = PrefixIndex(self.pool.num_pages, self.page_size, prefix_hash)
            self.pool.attach_prefix(self._prefix)
        self._init_sealing(bool(page_checksums))
        # Shared tier (pagedkv.tiers): checked here, after the pool, so that it is bound
        # to a cache that exists.
        self._tier = None
        self._tier_hits = 0
        if tier is not None:
            _check_tier(tier, enable_prefix_caching, window)
            # The tier says how many sealed pages may wait for its writer; more are not logged.
            waiting = tier._attach(self.num_layers, self.num_kv_heads, self.head_dim, self.page_size,
                                   np_dtype, prefix_hash)
            self._enable_sealed_log(True, max(1, min(self.pool.num_pages, waiting, 2**24)))
            self._log_without_checksums = True  # the tier's writer thread computes them on its copies
            self._tier = tier
        self._kv_events = None
        if enable_kv_events:
            self._kv_events = KVEventLog(kv_events_capacity, self.page_size)
            self._prefix.ix.events = &self._kv_events.log

    # ------------------------------------------------------------ internals
    cdef object _table(self, object seq_id, str name="seq_id"):
        """The table of a known sequence id (an integer: bools and floats are refused, not matched by value).

        Raises TypeError or ValueError (outside int64) naming ``name``, KeyError for an unknown id.
        """
        if type(seq_id) is int:  # the common case: a known id needs no other check
            table = self._tables.get(seq_id)
            if table is not None:
                return table
        cdef object key = _seq_key(seq_id, name)
        try:
            return self._tables[key]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r}") from None

    cdef list _tables_for(self, object seq_ids):
        """Tables of a batch of distinct, known sequence ids, in order."""
        cdef object ids = as_int_array(seq_ids, "seq_ids", np.int64)
        cdef list tables = [self._table(seq_id) for seq_id in ids.tolist()]
        if len(tables) > 1 and len(set(map(id, tables))) != len(tables):
            seen = set()
            for seq_id in ids.tolist():
                if seq_id in seen:
                    raise ValueError(f"Invalid value of seq_ids: sequence id {seq_id} is listed more than once")
                seen.add(seq_id)
        return tables

    cdef void _copy_page(self, int32_t src, int32_t dst) noexcept nogil:
        """Copy one page's K and V in every layer (copy-on-write)."""
        cdef Py_ssize_t layer
        cdef char* base
        for layer in range(self.num_layers):
            base = self._data + layer * self._layer_bytes
            memcpy(base + dst * self._page_bytes, base + src * self._page_bytes, self._page_bytes)

    cdef void _note_usage(self) noexcept nogil:
        cdef int64_t in_use = self.pool.num_pages - self.pool.q.num_free
        if in_use > self._pages_peak:
            self._pages_peak = in_use

    cdef int64_t _match_prefix(self, PageTable table, const int32_t* prompt, int64_t prompt_len,
                               int64_t num_hashable) except -1:
        """Start ``table`` on the cached pages its prompt matches; return the tokens served.

        At most ``(prompt_len - 1) // page_size`` pages are served, so the last
        prompt token is always computed. Without a window the served pages
        are the longest run of hits from the start. With a window W and sink
        pages, serving m pages needs only the sink pages and the pages that
        the query at position ``m * page_size`` can see, so the largest m for
        which those are all cached wins, and only they are taken.
        """
        cdef int64_t ps = self.page_size
        cdef int64_t servable = min((prompt_len - 1) // ps if prompt_len > 0 else 0, num_hashable)
        if servable <= 0:
            self._prefix_queries = sat_add(self._prefix_queries, prompt_len)
            table.hashes.num_registered = 0
            return 0
        cdef page_id_t* hit = <page_id_t*>malloc(servable * sizeof(page_id_t))
        if hit == NULL:
            raise MemoryError()
        try:
            return self._serve_prefix(table, prompt, prompt_len, servable, hit)
        finally:
            free(hit)

    cdef int64_t _serve_prefix(self, PageTable table, const int32_t* prompt, int64_t prompt_len,
                               int64_t servable, page_id_t* hit) except -1:
        """Body of :meth:`_match_prefix` over ``servable >= 1`` pages, ``hit`` a scratch of that length."""
        cdef PrefixIndex index = self._prefix
        cdef SequenceHashes hashes = table.hashes
        cdef int64_t ps = self.page_size
        cdef int64_t num_sink_pages = table.num_sink_pages
        cdef int64_t k, m = 0, lead = 0, run = 0, low, first_window = num_sink_pages
        cdef page_id_t page_id
        cdef bint windowed = self._window is not None
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
        if self._window is None:
            m = lead
        else:
            for k in range(servable):
                run = run + 1 if hit[k] != -1 else 0
                # Serving k + 1 pages: the next query sits at (k + 1) * ps.
                low = max(num_sink_pages, max(0, (k + 1) * ps - <int64_t>self._window + 1) // ps)
                if lead >= min(num_sink_pages, k + 1) and (low >= k + 1 or run >= k + 1 - low):
                    m = k + 1
                    first_window = low
        self._prefix_queries = sat_add(self._prefix_queries, prompt_len)
        self._prefix_hits = sat_add(self._prefix_hits, m * ps)
        hashes.num_registered = m
        if m == 0:
            return 0
        cdef int64_t num_sink = min(num_sink_pages, m) if self._window is not None else 0
        cdef int64_t num_window = m - first_window if self._window is not None else m
        if self._window is None:
            first_window = 0
        if num_window < 0:
            num_window = 0
        for k in range(num_sink):
            _take_cached(self.pool, hit[k])
        for k in range(first_window, first_window + num_window):
            _take_cached(self.pool, hit[k])
        table.adopt(&hit[0], num_sink, &hit[first_window] if num_window else NULL,
                    first_window, num_window, m)
        return m * ps

    cdef int _register_full_pages(self, PageTable table) except -1:
        """Index the sequence's newly full, held pages whose hash is known."""
        cdef SequenceHashes hashes = table.hashes
        cdef PrefixIndex index = self._prefix
        if hashes is None or index is None:
            return 0
        hashes.extend_hashes(index.algorithm, self.page_size)
        cdef int64_t upto = min(table.length // self.page_size, hashes.num_hashable)
        cdef int64_t k
        cdef page_id_t page_id
        cdef Py_ssize_t t
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
            if pkv_index_insert(&index.ix, hashes.chain[k].lo, hashes.chain[k].hi, page_id) and not hashes.external:
                for t in range(self.page_size):
                    index.tokens[page_id, t] = hashes.token_ids[k * self.page_size + t]
                index.has_tokens[page_id] = 1
            if self._kv_events is not None and pkv_index_is_cached(&index.ix, page_id):  # inserted
                if k != run_end:
                    _record_stored_run(self._kv_events, hashes, run_first, run_end, self.page_size)
                    run_first = k
                run_end = k + 1
        if self._kv_events is not None:
            _record_stored_run(self._kv_events, hashes, run_first, run_end, self.page_size)
        if upto > hashes.num_registered:
            hashes.num_registered = upto
        return 0

    # ----------------------------------------------------------- properties
    @property
    def num_pages(self):
        """Pages in the pool."""
        return self.pool.num_pages

    @property
    def dtype(self):
        """dtype of the pool (float16 or float32)."""
        return self.kv.dtype

    @property
    def window(self):
        """Sliding window in tokens, or None for full attention."""
        return self._window

    @property
    def prefix_caching(self):
        """True when prefix caching is enabled."""
        return self._prefix is not None

    @property
    def prefix_index(self):
        """The prefix cache's hash -> page index (``PrefixIndex``), or None when disabled."""
        return self._prefix

    @property
    def num_sequences(self):
        """Number of sequences in the cache."""
        return len(self._tables)

    def __contains__(self, seq_id):
        if type(seq_id) is not int and (isinstance(seq_id, (bool, np.bool_))
                                        or not isinstance(seq_id, (int, np.integer))):
            return False  # only integers are sequence ids
        return seq_id in self._tables

    def __len__(self):
        return len(self._tables)

    def seq_ids(self):
        """Ids of the sequences in the cache, in insertion order (list of int)."""
        self._lock.acquire()
        try:
            return list(self._tables)
        finally:
            self._lock.leave()

    # ------------------------------------------------------------ sequences
    def add_sequence(self, seq_id, prompt_token_ids=None, extra_key=None, *,
                     block_hashes=None, block_tokens=None, num_prompt_tokens=None):
        """Start a sequence, reusing cached pages of its prompt when prefix caching is on.

        Parameters
        ----------
        seq_id : int
            New sequence id (any int64).
        prompt_token_ids : sequence of int, shape ``[P]``, optional
            The prompt. With prefix caching the sequence starts on the
            longest run of cached full pages that match it and remembers the
            prompt, so that its remaining full pages become cached as they
            fill (append them without ``token_ids``). Without a prompt (or
            block ids) the sequence starts empty, and pages that tokens
            appended with ``token_ids`` fill become cached.
        extra_key : str, bytes, int or None
            Per-request salt (e.g. a tenant id): pages only match requests
            with the same salt. Types are kept apart: ``1``, ``"1"`` and
            ``b"1"`` are three salts (NumPy integers count as ints).
        block_hashes : sequence of int, shape ``[num_blocks]``, optional
            Instead of tokens: external hash ids, one per ``block_tokens``
            tokens of the prompt, prefix-chained (equal ids = equal content
            given equal earlier ids), as in the Mooncake trace. Page ``j`` of
            a block is keyed by (block id, j), chained like token pages, so
            an id must name the same tokens, under the same ``block_tokens``,
            wherever it appears. int64 or uint64 ids (a uint64 id and the
            int64 id with the same 64 bits are the same block); ids past the
            blocks that ``num_prompt_tokens`` covers are ignored.
        block_tokens : int
            Tokens per external block, a multiple of ``page_size``.
        num_prompt_tokens : int
            Prompt length in tokens, with ``block_hashes``: at most what the
            blocks cover and at most ``2**24`` pages (``2**24 * page_size``
            tokens; the prompt's page hashes take 16 bytes per page).

        Returns
        -------
        int
            Tokens served from cache (0 without prefix caching): the
            sequence's length, a multiple of ``page_size``. The caller appends
            and computes the rest. The last prompt token is never served from
            cache, so at least one token is always computed (a prompt of an
            exact multiple of ``page_size`` hits at most ``P - page_size``).
            With a window, a hit counts only when every page that the next
            query's window and sinks need is cached; pages before the window
            are not taken. Token-keyed and block-keyed requests never share a
            page (see ``pagedkv_c._prefix`` for the hashed bytes), and a page
            whose ref count reached ``2**31 - 1`` is not served. With a
            ``tier``, the pages after the leading local hits come from the
            tier as far as it holds valid ones (at most the free pages; they
            are copied into new pages and cached locally): the count includes
            them (``stats()["tier_hits"]``), and a fault of the tier only
            makes it smaller.

        Raises
        ------
        ValueError
            ``seq_id`` already exists; both or neither of ``prompt_token_ids``
            and ``block_hashes`` style arguments are inconsistent; token ids
            outside int32; ``block_tokens`` not a positive multiple of
            ``page_size``; ``num_prompt_tokens`` beyond what the blocks cover
            or past ``2**24`` pages; ``block_tokens`` or ``num_prompt_tokens``
            without ``block_hashes``.
        TypeError
            Non-integer ids, or an ``extra_key`` of another type.

        Notes
        -----
        With prefix caching, a page becomes findable as soon as an append
        fills it, before its K/V is stored, as in vLLM, where a step's
        blocks are cached at scheduling time. A sequence that starts on such
        a page reads whatever its K/V holds, so store every layer of the
        appended tokens before another sequence's attention reads them: the
        order of one forward pass (append, then per layer store, then
        attention). Threads sharing one cache must keep that order between
        them.
        """
        cdef int64_t key = check_int(seq_id, "seq_id", INT64_MIN, INT64_MAX)
        cdef PageTable table = PageTable(self.pool, self.page_size, self._window, self.sink_tokens,
                                         _owner_key=owner_key())
        cdef object prompt = None
        cdef object blocks = None
        cdef int64_t prompt_len = 0, per_block = 0
        cdef SequenceHashes hashes = None
        if prompt_token_ids is not None and block_hashes is not None:
            raise ValueError("Invalid value of block_hashes: give prompt_token_ids or block_hashes, not both")
        if block_hashes is None and (block_tokens is not None or num_prompt_tokens is not None):
            name = "block_tokens" if block_tokens is not None else "num_prompt_tokens"
            raise ValueError(f"Invalid value of {name}: it describes block_hashes, which were not given")
        if prompt_token_ids is not None:
            prompt = as_int_array(prompt_token_ids, "prompt_token_ids", np.int32)
            prompt_len = prompt.shape[0]
        elif block_hashes is not None:
            blocks = _block_ids(block_hashes)
            if block_tokens is None or num_prompt_tokens is None:
                raise ValueError("Invalid value of block_tokens: block_hashes needs block_tokens and num_prompt_tokens")
            per_block = check_int(block_tokens, "block_tokens", 1, 2**31 - 1)
            if per_block % self.page_size:
                raise ValueError(
                    f"Invalid value of block_tokens: expected a multiple of page_size {self.page_size}, got {per_block}"
                )
            # The hash chain of a prompt keyed by block ids takes 16 bytes per page, however few
            # ids describe it: the page bound keeps that in proportion (256 MiB at most).
            prompt_len = check_int(num_prompt_tokens, "num_prompt_tokens", 0,
                                   min(blocks.shape[0] * per_block, MAX_EXTERNAL_PROMPT_PAGES * self.page_size))
        if self._prefix is not None:
            # Without a prompt or block ids the sequence starts empty; token ids
            # that append is given are hashed as they fill pages.
            hashes = SequenceHashes()
            hashes.salt = hash_salt(self._prefix.algorithm, extra_key)
            if prompt is not None:
                hashes.reserve_tokens(prompt_len)
                if prompt_len:
                    np.asarray(hashes.token_ids)[:prompt_len] = prompt
                hashes.num_known = prompt_len
                hashes.extend_hashes(self._prefix.algorithm, self.page_size)
            elif blocks is not None:
                # Hashed lazily while matching and registering (see SequenceHashes), so
                # keep a copy: the caller may reuse its array for the next request.
                hashes.set_external(blocks.copy(), per_block // self.page_size, prompt_len // self.page_size)
        elif extra_key is not None:
            hash_salt(0, extra_key)  # same type check as with caching on
        table.hashes = hashes
        cdef int64_t cached = 0
        # Shared tier: ask it, without the lock, for the pages after the local hits.
        cdef object fetched = None
        if self._tier is not None and hashes is not None and (prompt is not None or blocks is not None) \
                and key not in self._tables:
            fetched = self._tier_lookup(table, prompt, prompt_len)
        self._lock.acquire()
        try:
            if key in self._tables:
                raise ValueError(f"Invalid value of seq_id: sequence {key} already exists")
            if hashes is not None and (prompt is not None or blocks is not None):
                cached = self._match_prefix(
                    table,
                    <const int32_t*>cnp.PyArray_DATA(prompt) if prompt is not None else NULL,
                    prompt_len,
                    hashes.num_hashable,
                )
                self._note_prefix_hit(cached)
                if fetched is not None:
                    cached += self._tier_install(table, fetched, cached // self.page_size)
                self._note_usage()
            self._tables[key] = table
            self._sequences_added = sat_add(self._sequences_added, 1)
        finally:
            self._lock.leave()
        return cached

    def remove_sequence(self, seq_id):
        """Drop a sequence and release its pages (newest first).

        Shared pages lose one reference; a page is freed only when its last
        reference goes. The sequence's full pages are sealed first (see
        :meth:`seal`): removal declares their K/V complete.

        Raises
        ------
        KeyError
            Unknown ``seq_id``, or its removal is already deferred.

        Notes
        -----
        Called from a finalizer that the garbage collector runs inside
        another call of this cache on the same thread, the removal is
        deferred: this call returns at once and the sequence is removed when
        the running call returns (see *Finalizers* in the class notes).
        """
        cdef PageTable table
        cdef object key
        if self._lock.held_by_this_thread():
            key = _seq_key(seq_id)
            if key not in self._tables or not self._lock.defer(_remove_deferred, (self, key)):
                raise KeyError(f"unknown sequence id {seq_id!r}") from None
            return
        self._lock.acquire()
        try:
            table = self._table(seq_id)
            with nogil:
                self._seal_table(table)  # removal declares the stored K/V complete
            table.drop_tail(0)
            del self._tables[_seq_key(seq_id)]
        finally:
            self._lock.leave()
        if self._tier is not None:
            self._offload_sealed()

    def fork(self, parent_id, child_id):
        """Create ``child_id`` sharing every page of ``parent_id`` (ref counts +1).

        The first write into a shared page copies it for all layers
        (copy-on-write), so parent and child then diverge independently.

        Raises
        ------
        KeyError
            Unknown ``parent_id``.
        ValueError
            ``child_id`` already exists, ``parent_id`` or ``child_id`` is
            outside int64, or a page of the parent already has ``2**31 - 1``
            references (the int32 ref count limit); nothing changes.
        TypeError
            ``parent_id`` or ``child_id`` is not an integer.
        """
        cdef int64_t key = check_int(child_id, "child_id", INT64_MIN, INT64_MAX)
        cdef PageTable parent, child
        self._lock.acquire()
        try:
            parent = self._table(parent_id, "parent_id")
            if key in self._tables:
                raise ValueError(f"Invalid value of child_id: sequence {key} already exists")
            child = PageTable(self.pool, self.page_size, self._window, self.sink_tokens,
                              _owner_key=owner_key())
            child.copy_from(parent)
            child.num_sealed = parent.num_sealed
            self._tables[key] = child
            self._sequences_added = sat_add(self._sequences_added, 1)
        finally:
            self._lock.leave()

    def truncate(self, seq_id, new_len):
        """Keep the first ``new_len`` tokens of a sequence; 0 releases everything.

        Parameters
        ----------
        seq_id : int
        new_len : int
            New length in tokens, ``0 <= new_len <= seq_len``.

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        ValueError
            ``new_len`` out of range, or with a window, the query at position
            ``new_len`` would need keys the window already released, or the
            window's ring would have to move back onto a released page (a
            window of 1 needs no cached key, yet only lengths inside the sink
            pages or from the first held window page's start + W - 1 on are
            allowed; the message names them).
        """
        cdef PageTable table
        self._lock.acquire()
        try:
            table = self._table(seq_id)
            table.truncate(new_len)
            table.num_sealed = min(table.num_sealed, table.length // self.page_size)
        finally:
            self._lock.leave()

    def seq_len(self, seq_id):
        """Tokens appended to a sequence so far, released ones included (= the next position).

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        """
        cdef PageTable table
        self._lock.acquire()
        try:
            table = self._table(seq_id)
            return table.length
        finally:
            self._lock.leave()

    def num_cached_tokens(self, seq_id):
        """Tokens of a sequence stored in pages it still holds.

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        """
        cdef PageTable table
        self._lock.acquire()
        try:
            table = self._table(seq_id)
            return _cached_tokens(table)
        finally:
            self._lock.leave()

    # ---------------------------------------------------------------- paging
    def append(self, seq_ids, num_tokens, token_ids=None, *, return_slot_mapping=True):
        """Reserve slots for the next tokens of each sequence.

        For each sequence in order: pages that left the window are released
        first (and reused in place), a shared last page that will be written
        is copied for all layers (copy-on-write), then new pages are taken.

        Parameters
        ----------
        seq_ids : sequence of int, shape ``[B]``
            Distinct, known sequence ids.
        num_tokens : sequence of int, shape ``[B]``
            Tokens to append per sequence, ``>= 0``, with every sequence's
            length staying at most ``2**62``. A sequence with 0 is left
            untouched.
        token_ids : sequence of int, shape ``[sum(num_tokens)]``, optional
            Token ids of the new tokens, in the same order as the slots. Used
            by prefix caching only: pages they fill become cached (prompt
            tokens given to :meth:`add_sequence` need not be passed again).
        return_slot_mapping : bool
            False skips building the slot mapping (8 bytes per token) and
            returns None: for callers that manage pages only, such as a
            scheduler or a trace replay with ``num_layers=0``.

        Returns
        -------
        numpy.ndarray or None
            int64, shape ``[sum(num_tokens)]``: the slot mapping,
            ``page_id * page_size + offset`` for each new token in sequence
            order (vLLM's ``slot_mapping``). Pass it to :meth:`store`. None
            when ``return_slot_mapping`` is False.

        Raises
        ------
        KeyError
            Unknown sequence id.
        ValueError
            Duplicate sequence id, negative count, a length past ``2**62``,
            length mismatch, or ``token_ids`` not of length
            ``sum(num_tokens)`` or outside int32.
        TypeError
            Non-integer ids, counts or token ids, or a ``return_slot_mapping``
            that is not a bool (True, False or a NumPy bool).
        OutOfPagesError
            The pool cannot supply the pages the whole batch needs (new pages
            and copy-on-write copies), counting the pages this call's own
            window releases free. The message names the tokens and pages
            asked for and the pages free. Nothing changed.

        Notes
        -----
        An append longer than the window keeps all its tokens (their queries
        need them); the out-of-window part is released at the next append.

        For each sequence with a count above 0, the append first seals its
        full pages (see :meth:`seal`): store every layer of a step before
        the next append. Pages it hands out slots in lose their seal.
        """
        cdef bint want_slots = check_bool(return_slot_mapping, "return_slot_mapping")
        counts = as_int_array(num_tokens, "num_tokens", np.int64)
        cdef Py_ssize_t batch = counts.shape[0]
        # as_int_array returns a C-contiguous int64 array: read it in place.
        cdef const int64_t* count_view = <const int64_t*>cnp.PyArray_DATA(counts)
        cdef int64_t total = 0
        cdef Py_ssize_t num_cow = 0, num_released = 0, i
        # No call can place more tokens than every page of the pool plus the free
        # room of each sequence's last page: refuse early, before sizing any output.
        # Sequences with room hold their last page, so at most num_pages have
        # room: most <= 2 * (2**31 - 2) * 2**20 < 2**53.
        cdef int64_t most = (<int64_t>self.pool.num_pages + min(<int64_t>batch, <int64_t>self.pool.num_pages)) * self.page_size
        for i in range(batch):
            if count_view[i] < 0:
                raise ValueError(f"Invalid value of num_tokens: expected counts >= 0, got {count_view[i]}")
            if count_view[i] > most - total:
                text = _over_pool_text(self, seq_ids, counts)  # ValueError first for a negative count
                self._num_out_of_pages = sat_add(self._num_out_of_pages, 1)
                raise OutOfPagesError(text)
            total += count_view[i]
        cdef object ids = None
        if token_ids is not None:
            ids = as_int_array(token_ids, "token_ids", np.int32)
            if ids.shape[0] != total:
                raise ValueError(
                    f"Invalid shape of token_ids: expected ({total},) = sum(num_tokens), got ({ids.shape[0]},)"
                )
        cdef list tables
        cdef PageTable table
        cdef int32_t* cow = NULL  # copy-on-write pairs: sources, then destinations
        cdef Py_ssize_t num_seals = 0
        self._lock.acquire()
        try:
            tables = self._tables_for(seq_ids)
            if len(tables) != batch:
                raise ValueError(
                    f"Invalid shape of num_tokens: expected ({len(tables)},) to match seq_ids, got ({batch},)"
                )
            for i in range(batch):
                if count_view[i] > MAX_POSITION - (<PageTable>tables[i]).length:
                    raise ValueError(
                        f"Invalid value of num_tokens: the sequence at index {i} would pass 2**62 "
                        f"tokens, the length limit of a sequence; got {count_view[i]} more after "
                        f"{(<PageTable>tables[i]).length}"
                    )
            if ids is not None and self._prefix is not None:
                for i in range(batch):  # grow token buffers now: nothing may fail after append_batch
                    table = <PageTable>tables[i]
                    if table.hashes is not None and not table.hashes.external:
                        table.hashes.reserve_tokens(table.length + count_view[i])
            slots = np.empty(total, dtype=np.int64) if want_slots else None
            cow = <int32_t*>malloc(2 * (batch + 1) * sizeof(int32_t))
            if cow == NULL:
                raise MemoryError()
            first_positions = [(<PageTable>t).length for t in tables] if self._prefix is not None else None
            num_seals = self._list_seals(tables, count_view)  # the seal moment: see seal()
            try:
                append_batch(self.pool, tables, count_view if batch else NULL,
                             <slot_t*>cnp.PyArray_DATA(slots) if want_slots else NULL,
                             cow, cow + batch + 1, &num_cow, &num_released)
                self._after_append_seals(tables, count_view, num_seals)  # before copies overwrite pages
                with nogil:
                    for i in range(num_cow):
                        self._copy_page(cow[i], cow[batch + 1 + i])
            except OutOfPagesError:
                self._num_out_of_pages = sat_add(self._num_out_of_pages, 1)
                raise
            finally:
                free(cow)
            self._cow_copies = sat_add(self._cow_copies, num_cow)
            self._evictions = sat_add(self._evictions, num_released)
            self._note_usage()
            self._tokens_appended = sat_add(self._tokens_appended, total)
            if self._prefix is not None:
                _record_tokens(tables, first_positions, count_view, ids, self.page_size)
                for i in range(batch):
                    self._register_full_pages(<PageTable>tables[i])
        finally:
            self._lock.leave()
        if self._tier is not None:
            self._offload_sealed()
        return slots

    def store(self, layer, slot_mapping, k, v):
        """Scatter K and V of new tokens into their slots (no GIL held while copying).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        slot_mapping : numpy.ndarray or sequence of int, shape ``[T]``
            Slots from :meth:`append`; -1 marks padding (the token is skipped).
        k, v : array-like of real numbers, shape ``[T, num_kv_heads, head_dim]``
            float16, float32, float64 or integers, ndarray or nested lists;
            converted to the pool dtype when they differ (see *Array
            arguments* in the class docstring).

        Raises
        ------
        IndexError
            ``layer`` out of range.
        ValueError
            Shape or length mismatch, or a slot outside
            ``[-1, num_pages * page_size)``. Nothing is written.
        TypeError
            ``k``/``v`` not real numbers (bools, complex, objects), or a
            non-integer ``slot_mapping``.

        Notes
        -----
        On x86-64 the rows are written with non-temporal (streaming) stores:
        a decode step writes one row per sequence into lines no cache holds,
        and streaming them skips reading those lines first.
        """
        cdef int64_t layer_index = check_index(layer, "layer", self.num_layers)
        cdef object slots = as_int_array(slot_mapping, "slot_mapping", np.int64)
        cdef Py_ssize_t num_tokens = slots.shape[0]
        shape = (num_tokens, self.num_kv_heads, self.head_dim)
        keys = check_float_array(k, "k", shape, self.kv.dtype)
        values = check_float_array(v, "v", shape, self.kv.dtype)
        cdef int64_t[::1] slot_view = slots
        cdef char* key_data = <char*>cnp.PyArray_DATA(keys)
        cdef char* value_data = <char*>cnp.PyArray_DATA(values)
        cdef int64_t num_slots = <int64_t>self.pool.num_pages * self.page_size
        cdef Py_ssize_t t, bad = -1
        cdef int64_t slot, page, offset
        cdef char* dst
        cdef char* layer_base = self._data + layer_index * self._layer_bytes
        with nogil:
            for t in range(num_tokens):
                if slot_view[t] < PAD_SLOT or slot_view[t] >= num_slots:
                    bad = t
                    break
        if bad >= 0:
            raise ValueError(
                f"Invalid value of slot_mapping: expected slots in [-1, {num_slots - 1}], "
                f"got {slot_view[bad]} at index {bad}"
            )
        cdef Py_ssize_t v_offset = self.page_size * self._row_bytes
        self._lock.acquire()
        with nogil:  # no Python code runs here, so no finalizer can queue a deferred call
            for t in range(num_tokens):
                slot = slot_view[t]
                if slot == PAD_SLOT:
                    continue
                page = slot // self.page_size
                offset = slot - page * self.page_size
                dst = layer_base + page * self._page_bytes + offset * self._row_bytes
                pkv_stream_copy(dst, key_data + t * self._row_bytes, self._row_bytes)
                pkv_stream_copy(dst + v_offset, value_data + t * self._row_bytes, self._row_bytes)
            pkv_stream_fence()
        self._lock.leave()

    def gather(self, layer, seq_id):
        """Copy out the cached tokens of one sequence in position order.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int

        Returns
        -------
        k, v : numpy.ndarray
            Pool dtype, shape ``[n, num_kv_heads, head_dim]``.
        positions : numpy.ndarray
            int64, shape ``[n]``: the token position of each row, increasing.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        KeyError
            Unknown ``seq_id``.
        """
        cdef int64_t layer_index = check_index(layer, "layer", self.num_layers)
        cdef PageTable table
        cdef Py_ssize_t num_pages, n
        cdef int64_t length
        cdef char* layer_base = self._data + layer_index * self._layer_bytes
        self._lock.acquire()
        try:
            table = self._table(seq_id)
            num_pages = table.num_held()
            n = _cached_tokens(table)
            length = table.length
            page_ids = np.empty(num_pages, dtype=np.int32)
            firsts = np.empty(num_pages, dtype=np.int64)
            table.export(<page_id_t*>cnp.PyArray_DATA(page_ids), <pos_t*>cnp.PyArray_DATA(firsts))
            shape = (n, self.num_kv_heads, self.head_dim)
            keys = np.empty(shape, dtype=self.kv.dtype)
            values = np.empty(shape, dtype=self.kv.dtype)
            positions = np.empty(n, dtype=np.int64)
            _gather_rows(layer_base, page_ids, firsts, length, self.page_size, self._row_bytes,
                         self._page_bytes, keys, values, positions)
        finally:
            self._lock.leave()
        return keys, values, positions

    def page_table(self, seq_ids):
        """Export the page tables of a batch in FlashInfer's CSR form.

        Parameters
        ----------
        seq_ids : sequence of int, shape ``[B]``
            Known sequence ids (repeats allowed).

        Returns
        -------
        PageTableView
            ``indptr`` int32[B+1], ``indices`` int32[nnz], ``last_page_len``
            int32[B], ``page_positions`` int64[nnz], ``seq_lens`` int64[B];
            ``block_tables(pad=-1)`` gives vLLM's form.

        Raises
        ------
        KeyError
            Unknown sequence id.
        ValueError
            The page tables of the batch list more than ``2**31 - 1`` pages
            in total (repeats counted each time), the int32 limit of the CSR
            ``indptr``; nothing is allocated.
        """
        cdef object ids = as_int_array(seq_ids, "seq_ids", np.int64)
        cdef Py_ssize_t batch = ids.shape[0], b, nnz = 0
        cdef int64_t total = 0
        cdef PageTable table
        cdef PageTableView view = PageTableView.__new__(PageTableView)
        self._lock.acquire()
        try:
            tables = [self._table(seq_id) for seq_id in ids.tolist()]
            for b in range(batch):  # at most 2**31 - 2 pages per table: no int64 overflow
                total += (<PageTable>tables[b]).num_held()
            if total > _MAX_CSR_PAGES:
                raise ValueError(
                    f"Invalid value of seq_ids: the page tables of the batch list {total} pages, more "
                    f"than 2**31 - 1, the limit of the int32 indptr of the CSR page table; split the batch"
                )
            indptr = np.empty(batch + 1, dtype=np.int32)
            last_page_len = np.empty(batch, dtype=np.int32)
            seq_lens = np.empty(batch, dtype=np.int64)
            _fill_indptr(tables, indptr, last_page_len, seq_lens, self.page_size)
            nnz = indptr[batch]
            indices = np.empty(nnz, dtype=np.int32)
            positions = np.empty(nnz, dtype=np.int64)
            _fill_indices(tables, indptr, indices, positions)
        finally:
            self._lock.leave()
        view.indptr = indptr
        view.indices = indices
        view.last_page_len = last_page_len
        view.page_positions = positions
        view.seq_lens = seq_lens
        view.page_size = self.page_size
        return view

    # ------------------------------------------------------------ reporting
    def stats(self, *, metrics=False):
        """Usage counters.

        Parameters
        ----------
        metrics : bool
            Also return the counters that only :mod:`pagedkv.metrics` needs:
            ``out_of_pages_errors`` and, with prefix caching,
            ``prefix_hit_histogram`` (a tuple; every other value is a number).
            Without them the dict is the same before and after a call that
            raised.

        Returns
        -------
        dict
            ``pages_in_use``, ``pages_free``, ``pages_peak`` (pages);
            ``evictions`` (page-table entries released by the window);
            ``cow_copies`` (pages copied on write); ``bytes_per_page`` (bytes
            of one page id across all layers, K and V); ``bytes_in_use``;
            ``num_sequences``; ``tokens_appended``. With prefix caching also
            ``prefix_queries`` and ``prefix_hits`` (prompt tokens looked up
            and served from cache), ``prefix_hit_rate`` (hits / queries),
            ``prefix_cached_pages`` (pages findable by hash, free ones
            included) and ``prefix_evictions`` (cached pages whose hash was
            dropped because the allocator handed them out again). With a
            ``tier`` also ``tier_hits`` (prompt tokens served from the tier)
            and the tier's own counters prefixed with ``tier_`` (see
            :meth:`pagedkv.tiers.RedisTier.stats`: lookups, hits, bytes read
            and written, dropped writes, fetch errors, checksum failures).
            dropped because the allocator handed them out again).

            Counters for metrics (:mod:`pagedkv.metrics`), since
            construction: ``num_pages`` (pages in the pool);
            ``pages_allocated`` (pages taken from the free queue: new pages
            and copy-on-write copies; a cached free page taken back by a
            prefix hit is not counted); ``ring_reuses`` (window pages a
            sequence's ring reused in place, without the free queue);
            ``sequences_added`` (sequences created by :meth:`add_sequence`
            and :meth:`fork`). With prefix caching also
            ``prefix_cached_free_pages`` (free pages still findable by hash,
            a subset of ``prefix_cached_pages``) and ``prefix_lookups``
            (:meth:`add_sequence` calls that looked up a prompt). With
            ``metrics=True`` also ``out_of_pages_errors``
            (``OutOfPagesError`` raised by :meth:`append`) and, with prefix
            caching, ``prefix_hit_histogram``: a tuple of
            ``len(PREFIX_HIT_BUCKETS) + 1`` counts of lookups by tokens
            served ``h``: entry ``i`` counts ``PREFIX_HIT_BUCKETS[i - 1] < h
            <= PREFIX_HIT_BUCKETS[i]`` (bounds in tokens: 0, 16, 32, ...,
            ``2**20``, in ``pagedkv_c._kv_cache``), the last entry ``h >
            2**20``; not cumulative, their sum is ``prefix_lookups`` and the
            sum of ``h`` is ``prefix_hits``.
            With ``enable_kv_events=True`` also ``kv_events_recorded`` and
            ``kv_events_dropped`` (page events kept in, and dropped from,
            the KV event log since construction; see :meth:`take_kv_events`).

        Raises
        ------
        TypeError
            ``metrics`` is not a bool (True, False or a NumPy bool).
        """
        cdef bint with_metrics = check_bool(metrics, "metrics")
        self._lock.acquire()
        try:
            in_use = self.pool.num_pages - self.pool.q.num_free
            hit_counts = tuple([self._prefix_hit_counts[j] for j in range(NUM_PREFIX_HIT_BUCKETS)])
            extra = {}
            if self._prefix is not None:
                extra = {
                    "prefix_queries": self._prefix_queries,
                    "prefix_hits": self._prefix_hits,
                    "prefix_hit_rate": (<double>self._prefix_hits) / self._prefix_queries if self._prefix_queries else 0.0,
                    "prefix_cached_pages": self._prefix.num_cached,
                    "prefix_evictions": self._prefix.evictions,
                    "prefix_cached_free_pages": self.pool.q.num_cached_free,
                    "prefix_lookups": sum(hit_counts),
                }
                if with_metrics:
                    extra["prefix_hit_histogram"] = hit_counts
            if self._tier is not None:
                extra["tier_hits"] = self._tier_hits
                extra |= {f"tier_{name}": value for name, value in self._tier.stats().items()}
            if self._kv_events is not None:
                extra |= {"kv_events_recorded": pkv_kv_events_total_recorded(&self._kv_events.log),
                          "kv_events_dropped": self._kv_events.log.total_dropped}
            return {
                "pages_in_use": in_use,
                "pages_free": self.pool.q.num_free,
                "pages_peak": self._pages_peak,
                "evictions": self._evictions,
                "cow_copies": self._cow_copies,
                "bytes_per_page": self.num_layers * self._page_bytes,
                "bytes_in_use": in_use * self.num_layers * self._page_bytes,
                "num_sequences": len(self._tables),
                "tokens_appended": self._tokens_appended,
                "num_pages": self.pool.num_pages,
                "pages_allocated": self.pool.num_taken,
                "ring_reuses": self.pool.num_reused_in_place,
                "sequences_added": self._sequences_added,
            } | extra | ({"out_of_pages_errors": self._num_out_of_pages} if with_metrics else {})
        finally:
            self._lock.leave()

    def check_invariants(self):
        """Verify allocator and page tables; raise AssertionError naming what is wrong.

        Checks the PagePool invariants, that every page's ref count equals
        the number of page-table entries referring to it, that free pages are
        unreferenced, and each table's window bounds.
        """
        cdef PageTable table
        self._lock.acquire()
        try:
            self.pool.check_invariants()
            counts = np.zeros(self.pool.num_pages, dtype=np.int64)
            for seq_id, table in self._tables.items():
                ids, firsts = table.pages()
                np.add.at(counts, ids, 1)
                logical = firsts // self.page_size
                sinks, window = logical[:table.sink_count], logical[table.sink_count:]
                if not np.array_equal(sinks, np.arange(table.sink_count)):
                    raise AssertionError(f"sequence {seq_id}: sink pages are not logical pages 0..{table.sink_count - 1}")
                if window.size and (window[0] < table.num_sink_pages or (np.diff(window) != 1).any()):
                    raise AssertionError(f"sequence {seq_id}: window pages are not one contiguous run after the sinks")
                if table.sink_count < table.num_sink_pages and window.size:
                    raise AssertionError(f"sequence {seq_id}: window pages held before all sink pages")
                # The next query (at position length) attends to the last token,
                # unless a 1-token window admits only that query itself: then
                # truncate may leave the last token's page released.
                needs_last = table.length and (table.window is None or table.window > 1)
                if needs_last and (logical.size == 0 or logical[logical.size - 1] != table.num_logical() - 1):
                    raise AssertionError(f"sequence {seq_id}: the page of its last token is not held")
                if table.window is not None:
                    bound = ((table.window - 1 + self.page_size - 1) // self.page_size) + 1
                    if window.size > max(bound, table.ring.shape[0]):
                        raise AssertionError(f"sequence {seq_id}: {window.size} window pages exceed the ring")
            refs = np.asarray(self.pool._ref_count)
            bad = np.flatnonzero(refs != counts)
            if bad.size:
                p = int(bad[0])
                raise AssertionError(
                    f"page {p}: ref count {int(refs[p])} but {int(counts[p])} page-table references"
                )
            if np.asarray(self.pool._pending).any():
                raise AssertionError("planning scratch of the pool is not clear")
            if self._prefix is not None:
                self._prefix.check_invariants()
        finally:
            self._lock.leave()

    def __reduce__(self):
        raise TypeError(
            "KVCache cannot be pickled or copied: its pages are shared between sequences through "
            "ref counts. Use fork(parent_id, child_id) for a copy-on-write copy of a sequence "
            "inside the cache, or gather(layer, seq_id) to copy a sequence's K/V out"
        )

    def __reduce_ex__(self, protocol):
        return self.__reduce__()

    # ------------------------------------------------------------ KV events
    @property
    def kv_events_enabled(self):
        """True when the cache records prefix-cache KV events (``enable_kv_events=True``)."""
        return self._kv_events is not None

    def take_kv_events(self):
        """Return and clear the prefix-cache KV events recorded since the last call.

        Returns
        -------
        events : pagedkv_c._kv_events.KVEvents
            The events in the order they happened, handed over without a
            copy: ``len(events)`` of them as vLLM counts them, ``tolist()``
            gives them as tuples tagged by vLLM's event names
            (``"BlockStored"``: pages entered the prefix cache, with their
            128-bit hashes, parent hash, token ids and page size;
            ``"BlockRemoved"``: cached pages left it, handed out again by the
            allocator or written into again by their sequence;
            ``"AllBlocksCleared"``: :meth:`reset_prefix_cache` emptied it),
            ``encode(ts)`` as one vLLM ``KVEventBatch``.
        num_dropped : int
            Events lost since the last call because the log was full
            (``kv_events_capacity``); 0 when the events are complete. A
            consumer that rebuilds the set of cached hashes must
            resynchronize when it is not 0.

        Raises
        ------
        RuntimeError
            The cache was made without ``enable_kv_events=True``.

        Notes
        -----
        Events are recorded in the core where pages enter and leave the
        prefix index, as vLLM's block pool emits them
        (``vllm/v1/core/block_pool.py``); :mod:`pagedkv.events` encodes them
        as vLLM's ``KVEventBatch`` and publishes them over ZeroMQ. Replaying
        every ``BlockStored`` and ``BlockRemoved`` from the cache's creation
        rebuilds exactly the hashes of ``prefix_index.cached_pages()``.
        """
        if self._kv_events is None:
            raise RuntimeError("this KVCache records no KV events: create it with enable_kv_events=True")
        self._lock.acquire()
        try:
            return self._kv_events.take()
        finally:
            self._lock.leave()

    def reset_prefix_cache(self):
        """Empty the prefix cache when no page is in use; return whether it did.

        Every cached page stops being findable by its hash (its K/V stays
        where it is, now unreferenced), as vLLM's
        ``BlockPool.reset_prefix_cache`` does after a weight update or
        between benchmark runs. With KV events one ``AllBlocksCleared`` is
        recorded (no ``BlockRemoved`` per page).

        Returns
        -------
        bool
            True when the prefix cache is now empty; False, with nothing
            changed, when sequences still hold pages (as vLLM, which refuses
            to reset while blocks are in use). True without prefix caching.
        """
        cdef int32_t page_id
        self._lock.acquire()
        try:
            if self._prefix is None:
                return True
            if self.pool.q.num_free != self.pool.num_pages:
                return False
            self._prefix.ix.events = NULL  # one AllBlocksCleared stands for every removal
            for page_id in range(self.pool.num_pages):
                if pkv_index_is_cached(&self._prefix.ix, page_id):
                    pkv_index_remove(&self._prefix.ix, page_id)
            self.pool.q.num_cached_free = 0  # every page is free, and none is cached now
            if self._kv_events is not None:
                self._prefix.ix.events = &self._kv_events.log
                pkv_kv_events_cleared(&self._kv_events.log)
            return True
        finally:
            self._lock.leave()

    def __repr__(self):
        return (f"KVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, num_pages={self.pool.num_pages}, page_size={self.page_size}, "
                f"dtype={self.kv.dtype}, window={self._window}, sink_tokens={self.sink_tokens})")

    # ------------------------------------------------------------ shared tier
    cdef object _tier_lookup(self, PageTable table, object prompt, int64_t prompt_len):
        """Fetch from the tier the prompt's pages after its leading local hits.

        The local hits are counted under the lock, the fetch runs without it.
        Returns ``(first, bodies)``: the logical page of the first fetched page
        and the verified bodies of the pages from there, or None. The table
        (new, not yet visible) gets ring room for all of them, so that
        :meth:`_tier_install` cannot fail.
        """
        cdef SequenceHashes hashes = table.hashes
        cdef PrefixIndex index = self._prefix
        cdef int64_t ps = self.page_size
        cdef int64_t servable = min((prompt_len - 1) // ps if prompt_len > 0 else 0, hashes.num_hashable)
        cdef int64_t first = 0, n = 0
        cdef page_id_t page_id
        cdef const int32_t* tokens = <const int32_t*>cnp.PyArray_DATA(prompt) if prompt is not None else NULL
        if servable <= 0:
            return None
        self._lock.acquire()
        try:
            while first < servable:  # the leading run that _serve_prefix serves without a window
                _look_ahead(index, hashes, first, servable)
                page_id = pkv_index_find(&index.ix, hashes.chain[first].lo, hashes.chain[first].hi)
                if page_id == -1 or pkv_ref(&self.pool.q, page_id) == _MAX_REF_COUNT:
                    break
                if (not index.tokens_match(page_id, tokens + first * ps) if tokens != NULL
                        else index.has_tokens[page_id]):
                    break
                first += 1
            n = min(servable - first, <int64_t>self.pool.q.num_free)
        finally:
            self._lock.leave()
        if n <= 0:
            return None
        hashes.hash_upto(index.algorithm, first + n)
        page_hashes = np.asarray(hashes.chain_array)[first:first + n].copy()
        token_rows = prompt[first * ps:(first + n) * ps].reshape(n, ps) if prompt is not None else None
        fetched = self._tier._fetch(page_hashes, token_rows)
        if fetched is None:
            return None
        # What _tier_install hands to C: checked here, without the lock, so the install cannot fail.
        records, count, body_offset, checksums = fetched
        count = check_int(count, "count", 0, n)
        body_offset = check_int(body_offset, "body_offset", 0, 2**40)
        check_array(records, "records", np.uint8, (n, body_offset + self.num_layers * self._page_bytes))
        check_array(checksums, "checksums", np.uint64, (n,))
        if count == 0:
            return None
        table.reserve(first + count)
        return first, records, count, body_offset, checksums

    cdef int64_t _tier_install(self, PageTable table, object fetched, int64_t num_local) except -1:
        """Put the fetched pages that follow the ``num_local`` local hits into new pages.

        ``fetched`` is what :meth:`_tier_lookup` returned: the first fetched
        logical page, the tier's verified values (uint8 rows, checked there)
        with each page's body at ``body_offset``, their count and their page
        checksums. Each body is copied into every layer of a page taken from
        the free queue (one C loop over pages and layers, without the GIL), the
        page is indexed under its hash (and token ids) and appended to the
        table. Takes at most the free pages; none when the local hits no longer
        end where the fetch began (a gap). Returns the tokens added.
        """
        cdef int64_t first = fetched[0]
        cdef object records = fetched[1]
        cdef Py_ssize_t count = fetched[2]
        cdef Py_ssize_t body_offset = fetched[3]
        cdef const uint64_t[::1] checksums = fetched[4]
        cdef SequenceHashes hashes = table.hashes
        cdef PrefixIndex index = self._prefix
        cdef int64_t ps = self.page_size, k
        cdef Py_ssize_t skip = num_local - first, r, i, t, layer
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
                self._unseal_page(page_view[i])  # a page still in the sealed-page log leaves it before it is written
                for layer in range(self.num_layers):
                    pkv_stream_copy(self._data + layer * self._layer_bytes + page_view[i] * self._page_bytes,
                                    <const char*>body + i * row_bytes + layer * self._page_bytes, self._page_bytes)
            pkv_stream_fence()
        for i in range(r):
            page_id = page_view[i]
            k = num_local + i
            if pkv_index_insert(&index.ix, hashes.chain[k].lo, hashes.chain[k].hi, page_id) and not hashes.external:
                for t in range(ps):
                    index.tokens[page_id, t] = hashes.token_ids[k * ps + t]
                index.has_tokens[page_id] = 1
            table.push_page(page_id)
            # Complete in every layer: sealed now, and not logged (the tier holds it).
            pkv_rec(&self.pool.q, page_id).sealed = 1
            self._pages_sealed = sat_add(self._pages_sealed, 1)
            if self._checksums != NULL:  # the tier verified the body's checksum: the page's own
                self._checksums[page_id] = checksums[skip + i]
        table.length += r * ps
        hashes.num_registered = num_local + r
        self._tier_hits += r * ps
        return r * ps

    cdef int _offload_sealed(self) except -1:
        """Tell the tier that the call just sealed pages: its writer thread copies them out.

        Called after the lock is released. The writer takes the pages from the
        log and copies their bytes in one hold of the lock
        (:meth:`_take_sealed_copies`, in C without the GIL), then makes the
        headers and checksums and sends them: this thread does no per-page
        work and never waits on the network.
        """
        if self._log_enabled and pkv_sealed_log_count(&self._log) > 0:  # most decode steps seal nothing
            self._tier._offload_notify(self)
        return 0

    # ------------------------------------------------------------ metrics
    cdef void _note_prefix_hit(self, int64_t tokens) noexcept nogil:
        """Count one prefix lookup that served ``tokens`` in the prefix-hit histogram."""
        cdef Py_ssize_t bucket = 0
        cdef int64_t bound = 16
        if tokens > 0:
            bucket = 1
            while bucket < NUM_PREFIX_HIT_BUCKETS - 1 and tokens > bound:
                bound <<= 1
                bucket += 1
        self._prefix_hit_counts[bucket] = sat_add(self._prefix_hit_counts[bucket], 1)

    # -------------------------------------------------------------- snapshots
    def save(self, path):
        """Write a snapshot of the whole cache to ``path``, atomically.

        The snapshot holds the configuration, every sequence (length, page
        table with its ring geometry, sink pages), sharing between forks
        (ref counts), the prefix-caching state (hash index, salts, kept token
        ids, the order of the free queue), the counters of :meth:`stats` and
        the K/V bytes of every page, each page with its checksum. The file
        is written to a temporary file in the same directory, fsynced and
        renamed over ``path``; the directory is fsynced. Format: see
        :mod:`pagedkv.snapshot`.

        Parameters
        ----------
        path : str or os.PathLike
            Target file (replaced if it exists).

        Raises
        ------
        pagedkv.SnapshotError
            The file would not load (a sealed page's bytes differ from the
            checksum recorded at its seal: see :meth:`verify_pages`); the
            existing file is left as it was.
        MemoryError
            No memory for the copy of the pool; nothing was written.
        OSError
            The file cannot be written; an existing file is left as it was.

        Notes
        -----
        Other threads may go on using the cache: the file is the cache at
        one point in time. The state and a copy of the pool are taken in one
        hold of the cache's lock, so other calls wait for a ``memcpy`` of
        the pool (about 0.1 to 0.25 s per GiB, docs/snapshots.md), and the
        copy takes as much memory as the pool until the call returns.
        ``path`` is only ever replaced by a rename, and only by a file that
        would load.
        """
        from pagedkv.snapshot import save_cache
        save_cache(self, path)

    @classmethod
    def load(cls, path, *, mmap=False):
        """Read a snapshot written by :meth:`save`; every later call answers as the saved cache would.

        Parameters
        ----------
        path : str or os.PathLike
        mmap : bool
            False: read and check every page. True: the pool is a
            copy-on-write memory map of the file's page section (writes stay
            in memory); metadata is verified, pages are not read: check
            them with ``pagedkv.snapshot.verify(path)``. Never rewrite or
            truncate a mapped file in place (``cp new old``): replace it by
            a rename (``mv``, :meth:`save`). On Linux the map is guarded by
            a read lease: a process that opens the file for writing or
            truncates it waits until the map's bytes are copied into this
            process's memory, so the cache keeps the bytes it loaded (no
            SIGBUS). Where no lease can be taken the pages are read at load
            instead. See :func:`pagedkv.snapshot.load_cache`.

        Returns
        -------
        KVCache

        Raises
        ------
        pagedkv.SnapshotError
            The file is damaged, truncated, of an unknown or newer format
            version, or inconsistent; the message names the section, and for
            a page its id and the sequences holding it.
        TypeError
            ``mmap`` is not a bool.
        """
        from pagedkv.snapshot import load_cache
        return load_cache(path, mmap=mmap)

    def export_sequence(self, seq_id):
        """One sequence with its K/V and page-table state, as bytes (checksummed).

        Other threads may go on using the cache: the sequence's state and
        a copy of its pages are taken in one hold of the cache's lock.

        Returns
        -------
        bytes
            Load with :meth:`import_sequence` into any cache of the same
            layer/head/dim/dtype/page-size geometry, window and sink tokens.

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        """
        from pagedkv.snapshot import export_sequence
        return export_sequence(self, seq_id)

    def import_sequence(self, seq_id, data, extra_key=None):
        """Add ``seq_id`` from :meth:`export_sequence` bytes, in this cache's free pages; all or nothing.

        The bytes are not trusted: their page tables must cover exactly what
        their length, window and sinks say, and with prefix caching their
        hash chain must follow from ``extra_key`` and their token (or block)
        ids, hashed again here with this cache's hash function.

        Parameters
        ----------
        seq_id : int
        data : bytes-like
        extra_key : str, bytes, int or None
            The salt the sequence was added with (:meth:`add_sequence`'s
            ``extra_key``, e.g. its tenant): the caller names it, the bytes
            cannot choose it. Its pages are cached and matched under it.

        Raises
        ------
        pagedkv.SnapshotError
            ``data`` is damaged, forged or from a cache of another geometry,
            or its hash chain was salted with another ``extra_key``.
        OutOfPagesError
            Fewer free pages than the sequence holds (or fewer pages in the
            whole pool); nothing changed.
        ValueError
            ``seq_id`` already exists.
        TypeError
            ``extra_key`` is not a str, bytes, int or None.
        """
        from pagedkv.snapshot import import_sequence
        import_sequence(self, seq_id, data, extra_key=extra_key)

    # --------------------------------------------------- state export / restore
    # Snapshots (pagedkv.snapshot) write and read these plain values; the
    # K/V bytes are the pool array itself.
    def _config(self):
        """The construction arguments (a dict of ints and strs; window -1 = None)."""
        return {
            "num_layers": int(self.num_layers), "num_kv_heads": int(self.num_kv_heads),
            "head_dim": int(self.head_dim), "num_pages": int(self.pool.num_pages),
            "page_size": int(self.page_size), "dtype": str(self.kv.dtype),
            "window": -1 if self._window is None else int(self._window),
            "sink_tokens": int(self.sink_tokens),
            "prefix_caching": int(self._prefix is not None),
            "prefix_hash": self._prefix.algorithm_name if self._prefix is not None else "xxh3_128",
            "page_checksums": int(self._checksums != NULL),
        }

    def _export_state(self):
        """Everything but the K/V bytes, as plain NumPy arrays and ints.

        Returns
        -------
        dict
            ``config`` (see ``_config``); ``counters`` (the counters of
            :meth:`stats`); ``ref_counts`` int32 ``(num_pages,)`` and
            ``free_queue`` int32 ``(num_free,)`` (hand-out order);
            ``prefix`` (the index's ``_export_state()``, or None);
            ``sequences``: a list of ``(seq_id, table state, hash chain
            state or None)`` in insertion order.
        """
        self._lock.acquire()
        try:
            return _state_of(self)
        finally:
            self._lock.leave()

    def _snapshot(self, kv_out):
        """A point-in-time copy for a snapshot: state, seal state and K/V bytes from one hold of the lock.

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
        self._lock.acquire()
        try:
            pool = self.kv  # (the pool array itself changes only while the lock is held: _adopt_pool)
            if kv_out.dtype != pool.dtype or kv_out.shape != pool.shape:
                raise ValueError(f"Invalid shape of kv_out: expected {pool.dtype} {pool.shape}, "
                                 f"got {kv_out.dtype} {kv_out.shape}")
            if not (kv_out.flags.c_contiguous and kv_out.flags.writeable) or np.may_share_memory(kv_out, pool):
                raise ValueError("Invalid layout of kv_out: expected a C-contiguous, writeable array "
                                 "apart from the pool")
            nbytes = <size_t>pool.nbytes
            dst = <char*>cnp.PyArray_DATA(kv_out)
            state = _state_of(self)
            sealed = _sealed_of(self)
            if nbytes:
                with nogil:  # no Python code runs here, so no finalizer can queue a deferred call
                    memcpy(dst, self._data, nbytes)
            return state, sealed
        finally:
            self._lock.leave()

    cdef PageTable _new_table(self):
        return PageTable(self.pool, self.page_size, self._window, self.sink_tokens, _owner_key=owner_key())

    def _restore_state(self, dict state):
        """Make this new, empty cache the one ``state`` (from ``_export_state``) describes.

        Everything is checked before anything changes: the configuration
        must equal this cache's, every table must cover exactly the pages
        its length, window and sinks say, every page's ref count must equal
        the page-table entries that hold it, the free queue must be exactly
        the pages without references, every hash chain must follow from its
        salt and kept token (or block) ids, and the prefix index must hold
        each registered page a sequence holds under that sequence's hash.

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
        self._lock.acquire()
        try:
            if self._tables or self.pool.q.num_free != self.pool.num_pages:
                raise RuntimeError("KVCache._restore_state needs a new cache without sequences")
            if state["config"] != self._config():
                raise StateError("config", f"Invalid value of config: expected {self._config()}, got {state['config']}")
            counters = state["counters"]
            names = ("pages_peak", "evictions", "cow_copies", "tokens_appended", "prefix_queries", "prefix_hits",
                     "out_of_pages_errors", "sequences_added", "pages_allocated", "ring_reuses")
            if (sorted(counters) != sorted(names + ("prefix_hit_counts",))
                    or not all(0 <= counters[k] < 2**63 for k in names)):
                raise StateError("counters", f"Invalid value of counters: expected {names} in [0, 2**63), "
                                             f"got {counters}")
            hit_counts = counters["prefix_hit_counts"]
            if (hit_counts.dtype != np.int64 or hit_counts.shape != (NUM_PREFIX_HIT_BUCKETS,)
                    or (hit_counts < 0).any()):
                raise StateError("counters", f"Invalid value of counters: expected prefix_hit_counts int64 "
                                             f"({NUM_PREFIX_HIT_BUCKETS},) >= 0, got {hit_counts}")
            ref_counts = state["ref_counts"]
            try:
                self.pool._check_state(ref_counts, state["free_queue"])
            except ValueError as exc:
                raise StateError("pool", str(exc)) from None
            if (self._prefix is None) != (state["prefix"] is None):
                raise StateError("prefix", "Invalid value of prefix: the prefix index does not match prefix_caching")
            if self._prefix is not None:
                try:
                    self._prefix._check_state(state["prefix"])
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
                table = self._new_table()
                try:
                    table._check_state(table_state)
                except ValueError as exc:
                    raise StateError("tables", f"sequence {key}: {exc}") from None
                if (hash_state is None) != (self._prefix is None):
                    raise StateError("hashes", f"Invalid value of sequence {key}: a hash chain goes with prefix "
                                               f"caching")
                if hash_state is not None:
                    try:
                        table.hashes = SequenceHashes._from_state(hash_state, self.page_size, table_state["length"],
                                                                  self._prefix.algorithm)
                    except ValueError as exc:
                        raise StateError("hashes", f"sequence {key}: {exc}") from None
                tables[key] = (table, table_state)
                held.append(table_state["pages"])
            counts = np.zeros(self.pool.num_pages, dtype=np.int64)
            for pages in held:
                np.add.at(counts, pages, 1)
            bad = np.flatnonzero(counts != ref_counts)
            if bad.size:
                p = int(bad[0])
                holders = [k for k, (t, ts) in tables.items() if (ts["pages"] == p).any()]
                raise StateError("tables", f"Invalid value of ref_counts: page {p} has ref count {int(ref_counts[p])} "
                                           f"but {int(counts[p])} page-table entries (held by sequences {holders})")
            if self._prefix is not None:
                self._check_registered(tables, state["prefix"])
            # Everything checked: apply.
            self.pool._apply_state(ref_counts, state["free_queue"])
            if self._prefix is not None:
                self._prefix._apply_state(state["prefix"])
            for key, (table, table_state) in tables.items():
                table._apply_state(table_state)
                self._tables[key] = table
            self._pages_peak = counters["pages_peak"]
            self._evictions = counters["evictions"]
            self._cow_copies = counters["cow_copies"]
            self._tokens_appended = counters["tokens_appended"]
            self._prefix_queries = counters["prefix_queries"]
            self._prefix_hits = counters["prefix_hits"]
            self._num_out_of_pages = counters["out_of_pages_errors"]
            self._sequences_added = counters["sequences_added"]
            self.pool.num_taken = counters["pages_allocated"]
            self.pool.num_reused_in_place = counters["ring_reuses"]
            for j in range(NUM_PREFIX_HIT_BUCKETS):
                self._prefix_hit_counts[j] = hit_counts[j]
            if self._prefix is not None:  # free pages still findable by hash (a count the queue keeps)
                self.pool.q.num_cached_free = int(np.count_nonzero(
                    (ref_counts == 0) & (np.asarray(self._prefix.page_cached) != 0)))
        finally:
            self._lock.leave()

    cdef int _check_registered(self, dict tables, dict prefix) except -1:
        """Raise StateError('prefix') unless every cached page a sequence holds as a full page is
        indexed under that sequence's hash of the page (a hit on it then serves what the chain says).
        Registered or not: a held page the sequence registers later would otherwise stay indexed
        under another hash. Only a partial last page (after a truncate) may keep an older entry.

        ``tables`` maps a sequence id to ``(checked PageTable with its hashes, checked table state)``.
        """
        cdef PageTable table
        cdef SequenceHashes hashes
        cdef int64_t upto, logical, first, ps = self.page_size
        cdef Py_ssize_t i, sink_count, row
        cdef const int32_t[::1] pages
        cdef int64_t[::1] index_of = np.full(self.pool.num_pages, -1, dtype=np.int64)
        cdef const int32_t[::1] cached = np.ascontiguousarray(prefix["pages"], dtype=np.int32)
        cdef const uint64_t[:, ::1] stored = np.ascontiguousarray(prefix["hashes"], dtype=np.uint64)
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
                    raise StateError("prefix", f"Invalid value of the prefix index hashes: page {pages[i]}, held "
                                               f"by sequence {key} as logical page {logical}, is indexed under "
                                               f"another hash than the sequence's chain gives it")
        return 0

    def _adopt_pool(self, kv):
        """Use ``kv`` as the pool array of this new, empty cache (e.g. a memory map of a snapshot).

        ``kv`` must have the pool's dtype and shape, be C-contiguous,
        aligned and writeable (a copy-on-write map is). Raises ValueError
        naming what differs, RuntimeError when the cache has sequences.
        """
        if not isinstance(kv, np.ndarray):
            raise TypeError(f"Invalid type of kv: expected a numpy.ndarray, got {type(kv).__name__}")
        if kv.dtype != self.kv.dtype or kv.shape != self.kv.shape:
            raise ValueError(f"Invalid shape of kv: expected {self.kv.dtype} {self.kv.shape}, got {kv.dtype} {kv.shape}")
        if not (kv.flags.c_contiguous and kv.flags.aligned and kv.flags.writeable):
            raise ValueError("Invalid layout of kv: expected a C-contiguous, aligned, writeable array")
        self._lock.acquire()
        try:
            if self._tables:
                raise RuntimeError("KVCache._adopt_pool needs a cache without sequences")
            self.kv = kv
            self._data = <char*>cnp.PyArray_DATA(kv)
        finally:
            self._lock.leave()

    def _make_pool_private(self, guard):
        """Move a mapped pool's bytes into process memory, under the lock (internal: mapped snapshots).

        ``guard`` is the ``pagedkv_c._file_io.GuardedMap`` under this
        cache's pool; its lease thread calls this when another process wants
        to write or truncate the mapped file, so that no ``store`` into the
        pool runs while the bytes are copied.
        """
        self._lock.acquire()
        try:
            guard.make_private()
        finally:
            self._lock.leave()

    def _export_sequence_state(self, seq_id):
        """One sequence's table, hash chain and K/V (for export_sequence).

        Returns ``(table state, hash chain state or None, kv)``: the table's
        pages are renumbered ``0 .. n-1`` in logical order and ``kv`` holds
        their bytes, shape ``(num_layers, n, 2, page_size, num_kv_heads,
        head_dim)``. Raises KeyError for an unknown ``seq_id``.
        """
        cdef PageTable table
        self._lock.acquire()
        try:
            table = self._table(seq_id)
            table_state = table._export_state()
            pages = table_state["pages"]
            kv = np.ascontiguousarray(self.kv[:, pages])
            table_state["pages"] = np.arange(pages.shape[0], dtype=np.int32)
            hash_state = table.hashes._export_state() if table.hashes is not None else None
            return table_state, hash_state, kv
        finally:
            self._lock.leave()

    def _import_sequence_state(self, seq_id, dict table_state, hash_state, kv, extra_key=None):
        """Add ``seq_id`` from an exported sequence, in pages taken from the free queue.

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
        cdef PageTable table = self._new_table()
        cdef Py_ssize_t n, i
        if not isinstance(kv, np.ndarray):
            raise TypeError(f"Invalid type of kv: expected a numpy.ndarray, got {type(kv).__name__}")
        pages = table_state["pages"]
        n = pages.shape[0] if pages.ndim == 1 else -1
        if pages.dtype != np.int32 or n < 0 or not np.array_equal(pages, np.arange(n)):
            raise StateError("tables", "Invalid value of pages: expected the local page ids 0 .. n-1 in order")
        if n > self.pool.num_pages:
            raise OutOfPagesError(
                f"Cannot import sequence {key}: it holds {n} pages but the pool has only {self.pool.num_pages} "
                f"pages in all. Nothing was changed. Create the cache with num_pages >= {n}."
            )
        try:
            table._check_state(dict(table_state, pages=np.zeros(n, dtype=np.int32)))  # geometry only
        except ValueError as exc:
            raise StateError("tables", str(exc)) from None
        expected = (self.num_layers, n) + self.kv.shape[2:]
        if kv.dtype != self.kv.dtype or kv.shape != expected:
            raise StateError("pages", f"Invalid shape of kv: expected {self.kv.dtype} {expected}, got {kv.dtype} "
                                      f"{kv.shape}")
        cdef hash128 salt = hash_salt(self._prefix.algorithm if self._prefix is not None else 0, extra_key)
        if self._prefix is not None and hash_state is not None:
            given = hash_state["salt"]
            if not (given.dtype == np.uint64 and given.shape == (2,) and int(given[0]) == salt.lo
                    and int(given[1]) == salt.hi):
                raise StateError("hashes", f"Invalid value of extra_key: the sequence's hash chain was salted "
                                           f"with another extra_key than {extra_key!r}; pass the extra_key the "
                                           f"sequence was added with")
            try:
                table.hashes = SequenceHashes._from_state(hash_state, self.page_size, table_state["length"],
                                                          self._prefix.algorithm)
            except ValueError as exc:
                raise StateError("hashes", str(exc)) from None
        elif self._prefix is not None:
            table.hashes = SequenceHashes()
            table.hashes.salt = salt  # the pages it registers later are the caller's tenant's
        self._lock.acquire()
        try:
            if key in self._tables:
                raise ValueError(f"Invalid value of seq_id: sequence {key} already exists")
            if n > self.pool.q.num_free:
                raise OutOfPagesError(
                    f"Cannot import sequence {key}: it holds {n} pages but only {self.pool.q.num_free} of the "
                    f"{self.pool.num_pages} pages are free. Nothing was changed. Remove or truncate sequences "
                    f"first, or create the cache with num_pages >= {self.pool.num_pages + n - self.pool.q.num_free}."
                )
            taken = np.zeros(n, dtype=np.int32)  # filled by take
            local = dict(table_state, pages=taken)
            if n:
                self.pool.take(<page_id_t*>cnp.PyArray_DATA(taken), n)
                for i in range(n):
                    self._unseal_page(taken[i])  # written again below
                self.kv[:, taken] = kv
            table._apply_state(local)
            self._tables[key] = table
            self._seal_table(table)  # the imported full pages are complete in every layer
            self._note_usage()
            if table.hashes is not None:
                table.hashes.num_registered = 0  # none of the new pages is cached yet
                self._register_full_pages(table)
        finally:
            self._lock.leave()

    # ---------------------------------------------------------- sealed pages
    # A page is sealed once it is full and its K/V complete in every layer (see
    # seal() and docs/page_integrity.md). The one hook serves page checksums
    # (verify_pages), snapshots (_sealed_state) and the sealed-page log.

    cdef int _init_sealing(self, bint page_checksums) except -1:
        """View the seal flags of the page records; allocate checksums with ``page_checksums``.

        Called after the prefix index (if any) adopted the pool's records.
        """
        records = np.asarray(self.pool._records).view(np.uint8)  # 16 or 32 bytes per page
        self._sealed_array = records[:, PKV_SEALED_OFFSET]
        self._checksum_array = None
        self._checksums = NULL
        if page_checksums:
            self._checksum_array = np.zeros(self.pool.num_pages, dtype=np.uint64)
            self._checksums = <uint64_t*>cnp.PyArray_DATA(self._checksum_array)
        self._digest_scratch = <uint8_t*>malloc(16 * max(<Py_ssize_t>self.num_layers, 1))
        if self._digest_scratch == NULL:
            raise MemoryError()
        if self._prefix is not None:
            self._ix = &self._prefix.ix
            self._index_tokens = &self._prefix.tokens[0, 0]
        self._update_seal_on_take()
        return 0

    @cython.final
    cdef void _update_seal_on_take(self) noexcept:
        """Let take clear seal flags itself while no checksum or log entry must go with them."""
        self.pool.clear_seal_on_take = self._checksums == NULL and not self._log_enabled

    def __dealloc__(self):
        free(self._digest_scratch)
        free(self._seal_buffer)
        if self._log_enabled:
            pkv_sealed_log_free(&self._log)

    @cython.final
    cdef bint _seal_page(self, page_id_t page_id) noexcept nogil:
        """Seal one page unless it is sealed: flag, checksum, log. True if newly sealed."""
        cdef uint64_t checksum = 0
        cdef pkv_page_record* record
        cdef bint logged
        if pkv_rec(&self.pool.q, page_id).sealed:
            return False
        pkv_rec(&self.pool.q, page_id).sealed = 1
        self._pages_sealed = sat_add(self._pages_sealed, 1)
        logged = self._log_enabled and self._ix != NULL and pkv_index_is_cached(self._ix, page_id)
        if self._checksums != NULL or (logged and not self._log_without_checksums):
            checksum = pkv_page_checksum(<const uint8_t*>self._data, <size_t>self._layer_bytes,
                                         <size_t>self._page_bytes, self.num_layers, page_id,
                                         self._digest_scratch)
        if self._checksums != NULL:
            self._checksums[page_id] = checksum
        if logged:
            record = &self._ix.pages[page_id]
            pkv_sealed_log_push(&self._log, page_id, record.lo, record.hi,
                                self._index_tokens + <Py_ssize_t>page_id * self.page_size
                                if record.has_tokens else NULL,
                                checksum)
        return True

    @cython.final
    cdef void _unseal_page(self, page_id_t page_id) noexcept nogil:
        """The page is about to be written again: clear its seal (and withdraw its log entry)."""
        if pkv_rec(&self.pool.q, page_id).sealed:
            pkv_rec(&self.pool.q, page_id).sealed = 0
            if self._checksums != NULL:
                self._checksums[page_id] = 0
            if self._log_enabled:
                pkv_sealed_log_withdraw(&self._log, page_id)

    cdef int64_t _seal_table(self, PageTable table) noexcept nogil:
        """Seal the held full pages of a table from its resume point on; return how many were new."""
        cdef int64_t upto = table.length // self.page_size
        cdef int64_t k, n = 0
        if upto <= table.num_sealed:
            return 0
        for k in range(table.num_sealed, min(upto, <int64_t>table.sink_count)):
            n += self._seal_page(table.sinks[k])
        for k in range(max(table.num_sealed, table.ring_first), min(upto, table.ring_first + table.ring_count)):
            n += self._seal_page(table.ring_page(k - table.ring_first))
        table.num_sealed = upto
        return n

    cdef Py_ssize_t _list_seals(self, list tables, const int64_t* counts) except -1:
        """List the pages the append about to run seals, before it changes anything.

        Those are the held, full, not yet sealed pages of each sequence that
        appends at least one token. They are sealed by _after_append_seals
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
        if bound > self._seal_capacity:
            grown = <page_id_t*>realloc(self._seal_buffer, bound * sizeof(page_id_t))
            if grown == NULL:
                raise MemoryError()
            self._seal_buffer = grown
            self._seal_capacity = bound
        for b in range(len(tables)):
            table = <PageTable>tables[b]
            if counts[b] <= 0:
                continue
            upto = table.length // self.page_size
            for k in range(table.num_sealed, min(upto, <int64_t>table.sink_count)):
                if not pkv_rec(&self.pool.q, table.sinks[k]).sealed:
                    self._seal_buffer[n] = table.sinks[k]
                    n += 1
            for k in range(max(table.num_sealed, table.ring_first), min(upto, table.ring_first + table.ring_count)):
                if not pkv_rec(&self.pool.q, table.ring_page(k - table.ring_first)).sealed:
                    self._seal_buffer[n] = table.ring_page(k - table.ring_first)
                    n += 1
        return n

    cdef void _after_append_seals(self, list tables, const int64_t* counts, Py_ssize_t num_listed):
        """Seal the pages _list_seals listed, then clear the seal of every page the append hands out slots in."""
        cdef Py_ssize_t i, b
        cdef int64_t n0, k, ps = self.page_size
        cdef PageTable table
        if num_listed:
            with nogil:
                for i in range(num_listed):
                    self._seal_page(self._seal_buffer[i])
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
                    self._unseal_page(table.page_at(n0 // ps))
                continue
            # New pages (from the free queue or reused in place), a copy-on-write
            # destination, or a partial last page written again after a truncate.
            for k in range(n0 // ps, (table.length - 1) // ps + 1):
                if k < table.num_sink_pages:
                    if k < table.sink_count:
                        self._unseal_page(table.sinks[k])
                elif table.ring_first <= k < table.ring_first + table.ring_count:
                    self._unseal_page(table.ring_page(k - table.ring_first))

    @property
    def page_checksums_enabled(self):
        """True when the cache records a checksum for each sealed page (``page_checksums=True``)."""
        return self._checksums != NULL

    def seal(self, seq_ids=None):
        """Seal the full pages of sequences now: their K/V is complete in every layer.

        A *sealed* page is a full page whose K/V the caller has stored in
        every layer. The cache seals a sequence's held full pages at three
        moments: at the start of each :meth:`append` that adds at least one
        token to it (by then the previous step's K/V was stored), in
        :meth:`remove_sequence`, and here. A page shared by forked
        sequences is sealed once. With ``page_checksums=True`` the page's
        checksum is recorded at its seal (without the GIL), for
        :meth:`verify_pages`.

        A page stops being sealed when an :meth:`append` hands out slots in
        it again: a page taken from the free queue or reused in place by the
        window's ring, a copy-on-write destination, or the partial last page
        of a sequence truncated into it (its bytes stay as they were until
        that append). A freed page keeps its seal while its bytes are
        unchanged (a cached free page of prefix caching can be matched again).

        Parameters
        ----------
        seq_ids : sequence of int, shape ``[B]``, optional
            Distinct, known sequence ids; None seals every sequence's pages.

        Returns
        -------
        int
            Pages newly sealed by this call (pages that were sealed already
            are not counted).

        Raises
        ------
        KeyError
            Unknown sequence id.
        ValueError
            A sequence id listed twice, or ``seq_ids`` not 1-D.
        TypeError
            Non-integer ids.

        Notes
        -----
        Call it after storing the last layer of a step when pages must be
        sealed before the next append (e.g. before :meth:`verify_pages` or
        a snapshot of a sequence that will not be appended to again).
        """
        cdef int64_t n = 0
        cdef PageTable table
        self._lock.acquire()
        try:
            tables = list(self._tables.values()) if seq_ids is None else self._tables_for(seq_ids)
            for table in tables:
                with nogil:
                    n += self._seal_table(table)
        finally:
            self._lock.leave()
        if self._tier is not None:
            self._offload_sealed()
        return n

    def verify_pages(self, seq_ids=None):
        """Recompute the checksums of sealed pages and report every page whose bytes changed (scrub).

        Parameters
        ----------
        seq_ids : sequence of int, shape ``[B]``, optional
            Check the sealed pages these sequences hold (distinct, known
            ids). None checks every sealed page of the pool, free ones that
            prefix caching keeps findable included.

        Returns
        -------
        PageCheckReport
            ``num_pages_checked`` and ``bad_pages`` (one :class:`BadPage`
            per page whose checksum differs: page id, recorded and
            recomputed checksum, the ids of the sequences holding it). The
            report is falsy when no page changed.

        Raises
        ------
        RuntimeError
            The cache was created without ``page_checksums=True``: no
            checksum was recorded.
        KeyError
            Unknown sequence id.
        ValueError, TypeError
            ``seq_ids`` invalid (listed twice, not 1-D, not integers).

        Notes
        -----
        Only sealed pages carry a checksum: a sequence's partial last page,
        and a full page that has not met a seal moment yet (see
        :meth:`seal`), are not checked. The checksums are computed in C
        without the GIL, one page after another (about the memory read
        bandwidth of one core; see docs/page_integrity.md). The checksum is
        XXH3-based (``pagedkv_c._checksum.page_checksums``): it detects
        corruption, not a forger who chooses the bytes.
        """
        cdef PageTable table
        cdef cnp.ndarray pages, actual
        cdef Py_ssize_t n
        if self._checksums == NULL:
            raise RuntimeError(
                "verify_pages needs recorded checksums: create the cache with KVCache(..., page_checksums=True)"
            )
        self._lock.acquire()
        try:
            sealed = np.asarray(self._sealed_array).view(np.bool_)
            if seq_ids is None:
                pages = np.flatnonzero(sealed).astype(np.int32)
            else:
                held = [table.pages()[0] for table in self._tables_for(seq_ids)]
                pages = np.unique(np.concatenate(held)) if held else np.empty(0, dtype=np.int32)
                pages = np.ascontiguousarray(pages[sealed[pages]], dtype=np.int32)
            n = pages.shape[0]
            actual = np.empty(n, dtype=np.uint64)
            with nogil:
                pkv_page_checksums(<const uint8_t*>self._data, <size_t>self._layer_bytes, <size_t>self._page_bytes,
                                   self.num_layers, <const int32_t*>cnp.PyArray_DATA(pages), n,
                                   <uint64_t*>cnp.PyArray_DATA(actual), self._digest_scratch)
            expected = self._checksum_array[pages]
            bad = np.flatnonzero(actual != expected)
            bad_pages = []
            if bad.size:
                holders = {int(p): [] for p in pages[bad]}
                for seq_id, table in self._tables.items():
                    for p in set(table.pages()[0].tolist()) & holders.keys():
                        holders[p].append(seq_id)
                bad_pages = [BadPage(int(pages[i]), int(expected[i]), int(actual[i]), holders[int(pages[i])])
                             for i in bad]
        finally:
            self._lock.leave()
        return PageCheckReport(int(n), bad_pages)

    def _enable_sealed_log(self, enabled, capacity=4096):
        """Start or stop logging sealed pages for a consumer that copies them out (internal: the shared tier).

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
        capacity : int
            Entries that can wait, ``1 <= capacity <= 2**24``; the log takes
            ``capacity * (32 + 4 * page_size)`` bytes plus 8 per page of the
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
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(f"Invalid type of enabled: expected a bool, got {type(enabled).__name__}")
        cdef int64_t entries = check_int(capacity, "capacity", 1, 2**24)
        self._lock.acquire()
        try:
            if enabled and not self._log_enabled:
                if pkv_sealed_log_init(&self._log, entries, self.page_size, self.pool.num_pages) != 0:
                    raise MemoryError(f"the sealed-page log of {entries} entries cannot be allocated")
                self._log_enabled = True
            elif not enabled and self._log_enabled:
                pkv_sealed_log_free(&self._log)
                self._log_enabled = False
            self._update_seal_on_take()
        finally:
            self._lock.leave()

    def _take_sealed_pages(self):
        """The pages sealed since the last call, in seal order, and empty the log (internal: the shared tier).

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
        self._lock.acquire()
        try:
            if not self._log_enabled:
                raise RuntimeError("the sealed-page log is not enabled: call _enable_sealed_log(True) first")
            n = pkv_sealed_log_count(&self._log)
            page_ids = np.empty(n, dtype=np.int32)
            hashes = np.empty((n, 2), dtype=np.uint64)
            token_ids = np.empty((n, self.page_size), dtype=np.int32)
            checksums = np.empty(n, dtype=np.uint64)
            pkv_sealed_log_drain(&self._log, <int32_t*>cnp.PyArray_DATA(page_ids), <uint64_t*>cnp.PyArray_DATA(hashes),
                                 <int32_t*>cnp.PyArray_DATA(token_ids), <uint64_t*>cnp.PyArray_DATA(checksums))
        finally:
            self._lock.leave()
        return page_ids, hashes.astype("<u8").view(np.uint8).reshape(n, 16), token_ids, checksums

    def _sealed_log_stats(self):
        """Counters of the sealed-page log (internal: the shared tier's metrics).

        Returns
        -------
        dict
            ``enabled`` (bool), ``capacity`` (entries), ``pending`` (entries
            waiting), ``logged`` (entries ever appended), ``dropped`` (seals
            not logged because the log was full), ``withdrawn`` (entries whose
            page was written again before the log was drained); counts are 0
            while disabled.
        """
        self._lock.acquire()
        try:
            if not self._log_enabled:
                return {"enabled": False, "capacity": 0, "pending": 0, "logged": 0, "dropped": 0, "withdrawn": 0}
            return {"enabled": True, "capacity": self._log.capacity, "pending": pkv_sealed_log_count(&self._log),
                    "logged": self._log.num_logged, "dropped": self._log.num_dropped,
                    "withdrawn": self._log.num_withdrawn}
        finally:
            self._lock.leave()

    def _sealed_state(self):
        """Copies of the per-page seal flags and checksums (internal: snapshots).

        Returns
        -------
        dict
            ``sealed``: uint8, shape ``[num_pages]``, 1 for a sealed page;
            ``checksums``: uint64, shape ``[num_pages]``, the checksum recorded
            at each sealed page's seal (0 elsewhere), or None without
            ``page_checksums``; ``pages_sealed``: seals over the cache's life
            (int, in pages).
        """
        self._lock.acquire()
        try:
            return _sealed_of(self)
        finally:
            self._lock.leave()

    def _restore_sealed_state(self, sealed, checksums=None, pages_sealed=0):
        """Set the per-page seal flags and checksums from :meth:`_sealed_state` (internal: snapshots).

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
        cdef PageTable table
        flags = check_array(sealed, "sealed", np.uint8, (self.pool.num_pages,))
        if flags.size and flags.max() > 1:
            raise ValueError(f"Invalid value of sealed: expected flags 0 or 1, got {int(flags.max())}")
        if self._checksums != NULL:
            if checksums is None:
                raise ValueError("Invalid value of checksums: expected an array, the cache records page checksums")
            values = check_array(checksums, "checksums", np.uint64, (self.pool.num_pages,))
        elif checksums is not None:
            raise ValueError("Invalid value of checksums: expected None, the cache records no page checksums")
        cdef int64_t counter = check_int(pages_sealed, "pages_sealed", 0, INT64_MAX)
        self._lock.acquire()
        try:
            if self._log_enabled:
                pkv_sealed_log_clear(&self._log)
            np.copyto(self._sealed_array, flags)
            if self._checksums != NULL:
                np.multiply(values, flags, out=self._checksum_array, casting="unsafe")
            self._pages_sealed = counter
            for table in self._tables.values():
                table.num_sealed = 0  # the flags no longer follow from this table's history
        finally:
            self._lock.leave()

    # ------------------------------------------------- sealed pages: one-hold copy
    def _take_sealed_copies(self, records, Py_ssize_t token_offset, Py_ssize_t body_offset, page_hashes,
                            bint discard_rest=False):
        """Take sealed pages from the log and copy them out, in one hold of the lock (internal: the shared tier).

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
        cdef Py_ssize_t token_bytes = 4 * self.page_size
        cdef Py_ssize_t body_bytes = self.num_layers * self._page_bytes
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
        cdef uint8_t* out = <uint8_t*>cnp.PyArray_DATA(rows)
        cdef uint64_t* out_hashes = <uint64_t*>cnp.PyArray_DATA(hashes)
        cdef int64_t taken = 0, discarded = 0, unlogged = 0
        self._lock.acquire()
        try:
            if not self._log_enabled:
                raise RuntimeError("the sealed-page log is not enabled: call _enable_sealed_log(True) first")
            with nogil:
                taken = pkv_sealed_log_take_copies(
                    &self._log, <const uint8_t*>self._data, <size_t>self._layer_bytes, <size_t>self._page_bytes,
                    self.num_layers, m, discard_rest, out, <size_t>record_bytes, <size_t>token_offset,
                    <size_t>body_offset, out_hashes, &discarded)
            unlogged = max(self._log.num_dropped - self._log_drops_reported, 0)
            self._log_drops_reported = self._log.num_dropped
        finally:
            self._lock.leave()
        return taken, discarded + unlogged


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


cdef dict _state_of(KVCache cache):
    """``KVCache._export_state``'s dict; the caller holds the cache's lock."""
    cdef PageTable table
    ref_counts, free_queue = cache.pool._export_state()
    sequences = []
    for seq_id, table in cache._tables.items():
        sequences.append((int(seq_id), table._export_state(),
                          table.hashes._export_state() if table.hashes is not None else None))
    return {
        "config": cache._config(),
        "counters": {"pages_peak": int(cache._pages_peak), "evictions": int(cache._evictions),
                     "cow_copies": int(cache._cow_copies), "tokens_appended": int(cache._tokens_appended),
                     "prefix_queries": int(cache._prefix_queries), "prefix_hits": int(cache._prefix_hits),
                     "out_of_pages_errors": int(cache._num_out_of_pages),
                     "sequences_added": int(cache._sequences_added),
                     "pages_allocated": int(cache.pool.num_taken),
                     "ring_reuses": int(cache.pool.num_reused_in_place),
                     "prefix_hit_counts": np.array([cache._prefix_hit_counts[j]
                                                    for j in range(NUM_PREFIX_HIT_BUCKETS)], dtype=np.int64)},
        "ref_counts": ref_counts,
        "free_queue": free_queue,
        "prefix": cache._prefix._export_state() if cache._prefix is not None else None,
        "sequences": sequences,
    }


cdef dict _sealed_of(KVCache cache):
    """``KVCache._sealed_state``'s dict (copies); the caller holds the cache's lock."""
    return {
        "sealed": np.array(cache._sealed_array, copy=True),
        "checksums": None if cache._checksum_array is None else np.array(cache._checksum_array, copy=True),
        "pages_sealed": cache._pages_sealed,
    }


def _remove_deferred(tuple cache_and_key):
    """Remove a sequence whose removal a re-entrant remove_sequence deferred (under the lock)."""
    cdef KVCache cache = cache_and_key[0]
    cdef PageTable table = cache._tables.get(cache_and_key[1])
    if table is not None:  # the running call may have removed it already
        cache._seal_table(table)
        table.drop_tail(0)
        del cache._tables[cache_and_key[1]]


cdef object _seq_key(object seq_id, str name="seq_id"):
    """A sequence id as the Python int keying the tables.

    TypeError for anything but an integer, ValueError for one outside int64
    (no sequence can have it), both naming ``name``.
    """
    return check_int(seq_id, name, INT64_MIN, INT64_MAX)


cdef int _record_tokens(list tables, list first_positions, const int64_t* counts, object ids,
                        int32_t page_size) except -1:
    """Note the token ids of appended tokens in each token-keyed hash chain.

    A token that differs from what the chain assumed (a prompt token that the
    caller replaced) cuts the chain's hashes back to the page before it.
    Tokens after a gap of unknown ids are not recorded: the chain stops there.
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
                    hashes.truncate(pos, page_size)
                hashes.token_ids[pos] = new_ids[offset + t]
                if pos + 1 > hashes.num_known:
                    hashes.num_known = pos + 1
        offset += counts[b]
    return 0


cdef object _block_ids(object block_hashes):
    """``block_hashes`` as a C-contiguous int64 array; uint64 ids keep their 64 bits."""
    cdef object arr = block_hashes
    if not isinstance(arr, np.ndarray):
        try:
            arr = np.asarray(block_hashes)
        except (TypeError, ValueError):
            arr = None
    if arr is not None and arr.dtype == np.uint64 and arr.ndim == 1:
        return np.ascontiguousarray(arr).view(np.int64)
    return as_int_array(block_hashes, "block_hashes", np.int64)


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


cdef str _over_pool_text(KVCache cache, object seq_ids, object counts):
    """Message of append's OutOfPagesError for a call larger than the whole pool.

    The pages it names are what the append would take (as ``append_batch`` plans
    it: new pages, copy-on-write copies, less what the window releases), so a cache
    created with the ``num_pages`` it suggests holds the append."""
    negative = np.flatnonzero(counts < 0)
    if negative.size:  # the count error comes first, as it would without the overflow
        raise ValueError(f"Invalid value of num_tokens: expected counts >= 0, got {counts[negative[0]]}")
    cdef object num_asked = sum(counts.tolist())  # Python int: cannot overflow
    cdef Py_ssize_t num_seqs = np.count_nonzero(counts)
    cdef int64_t ps = cache.page_size
    cdef list tables
    cdef object needed, available, lengths
    cache._lock.acquire()
    try:
        tables = cache._tables_for(seq_ids)
        if len(tables) != counts.shape[0]:
            raise ValueError(f"Invalid shape of num_tokens: expected ({len(tables)},) to match seq_ids, "
                             f"got ({counts.shape[0]},)")
        lengths = [(<PageTable>t).length for t in tables]
        if all(c <= MAX_POSITION - n for c, n in zip(counts.tolist(), lengths)):
            needed, available = pages_needed_for(cache.pool, tables,
                                                  <const int64_t*>cnp.PyArray_DATA(counts))
        else:  # past the length limit: only the new logical pages count (Python ints)
            needed = sum(-(-(n + c) // ps) - -(-n // ps) for c, n in zip(counts.tolist(), lengths))
            available = cache.pool.q.num_free
        num_pages, num_free = cache.pool.num_pages, cache.pool.q.num_free
    finally:
        cache._lock.leave()
    text = (f"Cannot append {num_asked} token{'s' if num_asked != 1 else ''} to {num_seqs} "
            f"sequence{'s' if num_seqs != 1 else ''}: they need {needed} new page{'s' if needed != 1 else ''} "
            f"of {ps} tokens, more than the whole pool holds ({num_pages} pages, "
            f"{num_free} of them free). Nothing was changed. ")
    cdef object least = num_pages + needed - available
    if least > MAX_NUM_PAGES:
        return text + (f"No cache holds that: num_pages is at most {MAX_NUM_PAGES}. "
                       + ("Append in smaller chunks." if cache._window is not None
                          else "Create the cache with a sliding window (window=W) and append in smaller chunks."))
    if cache._window is None:
        return text + (f"Create the cache with num_pages >= {least}, or with a sliding window "
                       f"(window=W) and append in smaller chunks.")
    return text + (f"Append in smaller chunks (the window releases earlier pages between appends), "
                   f"or create the cache with num_pages >= {least}.")


cdef int _take_cached(PagePool pool, page_id_t page_id) except -1:
    """Take a reference to a matched cached page, pulling it off the free queue if idle."""
    if pkv_ref(&pool.q, page_id) == 0:
        pkv_queue_remove(&pool.q, page_id)  # O(1) removal from the middle of the queue
        pkv_set_ref(&pool.q, page_id, 1)
    else:
        pkv_incref(&pool.q, page_id)
    return 0


cdef int64_t _cached_tokens(PageTable table) noexcept:
    """Positions below the length that lie in held pages."""
    cdef int64_t ps = table.page_size
    cdef int64_t length = table.length
    if table.num_held() == 0:
        return 0
    # Every held page is full except possibly the newest one.
    return (table.num_held() - 1) * ps + (length - (table.num_logical() - 1) * ps)


cdef int _gather_rows(char* layer_base, int32_t[::1] page_ids, int64_t[::1] firsts, int64_t length,
                      int64_t page_size, Py_ssize_t row_bytes, Py_ssize_t page_bytes,
                      object keys, object values, int64_t[::1] positions) except -1:
    cdef char* key_out = <char*>cnp.PyArray_DATA(keys)
    cdef char* value_out = <char*>cnp.PyArray_DATA(values)
    cdef Py_ssize_t i, row = 0
    cdef int64_t t, count
    cdef char* src
    with nogil:
        for i in range(page_ids.shape[0]):
            count = min(page_size, length - firsts[i])
            src = layer_base + <Py_ssize_t>page_ids[i] * page_bytes
            memcpy(key_out + row * row_bytes, src, count * row_bytes)
            memcpy(value_out + row * row_bytes, src + page_size * row_bytes, count * row_bytes)
            for t in range(count):
                positions[row + t] = firsts[i] + t
            row += count
    return 0


cdef int _fill_indptr(list tables, int32_t[::1] indptr, int32_t[::1] last_page_len,
                      int64_t[::1] seq_lens, int64_t page_size) except -1:
    cdef Py_ssize_t b
    cdef PageTable table
    indptr[0] = 0
    for b in range(len(tables)):
        table = <PageTable>tables[b]
        indptr[b + 1] = indptr[b] + <int32_t>table.num_held()
        seq_lens[b] = table.length
        last_page_len[b] = <int32_t>((table.length - 1) % page_size + 1) if table.length else 0
    return 0


cdef int _fill_indices(list tables, int32_t[::1] indptr, int32_t[::1] indices,
                       int64_t[::1] positions) except -1:
    cdef Py_ssize_t b
    cdef PageTable table
    if indices.shape[0] == 0:
        return 0
    for b in range(len(tables)):
        table = <PageTable>tables[b]
        if table.num_held():
            table.export(&indices[indptr[b]], &positions[indptr[b]])
    return 0


cdef int _check_tier(object tier, object enable_prefix_caching, object window) except -1:
    """A tier needs prefix caching and full attention; it must be a tier object."""
    if not all(hasattr(tier, name) for name in ("_attach", "_fetch", "_offload_notify")):
        raise TypeError(f"Invalid type of tier: expected a tier such as pagedkv.tiers.RedisTier, "
                        f"got {type(tier).__name__}")
    if not enable_prefix_caching:
        raise ValueError("Invalid value of tier: a shared tier needs enable_prefix_caching=True")
    if window is not None:
        raise ValueError(f"Invalid value of tier: a shared tier needs full attention (window=None), got window={window}")
    return 0
cdef inline void _record_stored_run(KVEventLog events, SequenceHashes hashes, int64_t first, int64_t end,
                                    int32_t page_size) noexcept:
    """Record the KV event of logical pages ``[first, end)`` of ``hashes`` entering the prefix index (one copy)."""
    if end > first:
        pkv_kv_events_stored_run(&events.log, <const uint64_t*>&hashes.chain[first], end - first,
                                 <const uint64_t*>&hashes.chain[first - 1] if first > 0 else NULL,
                                 NULL if hashes.external else &hashes.token_ids[first * page_size], 0)
