"""Paged attention over the KV pool: validation, work items, OpenMP dispatch.

The arithmetic lives in ``attention_kernels.c`` (one work item = the queries
of a block of KV-head groups of one sequence, each group computed on its own);
this module checks every argument, builds the work items and runs them with
``prange``. Each output element is produced by exactly one work item on one
thread (or, for a split decode, by a fixed-order merge of the partition
results of fixed items), with arithmetic that does not depend on how heads
are grouped, so results do not depend on the number of threads.
"""
import math
import numbers
import os
import warnings

import numpy as np

cimport numpy as cnp
from cython.parallel cimport prange, threadid
from libc.stdint cimport int32_t, int64_t, uint16_t
from cpython.pyport cimport PY_SSIZE_T_MAX
from libc.stdlib cimport malloc, free

from pagedkv_c._checks cimport check_int, check_index, check_array, check_float_array, as_int_array

cnp.import_array()


cdef extern from "attention_kernels.h" nogil:
    enum: PKV_MAX_HEAD_DIM
    enum: PKV_MAX_ITEM_HEADS
    ctypedef enum pkv_isa:
        PKV_ISA_SCALAR
        PKV_ISA_AVX2
        PKV_ISA_AVX512
    ctypedef struct pkv_attention_args:
        const void* pool
        int32_t format
        int64_t page_size
        int64_t num_kv_heads
        int64_t head_dim
        int64_t group_size
        const int32_t* indptr
        const int32_t* indices
        const int64_t* page_positions
        const int64_t* seq_lens
        int64_t window
        int64_t sink_tokens
        int64_t chunk_size
        float scale
        float softcap
        const float* sink_logits
        const float* q
        const float* q_sink
        float* out
        float* lse
        float* part_acc
        float* part_max
        float* part_sum
    ctypedef struct pkv_work_item:
        int64_t seq
        int64_t kv_head
        int64_t num_kv_heads
        int64_t first_token
        int64_t num_tokens
        int64_t first_position
        int64_t first_page
        int64_t end_page
        int64_t partial
    ctypedef void (*pkv_item_kernel)(const pkv_attention_args* args,
                                     const pkv_work_item* item, const pkv_work_item* next,
                                     float* scratch) noexcept nogil
    int64_t pkv_scratch_floats(int64_t max_rows, int64_t head_dim)
    pkv_isa pkv_best_isa()
    int pkv_isa_available(pkv_isa isa)
    const char* pkv_isa_name(pkv_isa isa)
    int pkv_int8_integer_scores(pkv_isa isa)
    pkv_item_kernel pkv_get_kernel(pkv_isa isa, int format)
    void pkv_merge_partitions(const pkv_attention_args* args, int64_t token, int64_t head,
                              int64_t first_partial, int64_t num_partials)
    void pkv_tanh_array(pkv_isa isa, const float* x, float* y, int64_t n)


cdef extern from "page_formats.h" nogil:
    int64_t pkv_row_bytes(int fmt, int64_t head_dim)
    float pkv_fmt_h2f(uint16_t h)  # the portable float16 -> float32 conversion of kernels and pages


cdef extern from *:
    """
    #if defined(_OPENMP)
    #include <omp.h>
    static int pkv_omp_max_threads(void) { return omp_get_max_threads(); }
    static int pkv_have_openmp(void) { return 1; }
    #else
    static int pkv_omp_max_threads(void) { return 1; }
    static int pkv_have_openmp(void) { return 0; }
    #endif
    """
    int pkv_omp_max_threads() nogil
    int pkv_have_openmp() nogil


# Rows (query, head pairs) per prefill work item: enough to reuse each K/V row
# many times while the accumulators stay in L1.
cdef int64_t PREFILL_ROWS = 16
_MAX_THREADS_ARG = 1024
# Most query heads (bounds the per-thread scratch, which grows with the GQA group).
_MAX_QO_HEADS = 2**20
# Largest |scale|: the kernels compute scale * log2(e) in float32 (max 3.4e38).
_MAX_SCALE = 1e38
# Smallest softcap: float32's normal range (about 1.2e-38), so that it never rounds to 0.
_MIN_SOFTCAP = 1e-38
# Bytes of K/V each thread should read before num_threads=None adds a thread.
cdef int64_t _BYTES_PER_THREAD = 2 * 1024 * 1024
# Split decode (Flash-Decoding): a batch of at most _SPLIT_MAX_ITEMS (sequence,
# KV head) pairs splits each sequence into as many partitions of whole pages
# as hold _PARTITION_BYTES of K/V (one layer) each, at most _MAX_PARTITIONS. The rule depends on the problem only, never on the thread count,
# so that results stay bit-identical for any num_threads. Each partition costs
# about a microsecond more than reading its pages in one pass (measured on
# Zen 4: 1 to 2 us), under 1% of a 1 MiB read; a sequence with less K/V than
# two partitions stays whole, as a call that small runs on one thread anyway
# (see _BYTES_PER_THREAD). More pairs than 64 keep the threads of a many-core
# CPU busy without a split (vLLM's paged_attention_v2 rule has the same form).
cdef int64_t _PARTITION_BYTES = 1024 * 1024
cdef int64_t _MAX_PARTITIONS = 8
cdef int64_t _SPLIT_MAX_ITEMS = 64
# Tests and benchmarks: -1 applies the rule above; 0 never splits; n > 0 splits
# every sequence into partitions of n tokens (rounded up to whole pages).
cdef int64_t _partition_tokens = -1
# Largest token position, sequence length, window and sink length: with a page
# size below 2**61 (a pool of 2 halves of 2-byte elements has < 2**63 bytes),
# positions + page_size and every window bound fit int64.
cdef int64_t MAX_POSITION = 2**62
_ISA_BY_NAME = {"scalar": PKV_ISA_SCALAR, "avx2": PKV_ISA_AVX2, "avx512": PKV_ISA_AVX512}
# Page formats (cache.kv_dtype): pkv_format of page_formats.h and the pool's dtype.
_PAGE_FORMATS = {"float32": 0, "float16": 1, "bfloat16": 2, "int8": 3, "int4": 4}
_POOL_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
                "int8": np.uint8, "int4": np.uint8}
# Formats whose pool's last axis is a packed row of bytes, not head_dim elements.
_PACKED_FORMATS = ("int8", "int4")

cdef pkv_isa _isa = PKV_ISA_SCALAR
# GNU OpenMP's thread pool does not survive fork(): a child whose parent had
# run a team of several threads hangs in its first parallel region. Once this
# process has run such a team, a child forked from it runs on one thread.
cdef bint _ran_team = False
cdef bint _forked_after_team = False


def _after_fork_in_child():
    global _forked_after_team
    if _ran_team:
        _forked_after_team = True


os.register_at_fork(after_in_child=_after_fork_in_child)


cdef pkv_isa _capped_isa(str cap):
    """Best available path not above ``cap`` (a name from _ISA_BY_NAME)."""
    cdef pkv_isa best = pkv_best_isa()
    cdef int limit = <int>_ISA_BY_NAME.get(cap, <int>best)
    cdef int i
    for i in range(min(<int>best, limit), -1, -1):
        if pkv_isa_available(<pkv_isa>i):
            return <pkv_isa>i
    return PKV_ISA_SCALAR


_isa_cap = os.environ.get("PAGEDKV_ATTENTION_ISA", "").strip().lower()
if _isa_cap and _isa_cap not in _ISA_BY_NAME:
    warnings.warn(
        f"PAGEDKV_ATTENTION_ISA={_isa_cap!r} is not one of {sorted(_ISA_BY_NAME)}; ignored",
        RuntimeWarning,
        stacklevel=2,
    )
_isa = _capped_isa(_isa_cap)


def kernel_info():
    """Describe the kernels this process uses. See ``pagedkv.attention.kernel_info``."""
    return {
        "isa": pkv_isa_name(_isa).decode(),
        "available_isas": [
            pkv_isa_name(<pkv_isa>i).decode() for i in range(3) if pkv_isa_available(<pkv_isa>i)
        ],
        "float16_conversion": "f16c" if _isa != PKV_ISA_SCALAR else "portable",
        "int8_scores": "int8 query (vnni)" if pkv_int8_integer_scores(_isa) else "float32",
        "page_formats": list(_PAGE_FORMATS),
        "openmp": bool(pkv_have_openmp()),
        "max_threads": 1 if _forked_after_team else pkv_omp_max_threads(),
        "max_head_dim": PKV_MAX_HEAD_DIM,
    }


