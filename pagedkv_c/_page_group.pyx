"""PageGroup: the page tables of one group of layers, and their window policy.

A group is a set of layers that share one attention setting
(:class:`AttentionSetting`: full attention, a sliding window of ``W`` tokens
with ``S`` sink tokens, or chunks of ``C`` tokens) and so one page table per
sequence. Every group of a cache draws its pages from the cache's one
:class:`~pagedkv_c._pool.PagePool`. A uniform model has one group.
The group owns its sequences' tables, appends to them all or nothing
(``append_batch``), exports them (CSR, block tables) and checks them; K/V
bytes, seals and prefix caching belong to other units of the cache.

How layers become groups (:func:`layer_groups`) follows vLLM's hybrid KV
cache manager: layers with equal settings are one *kind*; with ``G`` the
greatest common divisor of the kinds' layer counts, each kind of ``n``
layers is split into ``n / G`` groups of ``G`` layers, so that a page id,
owned by one group at a time, spans exactly ``G`` layers whatever its group.
"""
import math

import numpy as np

cimport numpy as cnp
from libc.stdint cimport INT64_MAX, INT64_MIN
from pagedkv_c._types cimport sat_add
from pagedkv_c._page_table cimport append_batch, owner_key, pages_needed_for
from pagedkv_c._checks cimport check_int, as_int_array
from pagedkv_c._checks import check_sink_window

cnp.import_array()

# Largest sequence length in tokens (as PageTable and attention).
cdef int64_t MAX_POSITION = 2**62
cdef int64_t MAX_NUM_PAGES = 2**31 - 2  # page ids are int32 (see PagePool)


class AttentionSetting:
    """The attention setting of a layer: full attention, a sliding window (with sinks), or chunks.

    An immutable, hashable value; two settings are equal when their three
    attributes are. Masks of the query at position ``p`` over key positions
    ``k``: full attention ``k <= p``; a window of ``W`` tokens ``p - W + 1 <=
    k <= p``, plus the sink positions ``k < S``; chunks of ``C`` tokens
    ``floor(p / C) * C <= k <= p`` (Llama 4's chunked local attention).

    Parameters
    ----------
    window : int or None
        Sliding window ``W`` in tokens, ``1 <= W <= 2**62``; None: no window.
    sink_tokens : int
        Attention-sink tokens ``0 <= S <= 2**62``; above 0 only with a window.
    chunk_size : int or None
        Chunk ``C`` in tokens, ``1 <= C <= 2**62``; None: no chunks. Not
        together with a window.

    Raises
    ------
    TypeError
        A value that is not an integer (or None where allowed).
    ValueError
        A value out of range, sinks without a window, or a window and a
        chunk size together; the message names the argument.

    Notes
    -----
    A :class:`KVCache` stores a chunked layer's keys as a sliding window of
    ``C`` tokens: a superset of what a chunk's query sees, whose exact mask
    the attention kernels apply.
    """
    __slots__ = ("_window", "_sink_tokens", "_chunk_size")

    def __init__(self, window=None, sink_tokens=0, chunk_size=None):
        if window is not None:
            window = int(check_int(window, "window", 1, MAX_POSITION))
        cdef int64_t sinks = check_int(sink_tokens, "sink_tokens", 0, MAX_POSITION)
        if sinks and chunk_size is not None:
            raise ValueError(f"Invalid value of sink_tokens: expected 0 with chunk_size (sinks exist only with a "
                             f"sliding window, which a chunked layer does not have), got {sinks}")
        check_sink_window(window, sinks)
        if chunk_size is not None:
            chunk_size = int(check_int(chunk_size, "chunk_size", 1, MAX_POSITION))
            if window is not None:
                raise ValueError(f"Invalid value of chunk_size: expected None with a sliding window "
                                 f"(window={window}), a layer has one or the other, got {chunk_size}")
        object.__setattr__(self, "_window", window)
        object.__setattr__(self, "_sink_tokens", int(sinks))
        object.__setattr__(self, "_chunk_size", chunk_size)

    @property
    def window(self):
        """Sliding window in tokens, or None."""
        return self._window

    @property
    def sink_tokens(self):
        """Attention-sink tokens (0 without a window)."""
        return self._sink_tokens

    @property
    def chunk_size(self):
        """Chunk size in tokens, or None."""
        return self._chunk_size

    def _key(self):
        return (self._chunk_size is not None, self._chunk_size or 0, self._window is not None, self._window or 0,
                self._sink_tokens)

    def __setattr__(self, name, value):
        raise AttributeError("AttentionSetting is immutable")

    def __delattr__(self, name):
        raise AttributeError("AttentionSetting is immutable")

    def __eq__(self, other):
        if not isinstance(other, AttentionSetting):
            return NotImplemented
        return self._key() == other._key()

    def __ne__(self, other):
        if not isinstance(other, AttentionSetting):
            return NotImplemented
        return self._key() != other._key()

    # An order (full attention first, then windows, then chunks) so that settings sort.
    def __lt__(self, other):
        if not isinstance(other, AttentionSetting):
            return NotImplemented
        return self._key() < other._key()

    def __le__(self, other):
        if not isinstance(other, AttentionSetting):
            return NotImplemented
        return self._key() <= other._key()

    def __gt__(self, other):
        if not isinstance(other, AttentionSetting):
            return NotImplemented
        return self._key() > other._key()

    def __ge__(self, other):
        if not isinstance(other, AttentionSetting):
            return NotImplemented
        return self._key() >= other._key()

    def __hash__(self):
        return hash(("AttentionSetting",) + self._key())

    def __reduce__(self):
        return (AttentionSetting, (self._window, self._sink_tokens, self._chunk_size))

    def __repr__(self):
        return (f"AttentionSetting(window={self._window}, sink_tokens={self._sink_tokens}, "
                f"chunk_size={self._chunk_size})")


