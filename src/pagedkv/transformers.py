"""Hugging Face transformers integration: a paged ``Cache`` and an attention function over it.

``PagedCache`` is a :class:`transformers.Cache` whose keys and values live in the pages of
a :class:`pagedkv.KVCache`; importing this module registers the attention function
``attn_implementation="pagedkv"`` with transformers' ``AttentionInterface``. With it, every
attention call reads K/V straight from the pages (:func:`pagedkv.attention.decode` for
one-token steps, :func:`pagedkv.attention.prefill` otherwise) and no step gathers the
context. With another implementation (``"sdpa"``, ``"eager"``) the cache returns the
gathered K/V in the dense ``[batch, kv_heads, tokens, head_dim]`` layout that
``DynamicCache`` returns: same tokens, one copy of the context per layer and step.

Example::

    import pagedkv.transformers  # registers attn_implementation="pagedkv"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation="pagedkv")
    cache = pagedkv.transformers.PagedCache(model.config, max_tokens=4096)
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=64)

Supported versions and models
-----------------------------
transformers 5.0 and later 5.x releases, with torch 2.13.0 (CPU build); the tests run on
5.0.0 and on the newest release (5.25.0 on 2026-12-04). What changed across 5.x and how the cache
meets it: 5.24 renamed the ``past_key_values`` argument of ``generate`` and ``forward``
to ``cache`` (the old name warns until its removal, announced for 5.40), so pass the cache
under the name your release expects; 5.24 passes the attention layer's keyword arguments,
``position_ids`` included, to ``Cache.update``, while earlier releases pass them only to
the attention function: there the pagedkv attention stores each layer's K/V itself, and
a dense attention (``"sdpa"``, ``"eager"``), which cannot tell left padding from tokens,
stores the padding too (a slot per padding token, same output). ``get_mask_sizes`` takes
the new tokens' ``cache_position`` tensor in 5.0 and their count later; ``crop`` takes a
length to keep (positive) in early releases and a count to remove (negative) later;
``get_max_cache_shape`` became ``get_max_length``: the cache answers every form.

Decoder-only models with standard multi-head or GQA attention whose attention layers
call ``cache.update`` and then the configured attention function (the Llama code path
of transformers). Tested family: Llama (SmolLM2-135M-Instruct loaded from GGUF).
Mistral, Qwen2 and other Llama-like families follow the same code path but are not
tested here.

How batches map to pages
------------------------
Row ``b`` of the batch is one ``KVCache`` sequence. Only the tokens whose position is the
sequence's next position are stored: the positions come from the ``position_ids`` that the
model passes to the attention layer (transformers' ``generate`` derives them from the
attention mask), and in each forward the stored tokens of a row are the trailing run of
consecutive positions that starts at the sequence's length. The tokens before that run are
left padding: they take no page and no attention work (their attention output is zero,
and no real token attends to them, as in the dense masked computation).
``get_seq_length`` counts the dense columns, padding included, as ``DynamicCache`` does.

Per forward, not per layer: layer 0 appends the new tokens (the slot mapping), and the
first attention call exports the rows' page tables once (``KVCache.page_table``); the
other layers store into the same slots and read the same export, which stays valid as
stores never change a table. An edit between forwards (``crop``, forks) drops it.

Beam search and ``num_return_sequences`` are forks: ``reorder_cache``,
``batch_select_indices`` and ``batch_repeat_interleave`` give each new row a
:meth:`KVCache.fork` of its source row, so beams share pages, and a shared page is copied
only when a beam writes into it (copy-on-write).

Sliding window and attention sinks
----------------------------------
``window=W`` (default: the config's ``sliding_window`` when it has one) and
``sink_tokens=S`` follow :class:`pagedkv.KVCache`: the query at position ``p`` attends to
positions ``[p - W + 1, p]`` and ``[0, S)``, and a sequence holds a bounded number of
pages (``pagedkv.models.decode_page_bound``). A window needs
``attn_implementation="pagedkv"``: dense implementations would attend to positions the
window has released.

Rotary positions, ``positions=``: with ``"absolute"`` (the default) queries and keys keep
their positions in the sequence, as the model computes them, so the distance from a
query to a sink grows without bound and passes the model's trained context in a long
generation. ``"cache"`` gives StreamingLLM's positions inside the cache (Xiao et al.
2023, "Efficient Streaming Language Models with Attention Sinks", section 3.2: sinks at
``0 .. S-1``, the window after them, the query last), so every distance stays below
``S + W``. Keys are stored once, rotated to their absolute positions by the model, and
never rotated again: rotary scores depend only on the distance between the positions of
query and key, so the window keys already have StreamingLLM's distances, and the sinks
are scored with a second query, the model's query turned by ``min(p, S + W - 1) - p``
(the ``q_sink`` argument of :func:`pagedkv.attention.decode` and ``prefill``). This
needs transformers' rotate-half rotary convention (Llama's ``apply_rotary_pos_emb``)
with fixed frequencies (``default``, ``linear``, ``llama3``, ``yarn`` rope types; not
``dynamic`` or ``longrope``). Same positions for every layer and every forked row; a
prompt chunk longer than the window is handled per query.

Prefix reuse
------------
Two ways. (1) Passing the same cache to a second ``generate`` call whose prompt extends
the conversation the cache holds (the first call's prompt and output) makes ``generate``
compute only the new tokens, as with ``DynamicCache``; like there, the caller is
responsible for the prompt extending what the cache holds. (2) With
``enable_prefix_caching=True``, :meth:`PagedCache.begin` starts a new request on the cache:
its prompt's full pages become findable by hash as they fill, and a later ``begin`` whose
prompt starts with the same tokens (a shared system prompt, an earlier turn) reuses them
(vLLM's automatic prefix caching), so ``generate`` computes only the rest. Generated tokens
are not hashed (the cache sees their K/V, not their ids).

Not supported
-------------
Encoder-decoder models and cross-attention; models with linear-attention, chunked or
per-layer-type (hybrid sliding/full) caches; ``torch.compile`` and static-shape export;
devices other than the CPU; bfloat16 pools (bfloat16 models work with a float32 or
float16 pool, at the cost of a conversion per step); ``crop`` of a windowed cache;
attention weights output (``output_attentions``) with the pagedkv attention; dropout.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

from pagedkv import KVCache
from pagedkv_c._checks import checked_int
from pagedkv import attention as paged_attention
from pagedkv.models.attention_backend import check_positions, sink_query_positions

__all__ = ["ATTN_IMPLEMENTATION", "PagedCache", "paged_attention_forward"]

#: Name under which :func:`paged_attention_forward` is registered with ``AttentionInterface``.
ATTN_IMPLEMENTATION = "pagedkv"

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


class _PagedLayer(CacheLayerMixin):
    """Per-layer view of a :class:`PagedCache` (transformers addresses caches layer by layer).

    All layers share one page table per row; the layer only forwards to its owner.
    """

    is_compileable = False
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, owner: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self._owner = owner
        self._layer_idx = layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        """Mark the layer initialized: its K/V live in the owner's pool, nothing to allocate."""
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Store this layer's new K/V through :meth:`PagedCache.update` (same arguments and result)."""
        return self._owner.update(key_states, value_states, self._layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        """(kv_length, kv_offset) in tokens, from :meth:`PagedCache.get_mask_sizes`."""
        return self._owner.get_mask_sizes(query_length, self._layer_idx)

    def get_seq_length(self) -> int:
        """Cached tokens of the batch, from :meth:`PagedCache.get_seq_length`."""
        return self._owner.get_seq_length(self._layer_idx)

    def get_max_length(self) -> int:
        """-1: no fixed maximum length in tokens (pages are taken as needed)."""
        return -1

    def get_max_cache_shape(self) -> int:
        """-1: no fixed cache shape (pages are taken as needed)."""
        return -1

    def reset(self) -> None:
        """Nothing per layer: :meth:`PagedCache.reset` releases the shared sequences."""

    def crop(self, tokens_to_remove: int) -> None:
        """Raise RuntimeError: rows share page tables across layers; crop the whole PagedCache."""
        raise RuntimeError("Invalid call of crop on a layer of a PagedCache: call PagedCache.crop")

    def reorder_cache(self, beam_idx) -> None:
        """Raise RuntimeError: reorder the whole PagedCache instead."""
        raise RuntimeError("Invalid call of reorder_cache on a layer of a PagedCache: call PagedCache.reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Raise RuntimeError: repeat rows of the whole PagedCache instead."""
        raise RuntimeError("Invalid call on a layer of a PagedCache: call PagedCache.batch_repeat_interleave")

    def batch_select_indices(self, indices) -> None:
        """Raise RuntimeError: select rows of the whole PagedCache instead."""
        raise RuntimeError("Invalid call on a layer of a PagedCache: call PagedCache.batch_select_indices")


class _Step:
    """Tag on the keys that update() returns: the cache and layer the attention function reads.

    ``deferred``: update() stored nothing (it got no ``position_ids``, as before
    transformers 5.24); the attention function stores the layer's K/V with the
    ``position_ids`` it receives.
    """

    __slots__ = ("cache", "layer_idx", "deferred")

    def __init__(self, cache: PagedCache, layer_idx: int, deferred: bool = False) -> None:
        self.cache = cache
        self.layer_idx = layer_idx
        self.deferred = deferred


class _StepPages:
    """The attention contract of :class:`pagedkv.KVCache` with one forward step's page tables.

    Every layer of a forward reads the same page tables (``KVCache.store`` writes rows,
    it never changes a table), so the step exports them once (``KVCache.page_table``) and
    the kernels of all layers reuse the export instead of building and converting it per
    layer. Valid until the rows change: :class:`PagedCache` drops it at the next forward
    and at every edit (``crop``, forks, ``reset``, ``begin``).
    """

    __slots__ = ("kv", "window", "sink_tokens", "num_layers", "page_size", "num_kv_heads", "head_dim",
                 "_kv_cache", "_seq_ids", "_view")

    def __init__(self, kv_cache: KVCache, seq_ids: np.ndarray) -> None:
        self.kv = kv_cache.kv
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


def _kernel_threads() -> int | None:
    """``num_threads`` for the kernels when the cache sets none: torch's thread count.

    None (the kernels' own choice: OpenMP's maximum, lowered so that each thread reads at
    least 2 MiB of K/V) when OpenMP's maximum is torch's count, i.e. the kernels run on
    torch's OpenMP runtime: then a short context runs on one thread instead of waking a
    second one per layer (on a loaded 2-core machine, 30 layers of 512 tokens took 74 ms
    on two threads against 11 ms on one). Otherwise torch's count, so that the two
    libraries never run more threads than torch was given.
    """
    threads = torch.get_num_threads()
    return None if paged_attention.kernel_info()["max_threads"] == threads else threads


def _numpy_view(tensor: torch.Tensor) -> np.ndarray:
    """``tensor.numpy()`` (same memory), detached first only when it requires grad."""
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


def _check_size(name: str, value, low: int, allow_none: bool = True):
    if value is None and allow_none:
        return None
    return checked_int(value, name, low, 2**62)  # TypeError for a float or a bool, ValueError out of range


def _config_value(config, name: str, default=None):
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, name, default)


def _rotary_inverse_frequencies(config, head_dim: int) -> np.ndarray:
    """Rotary inverse frequencies ``[rotary_dim // 2]`` (float64, radians per token) of a config.

    Only rotary types whose angle is ``position * inv_freq`` with fixed frequencies
    qualify: ``default``, ``linear``, ``llama3``, ``yarn`` and the like (their constant
    ``attention_factor`` scales queries and keys alike and commutes with a rotation).
    ``dynamic`` and ``longrope`` change the frequencies with the sequence length, and
    per-layer-type rotary settings differ between layers: both raise ValueError.
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text_config, "rope_parameters", None) or {}
    if params and "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("Invalid value of positions: 'cache' needs one rotary setting for every layer, "
                         f"got per-layer-type settings {sorted(params)}")
    rope_type = params.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise ValueError(f"Invalid value of positions: 'cache' needs fixed rotary frequencies, got rope_type "
                         f"{rope_type!r} (its frequencies follow the sequence length)")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(text_config, "rope_theta", 10000.0))
        factor = params.get("partial_rotary_factor", getattr(text_config, "partial_rotary_factor", 1.0))
        dim = int(head_dim * factor)
        return float(base) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"Invalid value of positions: 'cache' does not know rope_type {rope_type!r}")
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](text_config)
    return inv_freq.detach().cpu().double().numpy()


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[..., D]`` by angles with ``cos``/``sin`` ``[..., R/2]`` (transformers' rotate_half).

    The first ``R`` of the ``D`` features rotate, pairing feature ``i`` with ``i + R/2``
    (the GPT-NeoX / Llama convention of transformers); the rest pass unchanged.
    """
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class PagedCache(Cache):
    """A transformers ``Cache`` whose K/V live in the pages of a :class:`pagedkv.KVCache`.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (``model.config``): ``num_hidden_layers``,
        ``num_key_value_heads`` (default ``num_attention_heads``), ``head_dim`` (default
        ``hidden_size // num_attention_heads``), ``max_position_embeddings`` and, if
        present, ``sliding_window`` are read; ``_attn_implementation`` is read at each step
        (``"pagedkv"`` selects the in-place attention path).
    num_pages : int, optional
        Pages in the pool, ``>= 1``. Default: enough for every row of the first batch to
        hold ``max_tokens`` tokens (with a window: the windowed bound), plus one page per
        row for copy-on-write; computed at the first forward, when the batch size is known.
    max_tokens : int, optional
        Tokens per sequence used to size the default pool, ``>= 1``. Default:
        ``config.max_position_embeddings``. Ignored when ``num_pages`` is given.
    page_size : int
        Tokens per page, ``>= 1``. Default 16.
    dtype : torch.dtype or numpy dtype, optional
        Pool dtype, float32 or float16. Default: the dtype of the first keys stored
        (float32 for a bfloat16 model).
    window : int, optional
        Sliding window ``W`` in tokens, ``>= 1`` (the query at position ``p`` attends to
        ``[p - W + 1, p]``, Hugging Face's ``sliding_window = W``). Default: the config's
        ``sliding_window`` if set, else full attention. Needs ``attn_implementation="pagedkv"``.
    sink_tokens : int
        Attention-sink tokens ``S >= 0`` kept in attention with a window (StreamingLLM,
        Xiao et al. 2023). Default 0.
    positions : str
        Rotary positions of a windowed cache with sinks. ``"absolute"`` (default): every
        query and key keeps its position in the sequence, so the distance from a query to
        the sinks grows without bound. ``"cache"``: StreamingLLM's positions inside the
        cache (sinks at ``0 .. S-1``, the window after them, the query last), so every
        distance stays below ``S + W``; the keys stay stored once at their absolute
        positions and the sinks are scored with a second query rotated to
        ``min(p, S + W - 1)`` (the kernels' ``q_sink``), see the module docstring.
        ``"cache"`` needs a window, ``S >= 1``, ``attn_implementation="pagedkv"`` and a
        rotary embedding with fixed frequencies in transformers' rotate-half convention.
    enable_prefix_caching : bool
        Index full prompt pages by hash so that :meth:`begin` reuses them (vLLM's
        automatic prefix caching). Default False.
    prefix_hash : str
        ``"xxh3_128"`` (default) or ``"sha256"``, see :class:`pagedkv.KVCache`.
    num_threads : int, optional
        OpenMP threads of the attention kernels, ``>= 1``. Default:
        ``torch.get_num_threads()``, read at each forward, so one setting governs both
        libraries (the kernels run on the OpenMP runtime torch loaded: one thread pool);
        of those, a call whose K/V is under 2 MiB per thread uses fewer (see
        :func:`pagedkv.attention.decode`).

    Attributes
    ----------
    kv_cache : pagedkv.KVCache or None
        The paged storage, created at the first forward (None before).
    num_stored_tokens : int
        Tokens whose K/V were written into pages since the cache was made: the tokens the
        model was fed, less left padding and less the rows of a first forward that
        duplicate an earlier row (beams, returned sequences), which share its pages.
        Prefix reuse shows as tokens not counted here.

    Raises
    ------
    ValueError
        A size out of range, a config without the attention sizes, ``sink_tokens`` without
        a window, a dtype other than float32/float16, ``positions`` not ``"absolute"``
        or ``"cache"``, or ``"cache"`` without a window and sinks or with a rotary type
        whose frequencies change (``dynamic``, ``longrope``) or differ between layers.

    Notes
    -----
    Memory layout and page semantics are those of :class:`pagedkv.KVCache`; see the module
    docstring for padding, beams, windows and prefix reuse.
    """

    def __init__(self, config, *, num_pages=None, max_tokens=None, page_size=16, dtype=None,
                 window=None, sink_tokens=0, positions="absolute", enable_prefix_caching=False,
                 prefix_hash="xxh3_128", num_threads=None) -> None:
        num_layers = _config_value(config, "num_hidden_layers")
        num_heads = _config_value(config, "num_attention_heads")
        if not isinstance(num_layers, int) or not isinstance(num_heads, int):
            raise ValueError(
                "Invalid value of config: expected integer num_hidden_layers and num_attention_heads, "
                f"got {num_layers!r} and {num_heads!r}"
            )
        num_kv_heads = _config_value(config, "num_key_value_heads") or num_heads
        head_dim = _config_value(config, "head_dim") or _config_value(config, "hidden_size") // num_heads
        self._num_pages = _check_size("num_pages", num_pages, 1)
        self._max_tokens = _check_size("max_tokens", max_tokens, 1)
        self._page_size = _check_size("page_size", page_size, 1, allow_none=False)
        if window is None:
            window = _config_value(config, "sliding_window")
        self._window = _check_size("window", window, 1)
        self._sink_tokens = _check_size("sink_tokens", sink_tokens, 0, allow_none=False)
        if self._sink_tokens and self._window is None:
            raise ValueError(f"Invalid value of sink_tokens: expected 0 without a window, got {sink_tokens}")
        self._positions = check_positions(positions, self._window, self._sink_tokens)
        self._num_threads = _check_size("num_threads", num_threads, 1)
        if dtype is not None:
            dtype = _NUMPY_DTYPES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
            if isinstance(dtype, torch.dtype) or np.dtype(dtype) not in (np.float32, np.float16):
                raise ValueError(f"Invalid value of dtype: expected float32 or float16, got {dtype}")
            dtype = np.dtype(dtype)
        if prefix_hash not in ("xxh3_128", "sha256"):
            raise ValueError(f"Invalid value of prefix_hash: expected 'xxh3_128' or 'sha256', got {prefix_hash!r}")
        self._dtype = dtype
        self._prefix_caching = bool(enable_prefix_caching)
        self._prefix_hash = prefix_hash
        self._config = config
        self._num_layers = num_layers
        self._num_kv_heads = int(num_kv_heads)
        self._head_dim = int(head_dim)
        self._inv_freq = _rotary_inverse_frequencies(config, self._head_dim) if positions == "cache" else None
        self.kv_cache: KVCache | None = None
        self.num_stored_tokens = 0
        self._seq_ids: list[int] = []
        self._next_seq_id = 0
        self._num_columns = 0
        # Per forward: slots from the layer-0 append, stored tokens per row and where
        # they start in the row's columns; the next layer expected.
        self._slots: np.ndarray | None = None
        self._counts = np.zeros(0, dtype=np.int64)
        self._stored = np.zeros(0, dtype=np.int64)
        self._starts = np.zeros(0, dtype=np.int64)
        # With positions="cache": cos/sin [T, 1, R/2] that turn this forward's stored
        # queries into their sink queries (None when no query is past S + W - 1).
        self._sink_rotation: tuple[torch.Tensor, torch.Tensor] | None = None
        self._next_layer = 0
        # Decided once per forward, at layer 0, for every layer: the attention
        # implementation, the kernels' thread count, whether every row stores all its new
        # tokens, the rows' sequence ids as an array, and (made by the first attention
        # call) the page tables of the step.
        self._step_paged = False
        self._step_threads: int | None = 1
        self._step_unpadded = True  # no row has left padding in this forward
        self._step_dense_rows = True  # ... and every row stores all its new tokens
        self._step_seq_ids = np.zeros(0, dtype=np.int64)
        self._step_pages: _StepPages | None = None
        self._layer_steps = [_Step(self, i) for i in range(num_layers)]
        super().__init__(layers=[_PagedLayer(self, i) for i in range(num_layers)])

    # ------------------------------------------------------------------ sizes
    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def window(self) -> int | None:
        """Sliding window in tokens, or None for full attention."""
        return self._window

    @property
    def sink_tokens(self) -> int:
        """Attention-sink tokens."""
        return self._sink_tokens

    @property
    def positions(self) -> str:
        """Rotary positions mode: ``"absolute"`` or ``"cache"`` (StreamingLLM)."""
        return self._positions

    @property
    def seq_ids(self) -> list[int]:
        """The ``KVCache`` sequence id of each batch row, in row order."""
        return list(self._seq_ids)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Dense columns held per row (left padding included), as ``DynamicCache`` counts them."""
        return self._num_columns

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """Return ``(kv_length, kv_offset)`` of the dense mask for ``query_length`` new tokens.

        ``query_length`` is an int (transformers >= 5.x current) or the ``cache_position``
        tensor of the new tokens (earlier 5.x releases); ``kv_offset`` is always 0.
        """
        if isinstance(query_length, torch.Tensor):
            query_length = int(query_length.shape[0])
        return self._num_columns + int(query_length), 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: the cache has no fixed length (the pool bounds the pages, not the positions)."""
        return -1

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        """-1, as :meth:`get_max_length` (name used by earlier 5.x releases)."""
        return -1

    @property
    def is_compileable(self) -> bool:
        """False: the pages are NumPy memory, not torch.compile-able static tensors."""
        return False

    # ------------------------------------------------------------------ pool
    def _make_kv_cache(self, batch_size: int, key_dtype: torch.dtype) -> None:
        dtype = self._dtype
        if dtype is None:
            dtype = np.dtype(_NUMPY_DTYPES.get(key_dtype, np.float32))
        num_pages = self._num_pages
        if num_pages is None:
            max_tokens = self._max_tokens or int(_config_value(self._config, "max_position_embeddings", 4096))
            if self._window is not None:
                per_sequence = (-(-(self._window - 1) // self._page_size) + 1
                                + -(-self._sink_tokens // self._page_size))
                # A prefill chunk longer than the window holds all its tokens until the next append.
                per_sequence = max(per_sequence, 0) + -(-max_tokens // self._page_size)
            else:
                per_sequence = -(-max_tokens // self._page_size)
            num_pages = batch_size * (per_sequence + 1)
        self.kv_cache = KVCache(
            self._num_layers, self._num_kv_heads, self._head_dim, num_pages, page_size=self._page_size,
            dtype=dtype, window=self._window, sink_tokens=self._sink_tokens,
            enable_prefix_caching=self._prefix_caching, prefix_hash=self._prefix_hash,
        )

    def _new_seq_id(self) -> int:
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    def pool_tensor(self, layer: int | None = None) -> torch.Tensor:
        """The pool as a torch tensor sharing its memory (``torch.from_numpy``, no copy).

        Parameters
        ----------
        layer : int, optional
            Return only this layer's pages: shape ``(num_pages, 2, page_size,
            num_kv_heads, head_dim)`` (FlashInfer's NHD layout). Default: the whole pool,
            ``(num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)``.

        Raises
        ------
        RuntimeError
            Before the first forward (the pool does not exist yet).
        IndexError
            ``layer`` out of range.
        """
        if self.kv_cache is None:
            raise RuntimeError("Invalid state of PagedCache: the pool is made at the first forward")
        pool = torch.from_numpy(self.kv_cache.kv)
        if layer is None:
            return pool
        if not 0 <= layer < self._num_layers:
            raise IndexError(f"Invalid value of layer: expected 0 <= layer < {self._num_layers}, got {layer}")
        return pool[layer]

    def stats(self) -> dict:
        """``KVCache.stats()`` plus ``num_stored_tokens``; empty dict before the first forward."""
        if self.kv_cache is None:
            return {}
        return self.kv_cache.stats() | {"num_stored_tokens": self.num_stored_tokens}

    # ------------------------------------------------------------------ requests
    def begin(self, input_ids, attention_mask=None) -> int:
        """Start a new request: release the rows held, add one sequence per prompt row.

        With prefix caching each row starts on the longest run of cached full pages that
        its prompt matches, and the rest of its prompt's full pages become cached as they
        fill. ``generate`` then computes only the prompt tokens past the returned length.

        Parameters
        ----------
        input_ids : torch.Tensor or numpy.ndarray, shape ``[batch, prompt_tokens]``, integer
            The prompts that will be passed to ``generate``.
        attention_mask : torch.Tensor or numpy.ndarray, shape ``[batch, prompt_tokens]``, optional
            1 for tokens, 0 for left padding. A batch with padding starts cold (no reuse):
            rows with different padding cannot share one dense cached length.

        Returns
        -------
        int
            Tokens served from cache, the same for every row (the smallest hit; rows are
            truncated to it); 0 without prefix caching.

        Raises
        ------
        ValueError
            ``input_ids`` is not 2-D with at least one token per row, or the mask's shape
            differs. Nothing changes then.
        """
        ids = np.asarray(input_ids.cpu() if isinstance(input_ids, torch.Tensor) else input_ids)
        if ids.ndim != 2 or ids.shape[0] < 1 or ids.shape[1] < 1 or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"Invalid shape of input_ids: expected [batch >= 1, tokens >= 1] integers, got {ids.shape}")
        padded = False
        if attention_mask is not None:
            mask = np.asarray(attention_mask.cpu() if isinstance(attention_mask, torch.Tensor) else attention_mask)
            if mask.shape != ids.shape:
                raise ValueError(f"Invalid shape of attention_mask: expected {ids.shape}, got {mask.shape}")
            padded = not bool(np.all(mask != 0))
        self.reset()
        if self.kv_cache is None:
            self._make_kv_cache(ids.shape[0], torch.float32)  # dtype=None: float32 before any keys are seen
        kv = self.kv_cache
        hits = []
        for row in ids:
            seq_id = self._new_seq_id()
            hit = kv.add_sequence(seq_id, prompt_token_ids=row.tolist() if not padded else None)
            self._seq_ids.append(seq_id)
            hits.append(hit)
        common = min(hits)
        for seq_id, hit in zip(self._seq_ids, hits):
            if hit > common:
                kv.truncate(seq_id, common)
        self._num_columns = common
        return common

    def reset(self) -> None:
        """Release every row's pages (cached prefix pages stay findable) and empty the cache."""
        if self.kv_cache is not None:
            for seq_id in self._seq_ids:
                self.kv_cache.remove_sequence(seq_id)
        self._seq_ids = []
        self._num_columns = 0
        self._slots = None
        self._step_pages = None
        self._next_layer = 0

    # ------------------------------------------------------------------ update
    def _row_positions(self, position_ids, batch_size: int, num_new: int) -> np.ndarray:
        if position_ids is None:
            start = self._num_columns
            return np.broadcast_to(np.arange(start, start + num_new, dtype=np.int64), (batch_size, num_new))
        positions = position_ids.detach().cpu().numpy().astype(np.int64, copy=False)
        if positions.ndim == 1:
            positions = positions[None, :]
        if positions.ndim != 2 or positions.shape[1] != num_new or positions.shape[0] not in (1, batch_size):
            raise ValueError(
                f"Invalid shape of position_ids: expected [{batch_size} or 1, {num_new}], got {tuple(positions.shape)}"
            )
        return np.broadcast_to(positions, (batch_size, num_new))

    def _begin_step(self, key_states: torch.Tensor, attn_kwargs: dict) -> None:
        batch_size, _, num_new, _ = key_states.shape
        if self.kv_cache is None:
            self._make_kv_cache(batch_size, key_states.dtype)
        kv = self.kv_cache
        if not self._seq_ids and self._num_columns == 0:
            for _ in range(batch_size):
                seq_id = self._new_seq_id()
                kv.add_sequence(seq_id)
                self._seq_ids.append(seq_id)
        if len(self._seq_ids) != batch_size:
            raise ValueError(
                f"Invalid shape of key_states: expected batch size {len(self._seq_ids)} (the rows the cache holds), "
                f"got {batch_size}"
            )
        positions = self._row_positions(attn_kwargs.get("position_ids"), batch_size, num_new)
        counts = np.empty(batch_size, dtype=np.int64)
        lengths = np.empty(batch_size, dtype=np.int64)
        for row, seq_id in enumerate(self._seq_ids):
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
        duplicates = self._duplicate_rows(key_states, positions) if self._num_columns == 0 else {}
        stored = counts.copy()
        for row in duplicates:
            stored[row] = 0
        self._slots = kv.append(self._seq_ids, stored)
        for row, source in duplicates.items():
            # Same tokens at the same positions as an earlier row (generate expands the
            # prompt once per beam or returned sequence): share that row's pages, which the
            # stores of this forward fill for both.
            child = self._new_seq_id()
            kv.fork(self._seq_ids[source], child)
            kv.remove_sequence(self._seq_ids[row])
            self._seq_ids[row] = child
        self._stored = stored
        self._counts = counts
        self._starts = num_new - counts
        self._step_unpadded = bool((counts == num_new).all())
        self._step_dense_rows = self._step_unpadded and not duplicates
        self._step_seq_ids = np.asarray(self._seq_ids, dtype=np.int64)
        self._step_pages = None
        self._sink_rotation = self._sink_query_rotation(lengths, counts)
        self._num_columns += num_new
        self.num_stored_tokens += int(stored.sum())

    def _sink_query_rotation(self, lengths: np.ndarray, counts: np.ndarray):
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
        return torch.from_numpy(np.cos(angles)[:, None, :]), torch.from_numpy(np.sin(angles)[:, None, :])

    @staticmethod
    def _duplicate_rows(key_states: torch.Tensor, positions: np.ndarray) -> dict[int, int]:
        """Rows of a first forward whose layer-0 keys and positions equal an earlier row's."""
        duplicates: dict[int, int] = {}
        for row in range(1, key_states.shape[0]):
            for source in range(row):
                if source not in duplicates and np.array_equal(positions[row], positions[source]) \
                        and torch.equal(key_states[row], key_states[source]):
                    duplicates[row] = source
                    break
        return duplicates

    def _stored_rows(self, states: torch.Tensor) -> np.ndarray:
        """The stored tokens' rows of ``states`` [B, H, T, D] as one ``[n, H, D]`` array."""
        if self._step_dense_rows and states.shape[2] == 1 and states.dtype in _NUMPY_DTYPES:
            # A decode step: [B, H, 1, D] is [B, H, D] in memory; a NumPy view skips
            # three torch calls per layer (about 3 us, as much as the store itself).
            return _numpy_view(states)[:, :, 0]
        rows = states.detach().transpose(1, 2)
        if rows.dtype not in _NUMPY_DTYPES:
            rows = rows.float()
        batch_size, num_new = rows.shape[0], rows.shape[1]
        if self._step_dense_rows:
            flat = rows.reshape(batch_size * num_new, rows.shape[2], rows.shape[3])
        else:
            flat = torch.cat([rows[b, num_new - int(n):] for b, n in enumerate(self._stored)], dim=0)
        return flat.contiguous().numpy()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store the new tokens' K/V of one layer and return what attention reads.

        Parameters
        ----------
        key_states, value_states : torch.Tensor, shape ``[batch, kv_heads, new_tokens, head_dim]``
            After the rotary embedding; float32, float16 or bfloat16 (converted to the pool
            dtype on store).
        layer_idx : int
            Layers must come in order ``0, 1, ...`` within each forward; layer 0 appends the
            new tokens to every row's page table.
        kwargs
            transformers (5.24 and later) passes the attention keyword arguments as
            ``kwargs=...``; their ``position_ids`` (``[batch or 1, new_tokens]``) tell
            stored tokens from left padding (see the module docstring). Without them,
            with ``attn_implementation="pagedkv"`` nothing is stored here and
            :func:`paged_attention_forward` stores the K/V with the ``position_ids`` it
            receives (earlier releases pass them only there); with another
            implementation no token is padding.

        Returns
        -------
        keys, values : torch.Tensor
            With ``attn_implementation="pagedkv"``: the inputs, tagged for
            :func:`paged_attention_forward`. Otherwise the gathered context,
            ``[batch, kv_heads, seq_length, head_dim]`` in the inputs' dtype, zero in the
            padding columns.

        Raises
        ------
        ValueError
            Layers out of order, a batch size other than the rows held, positions that do
            not continue a row, or a window with a dense attention implementation.
        pagedkv.OutOfPagesError
            The pool has no room for the new tokens; the cache is unchanged.

        Notes
        -----
        With ``positions="cache"``, layer 0 also prepares the rotation that turns each
        stored query into its sink query (see the module docstring).
        """
        if layer_idx != self._next_layer:
            raise ValueError(f"Invalid value of layer_idx: expected {self._next_layer} (layers in order), got {layer_idx}")
        attn_kwargs = kwargs.get("kwargs")
        if not isinstance(attn_kwargs, dict):
            attn_kwargs = args[0] if args and isinstance(args[0], dict) else kwargs
        if layer_idx == 0:
            # Read once per forward (a config attribute lookup costs more than the rest of
            # a layer's bookkeeping); every layer of the forward runs the same attention.
            self._step_paged = getattr(self._config, "_attn_implementation", None) == ATTN_IMPLEMENTATION
            self._step_threads = self._num_threads or _kernel_threads()
        paged = self._step_paged
        if not paged and self._window is not None:
            raise ValueError(
                f"Invalid attn_implementation {self._config._attn_implementation!r} for a PagedCache with a window: "
                f"expected {ATTN_IMPLEMENTATION!r} (dense attention would read released positions)"
            )
        if paged and attn_kwargs.get("position_ids") is None:
            # transformers < 5.24 passes no position_ids to update(), but it passes them to
            # the attention function: the layer's K/V are stored there (_store_layer).
            self._next_layer = layer_idx + 1 if layer_idx + 1 < self._num_layers else 0
            key_states._pagedkv_step = _Step(self, layer_idx, deferred=True)
            return key_states, value_states
        self._store_layer(layer_idx, key_states, value_states, attn_kwargs)
        self._next_layer = layer_idx + 1 if layer_idx + 1 < self._num_layers else 0
        if paged:
            key_states._pagedkv_step = self._layer_steps[layer_idx]
            return key_states, value_states
        return self._gather_dense(layer_idx, key_states.dtype)

    def _store_layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor,
                     attn_kwargs: dict) -> None:
        """Write one layer's new K/V into the pages; layer 0 first appends the new tokens."""
        if layer_idx == 0:
            self._begin_step(key_states, attn_kwargs)
        self.kv_cache.store(layer_idx, self._slots, self._stored_rows(key_states), self._stored_rows(value_states))

    def _gather_dense(self, layer_idx: int, dtype: torch.dtype):
        batch_size = len(self._seq_ids)
        shape = (batch_size, self._num_kv_heads, self._num_columns, self._head_dim)
        keys = torch.zeros(shape, dtype=dtype)
        values = torch.zeros(shape, dtype=dtype)
        for row, seq_id in enumerate(self._seq_ids):
            k, v, _ = self.kv_cache.gather(layer_idx, seq_id)
            n = k.shape[0]
            if n:
                keys[row, :, self._num_columns - n:] = torch.from_numpy(k).transpose(0, 1)
                values[row, :, self._num_columns - n:] = torch.from_numpy(v).transpose(0, 1)
        return keys, values

    # ------------------------------------------------------------------ edits
    def crop(self, tokens_to_remove: int) -> None:
        """Drop the newest columns of every row (assisted decoding rolls back rejected tokens).

        Parameters
        ----------
        tokens_to_remove : int
            ``<= 0``: remove ``-tokens_to_remove`` columns (the current 5.x meaning; 0 does
            nothing). ``> 0``: keep that many columns (the meaning of earlier releases).

        Raises
        ------
        ValueError
            The cache has a window, or the removal reaches a row's left padding. Nothing
            changes then.
        """
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, (int, np.integer)):
            raise ValueError(f"Invalid value of tokens_to_remove: expected an integer, got {tokens_to_remove!r}")
        keep = self._num_columns + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, self._num_columns)
        if keep >= self._num_columns or self.kv_cache is None:
            return
        if self._window is not None:
            raise ValueError("Invalid call of crop: a windowed PagedCache has released the positions it would need")
        if keep < 0:
            raise ValueError(f"Invalid value of tokens_to_remove: expected >= {-self._num_columns}, got {tokens_to_remove}")
        removed = self._num_columns - keep
        lengths = [self.kv_cache.seq_len(s) for s in self._seq_ids]
        if any(n < removed for n in lengths):
            raise ValueError(
                f"Invalid value of tokens_to_remove: removing {removed} columns reaches the left padding of a row "
                f"holding {min(lengths)} tokens"
            )
        self._step_pages = None
        for seq_id, n in zip(self._seq_ids, lengths):
            self.kv_cache.truncate(seq_id, n - removed)
        self._num_columns = keep

    def _select_rows(self, source_rows: np.ndarray) -> None:
        """Make row ``i`` a fork of current row ``source_rows[i]`` (pages shared, copy-on-write)."""
        if self.kv_cache is None or not self._seq_ids:
            return
        if source_rows.ndim != 1 or (source_rows.size and (source_rows.min() < 0
                                                          or source_rows.max() >= len(self._seq_ids))):
            raise ValueError(
                f"Invalid value of indices: expected row indices in [0, {len(self._seq_ids)}), got {source_rows.tolist()}"
            )
        if source_rows.size == len(self._seq_ids) and np.array_equal(source_rows, np.arange(len(self._seq_ids))):
            return
        kv = self.kv_cache
        self._step_pages = None
        new_ids = []
        for src in source_rows.tolist():
            child = self._new_seq_id()
            kv.fork(self._seq_ids[src], child)
            new_ids.append(child)
        for seq_id in self._seq_ids:
            kv.remove_sequence(seq_id)
        self._seq_ids = new_ids

    @staticmethod
    def _as_index_array(indices) -> np.ndarray:
        if isinstance(indices, torch.Tensor):
            if indices.dtype == torch.bool:
                indices = indices.nonzero().flatten()
            indices = indices.detach().cpu().numpy()
        return np.asarray(indices, dtype=np.int64).reshape(-1)

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row ``i`` continues the beam of row ``beam_idx[i]`` (a fork, no copy).

        Parameters
        ----------
        beam_idx : torch.LongTensor, shape ``[batch]``
            Source row of each new row, in ``[0, batch)``.

        Raises
        ------
        ValueError
            An index out of range; nothing changes then.
        """
        self._select_rows(self._as_index_array(beam_idx))

    def batch_select_indices(self, indices) -> None:
        """Keep the rows ``indices`` (integer or boolean tensor), in that order, as forks."""
        self._select_rows(self._as_index_array(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times in place (``num_return_sequences``, beams), as forks."""
        repeats = _check_size("repeats", repeats, 1, allow_none=False)
        self._select_rows(np.repeat(np.arange(len(self._seq_ids)), repeats))

    def __repr__(self) -> str:
        return (f"PagedCache(rows={len(self._seq_ids)}, seq_length={self._num_columns}, page_size={self._page_size}, "
                f"window={self._window}, sink_tokens={self._sink_tokens}, positions={self._positions!r})")


def paged_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask, scaling: float | None = None, dropout: float = 0.0,
                            **kwargs: Any):
    """Attention that reads K/V from a :class:`PagedCache`'s pages (``attn_implementation="pagedkv"``).

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (unused beyond transformers' calling convention).
    query : torch.Tensor, shape ``[batch, heads, new_tokens, head_dim]``
        float32, float16 or bfloat16; converted to float32 for the kernels.
    key, value : torch.Tensor
        What :meth:`PagedCache.update` returned for this layer (tagged with the cache).
    attention_mask : any
        Unused: the rows' page tables carry padding, window and sinks exactly.
    scaling : float, optional
        Score scale, default ``1 / sqrt(head_dim)``.
    dropout : float
        Must be 0 (inference only).
    kwargs
        The attention layer's keyword arguments; their ``position_ids`` are used when
        :meth:`PagedCache.update` had none to store the layer's K/V with (transformers
        before 5.24), the rest is ignored.

    Returns
    -------
    out : torch.Tensor, shape ``[batch, new_tokens, heads, head_dim]``, the query's dtype
        Zero at padding tokens.
    weights : None

    Raises
    ------
    ValueError
        ``key`` does not come from a :class:`PagedCache` (the model ran without one, or
        with ``use_cache=False``), or ``dropout`` is not 0; when this call stores the
        K/V, the errors of :meth:`PagedCache.update`.
    pagedkv.OutOfPagesError
        When this call stores the K/V and the pool has no room for them.

    Notes
    -----
    One-token steps call :func:`pagedkv.attention.decode`; prompts and multi-token steps
    call :func:`pagedkv.attention.prefill` over the stored tokens of each row (ragged,
    FlashInfer's ``qo_indptr`` layout). With ``positions="cache"`` the keys at positions
    below ``sink_tokens`` are scored with the query turned to ``min(p, S + W - 1)``
    (``q_sink``; StreamingLLM's positions, Xiao et al. 2023).
    """
    step = getattr(key, "_pagedkv_step", None)
    if step is None:
        raise ValueError(
            f"Invalid past_key_values for attn_implementation={ATTN_IMPLEMENTATION!r}: expected a "
            "pagedkv.transformers.PagedCache (and use_cache=True)"
        )
    if dropout:
        raise ValueError(f"Invalid value of dropout: expected 0 (inference only), got {dropout}")
    cache = step.cache
    if step.deferred:
        try:
            cache._store_layer(step.layer_idx, key, value, kwargs)
        except Exception:
            if step.layer_idx == 0:
                cache._next_layer = 0  # nothing was appended: the next forward starts at layer 0
            raise
        step.deferred = False
    pages = cache._step_pages
    if pages is None:
        pages = cache._step_pages = _StepPages(cache.kv_cache, cache._step_seq_ids)
    seq_ids = cache._step_seq_ids
    batch_size, num_heads, num_new, head_dim = query.shape
    num_threads = cache._step_threads
    counts, starts = cache._counts, cache._starts
    sink_rotation = cache._sink_rotation
    if num_new == 1 and cache._step_unpadded:
        # [B, Hq, 1, D] is [B, Hq, D] in memory: NumPy views in and out, no torch reshapes.
        q = _numpy_view(query if query.dtype == torch.float32 else query.float())[:, :, 0]
        q_sink = (None if sink_rotation is None
                  else _rotate_half(torch.from_numpy(q).double(), *sink_rotation).float().numpy())
        out = paged_attention.decode(q, pages, step.layer_idx, seq_ids, scale=scaling, num_threads=num_threads,
                                     q_sink=q_sink)
        result = torch.from_numpy(out[:, None])
    else:
        rows = query.detach().transpose(1, 2)
        if rows.dtype != torch.float32:
            rows = rows.float()  # the kernels read float32 queries
        padded = not cache._step_unpadded
        if not padded:
            q = rows.reshape(batch_size * num_new, num_heads, head_dim)
        else:
            q = torch.cat([rows[b, int(s):] for b, s in enumerate(starts)], dim=0)
        qo_indptr = np.zeros(batch_size + 1, dtype=np.int64)
        np.cumsum(counts, out=qo_indptr[1:])
        q_sink = None if sink_rotation is None else _rotate_half(q.double(), *sink_rotation).float().numpy()
        out = paged_attention.prefill(q.contiguous().numpy(), pages, step.layer_idx, seq_ids, qo_indptr,
                                      scale=scaling, num_threads=num_threads, q_sink=q_sink)
        out = torch.from_numpy(out)
        if not padded:
            result = out.view(batch_size, num_new, num_heads, head_dim)
        else:
            result = torch.zeros((batch_size, num_new, num_heads, head_dim), dtype=torch.float32)
            for b in range(batch_size):
                result[b, int(starts[b]):] = out[int(qo_indptr[b]):int(qo_indptr[b + 1])]
    if result.dtype != query.dtype:
        result = result.to(query.dtype)
    return result, None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
