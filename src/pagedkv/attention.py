"""Paged attention on the CPU: decode and prefill that read K/V straight from the pool.

The kernels read the pages of a KV cache in place (no gather copy), the way
vLLM's PagedAttention (Kwon et al., SOSP 2023) and FlashInfer's paged
kernels do on GPUs. They work on any object with the attention contract of
:class:`pagedkv.KVCache`:

- ``cache.kv``: C-contiguous ndarray of shape ``(num_layers, num_pages, 2,
  page_size, num_kv_heads, E)``; ``kv[layer]`` is FlashInfer's NHD paged
  layout, index 0 of axis 2 is K, 1 is V, and the last axis holds one head
  row of ``head_dim`` values in the cache's page format (below);
- ``cache.kv_dtype`` (optional): the page format, one of ``"float32"``,
  ``"float16"``, ``"bfloat16"``, ``"int8"``, ``"int4"``; without it, the
  pool's dtype (float32 or float16) is the format;
- ``cache.window`` (tokens, or None for full attention),
  ``cache.sink_tokens`` (tokens) and, if the cache has it,
  ``cache.chunk_size`` (tokens, or None: no chunks; read with ``getattr``);
- ``cache.page_table(seq_ids)``: FlashInfer CSR arrays ``indptr`` int32[B+1]
  and ``indices`` int32[nnz] (the pages each sequence holds, in position
  order), ``page_positions`` int64[nnz] (first token position of each listed
  page: in ``[0, 2**62]``, and within a sequence each at least ``page_size``
  past the one before) and ``seq_lens`` int64[B] (tokens appended so far,
  at most ``2**62``).

A cache whose layers differ (per-layer windows or chunks, each layer group
in a pool of its own) has a method ``cache.layer_attention_view(layer,
seq_ids)`` instead; when it exists, the kernels call it, once per call, and
take everything from its answer, a tuple ``(pages, view, window,
sink_tokens, chunk_size)``: ``pages`` the C-contiguous pool of that layer,
shape ``(num_pages, 2, page_size, num_kv_heads, head_dim)`` (as ``kv[layer]``
above), ``view`` its page table for ``seq_ids`` (as ``page_table`` returns,
page ids indexing ``pages``), ``window`` and ``chunk_size`` None or tokens,
``sink_tokens`` tokens. ``cache.kv``, ``cache.page_table`` and the
attributes above are then not read.

Page formats
------------
Each head row of the pool holds ``head_dim = D`` values (``D`` is the last
axis of ``q``), in one of these formats (``pagedkv_c/page_formats.h``; the
NumPy oracle ``tests/reference_formats.py`` encodes and decodes them):

============  ===========  ================================================
kv_dtype      pool dtype   last axis ``E``
============  ===========  ================================================
``float32``   float32      ``D`` values
``float16``   float16      ``D`` values
``bfloat16``  uint16       ``D`` bfloat16 bit patterns
``int8``      uint8        ``D + 2`` bytes: ``D`` int8 levels, then one
                           bfloat16 scale, of the rotated row ``R x``
``int4``      uint8        ``ceil(D / 2) + 2 * ceil(D / 32)`` bytes: levels
                           in nibbles, then a bfloat16 scale per 32 values,
                           of the rotated row ``R x``
============  ===========  ================================================

The kernels read every format in place (no dequantized copy of the pages):
a row is decoded in registers, value ``i`` being ``scale * level_i`` (the
float32 product the decoder computes, exact) for int8 and int4, so that
attention over a page equals attention over its decoded values. A row with a
NaN scale (the encoding of a row that held an inf or NaN) decodes to NaN in
every element. int8 and int4 rows hold ``R x``, ``R`` the orthonormal block
Walsh-Hadamard transform of ``page_formats.h`` (its own inverse): the kernels
score ``R q`` against them and return ``R`` applied to the weighted sum of
the V rows, which is the output over the decoded rows (the LSE is
unchanged); this rounds in float32 only.

int8 scores: on the AVX-512 path of a CPU with AVX-512 VNNI
(``kernel_info()["int8_scores"]``), the rotated query row ``R q`` (and
``q_sink``'s) is quantized to int8 the way llama.cpp quantizes its query for
int8 keys, ``level_i = rint(x_i * (1 / d))`` with ``d = max |x_i| / 127`` in
float32 (``x = R q``, rotated in float32), and the scores are exact integer
dot products times ``d``, the key row's scale and ``scale``: the result is
attention with the query ``R (d * level)`` in place of ``q`` (a relative
change of the scores of about ``1 / 254`` of the row's largest element),
otherwise rounded in float32 only. A query row
holding an inf or NaN is scored in float32 as on the other paths, where
int8 pages score in float32 against the unrounded query.

Positions, lengths, the window, the sink tokens and the chunk size are limited to
``2**62`` tokens, so that every position plus a page or a window fits int64;
``indptr`` being int32, a batch lists at most ``2**31 - 1`` pages
(``KVCache.page_table`` refuses larger batches).

Mask
----
The query at position ``p`` attends to the cached key at position ``k`` iff
``k <= p`` and, with a window ``W``, ``k >= p - W + 1`` or ``k < S`` (the
``S = sink_tokens`` attention-sink positions). This is FlashInfer's
``window_left = W - 1`` and Hugging Face's ``sliding_window = W``.

With a chunk size ``C`` (chunked attention, as Llama 4's local layers use
it: ``attention_chunk_size`` in Hugging Face transformers), the query at
``p`` attends to the keys of its own chunk, ``floor(p / C) * C <= k <= p``.
A chunk size never comes with a window. A cache may hold more than the chunk
(``pagedkv`` stores a chunked layer as a window of ``C`` tokens, which covers
every chunk a query can be in); the kernels apply the chunk mask, and refuse
a page table that lacks a key some query's chunk admits.

Sink logits and softcap
-----------------------
``sink_logits`` (gpt-oss's learned attention sinks, OpenAI 2025, "gpt-oss-120b
& gpt-oss-20b Model Card"; the ``sinks`` of its attention layers) gives each
query head ``h`` one logit that joins the softmax denominator with no value
row: ``out = sum_k w_k v_k`` with ``w_k = exp(s_k) / (sum_j exp(s_j) +
exp(sink_logits[h]))``, and the LSE is ``log(sum_j exp(s_j) +
exp(sink_logits[h]))``. A logit of ``-inf`` means no sink term for that head.
These sinks are not the sink tokens of the mask above, which are cached keys.

``softcap`` (Gemma 2: Gemma Team 2024, "Gemma 2: Improving Open Language
Models at a Practical Size", section 2, logit soft-capping) maps every score
``s = scale * q . k`` to ``softcap * tanh(s / softcap)`` before the softmax
(and before the mask: a masked key stays excluded). The SIMD paths compute
tanh from their exp2 (relative error about 2e-7).

Sink queries
------------
``decode`` and ``prefill`` take an optional ``q_sink`` of the shape of ``q``:
the keys at positions ``k < S`` are then scored with ``q_sink`` and every
other key with ``q`` (one softmax over all admitted keys). Rotary scores
depend only on the distance between the positions the query and the key were
rotated to, so a ``q_sink`` rotated to position ``min(p, S + W - 1)`` gives
the attention of StreamingLLM's positions inside the cache (Xiao et al.,
2023, "Efficient Streaming Language Models with Attention Sinks", section
3.2: sinks at ``0 .. S-1``, the window after them) while the keys stay stored
at their absolute positions: the query's distance to a window key ``k`` is
``p - k`` in both schemes, and only the sink keys ``j`` need the distance
``min(p, S + W - 1) - j`` instead of ``p - j``. No stored key is rotated
again.

Non-finite values
-----------------
Results are those of dense softmax attention over the keys the mask admits
(masked keys are dropped before the softmax, whatever they hold): a NaN or
``+inf`` score ``scale * q . k`` among a query row's admitted keys (a NaN in
``q`` or in an admitted K row, an inf in K that meets ``q`` with the same
sign) makes that row's output and LSE NaN, as ``exp(s - max s)`` is then NaN;
a ``-inf`` score gives its key weight 0, and a row whose admitted keys all
score ``-inf`` is NaN (0/0). An inf or NaN in the V row of an admitted key
reaches the output through the weighted sum, also at weight 0 (``0 * NaN``
is NaN), in the columns it occupies. Other rows and heads are unaffected.

With ``softcap``, an infinite score becomes ``+-softcap`` (``tanh(+-inf) =
+-1``): only a NaN score makes a row NaN. With a finite sink logit, a row
whose admitted keys all score ``-inf`` (or that admits no key) is not NaN:
its keys weigh 0, the output is 0 (NaN where an admitted V row holds an inf
or NaN, as ``0 * inf``) and the LSE is the sink logit.

Algorithm
---------
One pass over the pages with the online softmax of FlashAttention (Dao et
al., NeurIPS 2022; Milakov & Gimelshein 2018): tokens are scored in chunks,
each chunk updates a running maximum and running sum per query row and
rescales its accumulator once. Arithmetic is float32. GQA/MQA: query head
``h`` reads KV head ``h // (Hq // Hkv)``; the query heads that share a KV
head are computed together, so each K/V row is read once per group.

Work is split into items (a sequence and a block of KV heads; for prefill
also a tile of queries) that OpenMP threads take one at a time. Every output
element comes from one item on one thread, in a fixed order, so the results
are bit-identical for any ``num_threads``.

Split decode: a sequence alone gives a decode call only as many items as it
has KV heads, too few to spread evenly over the threads (SmolLM2's 3 KV heads
on 2 threads: 2 against 1). So when the batch holds at most 64 (sequence, KV
head) pairs, ``decode`` splits each sequence whose listed pages hold at least
2 MiB of K/V (one layer) into 2 to 8 partitions of whole pages, as many as
hold 1 MiB each, computes each partition as an item of its own
(its running maximum, sum and weighted V), and merges the partitions of each
query row with the log-sum-exp rescaling, in a fixed order and in float64:
Flash-Decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for
long-context inference"), as vLLM's ``paged_attention_v2`` does on GPUs; the sink logit joins a
row once, after its partitions are merged. The
partitions follow from the batch and its page tables, never from the thread
count, so results stay bit-identical for any ``num_threads``; they differ
from an unsplit pass only by rounding.

SIMD paths (x86-64 AVX-512F + VL, AVX2 + FMA + F16C, portable C) are chosen once at
import from what the CPU supports; :func:`kernel_info` reports the choice.
The environment variable ``PAGEDKV_ATTENTION_ISA`` (``scalar``, ``avx2``,
``avx512``), read at import, caps the choice, e.g. to compare paths; any
other value is ignored with a RuntimeWarning.
"""
from pagedkv_c import _attention

