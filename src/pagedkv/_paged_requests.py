"""The batch rows of a paged transformers cache as :class:`pagedkv.KVCache` sequences.

:class:`pagedkv.transformers.PagedCache` speaks transformers' ``Cache`` protocol (dense
``[batch, kv_heads, tokens, head_dim]`` tensors, one call per layer); the bookkeeping
behind it lives here, in NumPy, without torch or transformers:

- which ``KVCache`` sequence each batch row is, and the dense column count that
  transformers sees (``get_seq_length``, left padding included);
- per forward (at layer 0): which new tokens of each row are stored (the trailing run
  of positions that continues the row; the rest is left padding), the slot mapping of
  the append, the rows of a first forward that repeat an earlier row (they share its
  pages), and the page tables that every layer of the forward reads (:class:`StepPages`);
- edits between forwards: a new request (``begin``), ``reset``, ``crop``, and row
  selection as forks (beam search, ``num_return_sequences``).

The layout and the rules are those of the module docstring of
:mod:`pagedkv.transformers`.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pagedkv import KVCache, OutOfPagesError
from pagedkv.models.attention_backend import sink_query_positions

__all__ = ["GroupStepPages", "PagedRequests", "StepPages", "check_prompts", "default_group_num_pages",
           "default_num_pages"]


def default_num_pages(batch_size: int, max_tokens: int, page_size: int, window: int | None,
                      sink_tokens: int) -> int:
    """Pages for ``batch_size`` rows of ``max_tokens`` tokens each, plus one per row for copy-on-write.

    With a window a row holds at most the window's pages, the sinks' pages and, while a
    prefill chunk longer than the window waits for the next append, the chunk's pages.
    """
    if window is not None:
        per_sequence = -(-(window - 1) // page_size) + 1 + -(-sink_tokens // page_size)
        # A prefill chunk longer than the window holds all its tokens until the next append.
        per_sequence = max(per_sequence, 0) + -(-max_tokens // page_size)
    else:
        per_sequence = -(-max_tokens // page_size)
    return batch_size * (per_sequence + 1)


def default_group_num_pages(batch_size: int, max_tokens: int, page_size: int, num_groups: int) -> int:
    """Pages for ``batch_size`` rows of ``max_tokens`` tokens in each of ``num_groups`` page groups.

    A cache with per-layer attention settings gives every group its own page tables over
    one pool. Each group needs ``ceil(max_tokens / page_size)`` pages per row at worst,
    plus one per row for copy-on-write, whatever its setting: a full-attention group holds
    the whole sequence; a sliding (or chunked) group holds at most
    ``pagedkv.models.decode_page_bound`` pages once decoding, but a prompt chunk is held
    whole until the next append, and its pages never exceed those of the same positions
    under full attention (pages hold page-aligned positions). A prompt of ``max_tokens``
    tokens reaches that worst case in every group at once, so the default does not count
    on the window; pass ``num_pages`` to size the pool for known prompt lengths.
    """
    return num_groups * batch_size * (-(-max_tokens // page_size) + 1)


def check_prompts(input_ids, attention_mask=None) -> tuple[np.ndarray, bool]:
    """Validate the prompts of :meth:`PagedRequests.add_prompts`.

    Parameters
    ----------
    input_ids : array_like, shape ``[batch, prompt_tokens]``, integer
        Token ids, at least one row and one token per row.
    attention_mask : array_like, shape ``[batch, prompt_tokens]``, optional
        1 for tokens, 0 for left padding.

    Returns
    -------
    ids : numpy.ndarray
        ``input_ids`` as an array.
    padded : bool
        Whether the mask has a zero (some row is left-padded).

    Raises
    ------
    ValueError
        ``input_ids`` is not 2-D with at least one token per row, or the mask's shape
        differs.
    """
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"Invalid shape of input_ids: expected [batch >= 1, tokens >= 1] integers, got {ids.shape}")
    if attention_mask is None:
        return ids, False
    mask = np.asarray(attention_mask)
    if mask.shape != ids.shape:
        raise ValueError(f"Invalid shape of attention_mask: expected {ids.shape}, got {mask.shape}")
    return ids, not bool(np.all(mask != 0))


class StepPages:
    """The attention contract of :class:`pagedkv.KVCache` with one forward step's page tables.

    Every layer of a forward reads the same page tables (``KVCache.store`` writes rows,
    it never changes a table), so the step exports them once (``KVCache.page_table``) and
    the kernels of all layers reuse the export instead of building and converting it per
    layer. Valid until the rows change: :class:`PagedRequests` drops it at the next
    forward and at every edit (``crop``, forks, ``reset``, ``add_prompts``).
    """

    __slots__ = ("kv", "kv_dtype", "window", "sink_tokens", "num_layers", "page_size", "num_kv_heads", "head_dim",
                 "_kv_cache", "_seq_ids", "_view")

    def __init__(self, kv_cache: KVCache, seq_ids: np.ndarray) -> None:
        self.kv = kv_cache.kv
        self.kv_dtype = kv_cache.kv_dtype
        self.window = kv_cache.window
        self.sink_tokens = kv_cache.sink_tokens
        self.num_layers = kv_cache.num_layers
        self.page_size = kv_cache.page_size
        self.num_kv_heads = kv_cache.num_kv_heads
        self.head_dim = kv_cache.head_dim
        self._kv_cache = kv_cache
        self._seq_ids = seq_ids
        self._view = kv_cache.page_table(seq_ids)

    def page_table(self, seq_ids):
        """The step's export for the step's own ``seq_ids`` array; any other batch is exported anew."""
        if seq_ids is self._seq_ids:
            return self._view
        return self._kv_cache.page_table(seq_ids)


class GroupStepPages:
    """The attention contract of a :class:`pagedkv.KVCache` with page groups, for one forward.

    With per-layer attention settings each page group has its own page tables; the layers
    of one group read the same export. The kernels call :meth:`layer_attention_view`
    (the per-layer form of the cache contract), which exports a group's page tables at
    the first layer of the group that asks in the forward and hands the same export to
    the group's other layers: one export per group per forward. Valid until the rows
    change, like :class:`StepPages`.

    Parameters
    ----------
    kv_cache : pagedkv.KVCache
        A cache made with ``layer_attention``.
    seq_ids : numpy.ndarray
        int64, shape ``[batch]``: the forward's rows, the array the kernels receive.
    layers : list of tuple
        Per layer ``(pages, group, window, sink_tokens, chunk_size)``: the layer's view
        of the pool (``KVCache.layer_pages``), its group and its mask settings, made once
        per pool by :func:`layer_layout`.
    """

    __slots__ = ("kv_dtype", "num_layers", "page_size", "num_kv_heads", "head_dim", "_kv_cache", "_seq_ids",
                 "_layers", "_views", "_grouped")

    def __init__(self, kv_cache: KVCache, seq_ids: np.ndarray, layers: list) -> None:
        self.kv_dtype = kv_cache.kv_dtype
        self.num_layers = kv_cache.num_layers
        self.page_size = kv_cache.page_size
        self.num_kv_heads = kv_cache.num_kv_heads
        self.head_dim = kv_cache.head_dim
        self._kv_cache = kv_cache
        self._seq_ids = seq_ids
        self._layers = layers
        self._views = [None] * kv_cache.num_groups
        self._grouped = kv_cache.num_groups > 1

    def layer_attention_view(self, layer: int, seq_ids):
        """``(pages, view, window, sink_tokens, chunk_size)`` of ``layer``, as ``KVCache.layer_attention_view``.

        The step's own ``seq_ids`` array reads the step's export of the layer's group
        (made at its first use); any other batch is answered by the cache anew.
        """
        if seq_ids is not self._seq_ids:
            return self._kv_cache.layer_attention_view(layer, seq_ids)
        pages, group, window, sink_tokens, chunk_size = self._layers[layer]
        view = self._views[group]
        if view is None:
            kv = self._kv_cache
            view = kv.page_table(seq_ids, group=group) if self._grouped else kv.page_table(seq_ids)
            self._views[group] = view
        return pages, view, window, sink_tokens, chunk_size


def layer_layout(kv_cache: KVCache) -> list:
    """Per layer ``(pages, group, window, sink_tokens, chunk_size)`` of a cache with page groups."""
    layout = []
    for layer in range(kv_cache.num_layers):
        setting = kv_cache.layer_setting(layer)
        layout.append((kv_cache.layer_pages(layer), kv_cache.layer_group(layer), setting.window,
                       setting.sink_tokens, setting.chunk_size))
    return layout


class PagedRequests:
    """The rows of a batch as ``KVCache`` sequences, and what each forward stores of them.

    Parameters
    ----------
    window : int or None
        Sliding window in tokens of the layers that slide (None: none slides).
    sink_tokens : int
        Attention-sink tokens of the layers that slide.
    positions : str
        ``"absolute"`` or ``"cache"`` (validated by the caller).
    inv_freq : numpy.ndarray or None
        float64, shape ``[rotary_dim // 2]``: rotary inverse frequencies in radians per
        token, for ``positions="cache"``; None otherwise.
    releases : bool
        Whether some layer releases keys (a window or chunks): then ``crop`` is refused.
        Default: whether ``window`` is set.

    Attributes
    ----------
    kv_cache : pagedkv.KVCache or None
        The paged storage; the owner assigns it before the first forward or request.
    seq_ids : list of int
        The sequence id of each batch row, in row order.
    num_columns : int
        Dense columns per row, left padding included (``get_seq_length``).
    num_stored_tokens : int
        Tokens appended to pages since creation (padding and duplicate rows excluded).
    slots : numpy.ndarray or None
        Slot mapping of the forward's append, one per stored token, rows after rows:
        int64 ``[stored_tokens]``, or ``[num_groups, stored_tokens]`` for a cache with
        page groups (row ``g``: the slots in group ``g``'s pages).
    counts, stored, starts : numpy.ndarray
        int64, shape ``[batch]``, per row of the forward: new tokens that continue the
        row (the rest is left padding), tokens appended (``counts``, or 0 for a row that
        shares an earlier row's pages), and the index of its first counted token among
        the new tokens (``new_tokens - counts``).
    lengths_before, lengths : numpy.ndarray
        int64, shape ``[batch]``: each row's tokens before and after the forward's append.
    unpadded : bool
        No row of the forward has left padding.
    dense_rows : bool
        ... and every row stores all its new tokens (no duplicate rows).
    step_seq_ids : numpy.ndarray
        int64, shape ``[batch]``: ``seq_ids`` as the array the kernels receive.
    pages : StepPages or GroupStepPages or None
        The forward's page tables, made by the first attention call that needs them;
        None after every change of the rows.
    """

    def __init__(self, *, window: int | None, sink_tokens: int, positions: str,
                 inv_freq: np.ndarray | None, releases: bool | None = None) -> None:
        self._window = window
        self._releases = window is not None if releases is None else bool(releases)
        self._sink_tokens = sink_tokens
        self._positions = positions
        self._inv_freq = inv_freq
        self.kv_cache: KVCache | None = None
        self.num_stored_tokens = 0
        self.seq_ids: list[int] = []
        self._next_seq_id = 0
        self.num_columns = 0
        self.slots: np.ndarray | None = None
        self.counts = np.zeros(0, dtype=np.int64)
        self.stored = np.zeros(0, dtype=np.int64)
        self.starts = np.zeros(0, dtype=np.int64)
        self.lengths_before = np.zeros(0, dtype=np.int64)
        self.lengths = np.zeros(0, dtype=np.int64)
        self.unpadded = True
        self.dense_rows = True
        self.step_seq_ids = np.zeros(0, dtype=np.int64)
        self.pages: StepPages | None = None

    def _new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    # ------------------------------------------------------------------ requests
    def add_prompts(self, ids: np.ndarray, padded: bool) -> int:
        """Add one sequence per prompt row to an empty batch (after :func:`check_prompts`).

        With prefix caching each row starts on the cached full pages its prompt matches
        (none when ``padded``); every row is truncated to the smallest hit, which is
        returned (0, every row truncated to 0, when a window refuses that truncation).
        """
        kv = self.kv_cache
        hits = []
        for row in ids:
            seq_id = self._new_seq_id()
            hit = kv.add_sequence(seq_id, prompt_token_ids=row.tolist() if not padded else None)
            self.seq_ids.append(seq_id)
            hits.append(hit)
        common = min(hits)
        try:
            for seq_id, hit in zip(self.seq_ids, hits):
                if hit > common:
                    kv.truncate(seq_id, common)
        except ValueError:
            # A sliding window started the row past keys the common length needs (the pages
            # before its window were not taken): every row starts cold instead.
            for seq_id in self.seq_ids:
                kv.truncate(seq_id, 0)
            common = 0
        self.num_columns = common
        return common

    def reset(self) -> None:
        """Remove every row's sequence (cached prefix pages stay findable); no rows after."""
        if self.kv_cache is not None:
            for seq_id in self.seq_ids:
                self.kv_cache.remove_sequence(seq_id)
        self.seq_ids = []
        self.num_columns = 0
        self.slots = None
        self.pages = None

    def stats(self) -> dict:
        """``KVCache.stats()`` plus ``num_stored_tokens``; empty dict without a pool."""
        if self.kv_cache is None:
            return {}
        return self.kv_cache.stats() | {"num_stored_tokens": self.num_stored_tokens}

    # ------------------------------------------------------------------ forward
    def row_positions(self, positions: np.ndarray | None, batch_size: int, num_new: int) -> np.ndarray:
        """The new tokens' positions ``[batch, new_tokens]`` (int64) from ``[batch or 1, new_tokens]``.

        None (no ``position_ids``): every row continues at ``num_columns``.
        """
        if positions is None:
            start = self.num_columns
            return np.broadcast_to(np.arange(start, start + num_new, dtype=np.int64), (batch_size, num_new))
        positions = positions.astype(np.int64, copy=False)
        if positions.ndim == 1:
            positions = positions[None, :]
        if positions.ndim != 2 or positions.shape[1] != num_new or positions.shape[0] not in (1, batch_size):
            raise ValueError(
                f"Invalid shape of position_ids: expected [{batch_size} or 1, {num_new}], got {tuple(positions.shape)}"
            )
        return np.broadcast_to(positions, (batch_size, num_new))

    def begin_step(self, batch_size: int, num_new: int, positions: np.ndarray | None,
                   same_keys: Callable[[int, int], bool]):
        """Append a forward's new tokens to the rows' page tables (layer 0; the pool must exist).

        Parameters
        ----------
        batch_size, num_new : int
            Rows of the forward and new tokens per row (padding included).
        positions : numpy.ndarray or None
            The forward's ``position_ids``, shape ``[batch or 1, new_tokens]``.
        same_keys : callable
            ``same_keys(row, source)``: whether the layer-0 keys of two rows are equal;
            asked only in a first forward, for rows with equal positions.

        Returns
        -------
        tuple of numpy.ndarray or None
            cos and sin ``[stored_tokens, 1, rotary_dim // 2]`` (float64) that turn each
            stored query into its sink query, see :meth:`sink_query_rotation`.

        Raises
        ------
        ValueError
            A batch size other than the rows held, or positions that do not continue a row.
        pagedkv.OutOfPagesError
            No room for the new tokens; nothing is appended.
        """
        kv = self.kv_cache
        if not self.seq_ids and self.num_columns == 0:
            for _ in range(batch_size):
                seq_id = self._new_seq_id()
                kv.add_sequence(seq_id)
                self.seq_ids.append(seq_id)
        if len(self.seq_ids) != batch_size:
            raise ValueError(
                f"Invalid shape of key_states: expected batch size {len(self.seq_ids)} (the rows the cache holds), "
                f"got {batch_size}"
            )
        positions = self.row_positions(positions, batch_size, num_new)
        counts = np.empty(batch_size, dtype=np.int64)
        lengths = np.empty(batch_size, dtype=np.int64)
        for row, seq_id in enumerate(self.seq_ids):
            length = kv.seq_len(seq_id)
            lengths[row] = length
            count = int(positions[row, -1]) - length + 1
            if not 0 <= count <= num_new or not np.array_equal(
                    positions[row, num_new - count:], np.arange(length, length + count)):
                raise ValueError(
                    f"Invalid value of position_ids: row {row} holds {length} tokens, so its new tokens must end "
                    f"with consecutive positions starting at {length} (earlier ones are left padding); "
                    f"got {positions[row].tolist()}"
                )
            counts[row] = count
        duplicates = self._duplicate_rows(positions, same_keys) if self.num_columns == 0 else {}
        stored = counts.copy()
        for row in duplicates:
            stored[row] = 0
        try:
            self.slots = kv.append(self.seq_ids, stored)
        except OutOfPagesError as exc:
            # The core's figure covers this forward; a generation keeps appending.
            raise OutOfPagesError(
                f"{exc} (That is this forward's need: every later token needs room too, so size the pool "
                f"for the longest row a generation reaches, prompt plus new tokens: PagedCache(config, "
                f"max_tokens=...) without num_pages does that for each page group.)"
            ) from None
        for row, source in duplicates.items():
            # Same tokens at the same positions as an earlier row (generate expands the
            # prompt once per beam or returned sequence): share that row's pages, which the
            # stores of this forward fill for both.
            child = self._new_seq_id()
            kv.fork(self.seq_ids[source], child)
            kv.remove_sequence(self.seq_ids[row])
            self.seq_ids[row] = child
        self.stored = stored
        self.counts = counts
        self.lengths_before = lengths
        self.lengths = lengths + counts
        self.starts = num_new - counts
        self.unpadded = bool((counts == num_new).all())
        self.dense_rows = self.unpadded and not duplicates
        self.step_seq_ids = np.asarray(self.seq_ids, dtype=np.int64)
        self.pages = None
        self.num_columns += num_new
        self.num_stored_tokens += int(stored.sum())
        return self.sink_query_rotation(lengths, counts)

    def undo_step(self, num_new: int) -> None:
        """Take back the last :meth:`begin_step` (``num_new`` new tokens per row), before its next one.

        Rows are truncated to their lengths before it; a first forward (the rows were made
        by it) or a row whose window cannot be truncated back removes every row instead,
        as :meth:`reset` does.
        """
        self.pages = None
        self.slots = None
        self.num_stored_tokens -= int(self.stored.sum())
        if self.num_columns == num_new:
            self.reset()
            return
        try:
            for seq_id, length in zip(self.seq_ids, self.lengths_before.tolist()):
                self.kv_cache.truncate(seq_id, length)
        except ValueError:
            self.reset()
            return
        self.num_columns -= num_new

    @staticmethod
    def _duplicate_rows(positions: np.ndarray, same_keys: Callable[[int, int], bool]) -> dict[int, int]:
        """Rows of a first forward whose positions and layer-0 keys equal an earlier row's."""
        duplicates: dict[int, int] = {}
        for row in range(1, positions.shape[0]):
            for source in range(row):
                if source not in duplicates and np.array_equal(positions[row], positions[source]) \
                        and same_keys(row, source):
                    duplicates[row] = source
                    break
        return duplicates

    def sink_query_rotation(self, lengths: np.ndarray, counts: np.ndarray):
        """cos/sin ``[T, 1, R/2]`` rotating each stored query from ``p`` to ``min(p, S + W - 1)``.

        The queries arrive rotated to their absolute positions ``p`` (rows after rows,
        ``counts[b]`` from position ``lengths[b]``); rotary rotations compose, so turning
        one by ``min(p, S + W - 1) - p`` gives the query of StreamingLLM's cache positions.
        None in absolute mode or while no query is past ``S + W - 1``.
        """
        if self._inv_freq is None:
            return None
        query_positions = np.repeat(lengths, counts) + (
            np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts))
        sink_positions = sink_query_positions(query_positions, self._positions, self._window, self._sink_tokens)
        if sink_positions is None:
            return None
        angles = (sink_positions - query_positions).astype(np.float64)[:, None] * self._inv_freq[None, :]
        return np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]

    # ------------------------------------------------------------------ edits
    def crop(self, tokens_to_remove) -> None:
        """Drop the newest columns of every row; see :meth:`pagedkv.transformers.PagedCache.crop`."""
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)):
            raise ValueError(f"Invalid value of tokens_to_remove: expected an integer, got {tokens_to_remove!r}")
        keep = self.num_columns + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, self.num_columns)
        if keep >= self.num_columns or self.kv_cache is None:
            return
        if self._releases:
            raise ValueError(
                "Invalid call of crop: a PagedCache with sliding-window or chunked layers does not crop (the "
                "window may already have released positions a crop would return to); assisted and "
                "prompt-lookup decoding crop rejected tokens, so they need a model whose layers all attend fully"
            )
        if keep < 0:
            raise ValueError(f"Invalid value of tokens_to_remove: expected >= {-self.num_columns}, got {tokens_to_remove}")
        removed = self.num_columns - keep
        lengths = [self.kv_cache.seq_len(s) for s in self.seq_ids]
        if any(n < removed for n in lengths):
            raise ValueError(
                f"Invalid value of tokens_to_remove: removing {removed} columns reaches the left padding of a row "
                f"holding {min(lengths)} tokens"
            )
        self.pages = None
        for seq_id, n in zip(self.seq_ids, lengths):
            self.kv_cache.truncate(seq_id, n - removed)
        self.num_columns = keep

    def select_rows(self, source_rows: np.ndarray) -> None:
        """Make row ``i`` a fork of current row ``source_rows[i]`` (pages shared, copy-on-write).

        The first new row of each source keeps the source's sequence; only its further
        rows fork it, and sources that no row takes are removed. A permutation of the
        rows (the common beam-search step) forks and removes nothing.

        Raises ValueError for an index out of range, before any change.
        """
        if self.kv_cache is None or not self.seq_ids:
            return
        if source_rows.ndim != 1 or (source_rows.size and (source_rows.min() < 0
                                                          or source_rows.max() >= len(self.seq_ids))):
            raise ValueError(
                f"Invalid value of indices: expected row indices in [0, {len(self.seq_ids)}), got {source_rows.tolist()}"
            )
        if source_rows.size == len(self.seq_ids) and np.array_equal(source_rows, np.arange(len(self.seq_ids))):
            return
        kv = self.kv_cache
        self.pages = None
        old_ids = self.seq_ids
        # A fork is an exact copy of its parent's table (pages, ring, hashes), so the
        # first taker may keep the parent itself: the same ref counts and copy-on-write
        # copies as forking every row and removing every source, without the calls.
        taken = [False] * len(old_ids)
        new_ids = []
        for src in source_rows.tolist():
            if taken[src]:
                child = self._new_seq_id()
                kv.fork(old_ids[src], child)
                new_ids.append(child)
            else:
                taken[src] = True
                new_ids.append(old_ids[src])
        for seq_id, kept in zip(old_ids, taken):
            if not kept:
                kv.remove_sequence(seq_id)
        self.seq_ids = new_ids