def _set_isa(name):
    """Select the kernel path by name; returns the previous name (tests, benchmarks).

    Raises ValueError if the path is unknown or this CPU/build cannot run it.
    """
    global _isa
    if name not in _ISA_BY_NAME or not pkv_isa_available(<pkv_isa><int>_ISA_BY_NAME[name]):
        raise ValueError(
            f"Invalid value of name: expected one of {kernel_info()['available_isas']}, got {name!r}"
        )
    previous = pkv_isa_name(_isa).decode()
    _isa = <pkv_isa><int>_ISA_BY_NAME[name]
    return previous


def _set_decode_partition(tokens):
    """Set the split-decode partitions; returns the previous setting (tests, benchmarks).

    ``tokens``: None for the default rule (partitions of about 1 MiB of K/V or
    more, at most 8 per sequence, for batches of at most 64 sequence x KV head
    pairs), 0 to never split, ``n > 0`` for as many partitions as ``n`` tokens
    (rounded up to whole pages) fit in a sequence, without a limit (1:
    partitions of one page).

    Raises ValueError if ``tokens`` is neither None nor an integer in ``[0, 2**62]``.
    """
    global _partition_tokens
    previous = None if _partition_tokens < 0 else _partition_tokens
    _partition_tokens = -1 if tokens is None else check_int(tokens, "tokens", 0, MAX_POSITION)
    return previous


def _tanh(x):
    """tanh of float32 values as the selected path computes it for the softcap (tests)."""
    cdef float[::1] src = check_array(x, "x", np.float32, (-1,))
    out = np.empty(src.shape[0], dtype=np.float32)
    cdef float[::1] dst = out
    if src.shape[0] > 0:
        with nogil:
            pkv_tanh_array(_isa, &src[0], &dst[0], src.shape[0])
    return out


def _half_to_float_portable(bits):
    """Convert uint16 float16 bit patterns with the portable C conversion (tests)."""
    cdef uint16_t[::1] src = check_array(bits, "bits", np.uint16, (-1,))
    out = np.empty(src.shape[0], dtype=np.float32)
    cdef float[::1] dst = out
    cdef Py_ssize_t i
    with nogil:
        for i in range(src.shape[0]):
            dst[i] = pkv_fmt_h2f(src[i])
    return out


# --------------------------------------------------------------- C kernels

cdef int _run_items(const pkv_attention_args* args, const pkv_work_item* items,
                    Py_ssize_t num_items, int64_t max_rows, int num_threads) except -1 nogil:
    """Run work items over OpenMP threads, one scratch block per thread."""
    global _ran_team
    cdef pkv_item_kernel kernel = pkv_get_kernel(_isa, args.format)
    if _forked_after_team:
        num_threads = 1
    elif num_threads > 1:
        _ran_team = True
    # Per-thread scratch rounded to 64 bytes so threads never share a line.
    # max_rows <= max(16, Hq) <= 2**20 (Hq is checked) and head_dim <= 256,
    # so stride * num_threads (<= 1024) * 4 bytes stays below 2**43.
    cdef int64_t stride = (pkv_scratch_floats(max_rows, args.head_dim) + 15) // 16 * 16
    cdef float* scratch = <float*>malloc(<size_t>(stride * num_threads + 16) * sizeof(float))
    cdef Py_ssize_t i
    if scratch == NULL:
        with gil:
            raise MemoryError("cannot allocate attention scratch memory")
    # Threads take items in turn, so item i + num_threads is the likely next
    # one of the thread running item i: its first pages are prefetched.
    for i in prange(num_items, schedule="dynamic", num_threads=num_threads):
        kernel(args, &items[i], &items[i + num_threads] if i + num_threads < num_items else NULL,
               scratch + threadid() * stride)
    free(scratch)
    return 0


cdef void _fill_args(pkv_attention_args* args, const void* pool_layer, int page_format,
                     int64_t page_size, int64_t num_kv_heads, int64_t head_dim,
                     int64_t num_qo_heads, const int32_t* indptr, const int32_t* indices,
                     const int64_t* page_positions, const int64_t* seq_lens, int64_t window,
                     int64_t sink_tokens, int64_t chunk_size, float scale, float softcap,
                     const float* sink_logits, const float* q, const float* q_sink,
                     float* out, float* lse) noexcept nogil:
    args.pool = pool_layer
    args.format = page_format
    args.page_size = page_size
    args.num_kv_heads = num_kv_heads
    args.head_dim = head_dim
    args.group_size = num_qo_heads // num_kv_heads
    args.indptr = indptr
    args.indices = indices
    args.page_positions = page_positions
    args.seq_lens = seq_lens
    args.window = window
    args.sink_tokens = sink_tokens
    args.chunk_size = chunk_size
    args.scale = scale
    args.softcap = softcap
    args.sink_logits = sink_logits
    args.q = q
    args.q_sink = q_sink
    args.out = out
    args.lse = lse
    args.part_acc = NULL
    args.part_max = NULL
    args.part_sum = NULL