__all__ = ["decode", "prefill", "kernel_info"]


def decode(q, cache, layer, seq_ids, scale=None, num_threads=None, return_lse=False, *, q_sink=None,
           sink_logits=None, softcap=None):
    """Attention of one new query per sequence over its cached tokens (decode step).

    Parameters
    ----------
    q : array-like of real numbers, shape ``(B, Hq, D)``
        One query per sequence: float32 is read in place when C-contiguous;
        float16, float64, integers, nested lists and other layouts are
        converted to float32 first (the array rule of
        :class:`pagedkv.KVCache`). ``Hq`` must be a positive multiple of
        ``cache.num_kv_heads``, at most ``2**20``, and ``D`` equal to ``cache.head_dim`` (at
        most 256).
    cache : KVCache-like
        Object with the attention contract described in the module docstring
        (``pagedkv.KVCache``).
    layer : int
        Layer index, ``0 <= layer < cache.num_layers``.
    seq_ids : sequence of hashable, length ``B``
        Sequences to attend for, as ``cache.page_table`` takes them (for
        ``pagedkv.KVCache``: integers, any 1-D array-like); each must hold at
        least one token. Query
        ``b`` sits at position ``seq_len(seq_ids[b]) - 1``, the last token
        appended (already stored).
    scale : float, optional
        Multiplies ``q . k`` before the softmax; finite, ``|scale| <= 1e38``
        (the kernels work in float32). Default ``1 / sqrt(D)``.
    num_threads : int, optional
        OpenMP threads, ``1 <= num_threads <= 1024``; default: OpenMP's
        maximum (``kernel_info()["max_threads"]``), lowered so that each
        thread reads at least 2 MiB of K/V (small calls run on one thread:
        waking idle threads costs more than they save). Results do not
        depend on it. A process forked (``os.fork``, multiprocessing's
        ``fork`` start method) after attention ran on several threads runs
        every call on one thread, as GNU OpenMP's thread pool does not
        survive fork (``kernel_info()["max_threads"]`` is then 1).
    return_lse : bool, default False
        Also return the log-sum-exp of the scaled scores.
    q_sink : array-like of real numbers, shape ``(B, Hq, D)``, optional
        Queries that score the keys at positions ``< cache.sink_tokens``
        (the attention sinks) in place of ``q``; every other key is scored
        with ``q``. See "Sink queries" in the module docstring. Only for a
        cache with a window and ``sink_tokens >= 1``. Default: ``q`` scores
        every key.
    sink_logits : array-like of real numbers, shape ``(Hq,)``, optional
        One natural-log logit per query head that joins its softmax
        denominator with no value row (gpt-oss's attention sinks; see "Sink
        logits and softcap" in the module docstring); each finite with
        ``|logit| <= 1e38``, or ``-inf`` (no sink term for that head; NaN and
        ``+inf`` are refused). Converted to float32. Default: no sink term.
    softcap : float, optional
        Soft cap of the scores (Gemma 2): each score ``s = scale * q . k``
        becomes ``softcap * tanh(s / softcap)`` before the softmax; finite,
        ``1e-38 <= softcap <= 1e38``, and ``|scale| / softcap <= 1e38`` (q is
        scaled by it in float32). Default: no cap.

    Returns
    -------
    out : numpy.ndarray, shape ``(B, Hq, D)``, float32
        Softmax-weighted sum of the V rows. A row is NaN where dense softmax
        attention over the admitted keys is: a NaN or ``+inf`` score, or only
        ``-inf`` scores (see "Non-finite values" in the module docstring).
    lse : numpy.ndarray, shape ``(B, Hq)``, float32
        Only if ``return_lse``: natural-log ``log(sum_k exp(s_k))`` of the
        (capped) scores ``s_k`` over the attended keys, plus
        ``exp(sink_logits[h])`` inside the sum when given, as FlashInfer
        returns it (in natural log, not base 2); NaN wherever the row of
        ``out`` is NaN because of its scores.

    Raises
    ------
    KeyError
        A sequence id is unknown (raised by ``cache.page_table``).
    IndexError
        ``layer`` is out of range (as in ``KVCache.store``/``gather``; with
        ``layer_attention_view``, checked against ``cache.num_layers`` when
        the cache has it, else raised by the cache).
    ValueError
        ``q`` has the wrong shape or is a ragged nesting (``B`` not ``len(seq_ids)``, ``D`` not
        ``head_dim``, ``Hq`` not a multiple of ``num_kv_heads`` or above
        ``2**20``), ``q_sink`` is given and its shape differs from ``q``'s
        or the cache has no window or no sink tokens, ``sink_logits`` has a
        shape other than ``(Hq,)`` or holds NaN, ``+inf`` or a finite value
        past ``1e38`` in magnitude, ``softcap`` is outside ``[1e-38, 1e38]``
        (or not finite) or ``|scale| / softcap > 1e38``,
        ``cache.head_dim > 256``, ``scale`` is not finite or
        ``|scale| > 1e38``, ``num_threads`` is out of range, the cache's
        window, sink tokens or chunk size is out of range (window and chunk
        size ``1 .. 2**62``, sink tokens ``0 .. 2**62``) or it has both a
        window and a chunk size, the pool has the wrong shape or layout,
        ``cache.kv_dtype`` is not a page format name, the pool's dtype is
        not the one of ``cache.kv_dtype`` (float32, float16, uint16 for
        bfloat16, uint8 for int8 and int4) or an int8/int4 pool's last axis
        is not the row size of ``D`` values, a sequence holds no cached
        token, the page table the
        cache returned is malformed (positions or lengths past ``2**62``
        included), or it no longer lists a key the query attends to (a
        position in its window or its chunk, or a sink).
    TypeError
        ``q``, a given ``q_sink`` or ``sink_logits`` is not real numbers
        (bools, complex numbers, strings, objects), the pool (``cache.kv``
        or the ``pages`` of ``layer_attention_view``) of a cache without
        ``kv_dtype`` is neither float32 nor float16, ``layer_attention_view`` does not return a tuple of 5, or
        ``layer``, ``num_threads``, ``scale``, ``softcap``, ``return_lse``,
        the window, the sink tokens or the chunk size has the wrong type.

    Every check runs before any work: nothing is computed when one fails.

    Notes
    -----
    Each call reads every cached K/V row of the listed sequences that the
    mask admits exactly once per KV head, so its cost follows the number of
    tokens in the window (plus sinks), not the sequence length.
    """
    return _attention.decode(q, cache, layer, seq_ids, scale, num_threads, return_lse, q_sink=q_sink,
                             sink_logits=sink_logits, softcap=softcap)


