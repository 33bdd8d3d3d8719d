"""Attention backend over a paged :class:`pagedkv.KVCache` and the paged attention kernels.

``begin_forward`` is one :meth:`KVCache.append` for the whole batch (it returns the slot
mapping of the new tokens), ``store`` scatters each layer's keys/values through that
slot mapping, and ``attend`` runs :func:`pagedkv.attention.decode` when every sequence
brings exactly one new token and :func:`pagedkv.attention.prefill` otherwise. The
kernels read K/V straight from the pages; the sliding window and the attention sinks
are those of the cache, so a windowed sequence holds only the pages its next query can
see (plus the sink pages), recycled in a ring.

Sources: vLLM's PagedAttention (Kwon et al., SOSP 2023) for the slot mapping and page
tables; FlashInfer's ragged ``qo_indptr`` layout for prefill batches; StreamingLLM
(Xiao et al., 2023) for attention sinks.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from pagedkv_c._checks import checked_int

from pagedkv import attention
from pagedkv.models.attention_backend import (
    AttentionBackend,
    ForwardBatch,
    _check_batch_arguments,
    check_positions,
    check_window,
    sink_query_positions,
)
from pagedkv.models.threads import AUTO, resolve_num_threads, threads_for_rows
from pagedkv_c._kv_cache import KVCache

SUPPORTED_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
# Page formats by name (KVCache(kv_dtype=...)).
PAGE_FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")


def _check_size(name: str, value, low: int) -> int:
    return checked_int(value, name, low, 2**62)  # TypeError for a float or a bool, ValueError out of range


def max_pages_per_sequence(
    num_tokens: int,
    page_size: int,
    window: int | None = None,
    sink_tokens: int = 0,
    max_append_tokens: int = 1,
) -> int:
    """Most pages one sequence of ``num_tokens`` tokens ever holds at once.

    Parameters
    ----------
    num_tokens : int
        Final length of the sequence in tokens (prompt plus generated), >= 0.
    page_size : int
        Tokens per page, >= 1.
    window : int or None
        Sliding window W in tokens; None for full attention.
    sink_tokens : int
        Attention-sink tokens S (used only with a window).
    max_append_tokens : int
        Largest number of tokens appended to the sequence in one call (its longest
        prefill chunk), >= 1.

    Returns
    -------
    int
        Pages. Without a window ``ceil(num_tokens / page_size)``. With a window the
        window bound after an append of T tokens,
        ``ceil((W + T - 2) / page_size) + 1`` window pages plus ``ceil(S / page_size)``
        sink pages (T = ``max_append_tokens``; a decode step has T = 1), and never more
        than ``ceil(num_tokens / page_size)``.

    Raises
    ------
    ValueError
        For a negative ``num_tokens``, ``page_size`` or ``max_append_tokens`` < 1, or an
        invalid window/sink combination.
    """
    num_tokens = _check_size("num_tokens", num_tokens, 0)
    page_size = _check_size("page_size", page_size, 1)
    max_append_tokens = _check_size("max_append_tokens", max_append_tokens, 1)
    check_window(window, sink_tokens)
    whole = -(-num_tokens // page_size)
    if window is None:
        return whole
    window_pages = -(-(window + max_append_tokens - 2) // page_size) + 1
    sink_pages = -(-sink_tokens // page_size)
    return min(whole, window_pages + sink_pages)


def decode_page_bound(page_size: int, window: int, sink_tokens: int = 0) -> int:
    """The bound on the pages a windowed sequence holds during decode.

    Parameters
    ----------
    page_size : int
        Tokens per page.
    window : int
        Sliding window W in tokens.
    sink_tokens : int
        Attention-sink tokens S.

    Returns
    -------
    int
        ``ceil((W - 1) / page_size) + 1 + ceil(S / page_size)`` pages.
    """
    page_size = _check_size("page_size", page_size, 1)
    window = _check_size("window", window, 1)
    sink_tokens = _check_size("sink_tokens", sink_tokens, 0)
    return -(-(window - 1) // page_size) + 1 + -(-sink_tokens // page_size)


@dataclass
class PagedForwardBatch(ForwardBatch):
    """:class:`ForwardBatch` plus the slot mapping returned by :meth:`KVCache.append`.

    Attributes
    ----------
    slot_mapping : numpy.ndarray
        int64, shape ``[num_tokens]``: ``page_id * page_size + offset`` of every new
        token, in batch row order (vLLM's ``slot_mapping``).
    """

    slot_mapping: np.ndarray | None = None


class PagedBackend(AttentionBackend):
    """Attention backend over a paged KV cache and the CPU paged attention kernels.

    Parameters
    ----------
    num_layers, num_kv_heads, head_dim : int
        Shape of the model's keys/values, each >= 1.
    num_pages : int
        Pages in the pool, >= 1; one page holds ``page_size`` tokens of every layer's
        K and V. See :meth:`pages_for` to size it from the requests.
    page_size : int
        Tokens per page, >= 1 (default 16).
    dtype : numpy dtype or str
        Page format: float16 (default, as for :class:`pagedkv.KVCache` and the commands),
        float32, or by name ``"bfloat16"``, ``"int8"``, ``"int4"`` (the quantized formats
        of :class:`pagedkv.KVCache`, *Page formats*). Keys/values are converted on store;
        the kernels read every format in place and accumulate in float32. float16 halves the pool and the bytes attention reads; on SmolLM2-135M
        it moves the perplexity of 1024 tinyshakespeare tokens from 40.8079 (float32,
        llama.cpp's figure) to 40.8092. Use float32 to compare logits with a float32
        reference.
    window : int or None
        Sliding window W in tokens; pages that leave it are released (and reused in
        place by the ring buffer). None: full causal attention.
    sink_tokens : int
        Attention sinks S kept visible (and their pages pinned) with a window.
    num_threads : int, "auto" or None
        OpenMP threads of the attention kernels, >= 1. Default ``"auto"``:
        :func:`~pagedkv.models.threads.default_num_threads`, the count ``LlamaModel``
        uses too (the cores this process can have to itself). None: OpenMP's default
        (``OMP_NUM_THREADS``, else one per core). Under ``"auto"``, decode steps of
        fewer than :data:`~pagedkv.models.threads.SMALL_BATCH_ROWS` sequences run on one
        thread, as the model's products do. Results do not depend on it.
    positions : str
        ``"absolute"`` (default): every token at its position in the sequence.
        ``"cache"``: StreamingLLM's positions inside the cache (sinks at ``0 .. S-1``,
        the window after them; needs a window and sinks). Keys stay stored at their
        absolute rotation; the sink keys are scored with a second query rotated to
        ``min(p, S + W - 1)`` (the kernels' ``q_sink``), so no stored key is ever
        rotated again. See :mod:`pagedkv.models.attention_backend`.
    enable_prefix_caching : bool
        Keep the full pages of prompts findable by their tokens (the cache's prefix
        caching), so that a later prompt with the same start reuses their K/V:
        :meth:`add_sequence` with the prompt's token ids returns the tokens served.
        Full attention only (``window=None``). Default False.
    tier : pagedkv.tiers.RedisTier or None
        A prefix tier shared with other processes (needs ``enable_prefix_caching``):
        sealed prompt pages are written to it, and :meth:`add_sequence` fetches the
        pages the local cache lacks. See :class:`pagedkv.KVCache`.

    Attributes
    ----------
    cache : pagedkv.KVCache
        The paged storage; ``cache.stats()`` reports pages in use, the peak, window
        evictions and bytes.
    positions : str
        The positions mode given.

    Raises
    ------
    ValueError
        For sizes out of range, an unsupported dtype, ``sink_tokens`` without a window
        (a cache would silently ignore them), ``num_threads`` < 1, or ``positions``
        not ``"absolute"``/``"cache"`` or ``"cache"`` without a window and sinks.
    MemoryError
        If the pool cannot be allocated.

    Notes
    -----
    Memory: ``num_pages * page_size * 2 * num_layers * num_kv_heads * head_dim`` times
    the dtype size, in bytes (SmolLM2-135M: 23,040 bytes per token in float16, 46,080 in
    float32); pages are touched only once written.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        *,
        page_size: int = 16,
        dtype=np.float16,
        window: int | None = None,
        sink_tokens: int = 0,
        num_threads: int | Literal["auto"] | None = AUTO,
        positions: str = "absolute",
        enable_prefix_caching: bool = False,
        tier=None,
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_pages", num_pages), ("page_size", page_size)):
            _check_size(name, value, 1)
        check_window(window, sink_tokens)
        check_positions(positions, window, sink_tokens)
        auto_threads = isinstance(num_threads, str) and num_threads == AUTO
        num_threads = resolve_num_threads(num_threads)
        if isinstance(dtype, str) and dtype in PAGE_FORMATS:
            kv_dtype = dtype
        else:
            try:
                np_dtype = np.dtype(dtype)
            except TypeError:
                np_dtype = None
            if np_dtype not in SUPPORTED_DTYPES:
                raise ValueError(f"Invalid value of dtype: expected one of {PAGE_FORMATS}, got {dtype!r}")
            kv_dtype = np_dtype.name
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.window = None if window is None else int(window)
        self.sink_tokens = int(sink_tokens)
        self.num_threads = None if num_threads is None else int(num_threads)
        self._auto_threads = auto_threads  # after the setter, which clears it
        self.positions = positions
        self.cache = KVCache(self.num_layers, self.num_kv_heads, self.head_dim, int(num_pages),
                             page_size=int(page_size), kv_dtype=kv_dtype, window=self.window,
                             sink_tokens=self.sink_tokens, enable_prefix_caching=bool(enable_prefix_caching),
                             tier=tier)

    @staticmethod
    def pages_for(
        sequence_lengths: Iterable[int],
        page_size: int = 16,
        window: int | None = None,
        sink_tokens: int = 0,
        max_append_tokens: int | None = None,
    ) -> int:
        """Pages needed to run sequences of the given final lengths together.

        Parameters
        ----------
        sequence_lengths : iterable of int
            Final length in tokens (prompt plus generated) of each sequence that is in
            the cache at the same time.
        page_size : int
        window, sink_tokens
            As for the backend.
        max_append_tokens : int or None
            Longest prefill chunk per sequence, in tokens; None: each sequence's whole
            length (the prompt in one append, the safe upper bound).

        Returns
        -------
        int
            The sum of :func:`max_pages_per_sequence` over the sequences, at least 1.
        """
        total = 0
        for length in sequence_lengths:
            chunk = max(1, length) if max_append_tokens is None else max_append_tokens
            total += max_pages_per_sequence(length, page_size, window, sink_tokens, chunk)
        return max(1, total)

    @classmethod
    def for_config(cls, config, num_pages: int, **kwargs) -> PagedBackend:
        """Backend sized for a :class:`~pagedkv.models.gguf_loader.LlamaConfig`.

        ``num_pages`` and ``kwargs`` are passed to the constructor.
        """
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, num_pages, **kwargs)

    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return int(self.cache.page_size)

    @property
    def dtype(self) -> np.dtype:
        """dtype of the pool array (``KVCache.dtype``; see :attr:`kv_dtype` for the page format)."""
        return self.cache.dtype

    @property
    def kv_dtype(self) -> str:
        """The page format (``KVCache.kv_dtype``): ``"float16"``, ``"float32"``, ``"bfloat16"``, ``"int8"``
        or ``"int4"``."""
        return self.cache.kv_dtype

    @property
    def seq_ids(self) -> list[int]:
        """Sequences currently held."""
        return list(self.cache.seq_ids())

    def stats(self) -> dict:
        """The cache's usage counters (see :meth:`pagedkv.KVCache.stats`)."""
        return self.cache.stats()

    def __contains__(self, seq_id: int) -> bool:
        return isinstance(seq_id, (int, np.integer)) and int(seq_id) in self.cache

    @property
    def prefix_caching(self) -> bool:
        """True when the cache keeps prompt pages for reuse (``enable_prefix_caching``)."""
        return bool(self.cache.prefix_caching)

    def add_sequence(self, seq_id: int, prompt_token_ids=None) -> int:
        """Start a sequence; see :meth:`AttentionBackend.add_sequence`.

        Parameters
        ----------
        seq_id : int
            A new id, >= 0.
        prompt_token_ids : sequence of int or None
            ``[prompt_len]`` token ids of the whole prompt, with prefix caching: the
            sequence starts holding the K/V of its longest cached start (local pages,
            then the tier's), at most ``prompt_len - 1`` tokens so that the last
            prompt token is computed. None starts it empty.

        Returns
        -------
        int
            Prompt tokens served from the prefix cache (and tier), in tokens; the
            caller feeds the prompt from there. 0 without ``prompt_token_ids``.

        Raises
        ------
        ValueError
            ``seq_id`` negative or present, or ``prompt_token_ids`` given without
            prefix caching.
        """
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)) or seq_id < 0:
            raise ValueError(f"Invalid value of seq_id: expected an int >= 0, got {seq_id!r}")
        if prompt_token_ids is None:
            self.cache.add_sequence(int(seq_id))
            return 0
        if not self.prefix_caching:
            raise ValueError("Invalid value of prompt_token_ids: expected None, the backend was made without "
                             "enable_prefix_caching")
        return int(self.cache.add_sequence(int(seq_id), np.asarray(prompt_token_ids, dtype=np.int32)))

    def remove_sequence(self, seq_id: int) -> None:
        """Drop a sequence and its K/V; see :meth:`AttentionBackend.remove_sequence`."""
        self.cache.remove_sequence(int(seq_id))

    def seq_len(self, seq_id: int) -> int:
        """Tokens stored for a sequence; see :meth:`AttentionBackend.seq_len`."""
        return int(self.cache.seq_len(int(seq_id)))

    def begin_forward(self, seq_ids, num_new_tokens) -> PagedForwardBatch:
        """Reserve room for the new tokens of a batch; see :meth:`AttentionBackend.begin_forward`."""
        seq_ids, counts = _check_batch_arguments(seq_ids, num_new_tokens)
        # page_table raises KeyError for an unknown id before anything changes.
        starts = self.cache.page_table(seq_ids).seq_lens
        slot_mapping = self.cache.append(seq_ids, counts)  # all or nothing (OutOfPagesError)
        qo_indptr = np.zeros(seq_ids.size + 1, dtype=np.int64)
        np.cumsum(counts, out=qo_indptr[1:])
        num_tokens = int(qo_indptr[-1])
        positions = np.arange(num_tokens, dtype=np.int64) + np.repeat(starts - qo_indptr[:-1], counts)
        return PagedForwardBatch(
            seq_ids=seq_ids.copy(),
            qo_indptr=qo_indptr,
            positions=positions,
            is_decode=num_tokens == seq_ids.size,
            sink_positions=sink_query_positions(positions, self.positions, self.window, self.sink_tokens),
            slot_mapping=slot_mapping,
        )

    @property
    def num_threads(self) -> int | None:
        """OpenMP threads of the attention kernels (the parameter, ``"auto"`` resolved to a count).

        Setting it to a count or None ends the ``"auto"`` rule for small decode steps.
        """
        return self._num_threads

    @num_threads.setter
    def num_threads(self, value: int | None) -> None:
        """Set the attention threads (an int >= 1, or None for OpenMP's default); ends the ``"auto"`` rule."""
        self._num_threads = value
        self._auto_threads = False

    def _check_batch(self, batch) -> None:
        if not isinstance(batch, PagedForwardBatch):
            raise TypeError(f"Invalid type of batch: expected PagedForwardBatch, got {type(batch).__name__}")

    def store(self, batch: ForwardBatch, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write one layer's K/V of the batch's new tokens; see :meth:`AttentionBackend.store`."""
        self._check_batch(batch)
        self.cache.store(layer, batch.slot_mapping, k, v)

    def attend(self, batch: ForwardBatch, layer: int, q: np.ndarray,
               q_sink: np.ndarray | None = None) -> np.ndarray:
        """Attention of one layer's queries over the cache; see :meth:`AttentionBackend.attend`."""
        self._check_batch(batch)
        if batch.is_decode:
            threads = threads_for_rows(self._num_threads, self._auto_threads, len(batch.seq_ids))
            return attention.decode(q, self.cache, layer, batch.seq_ids, num_threads=threads, q_sink=q_sink)
        return attention.prefill(q, self.cache, layer, batch.seq_ids, batch.qo_indptr,
                                 num_threads=self.num_threads, q_sink=q_sink)