cdef int paged_decode(
    const void* pool_layer, int page_format, int64_t page_size, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_qo_heads, int64_t batch_size, const int32_t* indptr,
    const int32_t* indices, const int64_t* page_positions, const int64_t* seq_lens,
    int64_t window, int64_t sink_tokens, int64_t chunk_size, float scale, float softcap,
    const float* sink_logits, const float* q, const float* q_sink,
    float* out, float* lse, int num_threads,
) except -1 nogil:
    """One query per sequence at position seq_len - 1.

    Work item = (sequence, partition of its pages, block of KV heads). A
    sequence is one partition unless it is split (see _PARTITION_BYTES): then
    each partition of part_pages listed pages is an item of its own, and the partitions of a query row are merged afterwards
    with the log-sum-exp rescaling (Flash-Decoding, Dao et al. 2023; vLLM's
    paged_attention_v2), so that one sequence keeps every thread busy. A
    block holds all KV heads unless that leaves fewer items than threads;
    then blocks shrink down to one KV head. Reading all heads of a token row
    in one run keeps the memory stream sequential inside a page (FlashInfer's
    NHD layout puts the heads of a token next to each other). Each head's
    arithmetic is the same whatever the block size, and the partitions depend
    on the problem only, so results do not depend on num_threads.
    """
    cdef pkv_attention_args args
    _fill_args(&args, pool_layer, page_format, page_size, num_kv_heads, head_dim,
               num_qo_heads, indptr, indices, page_positions, seq_lens, window, sink_tokens,
               chunk_size, scale, softcap, sink_logits, q, q_sink, out, lse)
    if batch_size == 0:
        return 0
    # Pages per partition at least (0: no split) and partitions per sequence at most (0: any).
    cdef int64_t min_pages = 0, max_parts = 0, page_bytes
    if _partition_tokens != 0 and batch_size * num_kv_heads <= _SPLIT_MAX_ITEMS:
        if _partition_tokens > 0:
            min_pages = max((_partition_tokens + page_size - 1) // page_size, 1)
        else:
            # one page of one layer, K and V: below the pool's size, no overflow
            page_bytes = page_size * num_kv_heads * pkv_row_bytes(page_format, head_dim) * 2
            min_pages = max((_PARTITION_BYTES + page_bytes - 1) // page_bytes, 1)
            max_parts = _MAX_PARTITIONS
    cdef int64_t b, parts, part_pages, num_seq_parts = 0, num_partials = 0, num_split = 0
    for b in range(batch_size):
        part_pages = _partition_pages(indptr[b + 1] - indptr[b], min_pages, max_parts)
        parts = _partition_count(indptr[b + 1] - indptr[b], part_pages)
        num_seq_parts += parts
        if parts > 1:
            num_partials += parts
            num_split += 1
    # One item per thread at most: an item of fewer heads reads each token row in
    # pieces, which streams at half the bandwidth or less (SmolLM2's 3 KV heads: 2-3x).
    cdef int64_t wanted_blocks = (num_threads + num_seq_parts - 1) // num_seq_parts
    cdef int64_t heads_per_item = num_kv_heads
    if wanted_blocks > 1:
        heads_per_item = (num_kv_heads + wanted_blocks - 1) // wanted_blocks
    if heads_per_item > PKV_MAX_ITEM_HEADS:
        heads_per_item = PKV_MAX_ITEM_HEADS
    cdef int64_t blocks = (num_kv_heads + heads_per_item - 1) // heads_per_item
    # num_seq_parts * blocks <= nnz * Hkv <= 2**31 * 2**20: no overflow; the byte
    # sizes are checked. Partition rows: num_partials * Hq * (D + 2) floats.
    cdef Py_ssize_t num_items = num_seq_parts * blocks
    cdef int64_t part_rows = num_partials * num_qo_heads
    if (<size_t>num_items > <size_t>PY_SSIZE_T_MAX // sizeof(pkv_work_item)
            or <size_t>part_rows > <size_t>PY_SSIZE_T_MAX // ((head_dim + 2) * sizeof(float))):
        with gil:
            raise MemoryError("cannot allocate attention work items")
    cdef pkv_work_item* items = <pkv_work_item*>malloc(num_items * sizeof(pkv_work_item))
    # per split sequence: its index, first partition row and number of partitions
    cdef int64_t* split_seqs = <int64_t*>malloc(max(3 * num_split, 1) * sizeof(int64_t))
    cdef float* part_buffer = NULL
    if num_partials > 0:
        part_buffer = <float*>malloc(<size_t>part_rows * (head_dim + 2) * sizeof(float))
    if items == NULL or split_seqs == NULL or (num_partials > 0 and part_buffer == NULL):
        free(items)
        free(split_seqs)
        free(part_buffer)
        with gil:
            raise MemoryError("cannot allocate attention work items")
    if num_partials > 0:
        args.part_acc = part_buffer
        args.part_max = part_buffer + part_rows * head_dim
        args.part_sum = args.part_max + part_rows
    cdef Py_ssize_t i = 0
    cdef int64_t part, block, first_head, first_page, end_page, next_partial = 0, split = 0
    for b in range(batch_size):
        part_pages = _partition_pages(indptr[b + 1] - indptr[b], min_pages, max_parts)
        parts = _partition_count(indptr[b + 1] - indptr[b], part_pages)
        if parts > 1:
            split_seqs[3 * split] = b
            split_seqs[3 * split + 1] = next_partial
            split_seqs[3 * split + 2] = parts
            split += 1
        for part in range(parts):
            first_page = indptr[b] + part * part_pages
            end_page = indptr[b + 1] if parts == 1 else min(first_page + part_pages, <int64_t>indptr[b + 1])
            for block in range(blocks):
                first_head = block * heads_per_item
                items[i].seq = b
                items[i].kv_head = first_head
                items[i].num_kv_heads = min(heads_per_item, num_kv_heads - first_head)
                items[i].first_token = b
                items[i].num_tokens = 1
                items[i].first_position = seq_lens[b] - 1
                items[i].first_page = first_page
                items[i].end_page = end_page
                items[i].partial = -1 if parts == 1 else next_partial + part
                i += 1
        if parts > 1:
            next_partial += parts
    try:
        _run_items(&args, items, num_items, heads_per_item * args.group_size, num_threads)
        if num_split > 0:
            _merge_split_rows(&args, split_seqs, num_split, num_threads)
    finally:
        free(items)
        free(split_seqs)
        free(part_buffer)
    return 0


cdef inline int64_t _partition_pages(int64_t num_pages, int64_t min_pages, int64_t max_parts) noexcept nogil:
    """Listed pages per partition of a sequence of num_pages pages; 0: one partition, no split.

    As many partitions as min_pages fit whole in num_pages (0: never split), at
    most max_parts (0: no limit), of equal length rounded up to a page; the
    last one takes what remains. Fewer than two: no split.
    """
    if min_pages <= 0:
        return 0
    cdef int64_t parts = num_pages // min_pages
    if max_parts > 0 and parts > max_parts:
        parts = max_parts
    if parts < 2:
        return 0
    return (num_pages + parts - 1) // parts


cdef inline int64_t _partition_count(int64_t num_pages, int64_t part_pages) noexcept nogil:
    """Partitions of a sequence of num_pages pages cut every part_pages pages (0: one, no split)."""
    return 1 if part_pages == 0 else (num_pages + part_pages - 1) // part_pages


cdef int _merge_split_rows(const pkv_attention_args* args, const int64_t* split_seqs,
                           int64_t num_split, int num_threads) except -1 nogil:
    """Merge the partitions of every query row of the split sequences into out and lse.

    split_seqs holds (sequence, first partition row, partitions) triples. Each
    row is merged by one thread in a fixed order, so the result does not
    depend on num_threads; a few rows (one sequence of a small model) merge
    faster than a thread wakes.
    """
    cdef int64_t num_qo_heads = args.num_kv_heads * args.group_size
    cdef Py_ssize_t r, num_rows = num_split * num_qo_heads
    cdef int64_t s
    if _forked_after_team or num_rows * args.head_dim < 65536:
        num_threads = 1
    for r in prange(num_rows, schedule="static", num_threads=num_threads):
        s = r // num_qo_heads
        pkv_merge_partitions(args, split_seqs[3 * s], r % num_qo_heads, split_seqs[3 * s + 1],
                             split_seqs[3 * s + 2])
    return 0


cdef int paged_prefill(
    const void* pool_layer, int page_format, int64_t page_size, int64_t num_kv_heads,
    int64_t head_dim, int64_t num_qo_heads, int64_t batch_size, const int32_t* indptr,
    const int32_t* indices, const int64_t* page_positions, const int64_t* seq_lens,
    const int64_t* qo_indptr, int64_t window, int64_t sink_tokens, int64_t chunk_size,
    float scale, float softcap, const float* sink_logits,
    const float* q, const float* q_sink, float* out, float* lse, int num_threads,
) except -1 nogil:
    """Ragged causal prefill; work item = (sequence, KV head, tile of consecutive queries).

    Prefill is bound by arithmetic, not memory, so items take one KV head and
    a tile of queries (PREFILL_ROWS rows) that share every K/V row they read.
    """
    cdef pkv_attention_args args
    _fill_args(&args, pool_layer, page_format, page_size, num_kv_heads, head_dim,
               num_qo_heads, indptr, indices, page_positions, seq_lens, window, sink_tokens,
               chunk_size, scale, softcap, sink_logits, q, q_sink, out, lse)
    cdef int64_t group = args.group_size
    cdef int64_t tile = PREFILL_ROWS // group if PREFILL_ROWS // group > 1 else 1
    cdef Py_ssize_t num_items = 0
    cdef int64_t b, h, start, qo_len
    for b in range(batch_size):
        qo_len = qo_indptr[b + 1] - qo_indptr[b]
        num_items += (qo_len + tile - 1) // tile * num_kv_heads
    if num_items == 0:
        return 0
    # num_items <= 2 * T * Hkv <= 2 * q.size (only sequences with queries add
    # items): no overflow; its byte size is checked.
    if <size_t>num_items > <size_t>PY_SSIZE_T_MAX // sizeof(pkv_work_item):
        with gil:
            raise MemoryError("cannot allocate attention work items")
    cdef pkv_work_item* items = <pkv_work_item*>malloc(num_items * sizeof(pkv_work_item))
    if items == NULL:
        with gil:
            raise MemoryError("cannot allocate attention work items")
    cdef Py_ssize_t i = 0
    for b in range(batch_size):
        qo_len = qo_indptr[b + 1] - qo_indptr[b]
        start = 0
        while start < qo_len:
            for h in range(num_kv_heads):
                items[i].seq = b
                items[i].kv_head = h
                items[i].num_kv_heads = 1
                items[i].first_token = qo_indptr[b] + start
                items[i].num_tokens = tile if qo_len - start > tile else qo_len - start
                items[i].first_position = seq_lens[b] - qo_len + start
                items[i].first_page = indptr[b]
                items[i].end_page = indptr[b + 1]
                items[i].partial = -1
                i += 1
            start += tile
    try:
        _run_items(&args, items, num_items, tile * group, num_threads)
    finally:
        free(items)
    return 0


# ------------------------------------------------------------- validation

cdef str _describe(object seq_ids, Py_ssize_t b):
    try:
        return repr(seq_ids[b])
    except Exception:
        return f"at index {b}"


cdef class _Problem:
    """Validated arguments of one call, ready for the nogil kernels."""
    cdef object pool_layer       # kv[layer], C-contiguous view
    cdef int page_format         # pkv_format of the pool's head rows
    cdef int64_t page_size, num_kv_heads, head_dim, num_qo_heads, batch_size
    cdef int64_t window, sink_tokens
    cdef int64_t chunk_size      # 0: no chunk mask
    cdef float scale
    cdef float softcap           # 0: no softcap
    cdef object sink_logits      # float32 (Hq,), or None
    cdef int num_threads
    cdef bint auto_threads       # num_threads=None: choose from the amount of work
    cdef object q                # float32 C-contiguous
    cdef object q_sink           # float32 C-contiguous like q, or None
    cdef object indptr, indices, page_positions, seq_lens
    cdef int64_t num_pages


cdef _Problem _validate_common(object q, object cache, object layer, object seq_ids,
                               object scale, object num_threads, object return_lse):
    cdef _Problem p = _Problem()
    # The kernels read float32: any array-like of real numbers is converted once.
    q = check_float_array(q, "q", (-1, -1, -1), np.float32, "(tokens, Hq, D)")
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(f"Invalid type of return_lse: expected bool, got {type(return_lse).__name__}")

    cdef int64_t layer_index
    hook = getattr(cache, "layer_attention_view", None)
    if hook is not None:
        # Caches whose layers differ (per-layer windows, chunks, page groups)
        # answer for one layer: its pool, page table and mask settings.
        source = "cache.layer_attention_view(layer, seq_ids)"
        cache_layers = getattr(cache, "num_layers", None)
        if cache_layers is None:
            layer_index = check_int(layer, "layer", 0, MAX_POSITION)
        else:
            layer_index = check_index(layer, "layer", cache_layers)
        answer = hook(layer_index, seq_ids)
        if not isinstance(answer, tuple) or len(answer) != 5:
            raise TypeError(
                f"Invalid type of {source}: expected a tuple (pages, view, window, sink_tokens, "
                f"chunk_size), got {type(answer).__name__}"
                + (f" of length {len(answer)}" if isinstance(answer, tuple) else "")
            )
        pages, view, window, sink_tokens, chunk_size = answer
        pool_name = f"{source}.pages"
        pool_shape = "(num_pages, 2, page_size, num_kv_heads, head_dim)"
        pool_ndim = 5
    else:
        source = "cache"
        pages = getattr(cache, "kv", None)
        window = getattr(cache, "window", None)
        sink_tokens = getattr(cache, "sink_tokens", 0)
        chunk_size = getattr(cache, "chunk_size", None)
        pool_name = "cache.kv"
        pool_shape = "(num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)"
        pool_ndim = 6
    if not isinstance(pages, np.ndarray):
        raise TypeError(f"Invalid type of {pool_name}: expected numpy.ndarray, got {type(pages).__name__}")
    kv_dtype = getattr(cache, "kv_dtype", None)
    if kv_dtype is None:
        # no page format named: the pool's dtype is the format
        if pages.dtype != np.float32 and pages.dtype != np.float16:
            raise TypeError(f"Invalid dtype of {pool_name}: expected float16 or float32, got {pages.dtype}")
        kv_dtype = "float16" if pages.dtype == np.float16 else "float32"
    elif not isinstance(kv_dtype, str) or kv_dtype not in _PAGE_FORMATS:
        raise ValueError(f"Invalid value of cache.kv_dtype: expected one of {list(_PAGE_FORMATS)}, got {kv_dtype!r}")
    elif pages.dtype != _POOL_DTYPES[kv_dtype]:
        raise ValueError(
            f"Invalid dtype of {pool_name}: expected {np.dtype(_POOL_DTYPES[kv_dtype])} for "
            f"cache.kv_dtype={kv_dtype!r}, got {pages.dtype}"
        )
    cdef int page_format = _PAGE_FORMATS[kv_dtype]
    dims = tuple(pages.shape)
    if len(dims) != pool_ndim or dims[len(dims) - 4] != 2:
        raise ValueError(f"Invalid shape of {pool_name}: expected {pool_shape}, got {pages.shape}")
    if not pages.flags.c_contiguous:
        raise ValueError(
            f"Invalid layout of {pool_name}: expected a C-contiguous array, got strides {pages.strides}"
        )
    num_pages, page_size, num_kv_heads, head_dim = (dims[pool_ndim - 5], dims[pool_ndim - 3],
                                                    dims[pool_ndim - 2], dims[pool_ndim - 1])
    if kv_dtype in _PACKED_FORMATS:
        # the last axis holds a packed row of head_dim values: head_dim comes from q
        row_elements = head_dim
        head_dim = q.shape[2]
        if head_dim < 1 or head_dim > PKV_MAX_HEAD_DIM:
            raise ValueError(
                f"Invalid shape of q: expected (*, Hq, head_dim) with 1 <= head_dim <= {PKV_MAX_HEAD_DIM}, "
                f"got {q.shape}"
            )
        if row_elements != pkv_row_bytes(page_format, head_dim):
            raise ValueError(
                f"Invalid shape of {pool_name}: expected a last axis of {pkv_row_bytes(page_format, head_dim)} "
                f"bytes (one {kv_dtype} head row of head_dim={head_dim} values, head_dim from q.shape[2]), "
                f"got {row_elements}"
            )
    num_layers = dims[0] if pool_ndim == 6 else 1
    checked = (("page_size", page_size), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim))
    if pool_ndim == 6:
        checked = (("num_layers", num_layers),) + checked
    for name, expected in checked:
        got = getattr(cache, name, expected)
        if got != expected:
            raise ValueError(
                f"Invalid value of cache.{name}: expected {expected} (from {pool_name}.shape), got {got}"
            )
    if head_dim < 1 or head_dim > PKV_MAX_HEAD_DIM:
        raise ValueError(
            f"Invalid value of cache.head_dim: expected 1 <= head_dim <= {PKV_MAX_HEAD_DIM}, got {head_dim}"
        )
    if num_pages < 1 or page_size < 1 or num_kv_heads < 1 or num_layers < 1:
        raise ValueError(f"Invalid shape of {pool_name}: expected every dimension >= 1, got {pages.shape}")
    p.window = 0 if window is None else check_int(window, f"{source}.window", 1, MAX_POSITION)
    p.sink_tokens = check_int(sink_tokens, f"{source}.sink_tokens", 0, MAX_POSITION)
    p.chunk_size = 0 if chunk_size is None else check_int(chunk_size, f"{source}.chunk_size", 1, MAX_POSITION)
    if p.chunk_size > 0 and p.window > 0:
        raise ValueError(
            f"Invalid value of {source}.chunk_size: expected None with a window (chunked attention "
            f"and a sliding window do not combine), got chunk_size={p.chunk_size} with window={p.window}"
        )

    if hook is None:
        layer_index = check_index(layer, "layer", num_layers)
        pages = pages[layer_index]
    num_qo_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(
            f"Invalid shape of q: expected (*, Hq, {head_dim}) (head_dim of the cache), got {q.shape}"
        )
    if num_qo_heads < 1 or num_qo_heads % num_kv_heads != 0 or num_qo_heads > _MAX_QO_HEADS:
        raise ValueError(
            f"Invalid shape of q: expected Hq = q.shape[1] a positive multiple of "
            f"num_kv_heads={num_kv_heads}, at most 2**20, got Hq={num_qo_heads}"
        )
    if scale is None:
        p.scale = 1.0 / math.sqrt(head_dim)
    else:
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
            raise TypeError(f"Invalid type of scale: expected a real number or None, got {type(scale).__name__}")
        # float32 math: scale * log2(e) must stay finite
        if not math.isfinite(float(scale)) or abs(float(scale)) > _MAX_SCALE:
            raise ValueError(
                f"Invalid value of scale: expected a finite number with |scale| <= {_MAX_SCALE:g}, got {scale}"
            )
        p.scale = float(scale)
    p.auto_threads = num_threads is None
    if num_threads is None:
        p.num_threads = pkv_omp_max_threads()  # capped by _cap_threads once the work is known
    else:
        p.num_threads = <int>check_int(num_threads, "num_threads", 1, _MAX_THREADS_ARG)
    if not pkv_have_openmp():
        p.num_threads = 1

    if hook is None:
        view = cache.page_table(seq_ids)
    p.indptr = check_array(view.indptr, "page_table(seq_ids).indptr", np.int32, (-1,))
    batch_size = p.indptr.shape[0] - 1
    if batch_size < 0:
        raise ValueError("Invalid shape of page_table(seq_ids).indptr: expected (B + 1,), got (0,)")
    p.indices = check_array(view.indices, "page_table(seq_ids).indices", np.int32, (-1,))
    p.page_positions = check_array(view.page_positions, "page_table(seq_ids).page_positions",
                                   np.int64, (p.indices.shape[0],))
    p.seq_lens = check_array(view.seq_lens, "page_table(seq_ids).seq_lens", np.int64, (batch_size,))
    p.num_pages = num_pages
    p.pool_layer = pages
    p.page_format = page_format
    p.page_size = page_size
    p.num_kv_heads = num_kv_heads
    p.head_dim = head_dim
    p.num_qo_heads = num_qo_heads
    p.batch_size = batch_size
    p.q = q
    p.q_sink = None
    p.softcap = 0.0
    p.sink_logits = None
    return p


cdef int _validate_score_options(_Problem p, object sink_logits, object softcap) except -1:
    """Check sink_logits (shape (Hq,), finite or -inf) and softcap (a float32-safe range)."""
    if softcap is not None:
        if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
            raise TypeError(
                f"Invalid type of softcap: expected a real number or None, got {type(softcap).__name__}"
            )
        cap = float(softcap)
        # float32 math: softcap and softcap * log2(e) stay normal and finite
        if not math.isfinite(cap) or cap < _MIN_SOFTCAP or cap > _MAX_SCALE:
            raise ValueError(
                f"Invalid value of softcap: expected None or a finite number with "
                f"{_MIN_SOFTCAP:g} <= softcap <= {_MAX_SCALE:g}, got {softcap}"
            )
        # q is scaled by scale / softcap in float32
        if abs(p.scale) / cap > _MAX_SCALE:
            raise ValueError(
                f"Invalid value of softcap: expected |scale| / softcap <= {_MAX_SCALE:g} (the kernels "
                f"scale q by it in float32), got scale={p.scale:g} and softcap={softcap}"
            )
        p.softcap = cap
    if sink_logits is not None:
        logits = check_float_array(sink_logits, "sink_logits", (p.num_qo_heads,), np.float64, "(Hq,)")
        bad = np.isnan(logits) | (logits > _MAX_SCALE) | ((logits < -_MAX_SCALE) & (logits != -np.inf))
        if bad.any():
            h = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"Invalid value of sink_logits: expected for every query head a finite logit with "
                f"|logit| <= {_MAX_SCALE:g}, or -inf (no sink term), got {float(logits[h])} for head {h}"
            )
        p.sink_logits = logits.astype(np.float32)
    return 0


cdef int _validate_q_sink(_Problem p, object q_sink) except -1:
    """Check q_sink like q (the array rule, q's shape) and that the cache has sinks."""
    if q_sink is None:
        return 0
    q_sink = check_float_array(q_sink, "q_sink", tuple(p.q.shape), np.float32, "the shape of q")
    if p.window <= 0 or p.sink_tokens <= 0:
        raise ValueError(
            "Invalid value of q_sink: expected None for a cache without attention sinks (it scores "
            f"only the keys at positions < sink_tokens, which exist with a window), got an array for "
            f"a cache with window={None if p.window <= 0 else p.window} and sink_tokens={p.sink_tokens}"
        )
    p.q_sink = q_sink
    return 0



cdef void _cap_threads(_Problem p, int64_t query_tiles) noexcept:
    """With num_threads=None, give each thread at least _BYTES_PER_THREAD of work.

    Waking idle OpenMP threads costs tens of microseconds, more than a small
    call saves, and much more on a machine whose other cores are busy.
    ``query_tiles`` scales the K/V bytes by how often prefill reads them.
    """
    if not p.auto_threads:
        return
    # In double: nnz pages (repeats allowed) times a page's bytes can pass 2**63.
    cdef double work = (<double>cnp.PyArray_DIM(p.indices, 0) * p.page_size * p.num_kv_heads
                        * pkv_row_bytes(p.page_format, p.head_dim) * 2 * max(query_tiles, 1))
    cdef double wanted = 1 + work / _BYTES_PER_THREAD
    if wanted < p.num_threads:
        p.num_threads = <int>wanted


cdef inline int64_t _held_in(const int64_t* starts, int64_t j0, int64_t j1, int64_t page_size,
                            int64_t lo, int64_t hi) noexcept:
    """Positions in [lo, hi) that the listed pages j0 .. j1 - 1 cover."""
    cdef int64_t j, a, z, held = 0
    for j in range(j0, j1):
        a = max(starts[j], lo)
        z = min(starts[j] + page_size, hi)
        if z > a:
            held += z - a
    return held


cdef bint _table_ok(_Problem p, const int64_t* qo, int64_t num_tokens) noexcept:
    """One pass over the page table: True when every value check passes.

    Checks offsets, page ids, lengths and positions (``0 <= page_positions
    <= 2**62``, ``0 <= seq_lens <= 2**62``, so that no sum below overflows),
    and that each sequence holds every
    position its queries (decode: the last token; prefill, with ``qo``: its
    last ``qo_len`` tokens) attend to, the queries' own positions included:
    the window range and the sinks below it, or the chunk of the first query
    onwards (see ``_explain_missing_keys``).
    Only when this fails do the NumPy checks of ``_explain_table_error`` run,
    to name what is wrong.
    """
    cdef const int32_t* indptr = <const int32_t*>cnp.PyArray_DATA(p.indptr)
    cdef const int32_t* indices = <const int32_t*>cnp.PyArray_DATA(p.indices)
    cdef const int64_t* starts = <const int64_t*>cnp.PyArray_DATA(p.page_positions)
    cdef const int64_t* seq_lens = <const int64_t*>cnp.PyArray_DATA(p.seq_lens)
    cdef int64_t nnz = cnp.PyArray_DIM(p.indices, 0)
    cdef int64_t b, j, first, need, held, key_lo, sink_hi
    if indptr[0] != 0 or indptr[p.batch_size] != nnz:
        return False
    if qo != NULL and (qo[0] != 0 or qo[p.batch_size] != num_tokens):
        return False
    for j in range(nnz):
        if indices[j] < 0 or indices[j] >= p.num_pages:
            return False
    for b in range(p.batch_size):
        if indptr[b + 1] < indptr[b] or seq_lens[b] < 0 or seq_lens[b] > MAX_POSITION:
            return False
        # pages in position order, none overlapping the next: the kernels
        # list keys in that order, and counting held positions is exact
        for j in range(indptr[b], indptr[b + 1]):
            if starts[j] < 0 or starts[j] > MAX_POSITION or (
                    j > indptr[b] and starts[j] < starts[j - 1] + p.page_size):
                return False
        if qo == NULL:
            need = 1
        else:
            need = qo[b + 1] - qo[b]
            if need < 0:
                return False
            if need == 0:
                continue
        if need > seq_lens[b]:
            return False
        first = seq_lens[b] - need
        # every key a query admits, [key_lo, seq_len) (the queries' positions
        # included) and the sinks [0, sink_hi)
        if p.window > 0:
            key_lo = max(first - p.window + 1, 0)
        elif p.chunk_size > 0:
            key_lo = first - first % p.chunk_size
        else:
            key_lo = 0
        sink_hi = min(p.sink_tokens, key_lo) if p.window > 0 else 0
        held = (_held_in(starts, indptr[b], indptr[b + 1], p.page_size, key_lo, seq_lens[b])
                + _held_in(starts, indptr[b], indptr[b + 1], p.page_size, 0, sink_hi))
        if held != seq_lens[b] - key_lo + sink_hi:
            return False
    return True


cdef int _explain_table_error(_Problem p, object seq_ids, object qo) except -1:
    """Raise the ValueError that names the first failed check of the page table."""
    cdef Py_ssize_t batch_size = p.batch_size
    nnz = int(p.indptr[batch_size])
    if int(p.indptr[0]) != 0 or nnz != p.indices.shape[0] or (
            batch_size > 0 and bool((np.diff(p.indptr) < 0).any())):
        raise ValueError(
            "Invalid value of page_table(seq_ids).indptr: expected non-decreasing offsets from 0 "
            f"to len(indices)={p.indices.shape[0]}, got {p.indptr.tolist()[:8]}..."
        )
    if nnz > 0:
        lo, hi = int(p.indices.min()), int(p.indices.max())
        if lo < 0 or hi >= p.num_pages:
            raise ValueError(
                f"Invalid value of page_table(seq_ids).indices: expected page ids in "
                f"[0, {p.num_pages - 1}], got range [{lo}, {hi}]"
            )
    if batch_size > 0 and int(p.seq_lens.min()) < 0:
        raise ValueError("Invalid value of page_table(seq_ids).seq_lens: expected lengths >= 0")
    if batch_size > 0 and int(p.seq_lens.max()) > MAX_POSITION:
        raise ValueError(
            f"Invalid value of page_table(seq_ids).seq_lens: expected lengths <= 2**62 (the position "
            f"limit), got {int(p.seq_lens.max())}"
        )
    _explain_page_order(p, seq_ids)
    if qo is None:
        _explain_decode(p, seq_ids)
    else:
        _explain_prefill(p, seq_ids, qo)
    raise ValueError("Invalid value of page_table(seq_ids): inconsistent page table")


cdef int _explain_page_order(_Problem p, object seq_ids) except -1:
    """Raise if a sequence's pages are not listed in position order without overlap."""
    starts = p.page_positions
    if starts.shape[0] == 0:
        return 0
    if int(starts.min()) < 0 or int(starts.max()) > MAX_POSITION:
        bad = int(starts.min()) if int(starts.min()) < 0 else int(starts.max())
        raise ValueError(
            f"Invalid value of page_table(seq_ids).page_positions: expected positions in "
            f"[0, 2**62], got {bad}"
        )
    # entry j follows entry j - 1 of the same sequence unless a sequence starts at j
    nnz = starts.shape[0]
    firsts = p.indptr[:p.batch_size]
    follows = np.ones(nnz, dtype=bool)
    follows[0] = False
    follows[firsts[firsts < nnz]] = False
    previous = np.zeros(nnz, dtype=np.int64)
    previous[1:] = starts[:nnz - 1]
    bad = follows & (starts < previous + p.page_size)
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        b = int(np.searchsorted(p.indptr, j, side="right")) - 1
        raise ValueError(
            f"Invalid value of page_table(seq_ids).page_positions: expected the pages of each "
            f"sequence in position order, each starting at least page_size={p.page_size} after "
            f"the previous one; sequence {_describe(seq_ids, b)} lists a page at position "
            f"{int(starts[j])} after one at {int(starts[j - 1])}"
        )
    return 0


cdef object _cached_from(_Problem p, object first_positions):
    """Number of tokens each sequence holds at positions >= first_positions[b]."""
    counts = np.diff(p.indptr).astype(np.int64)
    owner = np.repeat(np.arange(p.batch_size), counts)
    starts = p.page_positions
    ends = np.minimum(starts + p.page_size, p.seq_lens[owner])
    held = np.clip(ends - np.maximum(starts, first_positions[owner]), 0, None)
    return np.bincount(owner, weights=held, minlength=p.batch_size).astype(np.int64)


cdef int _explain_missing_keys(_Problem p, object seq_ids, object first_positions, object active,
                               str argument) except -1:
    """Raise if a sequence whose queries start at first_positions[b] lacks a key they admit.

    The queries admit positions [key_lo, seq_len) and, with a window, the
    sinks below key_lo; with chunks, key_lo is the start of the first query's
    chunk; the kernels read only the listed pages, so a released
    page would silently drop keys from the softmax.
    """
    if p.window > 0:
        key_lo = np.maximum(first_positions - p.window + 1, 0)
        sink_hi = np.minimum(key_lo, p.sink_tokens)
    elif p.chunk_size > 0:
        key_lo = first_positions - first_positions % p.chunk_size
        sink_hi = np.zeros(p.batch_size, dtype=np.int64)
    else:
        key_lo = np.zeros(p.batch_size, dtype=np.int64)
        sink_hi = key_lo
    held = _cached_from(p, key_lo) + _cached_from(p, np.zeros_like(key_lo)) - _cached_from(p, sink_hi)
    missing = active & (held != p.seq_lens - key_lo + sink_hi)
    if missing.any():
        b = int(np.flatnonzero(missing)[0])
        sinks = f" and the sink positions 0..{int(sink_hi[b]) - 1}" if sink_hi[b] > 0 else ""
        if p.window > 0:
            why = ("the sliding window releases them once later tokens are appended, so run attention "
                   "over new tokens before appending more")
        elif p.chunk_size > 0:
            why = (f"chunked attention reads every key from the start of the query's chunk (a multiple "
                   f"of chunk_size={p.chunk_size}); a cache holds only the last chunk_size positions, so "
                   f"run attention over new tokens before appending more")
        else:
            why = "the page table must list every cached position"
        raise ValueError(
            f"Invalid value of {argument}: sequence {_describe(seq_ids, b)} does not hold every key "
            f"its queries attend to (positions {int(key_lo[b])}..{int(p.seq_lens[b]) - 1}{sinks}); {why}"
        )
    return 0


cdef int _explain_decode(_Problem p, object seq_ids) except -1:
    if p.batch_size > 0:
        empty = p.seq_lens <= 0
        if empty.any():
            b = int(np.flatnonzero(empty)[0])
            raise ValueError(f"Invalid value of seq_ids: sequence {_describe(seq_ids, b)} has no cached token")
        held = _cached_from(p, p.seq_lens - 1)
        if (held != 1).any():
            b = int(np.flatnonzero(held != 1)[0])
            raise ValueError(
                f"Invalid value of seq_ids: sequence {_describe(seq_ids, b)} does not hold its last "
                f"token (position {int(p.seq_lens[b]) - 1}) in its page table"
            )
        _explain_missing_keys(p, seq_ids, p.seq_lens - 1, np.ones(p.batch_size, dtype=bool), "seq_ids")
    return 0


cdef int _explain_prefill(_Problem p, object seq_ids, object qo) except -1:
    num_tokens = p.q.shape[0]
    if int(qo[0]) != 0:
        raise ValueError(f"Invalid value of qo_indptr: expected qo_indptr[0] == 0, got {int(qo[0])}")
    qo_lens = np.diff(qo)
    if (qo_lens < 0).any():
        b = int(np.flatnonzero(qo_lens < 0)[0])
        raise ValueError(
            f"Invalid value of qo_indptr: expected non-decreasing offsets, got qo_indptr[{b + 1}]="
            f"{int(qo[b + 1])} < qo_indptr[{b}]={int(qo[b])}"
        )
    if int(qo[p.batch_size]) != num_tokens:
        raise ValueError(
            f"Invalid value of qo_indptr: expected qo_indptr[-1] == q.shape[0] == {num_tokens}, "
            f"got {int(qo[p.batch_size])}"
        )
    if p.batch_size > 0:
        too_long = qo_lens > p.seq_lens
        if too_long.any():
            b = int(np.flatnonzero(too_long)[0])
            raise ValueError(
                f"Invalid value of qo_indptr: expected at most seq_len={int(p.seq_lens[b])} new tokens "
                f"for sequence {_describe(seq_ids, b)}, got {int(qo_lens[b])}"
            )
        held = _cached_from(p, p.seq_lens - qo_lens)
        missing = (qo_lens > 0) & (held != qo_lens)
        if missing.any():
            b = int(np.flatnonzero(missing)[0])
            if int(p.seq_lens[b]) == 0 or held[b] == 0:
                raise ValueError(f"Invalid value of seq_ids: sequence {_describe(seq_ids, b)} has no cached token")
            raise ValueError(
                f"Invalid value of qo_indptr: sequence {_describe(seq_ids, b)} does not hold all of its "
                f"{int(qo_lens[b])} new tokens (positions {int(p.seq_lens[b] - qo_lens[b])}.."
                f"{int(p.seq_lens[b]) - 1}) in its page table"
            )
        _explain_missing_keys(p, seq_ids, p.seq_lens - qo_lens, qo_lens > 0, "qo_indptr")
    return 0


def decode(q, cache, layer, seq_ids, scale=None, num_threads=None, return_lse=False, *, q_sink=None,
           sink_logits=None, softcap=None):
    """Paged decode attention. See ``pagedkv.attention.decode``."""
    cdef _Problem p = _validate_common(q, cache, layer, seq_ids, scale, num_threads, return_lse)
    if p.q.shape[0] != p.batch_size:
        raise ValueError(
            f"Invalid shape of q: expected ({p.batch_size}, Hq, D) (one query per sequence), got {p.q.shape}"
        )
    _validate_q_sink(p, q_sink)
    _validate_score_options(p, sink_logits, softcap)
    if not _table_ok(p, NULL, 0):
        _explain_table_error(p, seq_ids, None)
    _cap_threads(p, 1)
    out = np.empty((p.batch_size, p.num_qo_heads, p.head_dim), dtype=np.float32)
    lse = np.empty((p.batch_size, p.num_qo_heads), dtype=np.float32) if return_lse else None
    _call_decode(p, out, lse)
    return (out, lse) if return_lse else out


cdef int _call_decode(_Problem p, object out, object lse) except -1:
    cdef const void* pool = cnp.PyArray_DATA(p.pool_layer)
    cdef const int32_t* indptr = <const int32_t*>cnp.PyArray_DATA(p.indptr)
    cdef const int32_t* indices = <const int32_t*>cnp.PyArray_DATA(p.indices)
    cdef const int64_t* positions = <const int64_t*>cnp.PyArray_DATA(p.page_positions)
    cdef const int64_t* seq_lens = <const int64_t*>cnp.PyArray_DATA(p.seq_lens)
    cdef const float* q = <const float*>cnp.PyArray_DATA(p.q)
    cdef const float* q_sink = NULL
    if p.q_sink is not None:
        q_sink = <const float*>cnp.PyArray_DATA(p.q_sink)
    cdef const float* sink_logits = NULL
    if p.sink_logits is not None:
        sink_logits = <const float*>cnp.PyArray_DATA(p.sink_logits)
    cdef float* out_ptr = <float*>cnp.PyArray_DATA(out)
    cdef float* lse_ptr = NULL if lse is None else <float*>cnp.PyArray_DATA(lse)
    with nogil:
        paged_decode(pool, p.page_format, p.page_size, p.num_kv_heads, p.head_dim,
                     p.num_qo_heads, p.batch_size, indptr, indices, positions, seq_lens,
                     p.window, p.sink_tokens, p.chunk_size, p.scale, p.softcap, sink_logits, q,
                     q_sink, out_ptr, lse_ptr, p.num_threads)
    return 0


def prefill(q, cache, layer, seq_ids, qo_indptr, scale=None, num_threads=None, return_lse=False, *,
            q_sink=None, sink_logits=None, softcap=None):
    """Paged prefill attention. See ``pagedkv.attention.prefill``."""
    cdef _Problem p = _validate_common(q, cache, layer, seq_ids, scale, num_threads, return_lse)
    _validate_q_sink(p, q_sink)
    _validate_score_options(p, sink_logits, softcap)
    qo = as_int_array(qo_indptr, "qo_indptr", np.int64)
    num_tokens = p.q.shape[0]
    if qo.shape[0] != p.batch_size + 1:
        raise ValueError(
            f"Invalid shape of qo_indptr: expected ({p.batch_size + 1},) (number of sequences + 1), got {qo.shape}"
        )
    if not _table_ok(p, <const int64_t*>cnp.PyArray_DATA(qo), num_tokens):
        _explain_table_error(p, seq_ids, qo)
    _cap_threads(p, (num_tokens // max(p.batch_size, 1) + 15) // 16)
    out = np.empty((num_tokens, p.num_qo_heads, p.head_dim), dtype=np.float32)
    lse = np.empty((num_tokens, p.num_qo_heads), dtype=np.float32) if return_lse else None
    _call_prefill(p, qo, out, lse)
    return (out, lse) if return_lse else out


cdef int _call_prefill(_Problem p, object qo, object out, object lse) except -1:
    cdef const void* pool = cnp.PyArray_DATA(p.pool_layer)
    cdef const int32_t* indptr = <const int32_t*>cnp.PyArray_DATA(p.indptr)
    cdef const int32_t* indices = <const int32_t*>cnp.PyArray_DATA(p.indices)
    cdef const int64_t* positions = <const int64_t*>cnp.PyArray_DATA(p.page_positions)
    cdef const int64_t* seq_lens = <const int64_t*>cnp.PyArray_DATA(p.seq_lens)
    cdef const int64_t* qo_ptr = <const int64_t*>cnp.PyArray_DATA(qo)
    cdef const float* q = <const float*>cnp.PyArray_DATA(p.q)
    cdef const float* q_sink = NULL
    if p.q_sink is not None:
        q_sink = <const float*>cnp.PyArray_DATA(p.q_sink)
    cdef const float* sink_logits = NULL
    if p.sink_logits is not None:
        sink_logits = <const float*>cnp.PyArray_DATA(p.sink_logits)
    cdef float* out_ptr = <float*>cnp.PyArray_DATA(out)
    cdef float* lse_ptr = NULL if lse is None else <float*>cnp.PyArray_DATA(lse)
    with nogil:
        paged_prefill(pool, p.page_format, p.page_size, p.num_kv_heads, p.head_dim,
                      p.num_qo_heads, p.batch_size, indptr, indices, positions, seq_lens, qo_ptr,
                      p.window, p.sink_tokens, p.chunk_size, p.scale, p.softcap, sink_logits, q,
                      q_sink, out_ptr, lse_ptr, p.num_threads)
    return 0


# ---------------------------------------------------------------- step entry
# Engines call attention once per layer with the same page table: the table is
# checked once per step (StepTable) and each layer's call reads C fields only.
# Anything the fast checks do not accept takes decode/prefill's general path,
# so errors and results are the general path's.

cdef class StepTable:
    """A page table checked once and shared by the layers of one step.

    For engines that run :func:`decode_step` / :func:`prefill_step` once per layer over
    the same batch (``pagedkv.vllm.PagedAttentionBackend``). The arrays are copied and
    made read-only, so a table checked against a pool stays valid for every layer whose
    pool has that shape.

    Parameters
    ----------
    indptr : int32 ``(B + 1,)``
        Offsets of each sequence's pages in ``indices``.
    indices : int32 ``(nnz,)``
        Page ids, in position order per sequence.
    page_positions : int64 ``(nnz,)``
        First token position held by each listed page.
    seq_lens : int64 ``(B,)``
        Tokens of each sequence, the step's new ones included.
    qo_indptr : int64 ``(B + 1,)`` or None
        Query rows of each sequence (prefill); None for decode only.

    Raises
    ------
    TypeError, ValueError
        An array of the wrong kind, dtype or shape (named in the message). The values are
        checked against a pool when a layer first uses the table, by the kernels' checks.
    """
    cdef readonly object indptr, indices, page_positions, seq_lens, qo_indptr
    cdef readonly int64_t batch_size
    # the pool and window the table last passed _table_ok for (kind 0: none yet)
    cdef int64_t _ok_num_pages, _ok_page_size, _ok_window, _ok_tokens
    cdef int _ok_kind

    def __init__(self, indptr, indices, page_positions, seq_lens, qo_indptr=None):
        indptr = check_array(indptr, "indptr", np.int32, (-1,))
        if indptr.shape[0] < 1:
            raise ValueError("Invalid shape of indptr: expected (B + 1,), got (0,)")
        b = indptr.shape[0] - 1
        indices = check_array(indices, "indices", np.int32, (-1,))
        page_positions = check_array(page_positions, "page_positions", np.int64, (indices.shape[0],))
        seq_lens = check_array(seq_lens, "seq_lens", np.int64, (b,))
        if qo_indptr is not None:
            qo_indptr = check_array(qo_indptr, "qo_indptr", np.int64, (b + 1,))
        arrays = [np.array(a, copy=True) for a in (indptr, indices, page_positions, seq_lens)]
        if qo_indptr is not None:
            arrays.append(np.array(qo_indptr, copy=True))
        for a in arrays:
            a.setflags(write=False)
        self.indptr, self.indices, self.page_positions, self.seq_lens = arrays[:4]
        self.qo_indptr = arrays[4] if qo_indptr is not None else None
        self.batch_size = b
        self._ok_kind = 0


class _StepView:
    """``layer_attention_view`` over one layer's pool and a StepTable: the general path's cache."""

    __slots__ = ("pages", "table", "window")

    def __init__(self, pages, table, window):
        self.pages = pages
        self.table = table
        self.window = window

    def layer_attention_view(self, layer, seq_ids):
        return self.pages, self.table, self.window, 0, None


cdef bint _is_carray(object a, int ndim) noexcept:
    return (type(a) is np.ndarray and cnp.PyArray_ISCARRAY_RO(<cnp.ndarray>a)
            and cnp.PyArray_NDIM(<cnp.ndarray>a) == ndim)


cdef _Problem _step_problem(object q, object pages, StepTable table, object window, object scale,
                            object num_threads):
    """The problem of one layer's call if the fast checks accept it, else None."""
    if not _is_carray(q, 3) or cnp.PyArray_TYPE(<cnp.ndarray>q) != cnp.NPY_FLOAT32:
        return None
    if not _is_carray(pages, 5):
        return None
    cdef int type_num = cnp.PyArray_TYPE(<cnp.ndarray>pages)
    if type_num != cnp.NPY_FLOAT32 and type_num != cnp.NPY_FLOAT16:
        return None
    cdef cnp.npy_intp* pd = cnp.PyArray_DIMS(<cnp.ndarray>pages)
    cdef cnp.npy_intp* qd = cnp.PyArray_DIMS(<cnp.ndarray>q)
    if (pd[0] < 1 or pd[1] != 2 or pd[2] < 1 or pd[3] < 1 or pd[4] < 1 or pd[4] > PKV_MAX_HEAD_DIM
            or qd[2] != pd[4] or qd[1] < 1 or qd[1] % pd[3] != 0 or qd[1] > _MAX_QO_HEADS):
        return None
    if window is not None and (type(window) is not int or window < 1 or window > MAX_POSITION):
        return None
    if type(scale) is not float or not math.isfinite(<double>scale) or abs(<double>scale) > _MAX_SCALE:
        return None
    if type(num_threads) is not int or num_threads < 1 or num_threads > _MAX_THREADS_ARG:
        return None
    cdef _Problem p = _Problem()
    p.pool_layer = pages
    p.page_format = 0 if type_num == cnp.NPY_FLOAT32 else 1
    p.num_pages = pd[0]
    p.page_size = pd[2]
    p.num_kv_heads = pd[3]
    p.head_dim = pd[4]
    p.num_qo_heads = qd[1]
    p.window = 0 if window is None else window
    p.sink_tokens = 0
    p.chunk_size = 0
    p.scale = scale
    p.softcap = 0.0
    p.sink_logits = None
    p.auto_threads = False
    p.num_threads = num_threads if pkv_have_openmp() else 1
    p.q = q
    p.q_sink = None
    p.indptr = table.indptr
    p.indices = table.indices
    p.page_positions = table.page_positions
    p.seq_lens = table.seq_lens
    p.batch_size = table.batch_size
    return p


cdef bint _step_table_ok(_Problem p, StepTable table, int kind, int64_t num_tokens) noexcept:
    """_table_ok, remembered for the last pool shape and window the table passed with."""
    if (table._ok_kind == kind and table._ok_num_pages == p.num_pages and table._ok_tokens == num_tokens
            and table._ok_page_size == p.page_size and table._ok_window == p.window):
        return True
    cdef const int64_t* qo = NULL
    if kind == 2:
        qo = <const int64_t*>cnp.PyArray_DATA(table.qo_indptr)
    if not _table_ok(p, qo, num_tokens):
        return False
    table._ok_kind = kind
    table._ok_num_pages = p.num_pages
    table._ok_page_size = p.page_size
    table._ok_window = p.window
    table._ok_tokens = num_tokens
    return True


cdef object _step_out(object out, tuple shape):
    """``out`` if it is a float32 C-contiguous ndarray of ``shape``, else a ValueError."""
    if out is None:
        return np.empty(shape, dtype=np.float32)
    if (not _is_carray(out, 3) or cnp.PyArray_TYPE(<cnp.ndarray>out) != cnp.NPY_FLOAT32
            or not cnp.PyArray_ISWRITEABLE(<cnp.ndarray>out) or tuple(out.shape) != shape):
        got = (f"{out.dtype} {out.shape}" if isinstance(out, np.ndarray) else type(out).__name__)
        raise ValueError(f"Invalid value of out: expected a writable C-contiguous float32 array of shape "
                         f"{shape}, got {got}")
    return out


cdef object _general_into(object result, object out):
    """The general path's ``result``, written into ``out`` when given (checked as _step_out does)."""
    target = _step_out(out, tuple(result.shape))
    if target is not result:
        target[...] = result
    return target


def decode_step(q, pages, StepTable table not None, window, scale, num_threads, out=None, *,
                sink_logits=None, softcap=None):
    """Decode attention of one layer over ``pages`` with a table checked once per step.

    The same result as ``decode(q, cache, 0, range(table.batch_size), scale, num_threads,
    sink_logits=..., softcap=...)`` for a cache whose ``layer_attention_view`` answers
    ``(pages, table, window, 0, None)``; calls the fast checks do not accept (another
    dtype or layout of ``q`` or ``pages``, a scale or thread count of another type) run
    that general path, with its errors.

    Parameters
    ----------
    q : float32 ``(B, Hq, D)``
        One query per sequence.
    pages : float32 or float16 ``(num_pages, 2, page_size, Hkv, D)``
        One layer's pool.
    table : StepTable
        The step's page table (its ``qo_indptr`` is not read).
    window : int or None
        Sliding window in tokens, or None for full attention.
    scale : float
    num_threads : int
    out : float32 ``(B, Hq, D)`` or None
        Written in place when given (C-contiguous); else a new array.
    sink_logits, softcap
        As for :func:`decode`.

    Returns
    -------
    numpy.ndarray
        ``out``, or a new float32 ``(B, Hq, D)`` array.

    Raises
    ------
    TypeError, ValueError
        As :func:`decode`; a ValueError naming ``out`` for an ``out`` of another dtype,
        shape or layout.
    """
    cdef _Problem p = _step_problem(q, pages, table, window, scale, num_threads)
    if p is None or p.q.shape[0] != p.batch_size or not _step_table_ok(p, table, 1, 0):
        result = decode(q, _StepView(pages, table, window), 0, range(table.batch_size), scale, num_threads,
                        sink_logits=sink_logits, softcap=softcap)
        return _general_into(result, out)
    if sink_logits is not None or softcap is not None:
        _validate_score_options(p, sink_logits, softcap)
    out = _step_out(out, (p.batch_size, p.num_qo_heads, p.head_dim))
    _call_decode(p, out, None)
    return out


def prefill_step(q, pages, StepTable table not None, window, scale, num_threads, out=None, *,
                 sink_logits=None, softcap=None):
    """Prefill attention of one layer over ``pages`` with a table checked once per step.

    As :func:`decode_step`, for ``prefill(q, cache, 0, range(table.batch_size),
    table.qo_indptr, ...)``: sequence ``b``'s queries are rows ``qo_indptr[b] ..
    qo_indptr[b + 1] - 1`` of ``q``, its last tokens.

    Parameters
    ----------
    q : float32 ``(num_tokens, Hq, D)``
    pages, window, scale, num_threads, sink_logits, softcap
        As for :func:`decode_step`.
    table : StepTable
        The step's page table, made with ``qo_indptr``.
    out : float32 ``(num_tokens, Hq, D)`` or None

    Returns
    -------
    numpy.ndarray
        ``out``, or a new float32 ``(num_tokens, Hq, D)`` array.

    Raises
    ------
    TypeError, ValueError
        As :func:`prefill`; a ValueError when ``table`` has no ``qo_indptr``, and one
        naming ``out`` for an ``out`` of another dtype, shape or layout.
    """
    if table.qo_indptr is None:
        raise ValueError("Invalid value of table: expected a StepTable made with qo_indptr for prefill_step")
    cdef _Problem p = _step_problem(q, pages, table, window, scale, num_threads)
    if p is None or not _step_table_ok(p, table, 2, p.q.shape[0]):
        result = prefill(q, _StepView(pages, table, window), 0, range(table.batch_size), table.qo_indptr,
                         scale, num_threads, sink_logits=sink_logits, softcap=softcap)
        return _general_into(result, out)
    if sink_logits is not None or softcap is not None:
        _validate_score_options(p, sink_logits, softcap)
    out = _step_out(out, (p.q.shape[0], p.num_qo_heads, p.head_dim))
    _call_prefill(p, table.qo_indptr, out, None)
    return out
