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
from libc.string cimport memcpy
from pagedkv_c._types cimport page_id_t, pos_t, slot_t, int32_t, int64_t, PAD_SLOT
from pagedkv_c._pool cimport PagePool
from pagedkv_c._page_table cimport PageTable, append_batch
from pagedkv_c._checks cimport check_int, check_float_array, as_int_array

cnp.import_array()

_SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))


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
        Sliding window ``W`` in tokens, ``>= 1``: the query at position
        ``p`` attends to keys ``[p - W + 1, p]`` (FlashInfer
        ``window_left = W - 1``; Mistral / Hugging Face ``sliding_window =
        W``). None: full attention.
    sink_tokens : int
        Attention-sink tokens ``S >= 0``: positions ``[0, S)`` stay attended
        and their pages pinned (StreamingLLM, Xiao et al. 2023). Only used
        with a window.

    Attributes
    ----------
    kv : numpy.ndarray
        The pool, C-contiguous, shape ``(num_layers, num_pages, 2, page_size,
        num_kv_heads, head_dim)``; ``kv[layer]`` is FlashInfer's NHD paged
        layout, index 0 of axis 2 is K and 1 is V.
    pool : PagePool
        The page allocator.

    Raises
    ------
    TypeError
        A non-integer size, or a dtype other than float16/float32.
    ValueError
        A size out of range.
    MemoryError
        The pool array cannot be allocated.

    Notes
    -----
    *Cached tokens.* A sequence holds whole pages; its cached tokens are the
    positions below its length that lie in pages it holds. The window
    releases pages by the release rule of :class:`PageTable` (all positions
    out of the window of the next query, no sink position), so a held page
    may still contain positions that the window masks; attention kernels
    apply the exact mask per position.

    *Threads.* Every method that reads or changes page tables takes an
    internal lock; the copy loops run without the GIL.
    """

    def __cinit__(self, num_layers, num_kv_heads, head_dim, num_pages, page_size=16,
                  dtype=np.float16, window=None, sink_tokens=0):
        self.num_layers = <int32_t>check_int(num_layers, "num_layers", 0, 2**20)
        self.num_kv_heads = <int32_t>check_int(num_kv_heads, "num_kv_heads", 1, 2**16)
        self.head_dim = <int32_t>check_int(head_dim, "head_dim", 1, 2**16)
        self.page_size = <int32_t>check_int(page_size, "page_size", 1, 2**20)
        check_int(num_pages, "num_pages", 1, 2**31 - 2)
        try:
            np_dtype = np.dtype(dtype)
        except TypeError as exc:
            raise TypeError(f"Invalid dtype of dtype: expected float16 or float32, got {dtype!r}") from exc
        if np_dtype not in _SUPPORTED_DTYPES:
            raise TypeError(f"Invalid dtype of dtype: expected float16 or float32, got {np_dtype}")
        if window is not None:
            check_int(window, "window", 1, INT64_MAX)
            window = int(window)
        self._window = window
        self.sink_tokens = check_int(sink_tokens, "sink_tokens", 0, INT64_MAX)
        self.pool = PagePool(num_pages)
        # np.zeros maps untouched pages lazily: a large pool costs memory only as it fills.
        self.kv = np.zeros(
            (self.num_layers, num_pages, 2, self.page_size, self.num_kv_heads, self.head_dim),
            dtype=np_dtype,
        )
        self._data = <char*>cnp.PyArray_DATA(self.kv)
        self._row_bytes = <Py_ssize_t>self.num_kv_heads * self.head_dim * np_dtype.itemsize
        self._page_bytes = 2 * <Py_ssize_t>self.page_size * self._row_bytes
        self._layer_bytes = <Py_ssize_t>num_pages * self._page_bytes
        self._tables = {}
        self._pages_peak = 0
        self._evictions = 0
        self._cow_copies = 0
        self._tokens_appended = 0

    # ------------------------------------------------------------ internals
    cdef object _table(self, object seq_id):
        try:
            return self._tables[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r}") from None
        except TypeError:
            raise TypeError(f"Invalid type of seq_id: expected an integer, got {type(seq_id).__name__}") from None

    cdef list _tables_for(self, object seq_ids):
        """Tables of a batch of distinct, known sequence ids, in order."""
        cdef object ids = as_int_array(seq_ids, "seq_ids", np.int64)
        cdef list tables = [self._table(seq_id) for seq_id in ids.tolist()]
        if len(set(map(id, tables))) != len(tables):
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
        cdef int64_t in_use = self.pool.num_pages - self.pool._num_free
        if in_use > self._pages_peak:
            self._pages_peak = in_use

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
    def num_sequences(self):
        """Number of sequences in the cache."""
        return len(self._tables)

    def __contains__(self, seq_id):
        return seq_id in self._tables

    def __len__(self):
        return len(self._tables)

    def seq_ids(self):
        """Ids of the sequences in the cache, in insertion order (list of int)."""
        with self._lock:
            return list(self._tables)

    # ------------------------------------------------------------ sequences
    def add_sequence(self, seq_id):
        """Start an empty sequence.

        Parameters
        ----------
        seq_id : int
            New sequence id (any int64).

        Raises
        ------
        ValueError
            ``seq_id`` is already in the cache.
        TypeError
            ``seq_id`` is not an integer.
        """
        cdef int64_t key = check_int(seq_id, "seq_id", INT64_MIN, INT64_MAX)
        table = PageTable(self.pool, self.page_size, self._window, self.sink_tokens)
        with self._lock:
            if key in self._tables:
                raise ValueError(f"Invalid value of seq_id: sequence {key} already exists")
            self._tables[key] = table
        return 0

    def remove_sequence(self, seq_id):
        """Drop a sequence and release its pages (newest first).

        Shared pages lose one reference; a page is freed only when its last
        reference goes.

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        """
        cdef PageTable table
        with self._lock:
            table = self._table(seq_id)
            table.drop_tail(0)
            del self._tables[seq_id]

    def fork(self, parent_id, child_id):
        """Create ``child_id`` sharing every page of ``parent_id`` (ref counts +1).

        The first write into a shared page copies it for all layers
        (copy-on-write), so parent and child then diverge independently.

        Raises
        ------
        KeyError
            Unknown ``parent_id``.
        ValueError
            ``child_id`` already exists.
        TypeError
            ``child_id`` is not an integer.
        """
        cdef int64_t key = check_int(child_id, "child_id", INT64_MIN, INT64_MAX)
        cdef PageTable parent, child
        with self._lock:
            parent = self._table(parent_id)
            if key in self._tables:
                raise ValueError(f"Invalid value of child_id: sequence {key} already exists")
            child = PageTable(self.pool, self.page_size, self._window, self.sink_tokens)
            child.copy_from(parent)
            self._tables[key] = child

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
            ``new_len`` would need keys the window already released (allowed
            lengths are named in the message).
        """
        cdef PageTable table
        with self._lock:
            table = self._table(seq_id)
            table.truncate(new_len)

    def seq_len(self, seq_id):
        """Tokens appended to a sequence so far, released ones included (= the next position).

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        """
        cdef PageTable table
        with self._lock:
            table = self._table(seq_id)
            return table.length

    def num_cached_tokens(self, seq_id):
        """Tokens of a sequence stored in pages it still holds.

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        """
        cdef PageTable table
        with self._lock:
            table = self._table(seq_id)
            return _cached_tokens(table)

    # ---------------------------------------------------------------- paging
    def append(self, seq_ids, num_tokens):
        """Reserve slots for the next tokens of each sequence.

        For each sequence in order: pages that left the window are released
        first (and reused in place), a shared last page that will be written
        is copied for all layers (copy-on-write), then new pages are taken.

        Parameters
        ----------
        seq_ids : sequence of int, shape ``[B]``
            Distinct, known sequence ids.
        num_tokens : sequence of int, shape ``[B]``
            Tokens to append per sequence, ``>= 0``. A sequence with 0 is
            left untouched.

        Returns
        -------
        numpy.ndarray
            int64, shape ``[sum(num_tokens)]``: the slot mapping,
            ``page_id * page_size + offset`` for each new token in sequence
            order (vLLM's ``slot_mapping``). Pass it to :meth:`store`.

        Raises
        ------
        KeyError
            Unknown sequence id.
        ValueError
            Duplicate sequence id, negative count, or length mismatch.
        OutOfPagesError
            The pool cannot supply the pages the whole batch needs, counting
            the pages this call's own releases free. Nothing changed.

        Notes
        -----
        An append longer than the window keeps all its tokens (their queries
        need them); the out-of-window part is released at the next append.
        """
        counts = as_int_array(num_tokens, "num_tokens", np.int64)
        cdef Py_ssize_t batch = counts.shape[0]
        if counts.size and counts.min() < 0:
            raise ValueError(f"Invalid value of num_tokens: expected counts >= 0, got {int(counts.min())}")
        cdef Py_ssize_t num_cow = 0, num_released = 0, i
        cdef list tables
        cdef int64_t[::1] count_view = counts
        cdef int32_t[::1] cow_src, cow_dst
        with self._lock:
            tables = self._tables_for(seq_ids)
            if len(tables) != batch:
                raise ValueError(
                    f"Invalid shape of num_tokens: expected ({len(tables)},) to match seq_ids, got ({batch},)"
                )
            slots = np.empty(int(counts.sum()), dtype=np.int64)
            cow_src = np.empty(batch + 1, dtype=np.int32)
            cow_dst = np.empty(batch + 1, dtype=np.int32)
            append_batch(self.pool, tables, &count_view[0] if batch else NULL,
                         <slot_t*>cnp.PyArray_DATA(slots), &cow_src[0], &cow_dst[0],
                         &num_cow, &num_released)
            with nogil:
                for i in range(num_cow):
                    self._copy_page(cow_src[i], cow_dst[i])
            self._cow_copies += num_cow
            self._evictions += num_released
            self._note_usage()
            self._tokens_appended += slots.shape[0]
        return slots

    def store(self, layer, slot_mapping, k, v):
        """Scatter K and V of new tokens into their slots (no GIL held while copying).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        slot_mapping : numpy.ndarray or sequence of int, shape ``[T]``
            Slots from :meth:`append`; -1 marks padding (the token is skipped).
        k, v : numpy.ndarray
            float16 or float32, shape ``[T, num_kv_heads, head_dim]``;
            converted to the pool dtype when they differ.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        ValueError
            Shape or length mismatch, or a slot outside
            ``[-1, num_pages * page_size)``. Nothing is written.
        TypeError
            Non-array or non-float ``k``/``v``.
        """
        cdef int64_t layer_index = _check_layer(layer, self.num_layers)
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
        with self._lock, nogil:
            for t in range(num_tokens):
                slot = slot_view[t]
                if slot == PAD_SLOT:
                    continue
                page = slot // self.page_size
                offset = slot - page * self.page_size
                dst = layer_base + page * self._page_bytes + offset * self._row_bytes
                memcpy(dst, key_data + t * self._row_bytes, self._row_bytes)
                memcpy(dst + self.page_size * self._row_bytes, value_data + t * self._row_bytes, self._row_bytes)

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
        cdef int64_t layer_index = _check_layer(layer, self.num_layers)
        cdef PageTable table
        cdef Py_ssize_t num_pages, n
        cdef int64_t length
        cdef char* layer_base = self._data + layer_index * self._layer_bytes
        with self._lock:
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
        """
        cdef object ids = as_int_array(seq_ids, "seq_ids", np.int64)
        cdef Py_ssize_t batch = ids.shape[0], b, nnz = 0
        cdef PageTable table
        cdef PageTableView view = PageTableView.__new__(PageTableView)
        with self._lock:
            tables = [self._table(seq_id) for seq_id in ids.tolist()]
            indptr = np.empty(batch + 1, dtype=np.int32)
            last_page_len = np.empty(batch, dtype=np.int32)
            seq_lens = np.empty(batch, dtype=np.int64)
            _fill_indptr(tables, indptr, last_page_len, seq_lens, self.page_size)
            nnz = indptr[batch]
            indices = np.empty(nnz, dtype=np.int32)
            positions = np.empty(nnz, dtype=np.int64)
            _fill_indices(tables, indptr, indices, positions)
        view.indptr = indptr
        view.indices = indices
        view.last_page_len = last_page_len
        view.page_positions = positions
        view.seq_lens = seq_lens
        view.page_size = self.page_size
        return view

    # ------------------------------------------------------------ reporting
    def stats(self):
        """Usage counters.

        Returns
        -------
        dict
            ``pages_in_use``, ``pages_free``, ``pages_peak`` (pages);
            ``evictions`` (page-table entries released by the window);
            ``cow_copies`` (pages copied on write); ``bytes_per_page`` (bytes
            of one page id across all layers, K and V); ``bytes_in_use``;
            ``num_sequences``; ``tokens_appended``.
        """
        with self._lock:
            in_use = self.pool.num_pages - self.pool._num_free
            return {
                "pages_in_use": in_use,
                "pages_free": self.pool._num_free,
                "pages_peak": self._pages_peak,
                "evictions": self._evictions,
                "cow_copies": self._cow_copies,
                "bytes_per_page": self.num_layers * self._page_bytes,
                "bytes_in_use": in_use * self.num_layers * self._page_bytes,
                "num_sequences": len(self._tables),
                "tokens_appended": self._tokens_appended,
            }

    def check_invariants(self):
        """Verify allocator and page tables; raise AssertionError naming what is wrong.

        Checks the PagePool invariants, that every page's ref count equals
        the number of page-table entries referring to it, that free pages are
        unreferenced, and each table's window bounds.
        """
        cdef PageTable table
        with self._lock:
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
                if table.length and (logical.size == 0 or logical[-1] != table.num_logical() - 1):
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

    def __repr__(self):
        return (f"KVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, num_pages={self.pool.num_pages}, page_size={self.page_size}, "
                f"dtype={self.kv.dtype}, window={self._window}, sink_tokens={self.sink_tokens})")


cdef int64_t _check_layer(object layer, int32_t num_layers) except? -1:
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"Invalid type of layer: expected an integer, got {type(layer).__name__}")
    if layer < 0 or layer >= num_layers:
        raise IndexError(f"Invalid value of layer: expected 0 <= layer < {num_layers}, got {layer}")
    return <int64_t>layer


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