FULL_ATTENTION = AttentionSetting()


def layer_settings(layer_attention, num_layers):
    """``layer_attention`` checked: a tuple of ``num_layers`` :class:`AttentionSetting` (None -> full attention).

    Raises TypeError for a value that is not a sequence of settings or None,
    ValueError for another length; both name ``layer_attention``.
    """
    if isinstance(layer_attention, (str, bytes, AttentionSetting)) or not hasattr(layer_attention, "__len__"):
        raise TypeError(f"Invalid type of layer_attention: expected a sequence of AttentionSetting or None per "
                        f"layer, got {type(layer_attention).__name__}")
    settings = tuple(layer_attention)
    if len(settings) != num_layers:
        raise ValueError(f"Invalid value of layer_attention: expected one entry per layer ({num_layers}), "
                         f"got {len(settings)}")
    for i, setting in enumerate(settings):
        if setting is not None and not isinstance(setting, AttentionSetting):
            raise TypeError(f"Invalid type of layer_attention[{i}]: expected an AttentionSetting or None, "
                            f"got {type(setting).__name__}")
    return tuple(FULL_ATTENTION if setting is None else setting for setting in settings)


def layer_groups(settings):
    """Split layers into page groups: a list of ``(AttentionSetting, layers)``, ``layers`` a tuple of int.

    ``settings`` has one :class:`AttentionSetting` per layer. Layers with
    equal settings are one kind; with ``G`` the greatest common divisor of
    the kinds' layer counts, each kind's layers, in ascending order, are cut
    into runs of ``G`` (vLLM's hybrid KV cache manager). The groups are
    ordered by their first layer. One kind (or no layer) gives one group of
    every layer.
    """
    kinds = {}
    for layer, setting in enumerate(settings):
        kinds.setdefault(setting, []).append(layer)
    if len(kinds) <= 1:
        return [(settings[0] if settings else FULL_ATTENTION, tuple(range(len(settings))))]
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    groups = [(setting, tuple(layers[i:i + size])) for setting, layers in kinds.items()
              for i in range(0, len(layers), size)]
    groups.sort(key=lambda group: group[1][0])
    return groups


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


