"""Where a model's keys and values live: the attention backend interface and a dense one.

A forward pass over a batch of sequences talks to its backend in three steps:

1. ``batch = backend.begin_forward(seq_ids, num_new_tokens)`` once per forward: the
   backend makes room for the new tokens of every sequence and returns their absolute
   positions (for rotary embeddings) and the ragged layout of the batch.
2. For every layer, after the rotary embedding:
   ``backend.store(batch, layer, k, v)`` keeps the new keys/values, then
   ``out = backend.attend(batch, layer, q)`` returns the attention output of the new
   queries over everything the sequence may see (its earlier tokens and the new ones).
3. ``backend.end_forward(batch)`` once the last layer is done.

The new tokens are packed sequence after sequence: sequence ``i`` owns rows
``qo_indptr[i]:qo_indptr[i+1]`` of ``q``, ``k`` and ``v`` (FlashInfer's ragged "qo_indptr"
layout). A decode step is the case of exactly one new token per sequence.

This shape maps one-to-one onto a paged cache: ``begin_forward`` is one append per
sequence (returning the slot mapping), ``store`` is a scatter of ``k``/``v`` through that
slot mapping, and ``attend`` is a paged prefill or decode kernel.

Window semantics (as in ``pagedkv.KVCache``): with ``window=W`` and ``sink_tokens=S`` the query at
position ``p`` attends to the keys at positions ``[p-W+1, p]`` plus ``[0, S)``; without
a window it attends to ``[0, p]`` (causal).

Positions (the rotary positions of a windowed sequence): ``"absolute"`` rotates every
token to its position in the sequence. ``"cache"`` gives the positions inside the cache
of StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention
Sinks", section 3.2): the sinks at ``0 .. S-1`` and the window right after them, so no
query-key distance exceeds ``S + W - 1`` however long the sequence grows. Keys are stored
rotated to their absolute positions in both modes, which already gives every window key
its cache distance ``p - k``; only the sink keys ``j`` need the distance
``min(p, S + W - 1) - j``, which a second query rotated to ``min(p, S + W - 1)`` provides
(``ForwardBatch.sink_positions``, the ``q_sink`` of :meth:`AttentionBackend.attend`).
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np

from pagedkv_c._checks import check_sink_window


@dataclass
class ForwardBatch:
    """Layout of the new tokens of one forward pass.

    Attributes
    ----------
    seq_ids : numpy.ndarray
        int64, shape ``[batch_size]``: the sequences in the batch, in row order.
    qo_indptr : numpy.ndarray
        int64, shape ``[batch_size + 1]``: sequence ``i`` owns token rows
        ``qo_indptr[i]:qo_indptr[i+1]``; ``qo_indptr[0] == 0``,
        ``qo_indptr[-1] == num_tokens``.
    positions : numpy.ndarray
        int64, shape ``[num_tokens]``: absolute position in its sequence of every new
        token (the sequence length before the call plus 0, 1, ...).
    is_decode : bool
        True when every sequence has exactly one new token.
    sink_positions : numpy.ndarray or None
        int64, shape ``[num_tokens]``: with ``"cache"`` positions, the position each
        new query is rotated to for the sink keys, ``min(p, S + W - 1)``; None when
        the sinks take the queries at their absolute positions (``"absolute"``
        positions, or no query yet past ``S + W - 1``).
    """

    seq_ids: np.ndarray
    qo_indptr: np.ndarray
    positions: np.ndarray
    is_decode: bool
    sink_positions: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        """New tokens in the batch, over all sequences."""
        return int(self.qo_indptr[-1])

    @property
    def batch_size(self) -> int:
        """Sequences in the batch."""
        return int(self.seq_ids.shape[0])


class AttentionBackend(abc.ABC):
    """Interface between a model's layers and the storage of its keys and values.

    Implementations own the keys/values of many sequences and every layer. Arrays passed
    in are float32 and C-contiguous; ``T`` is ``batch.num_tokens``, ``Hq``/``Hkv`` the
    query/key-value heads (GQA: query head ``h`` reads key-value head
    ``h // (Hq // Hkv)``), ``D`` the head size. Keys arrive after the rotary embedding.

    Attributes
    ----------
    num_layers, num_kv_heads, head_dim : int
        Shape of the stored keys/values.
    window : int or None
        Sliding window in tokens, None for full attention.
    sink_tokens : int
        Attention sinks: first positions every query keeps seeing (0 without a window).
    positions : str
        ``"absolute"`` or ``"cache"`` (StreamingLLM): see the module notes.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    sink_tokens: int
    positions: str = "absolute"

    @abc.abstractmethod
    def __contains__(self, seq_id: int) -> bool:
        """True if ``seq_id`` has been added and not removed."""

    @abc.abstractmethod
    def add_sequence(self, seq_id: int) -> None:
        """Start an empty sequence.

        Raises
        ------
        ValueError
            If ``seq_id`` is negative or already present.
        """

    @abc.abstractmethod
    def remove_sequence(self, seq_id: int) -> None:
        """Forget a sequence and release its keys/values.

        Raises
        ------
        KeyError
            If ``seq_id`` is unknown.
        """

    @abc.abstractmethod
    def seq_len(self, seq_id: int) -> int:
        """Tokens appended to ``seq_id`` so far (including any that left the window).

        Raises
        ------
        KeyError
            If ``seq_id`` is unknown.
        """

    @abc.abstractmethod
    def begin_forward(self, seq_ids: np.ndarray, num_new_tokens: np.ndarray) -> ForwardBatch:
        """Make room for new tokens and return the batch layout.

        Parameters
        ----------
        seq_ids : numpy.ndarray
            int64, shape ``[batch_size]``, distinct known sequences.
        num_new_tokens : numpy.ndarray
            int64, shape ``[batch_size]``, each >= 1.

        Returns
        -------
        ForwardBatch
            Pass it to :meth:`store`, :meth:`attend` and :meth:`end_forward`. Every
            sequence's length has grown by its ``num_new_tokens``.

        Raises
        ------
        KeyError
            If a sequence is unknown.
        ValueError
            For duplicate ids, counts < 1 or mismatched shapes; nothing changes.
        """

    @abc.abstractmethod
    def store(self, batch: ForwardBatch, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Keep the keys and values of the batch's new tokens for ``layer``.

        Parameters
        ----------
        batch : ForwardBatch
            From :meth:`begin_forward` of this backend.
        layer : int
            In ``[0, num_layers)``.
        k, v : numpy.ndarray
            float32, shape ``[T, Hkv, D]``, rows in ``batch`` order.
        """

    @abc.abstractmethod
    def attend(self, batch: ForwardBatch, layer: int, q: np.ndarray,
               q_sink: np.ndarray | None = None) -> np.ndarray:
        """Attention output of the new queries of ``layer`` (call after :meth:`store`).

        Parameters
        ----------
        batch : ForwardBatch
        layer : int
        q : numpy.ndarray
            float32, shape ``[T, Hq, D]``, after the rotary embedding, not yet scaled.
        q_sink : numpy.ndarray or None
            float32, shape ``[T, Hq, D]``: the queries rotated to
            ``batch.sink_positions``, which score the sink keys (positions
            ``< sink_tokens``) in place of ``q``; pass it whenever
            ``batch.sink_positions`` is not None, else None.

        Returns
        -------
        numpy.ndarray
            float32, shape ``[T, Hq, D]``: ``softmax(q k^T / sqrt(D) + mask) v`` per
            head, the mask being causal, windowed and with sinks as described in the
            module notes.
        """

    def end_forward(self, batch: ForwardBatch) -> None:  # noqa: B027 - optional hook
        """Called once after the last layer of a forward pass; the default does nothing."""


def _as_index_array(values, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise ValueError(
            f"Invalid shape or dtype of {name}: expected a 1-D integer array, "
            f"got shape {array.shape} dtype {array.dtype}"
        )
    return array.astype(np.int64, copy=False)


def _check_batch_arguments(seq_ids, num_new_tokens) -> tuple[np.ndarray, np.ndarray]:
    """``begin_forward``'s arguments as int64 arrays: distinct ids, one count >= 1 per id, at least one.

    Raises ValueError naming the argument.
    """
    seq_ids = _as_index_array(seq_ids, "seq_ids")
    counts = _as_index_array(num_new_tokens, "num_new_tokens")
    if seq_ids.shape != counts.shape or seq_ids.size == 0:
        raise ValueError(
            f"Invalid shape of num_new_tokens: expected {seq_ids.shape} (one count per sequence, "
            f"at least one sequence), got {counts.shape}"
        )
    if np.unique(seq_ids).size != seq_ids.size:
        raise ValueError(f"Invalid value of seq_ids: expected distinct ids, got {seq_ids.tolist()}")
    if counts.min() < 1:
        raise ValueError(f"Invalid value of num_new_tokens: expected counts >= 1, got {counts.tolist()}")
    return seq_ids, counts


def check_window(window: int | None, sink_tokens: int) -> None:
    """Validate a sliding window and sink count.

    Raises
    ------
    ValueError
        If ``window`` is not None and < 1, if ``sink_tokens`` < 0, or if
        ``sink_tokens`` > 0 without a window.
    """
    if window is not None and (not isinstance(window, (int, np.integer)) or window < 1):
        raise ValueError(f"Invalid value of window: expected None or an int >= 1, got {window!r}")
    if not isinstance(sink_tokens, (int, np.integer)) or sink_tokens < 0:
        raise ValueError(f"Invalid value of sink_tokens: expected an int >= 0, got {sink_tokens!r}")
    check_sink_window(window, sink_tokens)  # the wording KVCache and the CLI use


POSITIONS = ("absolute", "cache")


def check_positions(positions: str, window: int | None, sink_tokens: int) -> str:
    """Validate a positions mode against the window and the sinks.

    Parameters
    ----------
    positions : str
        ``"absolute"`` or ``"cache"``.
    window : int or None
        Sliding window in tokens.
    sink_tokens : int
        Attention sinks in tokens.

    Returns
    -------
    str
        ``positions``.

    Raises
    ------
    ValueError
        If ``positions`` is not one of :data:`POSITIONS`, or is ``"cache"`` without a
        window or without sinks: cache positions differ from absolute ones only in the
        distance to the sink keys, so without them there is nothing to change.
    """
    if positions not in POSITIONS:
        raise ValueError(f"Invalid value of positions: expected one of {POSITIONS}, got {positions!r}")
    if positions == "cache" and (window is None or sink_tokens < 1):
        raise ValueError(
            "Invalid value of positions: 'cache' needs a sliding window and at least one attention "
            "sink (cache positions change only the distance from a query to the sink keys; without "
            "a window no key ever leaves the cache, and without sinks every distance is already the "
            f"same as with absolute positions), got window={window!r}, sink_tokens={sink_tokens}"
        )
    return positions


def sink_query_positions(positions: np.ndarray, mode: str, window: int | None,
                         sink_tokens: int) -> np.ndarray | None:
    """Positions the queries take for the sink keys: ``min(p, S + W - 1)`` in ``"cache"`` mode.

    Parameters
    ----------
    positions : numpy.ndarray
        int64, shape ``[T]``: absolute positions of the new queries.
    mode : str
        ``"absolute"`` or ``"cache"`` (validated by :func:`check_positions`).
    window, sink_tokens : int
        W and S.

    Returns
    -------
    numpy.ndarray or None
        int64, shape ``[T]``; None when every entry would equal ``positions``
        (absolute mode, or no query past ``S + W - 1`` yet).

    Notes
    -----
    A query at ``p <= S + W - 1`` has seen no key leave (its window starts at or below
    ``S``), so its cache positions equal the absolute ones. Past that the cache holds
    ``S + W`` keys and the query is the last of them, at cache position ``S + W - 1``
    (StreamingLLM, Xiao et al. 2023, section 3.2).
    """
    if mode != "cache" or positions.size == 0:
        return None
    last = sink_tokens + window - 1
    if int(positions.max()) <= last:
        return None
    return np.minimum(positions, last)


def attention_mask(
    query_positions: np.ndarray,
    key_positions: np.ndarray,
    window: int | None = None,
    sink_tokens: int = 0,
) -> np.ndarray:
    """Boolean mask of which keys each query may attend to.

    Parameters
    ----------
    query_positions : numpy.ndarray
        int64, shape ``[n]``.
    key_positions : numpy.ndarray
        int64, shape ``[m]``.
    window : int or None
        Sliding window W in tokens; None for plain causal attention.
    sink_tokens : int
        Sink positions ``[0, S)`` that stay visible with a window.

    Returns
    -------
    numpy.ndarray
        bool, shape ``[n, m]``: ``k <= p`` and, with a window,
        ``k >= p - W + 1 or k < S`` (``p`` the query, ``k`` the key position).
    """
    p = np.asarray(query_positions, dtype=np.int64)[:, None]
    k = np.asarray(key_positions, dtype=np.int64)[None, :]
    allowed = k <= p
    if window is not None:
        allowed &= (k >= p - window + 1) | (k < sink_tokens)
    return allowed


@dataclass
class _KeyPlan:
    """Which stored keys a sequence's new queries read, and how they are masked."""

    ranges: list[tuple[int, int]]  # [start, stop) position ranges, ascending
    bias: np.ndarray | None  # float32 [n, num_keys] of 0 / -inf, None when all visible


@dataclass
class DenseForwardBatch(ForwardBatch):
    """:class:`ForwardBatch` plus the dense backend's per-sequence key plans."""

    key_plans: list[_KeyPlan] = field(default_factory=list)


class DenseBackend(AttentionBackend):
    """Reference backend: contiguous NumPy keys/values per sequence, exact softmax.

    Every sequence keeps all its keys/values (nothing is evicted, even with a window:
    the window is applied as a mask), in arrays of shape
    ``(num_layers, num_kv_heads, capacity, head_dim)`` that double in capacity when
    full. Several sequences can be decoded together and a forward may carry a ragged
    prefill chunk (any number of new tokens per sequence).

    Parameters
    ----------
    num_layers : int
    num_kv_heads : int
    head_dim : int
    window : int or None
        Sliding window W in tokens (None: full causal attention).
    sink_tokens : int
        Attention sinks S kept visible with a window (StreamingLLM, Xiao et al. 2023).
    initial_capacity : int
        Token capacity allocated for a new sequence.
    positions : str
        ``"absolute"`` (default) or ``"cache"`` (StreamingLLM positions inside the cache;
        needs a window and sinks): see the module notes.

    Raises
    ------
    ValueError
        For sizes < 1, an invalid window/sink combination (see :func:`check_window`) or
        positions mode (see :func:`check_positions`).

    Notes
    -----
    Memory: ``2 * num_layers * num_kv_heads * head_dim * 4`` bytes per token of capacity
    (46 KiB for SmolLM2-135M). Each layer's attention costs O(new tokens x visible keys)
    per sequence; a windowed query reads only its window and sinks.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        window: int | None = None,
        sink_tokens: int = 0,
        initial_capacity: int = 256,
        positions: str = "absolute",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("initial_capacity", initial_capacity)):
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Invalid value of {name}: expected an int >= 1, got {value!r}")
        check_window(window, sink_tokens)
        self.positions = check_positions(positions, window, sink_tokens)
        self.num_layers = int(num_layers)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        self.window = None if window is None else int(window)
        self.sink_tokens = int(sink_tokens)
        self._initial_capacity = int(initial_capacity)
        self._keys: dict[int, np.ndarray] = {}
        self._values: dict[int, np.ndarray] = {}
        self._lengths: dict[int, int] = {}

    @classmethod
    def for_config(cls, config, **kwargs) -> DenseBackend:
        """Backend sized for a :class:`~pagedkv.models.gguf_loader.LlamaConfig`."""
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, **kwargs)

    @property
    def seq_ids(self) -> list[int]:
        """Sequences currently held, in insertion order."""
        return list(self._lengths)

    def __contains__(self, seq_id: int) -> bool:
        return isinstance(seq_id, (int, np.integer)) and int(seq_id) in self._lengths

    def add_sequence(self, seq_id: int) -> None:
        """Start an empty sequence; see :meth:`AttentionBackend.add_sequence`."""
        if not isinstance(seq_id, (int, np.integer)) or seq_id < 0:
            raise ValueError(f"Invalid value of seq_id: expected an int >= 0, got {seq_id!r}")
        seq_id = int(seq_id)
        if seq_id in self._lengths:
            raise ValueError(f"Invalid value of seq_id: expected a new sequence, got {seq_id} which exists")
        shape = (self.num_layers, self.num_kv_heads, self._initial_capacity, self.head_dim)
        self._keys[seq_id] = np.empty(shape, dtype=np.float32)
        self._values[seq_id] = np.empty(shape, dtype=np.float32)
        self._lengths[seq_id] = 0

    def remove_sequence(self, seq_id: int) -> None:
        """Drop a sequence and its K/V; see :meth:`AttentionBackend.remove_sequence`."""
        seq_id = int(seq_id)
        if seq_id not in self._lengths:
            raise KeyError(f"Unknown seq_id {seq_id}")
        del self._keys[seq_id], self._values[seq_id], self._lengths[seq_id]

    def seq_len(self, seq_id: int) -> int:
        """Tokens stored for a sequence; see :meth:`AttentionBackend.seq_len`."""
        seq_id = int(seq_id)
        if seq_id not in self._lengths:
            raise KeyError(f"Unknown seq_id {seq_id}")
        return self._lengths[seq_id]

    def _plan_keys(self, start: int, stop: int) -> _KeyPlan:
        """Keys read by queries at positions ``[start, stop)`` of one sequence."""
        window, sinks = self.window, self.sink_tokens
        lowest = 0 if window is None else max(0, start - window + 1)
        if sinks > 0 and lowest > 0:
            ranges = [(0, min(sinks, lowest)), (lowest, stop)]
        else:
            ranges = [(lowest, stop)]
        n = stop - start
        needs_mask = n > 1  # one query sees exactly the keys planned for it
        bias = None
        if needs_mask:
            key_positions = np.concatenate([np.arange(a, b) for a, b in ranges])
            allowed = attention_mask(np.arange(start, stop), key_positions, window, sinks)
            bias = np.where(allowed, np.float32(0.0), np.float32(-np.inf)).astype(np.float32)
        return _KeyPlan(ranges, bias)

    def begin_forward(self, seq_ids, num_new_tokens) -> DenseForwardBatch:
        """Reserve room for the new tokens of a batch; see :meth:`AttentionBackend.begin_forward`."""
        seq_ids, counts = _check_batch_arguments(seq_ids, num_new_tokens)
        for s in seq_ids.tolist():
            if s not in self._lengths:
                raise KeyError(f"Unknown seq_id {s}")
        # Everything is valid: from here on state changes.
        qo_indptr = np.zeros(seq_ids.size + 1, dtype=np.int64)
        np.cumsum(counts, out=qo_indptr[1:])
        positions = np.empty(int(qo_indptr[-1]), dtype=np.int64)
        plans = []
        for i, (s, n) in enumerate(zip(seq_ids.tolist(), counts.tolist(), strict=True)):
            start = self._lengths[s]
            self._reserve(s, start + n)
            positions[qo_indptr[i]:qo_indptr[i + 1]] = np.arange(start, start + n)
            plans.append(self._plan_keys(start, start + n))
            self._lengths[s] = start + n
        return DenseForwardBatch(
            seq_ids=seq_ids.copy(),
            qo_indptr=qo_indptr,
            positions=positions,
            is_decode=bool(np.all(counts == 1)),
            sink_positions=sink_query_positions(positions, self.positions, self.window, self.sink_tokens),
            key_plans=plans,
        )

    def _reserve(self, seq_id: int, num_tokens: int) -> None:
        keys = self._keys[seq_id]
        capacity = keys.shape[2]
        if num_tokens <= capacity:
            return
        while capacity < num_tokens:
            capacity *= 2
        length = self._lengths[seq_id]
        for store in (self._keys, self._values):
            old = store[seq_id]
            new = np.empty(old.shape[:2] + (capacity,) + old.shape[3:], dtype=np.float32)
            new[:, :, :length] = old[:, :, :length]
            store[seq_id] = new

    def _check_batch(self, batch: ForwardBatch, layer: int, array: np.ndarray, heads: int | None, name: str):
        if not isinstance(batch, DenseForwardBatch):
            raise TypeError(f"Invalid type of batch: expected DenseForwardBatch, got {type(batch).__name__}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"Invalid value of layer: expected [0, {self.num_layers}), got {layer}")
        if array.dtype != np.float32 or array.ndim != 3 or array.shape[0] != batch.num_tokens \
                or array.shape[2] != self.head_dim or (heads is not None and array.shape[1] != heads):
            expected = f"[{batch.num_tokens}, {heads if heads is not None else 'Hq'}, {self.head_dim}] float32"
            raise ValueError(f"Invalid shape of {name}: expected {expected}, got {array.shape} {array.dtype}")

    def store(self, batch: ForwardBatch, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Write one layer's K/V of the batch's new tokens; see :meth:`AttentionBackend.store`."""
        self._check_batch(batch, layer, k, self.num_kv_heads, "k")
        self._check_batch(batch, layer, v, self.num_kv_heads, "v")
        indptr = batch.qo_indptr
        for i, s in enumerate(batch.seq_ids.tolist()):
            a, b = int(indptr[i]), int(indptr[i + 1])
            start = int(batch.positions[a])
            # [n, Hkv, D] -> [Hkv, n, D]
            self._keys[s][layer, :, start:start + b - a] = k[a:b].transpose(1, 0, 2)
            self._values[s][layer, :, start:start + b - a] = v[a:b].transpose(1, 0, 2)

    def attend(self, batch: ForwardBatch, layer: int, q: np.ndarray,
               q_sink: np.ndarray | None = None) -> np.ndarray:
        """Attention of one layer's queries over the cache; see :meth:`AttentionBackend.attend`."""
        self._check_batch(batch, layer, q, None, "q")
        if q_sink is not None:
            self._check_batch(batch, layer, q_sink, q.shape[1], "q_sink")
            if self.window is None or self.sink_tokens == 0:
                raise ValueError("Invalid value of q_sink: expected None for a backend without "
                                 "attention sinks")
        num_heads = q.shape[1]
        if num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"Invalid shape of q: expected a multiple of {self.num_kv_heads} heads, got {num_heads}"
            )
        group = num_heads // self.num_kv_heads
        hkv, d = self.num_kv_heads, self.head_dim
        scale = np.float32(1.0 / np.sqrt(d))
        out = np.empty_like(q)
        indptr = batch.qo_indptr
        for i, s in enumerate(batch.seq_ids.tolist()):
            a, b = int(indptr[i]), int(indptr[i + 1])
            n = b - a
            plan = batch.key_plans[i]
            keys, values = self._keys[s][layer], self._values[s][layer]
            if len(plan.ranges) == 1:
                (lo, hi), = plan.ranges
                k_seq, v_seq = keys[:, lo:hi], values[:, lo:hi]
            else:
                k_seq = np.concatenate([keys[:, lo:hi] for lo, hi in plan.ranges], axis=1)
                v_seq = np.concatenate([values[:, lo:hi] for lo, hi in plan.ranges], axis=1)
            # [n, Hq, D] -> [Hkv, group * n, D]; query head h reads kv head h // group.
            q_seq = (q[a:b] * scale).reshape(n, hkv, group, d).transpose(1, 2, 0, 3).reshape(hkv, group * n, d)
            scores = np.matmul(q_seq, k_seq.transpose(0, 2, 1))  # [Hkv, group*n, L]
            num_sinks = min(self.sink_tokens, plan.ranges[0][1]) if plan.ranges[0][0] == 0 else 0
            if q_sink is not None and num_sinks > 0:
                # the sink keys are the first columns: score them with the sink queries
                qs_seq = (q_sink[a:b] * scale).reshape(n, hkv, group, d).transpose(1, 2, 0, 3)
                scores[:, :, :num_sinks] = np.matmul(qs_seq.reshape(hkv, group * n, d),
                                                     k_seq[:, :num_sinks].transpose(0, 2, 1))
            if plan.bias is not None:
                scores = scores.reshape(hkv, group, n, -1)
                scores += plan.bias
                scores = scores.reshape(hkv, group * n, -1)
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=-1, keepdims=True)
            o = np.matmul(scores, v_seq)  # [Hkv, group*n, D]
            out[a:b] = o.reshape(hkv, group, n, d).transpose(2, 0, 1, 3).reshape(n, num_heads, d)
        return out