def prefill(q, cache, layer, seq_ids, qo_indptr, scale=None, num_threads=None, return_lse=False, *,
            q_sink=None, sink_logits=None, softcap=None):
    """Causal attention of a ragged chunk of new tokens per sequence (prefill / extend).

    The new tokens must already be appended and stored in the cache. The
    ``qo_len_b = qo_indptr[b+1] - qo_indptr[b]`` queries of sequence ``b``
    are its last ``qo_len_b`` tokens, at positions ``seq_len_b - qo_len_b ...
    seq_len_b - 1``; each attends under its own causal, window and sink, or
    chunk mask (a chunk of new tokens may cross chunk boundaries: each query
    sees its own chunk).

    Parameters
    ----------
    q : array-like of real numbers, shape ``(T, Hq, D)``
        The queries of all sequences, sequence after sequence (FlashInfer's
        ragged layout); ``T = qo_indptr[B]``. Same conversion and head rules
        as :func:`decode`.
    cache : KVCache-like
        See :func:`decode`.
    layer : int
        Layer index, ``0 <= layer < cache.num_layers``.
    seq_ids : sequence of hashable, length ``B``
        Sequences of the batch.
    qo_indptr : sequence of int or numpy.ndarray of any integer dtype, shape ``(B + 1,)``
        Offsets of each sequence's queries in ``q``: starts at 0, never
        decreases, ends at ``T``, and ``qo_len_b <= seq_len_b``. A sequence
        may have ``qo_len_b = 0``.
    scale, num_threads, return_lse
        As in :func:`decode`.
    q_sink : array-like of real numbers, shape ``(T, Hq, D)``, optional
        As in :func:`decode`, row for row with ``q``: each query row has its
        own sink query (for StreamingLLM positions, rotated to
        ``min(p, S + W - 1)`` for the row's own position ``p``).
    sink_logits, softcap
        As in :func:`decode`.

    Returns
    -------
    out : numpy.ndarray, shape ``(T, Hq, D)``, float32
        As in :func:`decode`; non-finite values follow the module docstring,
        per query and its own mask (a NaN key that a query's causal or window
        mask excludes does not reach that query).
    lse : numpy.ndarray, shape ``(T, Hq)``, float32
        Only if ``return_lse``; natural log.

    Raises
    ------
    KeyError
        A sequence id is unknown.
    IndexError
        ``layer`` is out of range.
    ValueError
        As in :func:`decode` (``q_sink`` included), and: ``qo_indptr`` has the wrong length, does
        not start at 0, decreases, does not end at ``T``, or gives a sequence
        more new tokens than it has (``qo_len_b > seq_len_b``) or than it
        still holds in its page table; a sequence with queries holds no
        cached token; a query's window or chunk reaches a position the sequence no
        longer holds (the window released it when later tokens were appended:
        run prefill over each append's tokens before appending more).
    TypeError
        As in :func:`decode`, or ``qo_indptr`` is not a 1-D sequence of
        integers (floats, bools and objects are refused).

    Every check runs before any work: nothing is computed when one fails.

    Notes
    -----
    Prefill does ``O(T x context)`` arithmetic; its work items take one KV
    head and a tile of consecutive queries so that each K/V row read serves
    every query of the tile.
    """
    return _attention.prefill(q, cache, layer, seq_ids, qo_indptr, scale, num_threads, return_lse,
                              q_sink=q_sink, sink_logits=sink_logits, softcap=softcap)


def kernel_info():
    """Report the kernel path this process uses.

    Returns
    -------
    dict
        ``isa`` (str): ``"avx512"`` (AVX-512F + VL, with AVX2, FMA, F16C),
        ``"avx2"`` (AVX2 + FMA + F16C) or
        ``"scalar"`` (portable C); ``available_isas`` (list of str): paths
        this CPU and build can run; ``float16_conversion`` (str): ``"f16c"``
        (hardware conversion in the SIMD paths) or ``"portable"``;
        ``int8_scores`` (str): ``"int8 query (vnni)"`` when int8 pages are
        scored with integer dot products against the query quantized per
        row (see Page formats in the module docstring), else ``"float32"``;
        ``page_formats`` (list of str): the ``cache.kv_dtype`` values the
        kernels read; ``openmp``
        (bool): whether the core was built with OpenMP; ``max_threads``
        (int): OpenMP's default thread count; ``max_head_dim`` (int): 256.
    """
    return _attention.kernel_info()