cdef class PageGroup:
    """The page tables of one group of layers of a KVCache (internal; made by :func:`new_page_group`).

    Callers hold the cache's lock around every method and validate
    arguments that reach C loops.
    """

    cdef PageTable new_table(self):
        """An empty table of this group's page size, window and sinks, on the cache's pool."""
        return PageTable(self.pool, self.page_size, self.window, self.sink_tokens, _owner_key=owner_key())

    cdef PageTable table(self, object seq_id, str name="seq_id"):
        """The table of a known sequence id (an integer: bools and floats are refused, not matched by value).

        Raises TypeError or ValueError (outside int64) naming ``name``, KeyError for an unknown id.
        """
        if type(seq_id) is int:  # the common case: a known id needs no other check
            table = self.tables.get(seq_id)
            if table is not None:
                return table
        cdef object key = seq_key(seq_id, name)
        try:
            return self.tables[key]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id!r}") from None

    cdef list tables_for(self, object seq_ids):
        """Tables of a batch of distinct, known sequence ids, in order."""
        cdef object ids = as_int_array(seq_ids, "seq_ids", np.int64)
        cdef list tables = [self.table(seq_id) for seq_id in ids.tolist()]
        if len(tables) > 1 and len(set(map(id, tables))) != len(tables):
            seen = set()
            for seq_id in ids.tolist():
                if seq_id in seen:
                    raise ValueError(f"Invalid value of seq_ids: sequence id {seq_id} is listed more than once")
                seen.add(seq_id)
        return tables

    cdef int reserve(self, list tables, const int64_t* counts, slot_t* slots,
                     page_id_t* cow_src, page_id_t* cow_dst, Py_ssize_t* num_cow) except -1:
        """Reserve ``counts[b]`` slots in ``tables[b]``, all or nothing (see ``append_batch``).

        ``slots`` receives ``sum(counts)`` slots (NULL: none wanted); the
        copy-on-write pairs land in ``cow_src``/``cow_dst`` (room for one
        per table), their number in ``num_cow``: the caller copies the bytes.
        Raises OutOfPagesError with nothing changed.
        """
        cdef Py_ssize_t num_released = 0
        append_batch(self.pool, tables, counts if len(tables) else NULL, slots, cow_src, cow_dst,
                     num_cow, &num_released)
        self.cow_copies = sat_add(self.cow_copies, num_cow[0])
        self.evictions = sat_add(self.evictions, num_released)
        return 0

    cdef PageTableView view(self, list tables):
        """The CSR page tables of ``tables`` (known, repeats allowed).

        Raises ValueError, allocating nothing, when they list more than
        ``2**31 - 1`` pages (the int32 ``indptr``).
        """
        cdef Py_ssize_t batch = len(tables), b, nnz
        cdef int64_t total = 0
        cdef PageTableView view = PageTableView.__new__(PageTableView)
        for b in range(batch):  # at most 2**31 - 2 pages per table: no int64 overflow
            total += (<PageTable>tables[b]).num_held()
        if total > 2**31 - 1:
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
        view.indptr = indptr
        view.indices = indices
        view.last_page_len = last_page_len
        view.page_positions = positions
        view.seq_lens = seq_lens
        view.page_size = self.page_size
        return view

    cdef int count_references(self, object counts) except -1:
        """Check each table's geometry and add its page references to ``counts`` (int64, per page).

        Raises AssertionError naming the sequence: sink pages that are not
        logical pages ``0 ..``, window pages that are not one run after the
        sinks, the page of the last token not held, more window pages than
        the ring allows.
        """
        cdef PageTable table
        for seq_id, table in self.tables.items():
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
        return 0

    cdef str over_pool_text(self, list tables, object counts):
        """Message of append's OutOfPagesError for a call larger than the whole pool.

        ``counts`` (int64, C-contiguous, ``>= 0``) has one entry per table.
        The pages it names are what the append would take (as
        ``append_batch`` plans it: new pages, copy-on-write copies, less what
        the window releases), so a cache created with the ``num_pages`` it
        suggests holds the append.
        """
        cdef object num_asked = sum(counts.tolist())  # Python int: cannot overflow
        cdef Py_ssize_t num_seqs = np.count_nonzero(counts)
        cdef int64_t ps = self.page_size
        cdef object needed, available
        lengths = [(<PageTable>t).length for t in tables]
        if all(c <= MAX_POSITION - n for c, n in zip(counts.tolist(), lengths)):
            needed, available = pages_needed_for(self.pool, tables, <const int64_t*>cnp.PyArray_DATA(counts))
        else:  # past the length limit: only the new logical pages count (Python ints)
            needed = sum(-(-(n + c) // ps) - -(-n // ps) for c, n in zip(counts.tolist(), lengths))
            available = self.pool.q.num_free
        num_pages, num_free = self.pool.num_pages, self.pool.q.num_free
        text = (f"Cannot append {num_asked} token{'s' if num_asked != 1 else ''} to {num_seqs} "
                f"sequence{'s' if num_seqs != 1 else ''}: they need {needed} new page{'s' if needed != 1 else ''} "
                f"of {ps} tokens, more than the whole pool holds ({num_pages} pages, "
                f"{num_free} of them free). Nothing was changed. ")
        cdef object least = num_pages + needed - available
        if least > MAX_NUM_PAGES:
            return text + (f"No cache holds that: num_pages is at most {MAX_NUM_PAGES}. "
                           + ("Append in smaller chunks." if self.window is not None
                              else "Create the cache with a sliding window (window=W) and append in smaller chunks."))
        if self.window is None:
            return text + (f"Create the cache with num_pages >= {least}, or with a sliding window "
                           f"(window=W) and append in smaller chunks.")
        return text + (f"Append in smaller chunks (the window releases earlier pages between appends), "
                       f"or create the cache with num_pages >= {least}.")


cdef PageGroup new_page_group(PagePool pool, int32_t page_size, object window, int64_t sink_tokens):
    """A group without sequences (arguments checked by the caller)."""
    cdef PageGroup group = PageGroup.__new__(PageGroup)
    group.pool = pool
    group.page_size = page_size
    group.window = window
    group.sink_tokens = sink_tokens
    group.tables = {}
    return group


cdef object seq_key(object seq_id, str name="seq_id"):
    """A sequence id as the Python int keying the tables.

    TypeError for anything but an integer, ValueError for one outside int64
    (no sequence can have it), both naming ``name``.
    """
    return check_int(seq_id, name, INT64_MIN, INT64_MAX)


cdef int64_t cached_tokens(PageTable table) noexcept:
    """Positions below the length that lie in held pages."""
    cdef int64_t ps = table.page_size
    cdef int64_t length = table.length
    if table.num_held() == 0:
        return 0
    # Every held page is full except possibly the newest one.
    return (table.num_held() - 1) * ps + (length - (table.num_logical() - 1) * ps)


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
