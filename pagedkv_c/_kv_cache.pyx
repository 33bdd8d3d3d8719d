"""KVCache: paged K/V storage for many sequences and layers.

One C-contiguous pool array holds every K/V byte:
``kv.shape == (num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)``,
index 0 of axis 2 = K, 1 = V, so ``kv[layer]`` is FlashInfer's NHD paged
layout and one page id addresses the same page in every layer (as in vLLM).

``KVCache`` is the coordinator of the units that own each concept, and the
public API: it validates arguments at the boundary, takes the cache's lock
and delegates (the map of who owns and calls what: docs/architecture.md):

- ``PagePool`` (``_pool``): page ids, ref counts and the free queue;
- ``PageStore`` (``_page_store``): the pool array, its byte layout and copies;
- ``PageGroup`` (``_page_group``): the page tables of the layers that share
  one attention setting, and the window policy;
- ``PrefixServer`` (``_prefix_serving``): prefix caching over the
  ``PrefixIndex``, its counters and KV events;
- ``SealTracker`` (``_seals``): the seal life cycle, page checksums and the
  sealed-page log;
- ``TierLink`` (``_tier_link``): the shared tier's lookup, install and offload;
- ``_kv_state``: state export, check and restore for snapshots and sequence
  moves.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport INT64_MAX, INT64_MIN
from libc.stdlib cimport malloc, free
from pagedkv_c._types cimport sat_add, page_id_t, pos_t, slot_t, int32_t, int64_t, PAD_SLOT
from pagedkv_c._pool cimport PagePool
from pagedkv_c._pool import OutOfPagesError
from pagedkv_c._prefix import ALGORITHMS as _PREFIX_HASHES
from pagedkv_c._prefix cimport SequenceHashes, hash_salt
from pagedkv_c._page_table cimport PageTable
from pagedkv_c._checks cimport check_bool, check_int, check_index, check_float_array, check_pool_dtype, as_int_array
from pagedkv_c._checks import check_sink_window
from pagedkv_c._lock cimport CacheLock
from pagedkv_c._page_store cimport PageStore, new_page_store, check_layer_bytes
from pagedkv_c._page_store import PAGE_FORMATS, ROW_KINDS, MAX_QUANTIZED_HEAD_DIM
from pagedkv_c._page_group cimport PageGroup, new_page_group, seq_key, cached_tokens
from pagedkv_c._page_group import AttentionSetting, layer_groups, layer_settings
from pagedkv_c._page_table cimport pages_needed_for
from pagedkv_c._prefix_serving cimport PrefixServer, new_prefix_server
from pagedkv_c._seals cimport SealTracker, new_seal_tracker
from pagedkv_c._tier_link cimport TierLink, new_tier_link, check_tier
from pagedkv_c._kv_state cimport note_usage, state_of, snapshot, restore_state
from pagedkv_c cimport _kv_state

# Names other modules import from here; they live with the unit that owns them.
from pagedkv_c._page_group import PageTableView, AttentionSetting
from pagedkv_c._prefix_serving import PREFIX_HIT_BUCKETS
from pagedkv_c._seals import BadPage, PageCheckReport
from pagedkv_c._kv_state import StateError

cnp.import_array()


_SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32))
# Largest sequence length, window and sink length, in tokens (as PageTable and attention).
cdef int64_t MAX_POSITION = 2**62
# Largest prompt, in pages, that add_sequence takes as block ids (its chain: 16 bytes per page).
cdef int64_t MAX_EXTERNAL_PROMPT_PAGES = 2**24


def resolve_kv_dtype(dtype, kv_dtype):
    """The page format (a name of ``PAGE_FORMATS``) of ``KVCache(dtype=..., kv_dtype=...)``.

    ``kv_dtype`` names the format (a str, or the numpy dtype float16 /
    float32); ``dtype`` is the older spelling of the float formats. With
    neither, float16. Raises TypeError (``dtype`` not float16/float32, a
    ``kv_dtype`` of another type) or ValueError (an unknown format name, or
    the two arguments disagreeing).
    """
    if kv_dtype is None:
        return "float16" if dtype is None else check_pool_dtype(dtype, "dtype", _SUPPORTED_DTYPES).name
    if isinstance(kv_dtype, str):
        name = kv_dtype
    else:
        try:
            name = np.dtype(kv_dtype).name
        except (TypeError, ValueError) as exc:
            raise TypeError(f"Invalid type of kv_dtype: expected one of {PAGE_FORMATS} (a str), "
                            f"got {kv_dtype!r}") from exc
    if name not in PAGE_FORMATS:
        raise ValueError(f"Invalid value of kv_dtype: expected one of {PAGE_FORMATS}, got {kv_dtype!r}")
    if dtype is not None and check_pool_dtype(dtype, "dtype", _SUPPORTED_DTYPES).name != name:
        raise ValueError(f"Invalid value of dtype: {np.dtype(dtype).name} contradicts kv_dtype={name!r}; "
                         f"give kv_dtype only")
    return name


cdef int _ready_row_kind(object a, tuple shape, str kv_dtype):
    """The row kind (0 float32, 1 float16) of ``a`` if it can be stored as it is, else -1.

    As it is: a C-contiguous, aligned, native float32 or float16 ndarray of
    exactly ``shape`` whose dtype the pool takes without conversion (its own
    for float16 and float32 pools; either for the encoded formats). Only C
    fields are read, as this runs for every layer of every forward pass;
    anything else takes :func:`_rows_to_store`'s general path.
    """
    if type(a) is not np.ndarray or not cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>a) \
            or cnp.PyArray_NDIM(<cnp.ndarray>a) != 3:
        return -1
    cdef cnp.npy_intp* dims = cnp.PyArray_DIMS(<cnp.ndarray>a)
    if dims[0] != <cnp.npy_intp>shape[0] or dims[1] != <cnp.npy_intp>shape[1] or dims[2] != <cnp.npy_intp>shape[2]:
        return -1
    cdef int type_num = cnp.PyArray_TYPE(<cnp.ndarray>a)
    cdef int kind = 0 if type_num == cnp.NPY_FLOAT32 else (1 if type_num == cnp.NPY_FLOAT16 else -1)
    if kind < 0 or (kv_dtype == "float32" and kind != 0) or (kv_dtype == "float16" and kind != 1):
        return -1
    return kind


cdef tuple _rows_to_store(object k, object v, tuple shape, str kv_dtype, bint bfloat16_bits):
    """K and V rows for ``PageStore.store_rows``: ``(input_kind, keys, values)``, C-contiguous.

    float32 and float16 ndarrays are passed as they are to a pool that encodes
    (bfloat16, int8, int4) or has their dtype; bfloat16 arrives as uint16 bit
    patterns (``bfloat16_bits``) or as an ndarray whose dtype is named
    ``bfloat16`` (ml_dtypes); anything else is converted as *Array arguments*
    says, to the float pool's dtype or to float32.
    """
    cdef int fast_k = -1 if bfloat16_bits else _ready_row_kind(k, shape, kv_dtype)
    if fast_k >= 0 and fast_k == _ready_row_kind(v, shape, kv_dtype):
        return fast_k, k, v  # the per-layer store of a decode step: nothing to check twice or convert
    cdef list out = []
    cdef list kinds = []
    for name, a in (("k", k), ("v", v)):
        if bfloat16_bits or (isinstance(a, np.ndarray) and a.dtype.name == "bfloat16" and a.dtype.itemsize == 2):
            if not isinstance(a, np.ndarray) or (bfloat16_bits and a.dtype not in (np.uint16, np.int16)) \
                    or a.dtype.itemsize != 2:
                got = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
                raise TypeError(f"Invalid dtype of {name}: expected uint16 bfloat16 bit patterns "
                                f"(bfloat16_bits=True), got {got}")
            if a.shape != shape:
                raise ValueError(f"Invalid shape of {name}: expected {shape}, got {a.shape}")
            out.append(np.ascontiguousarray(a).view(np.uint16))
            kinds.append(2)
        elif isinstance(a, np.ndarray) and a.dtype in (np.float32, np.float16) \
                and (kv_dtype not in ("float32", "float16") or a.dtype.name == kv_dtype):
            out.append(check_float_array(a, name, shape, a.dtype))
            kinds.append(0 if a.dtype == np.float32 else 1)
        else:
            target = np.dtype(kv_dtype) if kv_dtype in ("float32", "float16") else np.dtype(np.float32)
            out.append(check_float_array(a, name, shape, target))
            kinds.append(0 if target == np.float32 else 1)
    if kinds[0] != kinds[1]:  # one element type for both: widen to float32
        for i in range(2):
            if kinds[i] == 2:
                out[i] = (out[i].astype(np.uint32) << 16).view(np.float32)
            else:
                out[i] = out[i].astype(np.float32)
        kinds = [0, 0]
    return kinds[0], out[0], out[1]



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
    dtype : numpy dtype or None
        float16 or float32: the older spelling of ``kv_dtype`` for the float
        formats. None (default): as ``kv_dtype`` says, float16 without it.
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
    layer_attention : sequence of AttentionSetting or None, optional
        Keyword only. Per-layer attention settings (hybrid models), one
        entry per layer, None meaning full attention; needs ``window=None``
        and ``sink_tokens=0``. None (the default): every layer has
        ``window`` and ``sink_tokens``. See *Page groups* below.
    kv_dtype : str or None, optional
        Keyword only. The page format: ``"float16"`` (default),
        ``"float32"``, ``"bfloat16"``, ``"int8"`` or ``"int4"`` (the
        numpy dtypes float16 / float32 are taken too). See *Page formats*
        below; int8 and int4 need ``head_dim <= 256``.

    Attributes
    ----------
    kv : numpy.ndarray
        The pool, C-contiguous, shape ``(G, num_pages, 2, page_size,
        num_kv_heads, row_items)`` with ``G = num_layers`` for a cache with
        one page group (see *Page groups*); ``kv[layer]`` is then
        FlashInfer's NHD paged layout, index 0 of axis 2 is K and 1 is V.
        ``row_items = head_dim`` for float32, float16 and bfloat16 pages
        (uint16 bit patterns), the bytes of a head row for int8 and int4
        (uint8; see *Page formats*). :meth:`layer_pages` gives any layer's
        view.
    pool : PagePool
        The page allocator, read-only here (``pool.owner == "KVCache"``):
        ``num_free``, ``ref_count``, ``free_pages`` and ``check_invariants``
        work; ``allocate``, ``free`` and ``incref`` raise RuntimeError, as
        pages are taken and released through the sequences.

    Raises
    ------
    TypeError
        A non-integer size, a ``dtype`` other than float16/float32, a
        ``kv_dtype`` that is not a str or numpy dtype, or a ``tier`` that
        is not a tier object.
    ValueError
        A size out of range: ``num_layers <= 2**20``, ``num_kv_heads <=
        2**16``, ``head_dim <= 2**16``, ``page_size <= 2**20``, ``num_pages
        <= 2**31 - 2``; ``sink_tokens > 0`` without a ``window``; a ``tier``
        without prefix caching, with a window, or already serving caches of
        another layout. (``enable_prefix_caching`` and ``page_checksums``
        that are not bools raise TypeError.) ``layer_attention`` of another
        length than ``num_layers``, or given with a ``window`` or sink
        tokens; with more than one page group, ``enable_kv_events`` or a
        ``tier`` (not supported with per-layer attention settings). An
        unknown ``kv_dtype``, one that contradicts ``dtype``, or int8 / int4
        with ``head_dim > 256``.
    MemoryError
        The pool array cannot be allocated, or one layer of it (``num_pages
        * 2 * page_size * num_kv_heads * head_dim * itemsize`` bytes) would
        pass ``2**63 - 1`` bytes, also with ``num_layers=0``.

    Notes
    -----
    *Page groups.* Layers with equal attention settings are one kind. With
    ``G`` the greatest common divisor of the kinds' layer counts, each kind
    of ``n`` layers is split into ``n / G`` *page groups* of ``G`` layers
    (ascending), ordered by their first layer (vLLM's hybrid KV cache
    manager); e.g. 15 sliding-window and 3 full-attention layers give 6
    groups of 3 layers, 7 and 5 layers give 12 groups of 1. Each group has
    its own page tables (its window releases its pages); all groups draw
    from the one pool and free queue, and a page id belongs to one group at
    a time: slot ``i`` of the pool's axis 0 holds the ``i``-th layer of the
    group owning the page. A cache whose layers all have one setting (or
    ``layer_attention=None``) has one group of every layer, ``G =
    num_layers``, and behaves as without groups. A chunked layer (``chunk_size
    C``) is stored as a sliding window of ``C`` tokens: a superset of what a
    chunk's query sees; attention kernels apply the chunk mask. With more
    than one group, :meth:`append` returns one row of slots per group,
    :meth:`page_table` needs ``group=``, and KV events, the shared tier and
    :meth:`export_sequence` / :meth:`import_sequence` are refused
    (ValueError: not supported with per-layer attention settings).

    *Page formats* (``kv_dtype``). A page of one layer is
    ``[2][page_size][num_kv_heads][row]``, K then V, in every format; only
    the bytes of a head row (one token's ``head_dim`` values of one KV
    head) differ, and the scales of a quantized row are inside the row
    (``pagedkv_c/page_formats.h``). So a page stays one unit of bytes for
    copy-on-write, prefix sharing, seals and checksums, snapshots and the
    tier, which never look inside it; the format is part of the layout they
    record, so pages of one format never reach a cache of another.

    - ``float32``, ``float16``: IEEE values (4 and 2 bytes per value).
    - ``bfloat16``: the upper half of the float32 value, rounded to nearest
      even (2 bytes per value); the dtype of most released models.
    - ``int8``: the row rotated by a Walsh-Hadamard transform ``R``
      (orthonormal, over blocks of the largest power of two dividing
      ``head_dim``, at most 256), then quantized symmetrically with one
      scale: ``head_dim`` int8 values in ``[-127, 127]`` and the scale
      ``max|R x| / 127`` rounded up to bfloat16 (``head_dim + 2`` bytes:
      51.6% of float16 at ``head_dim`` 64, 50.8% at 128).
    - ``int4``: the rotated row in blocks of 32 values, each on llama.cpp's
      q4_0 grid: levels ``-8 .. 7`` times the block's scale ``f * m / -8``
      (``m`` the value of largest magnitude), the clip factor ``f`` in
      ``{1, 0.95, 0.9, 0.85, 0.8, 0.75}`` of least squared error, the scale
      in bfloat16 (two values per byte, then the scales: ``head_dim / 2 + 2
      * ceil(head_dim / 32)`` bytes, 28.1% of float16).

    Rotation spreads a channel outlier (keys carry a few) over the block,
    so the grid of the row fits its values (QuaRot, Ashkboos et al. 2024;
    llama.cpp rotates its quantized caches the same way); attention scores
    with ``R q`` and rotates the output back, and :meth:`gather` undoes it.
    Values are rounded to the nearest integer (ties to even); a row with a
    NaN or an infinity is stored with a NaN scale and reads back as NaN in
    every value, never as a finite number. The schemes were chosen by
    measurement on SmolLM2-135M over 4,096 tokens (docs/page_formats.md).

    *Prefix caching with page groups* (vLLM's hybrid KV cache manager).
    Every group indexes its own full pages, registered as they fill, in the
    one prefix index, under the sequence's chained page hash salted per
    group (``s XOR m_g``, see ``pagedkv_c._prefix``), so a page is only ever
    found by its own group. :meth:`add_sequence` serves the largest number
    of pages ``h`` that every group can start on (each group as a cache of
    its own setting would: a full-attention group needs its pages ``0 ..
    h-1`` cached, a sliding group its sink pages and the pages the query at
    ``h * page_size`` still sees, a chunked group those of its window of
    ``C`` tokens); each group adopts only the pages it needs. Pages a
    sliding group released stay in the index as cached free pages, findable
    by their hash, until the allocator hands them out again (to any group),
    like every freed cached page; evicting one group's page can shorten the
    hit of every group. :meth:`stats` counts one lookup per
    :meth:`add_sequence`; :meth:`reset_prefix_cache`, :meth:`check_invariants`
    and snapshots cover every group.

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
                  dtype=None, window=None, sink_tokens=0, enable_prefix_caching=False,
                  prefix_hash="xxh3_128", page_checksums=False, tier=None, enable_kv_events=False,
                  kv_events_capacity=2**20, *, layer_attention=None, kv_dtype=None):
        self.num_layers = <int32_t>check_int(num_layers, "num_layers", 0, 2**20)
        self.num_kv_heads = <int32_t>check_int(num_kv_heads, "num_kv_heads", 1, 2**16)
        self.head_dim = <int32_t>check_int(head_dim, "head_dim", 1, 2**16)
        self.page_size = <int32_t>check_int(page_size, "page_size", 1, 2**20)
        cdef int64_t pages = check_int(num_pages, "num_pages", 1, 2**31 - 2)
        self._kv_dtype = resolve_kv_dtype(dtype, kv_dtype)
        if self._kv_dtype in ("int8", "int4") and self.head_dim > MAX_QUANTIZED_HEAD_DIM:
            raise ValueError(f"Invalid value of head_dim: {self._kv_dtype} pages take head_dim <= "
                             f"{MAX_QUANTIZED_HEAD_DIM}, got {self.head_dim}")
        if window is not None:
            check_int(window, "window", 1, MAX_POSITION)
            window = int(window)
        self._window = window
        self.sink_tokens = check_int(sink_tokens, "sink_tokens", 0, MAX_POSITION)
        if layer_attention is None:  # with it, the per-layer settings carry windows and sinks (checked below)
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
        cdef int64_t events_capacity = check_int(kv_events_capacity, "kv_events_capacity", 1, 2**31)
        cdef list groups
        cdef PageGroup group
        cdef int32_t slots_per_page = self.num_layers
        self._chunk_size = None
        self._layer_attention = None
        if layer_attention is None:
            groups = [(AttentionSetting(window, self.sink_tokens, None), tuple(range(self.num_layers)))]
        else:
            if window is not None:
                raise ValueError(f"Invalid value of window: expected None with layer_attention (each layer's "
                                 f"AttentionSetting has its window), got {window}")
            if self.sink_tokens:
                raise ValueError(f"Invalid value of sink_tokens: expected 0 with layer_attention (each layer's "
                                 f"AttentionSetting has its sink tokens), got {self.sink_tokens}")
            self._layer_attention = layer_settings(layer_attention, self.num_layers)
            groups = layer_groups(self._layer_attention)
            if len(groups) == 1:  # one setting for every layer: the uniform cache of that setting
                setting = groups[0][0]
                self._chunk_size = setting.chunk_size
                window = setting.window if setting.chunk_size is None else setting.chunk_size
                self._window = window
                self.sink_tokens = setting.sink_tokens
            else:
                slots_per_page = <int32_t>len(groups[0][1])
                self._window = None
                for name, wanted in (("tier", tier is not None), ("enable_kv_events", enable_kv_events)):
                    if wanted:
                        feature = {"tier": "the shared tier", "enable_kv_events": "KV events"}[name]
                        raise ValueError(f"Invalid value of {name}: {feature} is not supported with per-layer "
                                         f"attention settings ({len(groups)} page groups); leave it off")
        self.num_groups = <int32_t>len(groups)
        check_layer_bytes(pages, self.page_size, self.num_kv_heads, self.head_dim, self._kv_dtype)
        self.pool = PagePool(pages)
        self.pool.owner = "KVCache"
        self._store = new_page_store(slots_per_page, pages, self.page_size, self.num_kv_heads, self.head_dim,
                                     self._kv_dtype)
        self._groups = []
        layer_group = [0] * self.num_layers
        layer_slot = [0] * self.num_layers
        for g, (setting, layers) in enumerate(groups):
            group = new_page_group(self.pool, self.page_size,
                                   setting.window if setting.chunk_size is None else setting.chunk_size,
                                   setting.sink_tokens)
            group.setting = setting
            group.layers = layers
            self._groups.append(group)
            for i, layer in enumerate(layers):
                layer_group[layer] = g
                layer_slot[layer] = i
        self._group = self._groups[0]
        self._layer_group = tuple(layer_group)
        self._layer_slot = tuple(layer_slot)
        self._layer_settings = tuple([(<PageGroup>self._groups[g]).setting for g in layer_group])
        self._lock = CacheLock(
            "KVCache", "only remove_sequence may be called there (it is deferred until the running call returns)"
        )
        self._prefix = None
        if enable_prefix_caching:
            self._prefix = new_prefix_server(self.pool, self.page_size, window, prefix_hash,
                                             bool(enable_kv_events), events_capacity, self.num_groups)
        self._seals = new_seal_tracker(self.pool, self._store,
                                       self._prefix.index if self._prefix is not None else None,
                                       bool(page_checksums))
        # Shared tier (pagedkv.tiers): checked here, after the pool, so that it is bound
        # to a cache that exists.
        self._tier = None
        if tier is not None:
            check_tier(tier, enable_prefix_caching, window)
            self._tier = new_tier_link(tier, self.pool, self._store, self._prefix, self._seals, self._lock,
                                       self._kv_dtype)

    # ------------------------------------------------------------ internals
    cdef int _offload_sealed(self) except -1:
        """After a call that can seal pages, with the lock released: hand them to the tier."""
        if self._tier is not None:
            self._tier.offload(self)
        return 0

    # ----------------------------------------------------------- properties
    @property
    def kv(self):
        """The pool, C-contiguous, shape ``(G, num_pages, 2, page_size, num_kv_heads, head_dim)``.

        ``G = num_layers`` for a cache with one page group, where ``kv[layer]``
        is FlashInfer's NHD paged layout, index 0 of axis 2 is K and 1 is V.
        With more than one group, ``G`` is the layers per group and slot
        ``i`` holds the ``i``-th layer of the group owning each page: use
        :meth:`layer_pages`.
        """
        return self._store.kv

    @property
    def num_pages(self):
        """Pages in the pool."""
        return self.pool.num_pages

    @property
    def dtype(self):
        """dtype of the pool array: float16 or float32 for float pages, uint16 for bfloat16
        (bit patterns), uint8 for int8 and int4 (rows with their scales); see :attr:`kv_dtype`."""
        return self._store.kv.dtype

    @property
    def kv_dtype(self):
        """The page format (str): ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"int8"`` or ``"int4"``."""
        return self._kv_dtype

    @property
    def window(self):
        """Sliding window in tokens, or None for full attention.

        None also for a cache with more than one page group (see
        :meth:`layer_setting`) and for a chunked cache (see :attr:`chunk_size`).
        """
        return self._window if self._chunk_size is None else None

    @property
    def chunk_size(self):
        """Chunk size in tokens of a cache whose every layer is chunked, else None (see :meth:`layer_setting`)."""
        return self._chunk_size

    # ---------------------------------------------------------- page groups
    def layer_group(self, layer):
        """The page group of a layer (int, ``0 <= group < num_groups``).

        Raises
        ------
        IndexError
            ``layer`` out of range.
        """
        return self._layer_group[check_index(layer, "layer", self.num_layers)]

    def layer_setting(self, layer):
        """The :class:`AttentionSetting` of a layer.

        A cache made without ``layer_attention`` answers
        ``AttentionSetting(window, sink_tokens, None)`` for every layer.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        """
        return self._layer_settings[check_index(layer, "layer", self.num_layers)]

    def group_layers(self, group):
        """The layers of a page group, ascending (tuple of int); layer ``i`` of it lives in pool slot ``i``.

        Raises
        ------
        IndexError
            ``group`` out of range.
        """
        return (<PageGroup>self._groups[check_index(group, "group", self.num_groups)]).layers

    def group_setting(self, group):
        """The :class:`AttentionSetting` of a page group's layers.

        Raises
        ------
        IndexError
            ``group`` out of range.
        """
        return (<PageGroup>self._groups[check_index(group, "group", self.num_groups)]).setting

    def layer_pages(self, layer):
        """The view of the pool that holds a layer's pages (no copy).

        Returns
        -------
        numpy.ndarray
            Pool dtype, shape ``(num_pages, 2, page_size, num_kv_heads,
            head_dim)``, FlashInfer's NHD paged layout: the page ids of the
            layer's group's page tables index axis 0. ``kv[layer]`` for a
            cache with one group.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        """
        return self._store.kv[self._layer_slot[check_index(layer, "layer", self.num_layers)]]

    def layer_attention_view(self, layer, seq_ids):
        """What attention over one layer reads: its pages, its group's page tables and its mask.

        Parameters
        ----------
        layer : int
            ``0 <= layer < num_layers``.
        seq_ids : sequence of int, shape ``[B]``
            Known sequence ids (repeats allowed).

        Returns
        -------
        pages : numpy.ndarray
            As :meth:`layer_pages`.
        view : PageTableView
            The page tables of the layer's group for ``seq_ids``, as
            :meth:`page_table` returns them.
        window : int or None
            The layer's sliding window in tokens.
        sink_tokens : int
            The layer's attention-sink tokens.
        chunk_size : int or None
            The layer's chunk size in tokens (the group stores a window of
            ``chunk_size`` tokens; the kernel applies the chunk mask).

        Raises
        ------
        IndexError
            ``layer`` out of range.
        KeyError
            Unknown sequence id.
        ValueError
            As :meth:`page_table`.
        """
        cdef int64_t layer_index = check_index(layer, "layer", self.num_layers)
        cdef PageGroup group = self._groups[self._layer_group[layer_index]]
        cdef object ids = as_int_array(seq_ids, "seq_ids", np.int64)
        setting = group.setting
        self._lock.acquire()
        try:
            view = group.view([group.table(seq_id) for seq_id in ids.tolist()])
        finally:
            self._lock.leave()
        return (self._store.kv[self._layer_slot[layer_index]], view, setting.window, setting.sink_tokens,
                setting.chunk_size)

    cdef list _tables_of_groups(self, object seq_ids):
        """Tables of a batch of distinct, known sequence ids in every group: group 0's, then group 1's, ..."""
        cdef list tables = self._group.tables_for(seq_ids)
        cdef list keys
        cdef PageGroup group
        cdef Py_ssize_t g
        if self.num_groups == 1:
            return tables
        keys = as_int_array(seq_ids, "seq_ids", np.int64).tolist()
        for g in range(1, self.num_groups):
            group = self._groups[g]
            tables.extend([group.tables[key] for key in keys])
        return tables

    cdef list _all_tables(self):
        """``(seq_id, table)`` of every page group, group after group."""
        cdef list pairs = []
        cdef PageGroup group
        for group in self._groups:
            pairs.extend(group.tables.items())
        return pairs

    cdef int _refuse_groups(self, str feature) except -1:
        """Raise ValueError when a feature that needs one page group is called on a cache with more."""
        if self.num_groups > 1:
            raise ValueError(f"{feature} is not supported with per-layer attention settings (this cache has "
                             f"{self.num_groups} page groups)")
        return 0

    @property
    def prefix_caching(self):
        """True when prefix caching is enabled."""
        return self._prefix is not None

    @property
    def prefix_index(self):
        """The prefix cache's hash -> page index (``PrefixIndex``), or None when disabled."""
        return self._prefix.index if self._prefix is not None else None

    @property
    def num_sequences(self):
        """Number of sequences in the cache."""
        return len(self._group.tables)

    def __contains__(self, seq_id):
        if type(seq_id) is not int and (isinstance(seq_id, (bool, np.bool_))
                                        or not isinstance(seq_id, (int, np.integer))):
            return False  # only integers are sequence ids
        return seq_id in self._group.tables

    def __len__(self):
        return len(self._group.tables)

    def seq_ids(self):
        """Ids of the sequences in the cache, in insertion order (list of int)."""
        self._lock.acquire()
        try:
            return list(self._group.tables)
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
            are not taken. With more than one page group, the hit is the
            largest that every group can serve, each group starting on its
            own pages (see *Prefix caching with page groups* in the class
            notes): every group's table then has this length, and a sliding
            group holds only the pages its window still needs
            (:meth:`num_cached_tokens` per group counts those). Token-keyed and block-keyed requests never share a
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
        cdef PageTable table = self._group.new_table()
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
        cdef list more = None  # the new tables of the further page groups
        if self.num_groups != 1:
            more = [(<PageGroup>self._groups[g]).new_table() for g in range(1, self.num_groups)]
        if self._prefix is not None:
            if more is None:
                hashes = self._prefix.new_hashes(extra_key, prompt, blocks, per_block // self.page_size,
                                                 prompt_len // self.page_size)
            else:  # one chain per page group, each under the group's salt
                group_hashes = self._prefix.new_group_hashes(extra_key, prompt, blocks, per_block // self.page_size,
                                                             prompt_len // self.page_size)
                hashes = group_hashes[0]
                for g in range(1, self.num_groups):
                    (<PageTable>more[g - 1]).hashes = group_hashes[g]
        elif extra_key is not None:
            hash_salt(0, extra_key)  # same type check as with caching on
        table.hashes = hashes
        cdef int64_t cached = 0
        cdef bint lookup = hashes is not None and (prompt is not None or blocks is not None)
        # Shared tier: ask it, without the lock, for the pages after the local hits.
        cdef object fetched = None
        if self._tier is not None and lookup and key not in self._group.tables:
            fetched = self._tier.lookup(table, prompt, prompt_len)
        self._lock.acquire()
        try:
            if key in self._group.tables:
                raise ValueError(f"Invalid value of seq_id: sequence {key} already exists")
            if lookup:
                if more is None:
                    cached = self._prefix.match(
                        table, <const int32_t*>cnp.PyArray_DATA(prompt) if prompt is not None else NULL, prompt_len)
                else:
                    cached = self._prefix.match_groups(
                        [table] + more, <const int32_t*>cnp.PyArray_DATA(prompt) if prompt is not None else NULL,
                        prompt_len)
                if fetched is not None:
                    cached += self._tier.install(table, fetched, cached // self.page_size)
                note_usage(&self._counters, self.pool)
            self._group.tables[key] = table
            for g in range(1, self.num_groups):
                (<PageGroup>self._groups[g]).tables[key] = more[g - 1]
            self._counters.sequences_added = sat_add(self._counters.sequences_added, 1)
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
            key = seq_key(seq_id)
            if key not in self._group.tables or not self._lock.defer(_remove_deferred, (self, key)):
                raise KeyError(f"unknown sequence id {seq_id!r}") from None
            return
        cdef PageGroup group
        self._lock.acquire()
        try:
            table = self._group.table(seq_id)
            key = seq_key(seq_id)
            for group in self._groups:
                table = group.tables[key]
                with nogil:
                    self._seals.seal_table(table)  # removal declares the stored K/V complete
                table.drop_tail(0)
                del group.tables[key]
        finally:
            self._lock.leave()
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
        cdef PageGroup group
        cdef list children = []
        self._lock.acquire()
        try:
            parent = self._group.table(parent_id, "parent_id")
            if key in self._group.tables:
                raise ValueError(f"Invalid value of child_id: sequence {key} already exists")
            parent_key = seq_key(parent_id, "parent_id")
            try:
                for group in self._groups:
                    parent = group.tables[parent_key]
                    child = group.new_table()
                    child.copy_from(parent)  # all or nothing per table
                    child.num_sealed = parent.num_sealed
                    children.append(child)
            except ValueError:
                for child in children:  # shared pages keep a reference: nothing is freed
                    child.drop_tail(0)
                raise
            for group, child in zip(self._groups, children):
                group.tables[key] = child
            self._counters.sequences_added = sat_add(self._counters.sequences_added, 1)
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
            ``new_len`` out of range, or with a window (in any page group:
            all are checked before any changes), the query at position
            ``new_len`` would need keys the window already released, or the
            window's ring would have to move back onto a released page (a
            window of 1 needs no cached key, yet only lengths inside the sink
            pages or from the first held window page's start + W - 1 on are
            allowed; the message names them).
        """
        cdef PageTable table
        cdef PageGroup group
        cdef int64_t n
        self._lock.acquire()
        try:
            table = self._group.table(seq_id)
            n = check_int(new_len, "new_len", 0, table.length)
            key = seq_key(seq_id)
            for group in self._groups:  # every group's window allows it before any changes
                (<PageTable>group.tables[key]).check_truncate(n)
            for group in self._groups:
                table = group.tables[key]
                table.drop_tail(n)
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
            table = self._group.table(seq_id)
            return table.length
        finally:
            self._lock.leave()

    def num_cached_tokens(self, seq_id, *, group=None):
        """Tokens of a sequence stored in pages it still holds.

        Parameters
        ----------
        seq_id : int
        group : int, optional
            The page group whose pages count, ``0 <= group < num_groups``;
            required with more than one group, optional (0) with one.

        Raises
        ------
        KeyError
            Unknown ``seq_id``.
        ValueError
            ``group`` missing with more than one page group.
        IndexError
            ``group`` out of range.
        """
        cdef PageTable table
        cdef PageGroup chosen = self._group
        if group is not None:
            chosen = self._groups[check_index(group, "group", self.num_groups)]
        elif self.num_groups != 1:
            raise ValueError(f"Invalid value of group: expected the page group whose pages count, 0 <= group < "
                             f"{self.num_groups} (see layer_group), got None")
        self._lock.acquire()
        try:
            table = chosen.table(seq_id)
            return cached_tokens(table)
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
            when ``return_slot_mapping`` is False. With more than one page
            group, shape ``[num_groups, sum(num_tokens)]``: row ``g`` holds
            the slots in group ``g``'s pages (pass the whole array or the
            layer's row to :meth:`store`).

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
            and copy-on-write copies) in every page group, counting the pages
            this call's own windows release free. The message names the tokens
            and pages asked for and the pages free. Nothing changed, in any
            group.

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
        cdef Py_ssize_t num_cow = 0, i
        # No call can place more tokens than every page of the pool plus the free
        # room of each sequence's last page: refuse early, before sizing any output.
        # Sequences with room hold their last page, so at most num_pages have
        # room: most <= 2 * (2**31 - 2) * 2**20 < 2**53.
        cdef int64_t most = (<int64_t>self.pool.num_pages + min(<int64_t>batch, <int64_t>self.pool.num_pages)) * self.page_size
        for i in range(batch):
            if count_view[i] < 0:
                raise ValueError(f"Invalid value of num_tokens: expected counts >= 0, got {count_view[i]}")
            if count_view[i] > most - total:
                text = self._over_pool_text(seq_ids, counts)  # ValueError first for a negative count
                self._counters.out_of_pages = sat_add(self._counters.out_of_pages, 1)
                raise OutOfPagesError(text)
            total += count_view[i]
        cdef object ids = None
        if token_ids is not None:
            ids = as_int_array(token_ids, "token_ids", np.int32)
            if ids.shape[0] != total:
                raise ValueError(
                    f"Invalid shape of token_ids: expected ({total},) = sum(num_tokens), got ({ids.shape[0]},)"
                )
        if self.num_groups != 1:
            return self._append_groups(seq_ids, counts, total, want_slots, ids)
        cdef list tables
        cdef int32_t* cow = NULL  # copy-on-write pairs: sources, then destinations
        cdef Py_ssize_t num_seals = 0
        self._lock.acquire()
        try:
            tables = self._group.tables_for(seq_ids)
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
                self._prefix.reserve_tokens(tables, count_view)  # now: nothing may fail after the reserve
            slots = np.empty(total, dtype=np.int64) if want_slots else None
            cow = <int32_t*>malloc(2 * (batch + 1) * sizeof(int32_t))
            if cow == NULL:
                raise MemoryError()
            first_positions = [(<PageTable>t).length for t in tables] if self._prefix is not None else None
            num_seals = self._seals.list_seals(tables, count_view)  # the seal moment: see seal()
            try:
                self._group.reserve(tables, count_view, <slot_t*>cnp.PyArray_DATA(slots) if want_slots else NULL,
                                    cow, cow + batch + 1, &num_cow)
                self._seals.after_append(tables, count_view, num_seals)  # before copies overwrite pages
                with nogil:
                    self._store.copy_pages(cow, cow + batch + 1, num_cow)
            except OutOfPagesError:
                self._counters.out_of_pages = sat_add(self._counters.out_of_pages, 1)
                raise
            finally:
                free(cow)
            note_usage(&self._counters, self.pool)
            self._counters.tokens_appended = sat_add(self._counters.tokens_appended, total)
            if self._prefix is not None:
                self._prefix.record_tokens(tables, first_positions, count_view, ids)
                for i in range(batch):
                    self._prefix.register_full_pages(<PageTable>tables[i])
        finally:
            self._lock.leave()
        self._offload_sealed()
        return slots

    cdef object _append_groups(self, object seq_ids, object counts, int64_t total, bint want_slots, object ids):
        """append for a cache with more than one page group (arguments checked by append).

        One ``append_batch`` over the tables of every group (group 0's, then
        group 1's, ...) with the counts repeated per group: one plan over the
        one pool, so the append is all or nothing across groups, pages one
        group's window releases serve another, and the slots come out as the
        rows of a ``(num_groups, total)`` array. With prefix caching every
        group's chain records ``ids`` and registers the pages that filled.
        """
        cdef Py_ssize_t batch = counts.shape[0], num_groups = self.num_groups, i
        cdef Py_ssize_t num_cow = 0, num_seals = 0, num_tables = batch * num_groups
        cdef list tables
        cdef object slots = None
        cdef const int64_t* count_view
        cdef page_id_t* cow_pairs
        self._lock.acquire()
        try:
            tables = self._tables_of_groups(seq_ids)
            if len(tables) != num_tables:
                raise ValueError(f"Invalid shape of num_tokens: expected ({len(tables) // num_groups},) to match "
                                 f"seq_ids, got ({batch},)")
            counts = np.tile(counts, num_groups)
            count_view = <const int64_t*>cnp.PyArray_DATA(counts)
            for i in range(batch):
                if count_view[i] > MAX_POSITION - (<PageTable>tables[i]).length:
                    raise ValueError(
                        f"Invalid value of num_tokens: the sequence at index {i} would pass 2**62 "
                        f"tokens, the length limit of a sequence; got {count_view[i]} more after "
                        f"{(<PageTable>tables[i]).length}"
                    )
            if self._prefix is not None:
                if ids is not None:
                    ids = np.tile(ids, num_groups)  # in table order: every group's tables take the same tokens
                    self._prefix.reserve_tokens(tables, count_view)  # now: nothing may fail after the reserve
                first_positions = [(<PageTable>t).length for t in tables]
            if want_slots:
                slots = np.empty((num_groups, total), dtype=np.int64)
            cow = np.empty(2 * (num_tables + 1), dtype=np.int32)  # copy-on-write pairs: sources, then destinations
            num_seals = self._seals.list_seals(tables, count_view)  # the seal moment: see seal()
            try:
                self._group.reserve(tables, count_view,
                                    <slot_t*>cnp.PyArray_DATA(slots) if want_slots else NULL,
                                    <page_id_t*>cnp.PyArray_DATA(cow),
                                    <page_id_t*>cnp.PyArray_DATA(cow) + num_tables + 1, &num_cow)
            except OutOfPagesError:
                self._counters.out_of_pages = sat_add(self._counters.out_of_pages, 1)
                raise OutOfPagesError(self._groups_out_of_pages_text(tables, counts, total, batch)) from None
            self._seals.after_append(tables, count_view, num_seals)  # before copies overwrite pages
            cow_pairs = <page_id_t*>cnp.PyArray_DATA(cow)
            with nogil:
                self._store.copy_pages(cow_pairs, cow_pairs + num_tables + 1, num_cow)
            note_usage(&self._counters, self.pool)
            self._counters.tokens_appended = sat_add(self._counters.tokens_appended, total)
            if self._prefix is not None:
                self._prefix.record_tokens(tables, first_positions, count_view, ids)
                for i in range(num_tables):
                    self._prefix.register_full_pages(<PageTable>tables[i])
        finally:
            self._lock.leave()
        return slots

    cdef str _groups_out_of_pages_text(self, list tables, object counts, int64_t total, Py_ssize_t batch):
        """Message of the OutOfPagesError of an append to every page group (nothing changed yet)."""
        needed, available = pages_needed_for(self.pool, tables, <const int64_t*>cnp.PyArray_DATA(counts))
        num_seqs = int(np.count_nonzero(counts[:batch]))
        free_pages = self.pool.q.num_free
        return (f"Cannot append {total} token{'s' if total != 1 else ''} to {num_seqs} "
                f"sequence{'s' if num_seqs != 1 else ''}: the cache's {self.num_groups} page groups need "
                f"{needed} new pages of {self.page_size} tokens in all (copy-on-write copies included), but only "
                f"{free_pages} of the {self.pool.num_pages} pages are free, plus {available - free_pages} that "
                f"the windows release in this call. Nothing was changed. Free pages by removing or truncating "
                f"sequences (remove_sequence, truncate), append fewer tokens per call, or create the cache with "
                f"num_pages >= {self.pool.num_pages + needed - available}.")

    cdef str _over_pool_text(self, object seq_ids, object counts):
        """Message of append's OutOfPagesError for a call larger than the whole pool (see PageGroup)."""
        negative = np.flatnonzero(counts < 0)
        if negative.size:  # the count error comes first, as it would without the overflow
            raise ValueError(f"Invalid value of num_tokens: expected counts >= 0, got {counts[negative[0]]}")
        self._lock.acquire()
        try:
            tables = self._group.tables_for(seq_ids)
            if len(tables) != counts.shape[0]:
                raise ValueError(f"Invalid shape of num_tokens: expected ({len(tables)},) to match seq_ids, "
                                 f"got ({counts.shape[0]},)")
            text = self._group.over_pool_text(tables, counts)
            if self.num_groups != 1:
                text += (f" (Counted for page group 0 alone: each of the cache's {self.num_groups} page groups "
                         f"takes pages of its own from the pool.)")
            return text
        finally:
            self._lock.leave()

    def store(self, layer, slot_mapping, k, v, *, bfloat16_bits=False):
        """Scatter K and V of new tokens into their slots (no GIL held while copying).

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        slot_mapping : numpy.ndarray or sequence of int, shape ``[T]``
            Slots from :meth:`append`; -1 marks padding (the token is skipped).
            With more than one page group: the whole int64 ndarray of shape
            ``[num_groups, T]`` that :meth:`append` returned (the layer's row
            is taken from it); a 1-D row is refused, as a row of another
            group would write another layer's K/V.
        k, v : array-like of real numbers, shape ``[T, num_kv_heads, head_dim]``
            float16, float32, float64 or integers, ndarray or nested lists;
            converted to the pool dtype when they differ (see *Array
            arguments* in the class docstring). A cache whose page format
            encodes (:attr:`kv_dtype` bfloat16, int8, int4) reads float32,
            float16 and bfloat16 rows as they are and encodes each head
            row (bfloat16: rounded to nearest even; int8 and int4: see
            :class:`KVCache`, *Page formats*). bfloat16 rows are an ndarray
            whose dtype is named ``bfloat16`` (``ml_dtypes``), or uint16
            bit patterns with ``bfloat16_bits=True``.
        bfloat16_bits : bool
            ``k`` and ``v`` are uint16 (or int16) arrays of bfloat16 bit
            patterns, e.g. ``tensor.view(torch.int16).numpy()`` of a
            bfloat16 torch tensor (NumPy has no bfloat16 type).

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
        cdef int64_t slot_index = layer_index  # the layer's slot on axis 0 of the pool
        if self.num_groups != 1:
            if not isinstance(slot_mapping, np.ndarray) or slot_mapping.ndim != 2 \
                    or slot_mapping.shape[0] != self.num_groups:
                shape = slot_mapping.shape if isinstance(slot_mapping, np.ndarray) else type(slot_mapping).__name__
                raise ValueError(f"Invalid shape of slot_mapping: expected the ({self.num_groups}, T) array that "
                                 f"append returned, one row per page group (the layer's row is taken from it), "
                                 f"got {shape}")
            slot_mapping = slot_mapping[self._layer_group[layer_index]]
            slot_index = self._layer_slot[layer_index]
        cdef object slots = as_int_array(slot_mapping, "slot_mapping", np.int64)
        cdef Py_ssize_t num_tokens = slots.shape[0]
        shape = (num_tokens, self.num_kv_heads, self.head_dim)
        check_bool(bfloat16_bits, "bfloat16_bits")
        input_kind, keys, values = _rows_to_store(k, v, shape, self._kv_dtype, bfloat16_bits)
        cdef int32_t kind = input_kind
        cdef const int64_t* slot_view = <const int64_t*>cnp.PyArray_DATA(slots)
        cdef const char* key_data = <const char*>cnp.PyArray_DATA(keys)
        cdef const char* value_data = <const char*>cnp.PyArray_DATA(values)
        cdef int64_t num_slots = <int64_t>self.pool.num_pages * self.page_size
        cdef Py_ssize_t t, bad = -1
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
        self._lock.acquire()
        with nogil:  # no Python code runs here, so no finalizer can queue a deferred call
            self._store.store_rows(slot_index, slot_view, num_tokens, key_data, value_data, kind)
        self._lock.leave()

    def gather(self, layer, seq_id, *, dtype=None):
        """Copy out the cached tokens of one sequence in position order.

        Parameters
        ----------
        layer : int
            Layer index, ``0 <= layer < num_layers``.
        seq_id : int
        dtype : numpy dtype or "bfloat16", optional
            Element type of the rows returned: float32, float16, or
            ``"bfloat16"`` (uint16 bit patterns). Default: the pool's dtype
            for float16 and float32 pages, float32 for the other formats,
            whose rows are decoded (int8 and int4: dequantized, and the
            rotation of a rotated format undone).

        Returns
        -------
        k, v : numpy.ndarray
            ``dtype``, shape ``[n, num_kv_heads, head_dim]``: the rows the
            layer's page group holds (keys its window released are gone).
        positions : numpy.ndarray
            int64, shape ``[n]``: the token position of each row, increasing.

        Raises
        ------
        IndexError
            ``layer`` out of range.
        KeyError
            Unknown ``seq_id``.
        TypeError
            ``dtype`` not float32, float16 or "bfloat16".
        """
        cdef int64_t layer_index = check_index(layer, "layer", self.num_layers)
        cdef int32_t output_kind
        if dtype is None:
            output_kind = ROW_KINDS.index(self._kv_dtype) if self._kv_dtype in ("float32", "float16") else 0
        elif isinstance(dtype, str) and dtype == "bfloat16":
            output_kind = 2
        else:
            output_kind = 0 if check_pool_dtype(dtype, "dtype", _SUPPORTED_DTYPES) == np.float32 else 1
        out_dtype = (np.float32, np.float16, np.uint16)[output_kind]
        cdef PageTable table
        cdef Py_ssize_t num_pages, n
        cdef PageGroup group = self._group
        if self.num_groups != 1:
            group = self._groups[self._layer_group[layer_index]]
            layer_index = self._layer_slot[layer_index]  # the layer's slot on the pool's axis 0
        self._lock.acquire()
        try:
            table = group.table(seq_id)
            num_pages = table.num_held()
            n = cached_tokens(table)
            page_ids = np.empty(num_pages, dtype=np.int32)
            firsts = np.empty(num_pages, dtype=np.int64)
            table.export(<page_id_t*>cnp.PyArray_DATA(page_ids), <pos_t*>cnp.PyArray_DATA(firsts))
            shape = (n, self.num_kv_heads, self.head_dim)
            keys = np.empty(shape, dtype=out_dtype)
            values = np.empty(shape, dtype=out_dtype)
            positions = np.empty(n, dtype=np.int64)
            self._gather_rows(layer_index, page_ids, firsts, num_pages, table.length, keys, values, positions,
                              output_kind)
        finally:
            self._lock.leave()
        return keys, values, positions

    cdef int _gather_rows(self, int64_t layer, int32_t[::1] page_ids, int64_t[::1] firsts, Py_ssize_t num_pages,
                          int64_t length, object keys, object values, int64_t[::1] positions,
                          int32_t output_kind) except -1:
        """Run the store's gather loop without the GIL over the arrays gather made (``num_pages >= 0`` of them)."""
        cdef char* key_out = <char*>cnp.PyArray_DATA(keys)
        cdef char* value_out = <char*>cnp.PyArray_DATA(values)
        if num_pages == 0:
            return 0
        with nogil:
            self._store.gather_rows(layer, &page_ids[0], &firsts[0], num_pages, length, key_out, value_out,
                                    &positions[0], output_kind)
        return 0

    def page_table(self, seq_ids, *, group=None):
        """Export the page tables of a batch in FlashInfer's CSR form.

        Parameters
        ----------
        seq_ids : sequence of int, shape ``[B]``
            Known sequence ids (repeats allowed).
        group : int, optional
            The page group whose tables to export, ``0 <= group <
            num_groups``; required with more than one group (see
            :meth:`layer_group`), optional (0) with one.

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
            ``indptr``; nothing is allocated. ``group`` missing with more
            than one page group.
        IndexError
            ``group`` out of range.
        """
        cdef object ids = as_int_array(seq_ids, "seq_ids", np.int64)
        cdef PageGroup chosen = self._group
        if group is not None:
            chosen = self._groups[check_index(group, "group", self.num_groups)]
        elif self.num_groups != 1:
            raise ValueError(f"Invalid value of group: expected the page group to export, 0 <= group < "
                             f"{self.num_groups} (see layer_group), got None")
        self._lock.acquire()
        try:
            return chosen.view([chosen.table(seq_id) for seq_id in ids.tolist()])
        finally:
            self._lock.leave()

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
            ``pages_in_use``, ``pages_free``, ``pages_peak`` (pages, every
            page group's);
            ``evictions`` (page-table entries released by the window);
            ``cow_copies`` (pages copied on write); ``bytes_per_page`` (bytes
            of one page id across the layers it spans, K and V: all layers,
            or a page group's with more than one); ``bytes_in_use``;
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
        cdef int64_t page_bytes = self._store.num_layers * self._store.page_bytes
        cdef int64_t evictions = 0, cow_copies = 0
        cdef PageGroup group
        for group in self._groups:
            evictions = sat_add(evictions, group.evictions)
            cow_copies = sat_add(cow_copies, group.cow_copies)
        self._lock.acquire()
        try:
            in_use = self.pool.num_pages - self.pool.q.num_free
            extra = self._prefix.stats(with_metrics) if self._prefix is not None else {}
            if self._tier is not None:
                extra["tier_hits"] = self._tier.hits
                extra |= {f"tier_{name}": value for name, value in self._tier.tier.stats().items()}
            if self._prefix is not None:
                extra |= self._prefix.event_stats()
            return {
                "pages_in_use": in_use,
                "pages_free": self.pool.q.num_free,
                "pages_peak": self._counters.pages_peak,
                "evictions": evictions,
                "cow_copies": cow_copies,
                "bytes_per_page": page_bytes,
                "bytes_in_use": in_use * page_bytes,
                "num_sequences": len(self._group.tables),
                "tokens_appended": self._counters.tokens_appended,
                "num_pages": self.pool.num_pages,
                "pages_allocated": self.pool.num_taken,
                "ring_reuses": self.pool.num_reused_in_place,
                "sequences_added": self._counters.sequences_added,
            } | extra | ({"out_of_pages_errors": self._counters.out_of_pages} if with_metrics else {})
        finally:
            self._lock.leave()

    def check_invariants(self):
        """Verify every unit of the cache; raise AssertionError naming what is wrong.

        Checks the PagePool invariants; each table's geometry (sink pages,
        one run of window pages, the page of the last token held, the ring
        bound), in every page group; that every group has the same sequences
        and lengths and no page is held by two groups; that every page's ref
        count equals the number of page-table entries (of all groups)
        referring to it and free pages are unreferenced; the prefix index
        (with page groups also against every group: each held cached page is
        indexed under its own group's chain, and a sequence's chains share one
        salt digest); and that no unsealed page keeps a recorded checksum.
        """
        cdef PageGroup group
        cdef PageTable table
        self._lock.acquire()
        try:
            self.pool.check_invariants()
            counts = np.zeros(self.pool.num_pages, dtype=np.int64)
            if self.num_groups == 1:
                self._group.count_references(counts)
            else:
                owner = np.full(self.pool.num_pages, -1, dtype=np.int64)
                lengths = {key: table.length for key, table in self._group.tables.items()}
                for g, group in enumerate(self._groups):
                    if list(group.tables) != list(lengths):
                        raise AssertionError(f"page group {g}: sequences {list(group.tables)}, group 0 has "
                                             f"{list(lengths)}")
                    for key, table in group.tables.items():
                        if table.length != lengths[key]:
                            raise AssertionError(f"sequence {key}: length {table.length} in page group {g}, "
                                                 f"{lengths[key]} in group 0")
                    mine = np.zeros(self.pool.num_pages, dtype=np.int64)
                    group.count_references(mine)
                    held = np.flatnonzero(mine)
                    shared = held[owner[held] >= 0]
                    if shared.size:
                        p = int(shared[0])
                        raise AssertionError(f"page {p}: held by page groups {int(owner[p])} and {g}")
                    owner[held] = g
                    counts += mine
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
                self._prefix.index.check_invariants()
                if self.num_groups != 1:  # the index against every group's chains
                    index_state = self._prefix.index._export_state()
                    try:
                        self._prefix.check_groups(
                            [{key: (table, table._export_state()) for key, table in group.tables.items()}
                             for group in self._groups], index_state)
                    except ValueError as exc:
                        raise AssertionError(str(exc)) from None
            self._seals.check_invariants()
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
        return self._prefix is not None and self._prefix.events is not None

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
        if not self.kv_events_enabled:
            raise RuntimeError("this KVCache records no KV events: create it with enable_kv_events=True")
        self._lock.acquire()
        try:
            return self._prefix.events.take()
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
        self._lock.acquire()
        try:
            return True if self._prefix is None else self._prefix.reset()
        finally:
            self._lock.leave()

    def __repr__(self):
        if self._layer_attention is not None:
            return (f"KVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
                    f"head_dim={self.head_dim}, num_pages={self.pool.num_pages}, page_size={self.page_size}, "
                    f"kv_dtype={self._kv_dtype!r}, num_groups={self.num_groups}, "
                    f"layer_attention={list(self._layer_attention)})")
        return (f"KVCache(num_layers={self.num_layers}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, num_pages={self.pool.num_pages}, page_size={self.page_size}, "
                f"kv_dtype={self._kv_dtype!r}, window={self._window}, sink_tokens={self.sink_tokens})")

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
        ValueError
            The cache has more than one page group (not supported with
            per-layer attention settings).
        """
        self._refuse_groups("export_sequence")
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
            ``seq_id`` already exists, or the cache has more than one page
            group (not supported with per-layer attention settings).
        TypeError
            ``extra_key`` is not a str, bytes, int or None.
        """
        self._refuse_groups("import_sequence")
        from pagedkv.snapshot import import_sequence
        import_sequence(self, seq_id, data, extra_key=extra_key)

    # --------------------------------------------------- state export / restore
    # Snapshots (pagedkv.snapshot) write and read these plain values (see _kv_state);
    # the K/V bytes are the pool array itself.
    def _config(self):
        """The construction arguments (a dict of ints and strs; window -1 = None).

        ``layer_attention`` is None or a tuple of ``(window, sink_tokens,
        chunk_size)`` per layer (-1 = None); with it, ``window`` is -1 and
        ``sink_tokens`` 0.
        """
        return {
            "num_layers": int(self.num_layers), "num_kv_heads": int(self.num_kv_heads),
            "head_dim": int(self.head_dim), "num_pages": int(self.pool.num_pages),
            "page_size": int(self.page_size), "dtype": self._kv_dtype,
            "window": -1 if self._window is None or self._layer_attention is not None else int(self._window),
            "sink_tokens": int(self.sink_tokens) if self._layer_attention is None else 0,
            "prefix_caching": int(self._prefix is not None),
            "prefix_hash": self._prefix.index.algorithm_name if self._prefix is not None else "xxh3_128",
            "page_checksums": int(self._seals.checksums != NULL),
            "layer_attention": None if self._layer_attention is None else tuple(
                (-1 if a.window is None else a.window, a.sink_tokens, -1 if a.chunk_size is None else a.chunk_size)
                for a in self._layer_attention),
        }

    def _export_state(self):
        """Everything but the K/V bytes, as plain NumPy arrays and ints.

        See ``pagedkv_c._kv_state.state_of`` for the arguments, the result and the errors.
        """
        self._lock.acquire()
        try:
            return state_of(self.pool, self._groups, self._prefix, &self._counters, self._config())
        finally:
            self._lock.leave()

    def _snapshot(self, kv_out):
        """A point-in-time copy for a snapshot: state, seal state and K/V bytes from one hold of the lock.

        See ``pagedkv_c._kv_state.snapshot`` for the arguments, the result and the errors.
        """
        return snapshot(kv_out, self._store, self.pool, self._groups, self._prefix, self._seals, &self._counters,
                        self._config(), self._lock)

    def _restore_state(self, dict state):
        """Make this new, empty cache the one ``state`` (from ``_export_state``) describes.

        See ``pagedkv_c._kv_state.restore_state`` for the arguments, the result and the errors.
        """
        self._lock.acquire()
        try:
            if self._group.tables or self.pool.q.num_free != self.pool.num_pages:
                raise RuntimeError("KVCache._restore_state needs a new cache without sequences")
            restore_state(state, self.pool, self._groups, self._prefix, &self._counters, self._config())
        finally:
            self._lock.leave()

    def _adopt_pool(self, kv):
        """Use ``kv`` as the pool array of this new, empty cache (e.g. a memory map of a snapshot).

        ``kv`` must have the pool's dtype and shape, be C-contiguous,
        aligned and writeable (a copy-on-write map is). Raises ValueError
        naming what differs, RuntimeError when the cache has sequences.
        """
        if not isinstance(kv, np.ndarray):
            raise TypeError(f"Invalid type of kv: expected a numpy.ndarray, got {type(kv).__name__}")
        pool = self._store.kv
        if kv.dtype != pool.dtype or kv.shape != pool.shape:
            raise ValueError(f"Invalid shape of kv: expected {pool.dtype} {pool.shape}, got {kv.dtype} {kv.shape}")
        if not (kv.flags.c_contiguous and kv.flags.aligned and kv.flags.writeable):
            raise ValueError("Invalid layout of kv: expected a C-contiguous, aligned, writeable array")
        self._lock.acquire()
        try:
            if self._group.tables:
                raise RuntimeError("KVCache._adopt_pool needs a cache without sequences")
            self._store.adopt(kv)
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

        See ``pagedkv_c._kv_state.export_sequence`` for the arguments, the result and the errors.
        """
        self._refuse_groups("export_sequence")
        self._lock.acquire()
        try:
            return _kv_state.export_sequence(self._group.table(seq_id), self._store)
        finally:
            self._lock.leave()

    def _import_sequence_state(self, seq_id, dict table_state, hash_state, kv, extra_key=None):
        """Add ``seq_id`` from an exported sequence, in pages taken from the free queue.

        See ``pagedkv_c._kv_state.import_sequence`` for the arguments, the result and the errors.
        """
        self._refuse_groups("import_sequence")
        _kv_state.import_sequence(seq_id, table_state, hash_state, kv, extra_key, self.pool, self._group,
                                  self._prefix, self._seals, self._store, &self._counters, self._lock)

    # ---------------------------------------------------------- sealed pages
    @property
    def page_checksums_enabled(self):
        """True when the cache records a checksum for each sealed page (``page_checksums=True``)."""
        return self._seals.checksums != NULL

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
        cdef PageGroup group
        self._lock.acquire()
        try:
            if seq_ids is not None:
                tables = self._tables_of_groups(seq_ids)
            else:
                tables = [pair[1] for pair in self._all_tables()]
            for table in tables:
                with nogil:
                    n += self._seals.seal_table(table)
        finally:
            self._lock.leave()
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
        if self._seals.checksums == NULL:
            raise RuntimeError(
                "verify_pages needs recorded checksums: create the cache with KVCache(..., page_checksums=True)"
            )
        self._lock.acquire()
        try:
            held = None if seq_ids is None else [table.pages()[0] for table in self._tables_of_groups(seq_ids)]
            return self._seals.verify(held, self._all_tables())
        finally:
            self._lock.leave()

    def _enable_sealed_log(self, enabled, capacity=4096):
        """Start or stop logging sealed pages for a consumer that copies them out (internal: the shared tier).

        See ``pagedkv_c._seals.SealTracker.enable_log`` for the arguments, the result and the errors.
        """
        if not isinstance(enabled, (bool, np.bool_)):
            raise TypeError(f"Invalid type of enabled: expected a bool, got {type(enabled).__name__}")
        self._refuse_groups("the sealed-page log")
        cdef int64_t entries = check_int(capacity, "capacity", 1, 2**24)
        self._lock.acquire()
        try:
            self._seals.enable_log(bool(enabled), entries)
        finally:
            self._lock.leave()

    def _take_sealed_pages(self):
        """The pages sealed since the last call, in seal order, and empty the log (internal: the shared tier).

        See ``pagedkv_c._seals.SealTracker.take_pages`` for the arguments, the result and the errors.
        """
        self._lock.acquire()
        try:
            return self._seals.take_pages()
        finally:
            self._lock.leave()

    def _sealed_log_stats(self):
        """Counters of the sealed-page log (internal: the shared tier's metrics).

        See ``pagedkv_c._seals.SealTracker.log_stats`` for the arguments, the result and the errors.
        """
        self._lock.acquire()
        try:
            return self._seals.log_stats()
        finally:
            self._lock.leave()

    def _sealed_state(self):
        """Copies of the per-page seal flags and checksums (internal: snapshots).

        See ``pagedkv_c._seals.SealTracker.state`` for the arguments, the result and the errors.
        """
        self._lock.acquire()
        try:
            return self._seals.state()
        finally:
            self._lock.leave()

    def _restore_sealed_state(self, sealed, checksums=None, pages_sealed=0):
        """Set the per-page seal flags and checksums from :meth:`_sealed_state` (internal: snapshots).

        See ``pagedkv_c._seals.SealTracker.checked_state`` for the arguments, the result and the errors.
        """
        cdef PageGroup group
        cdef PageTable table
        checked = self._seals.checked_state(sealed, checksums, pages_sealed)
        self._lock.acquire()
        try:
            self._seals.apply_state(checked, self._group.tables)
            for group in self._groups[1:]:
                for table in group.tables.values():
                    table.num_sealed = 0  # the flags no longer follow from this table's history
        finally:
            self._lock.leave()

    def _take_sealed_copies(self, records, Py_ssize_t token_offset, Py_ssize_t body_offset, page_hashes,
                            bint discard_rest=False):
        """Take sealed pages from the log and copy them out, in one hold of the lock (internal: the shared tier).

        See ``pagedkv_c._seals.SealTracker.take_copies`` for the arguments, the result and the errors.
        """
        rows, hashes = self._seals.checked_copy_targets(records, token_offset, body_offset, page_hashes)
        self._lock.acquire()
        try:
            return self._seals.take_copies(rows, hashes, token_offset, body_offset, discard_rest)
        finally:
            self._lock.leave()


def _remove_deferred(tuple cache_and_key):
    """Remove a sequence whose removal a re-entrant remove_sequence deferred (under the lock)."""
    cdef KVCache cache = cache_and_key[0]
    cdef PageGroup group
    cdef PageTable table
    if cache_and_key[1] not in cache._group.tables:  # the running call may have removed it already
        return
    for group in cache._groups:
        table = group.tables[cache_and_key[1]]
        cache._seals.seal_table(table)
        table.drop_tail(0)
        del group.tables[cache_and_key[1]]


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
