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
of transformers), with full, sliding-window and chunked attention layers in any mix.
Each layer's attention is read from the config as transformers reads it
(``config.layer_types``, else ``sliding_window`` / ``attention_chunk_size``, Qwen2's
``use_sliding_window`` and ``max_window_layers``): a model whose layers all share one
setting (Llama, Mistral) has a cache as before per-layer settings; one whose layers
differ (Gemma 2 and 3, gpt-oss, Qwen2 with ``max_window_layers`` below the layer count,
Llama 4's chunked layers) gets a :class:`pagedkv.KVCache` with ``layer_attention``:
page groups with their own page tables in one pool, a sliding group holding a bounded
number of pages per row. The pagedkv attention passes each layer's ``scaling``, its
attention logit soft-capping (``softcap``, Gemma 2) and its learned sink logits
(``s_aux``, gpt-oss) to the kernels. Tested: Llama (SmolLM2-135M-Instruct loaded from
GGUF), and random-weight tiny models of Llama, Mistral, Qwen2, Gemma 2, Gemma 3,
gpt-oss and Llama 4 against ``DynamicCache`` (greedy, beam search, left padding, logits).

``PagedCache`` refuses at construction, with a ValueError naming the layer (index and
type) or the config field, every model it would serve differently from the model
itself: layers that hold no per-token K/V (linear attention, state-space, convolution,
``moe``-only layers) or follow another rule (sparse, compressed, non-overlapping
windows), layers that reuse another layer's K/V, per-layer config overrides, ALiBi,
bidirectional attention and cross-attention. The
attention function refuses a layer whose window or chunk size (its ``sliding_window``
keyword, the window or chunk of its mask) differs from what the cache applies to it
(a cache built from another config; with ``window=``/``sink_tokens=`` only a layer that
slides where the cache holds everything), an ``attention_mask`` that masks columns the
``position_ids`` count as tokens (a direct forward of a left-padded batch without
``position_ids``: pass ``(attention_mask.cumsum(-1) - 1).clamp(min=0)``, as ``generate``
does), and ``output_attentions=True``; the forward's tokens are then taken back. Importing
this module also registers a mask function for ``"pagedkv"`` with transformers'
``AttentionMaskInterface``: the model's mask is the 2-D padding mask, no dense 4-D mask is
built. A model whose decoder layers do not pass ``position_ids`` on
to attention (Llama 4) gives the cache no way to tell left padding from tokens: a first
forward of different rows is refused for it (one prompt at a time works; beams repeat
one prompt).

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
stores never change a table. An edit between forwards (``crop``, forks) drops it. With
page groups the append returns one row of slots per group (each layer stores through
its group's row), and the page tables are exported once per group per forward, by the
group's first layer, through ``KVCache.layer_attention_view``'s contract.

Beam search and ``num_return_sequences`` are forks: ``reorder_cache``,
``batch_select_indices`` and ``batch_repeat_interleave`` give each new row a
:meth:`KVCache.fork` of its source row, so beams share pages, and a shared page is copied
only when a beam writes into it (copy-on-write).

Sliding window and attention sinks
----------------------------------
``window=W`` (default: the config's ``sliding_window`` for the layers that slide) and
``sink_tokens=S`` follow :class:`pagedkv.KVCache`: the query at position ``p`` attends to
positions ``[p - W + 1, p]`` and ``[0, S)``, and a sequence holds a bounded number of
pages (``pagedkv.models.decode_page_bound``). They apply to the sliding layers only; a
model whose layers are all full attention takes them for every layer, and one with
chunked layers but no sliding one refuses a window. A window or chunked layers need
``attn_implementation="pagedkv"``: dense implementations would attend to positions the
cache has released.

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
``dynamic`` or ``longrope``). Same positions for every sliding layer and every forked
row (full and chunked layers keep absolute positions and have no sinks; a rotary
setting per layer type, as Gemma 3's, is read for the sliding layers); a prompt chunk
longer than the window is handled per query.

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
are not hashed (the cache sees their K/V, not their ids). For a model whose layers differ,
every page group keeps its own cached pages and a prompt is served as far as every group
can serve it (a sliding or chunked layer needs only the pages its window still sees; see
:class:`pagedkv.KVCache`).

Not supported
-------------
Everything refused at construction (see above): encoder-decoder models and
cross-attention, linear-attention and state-space layers, K/V sharing, ALiBi;
``torch.compile`` and static-shape
export; devices other than the CPU; bfloat16 pools (bfloat16 models work with a float32
or float16 pool, at the cost of a conversion per step); ``crop`` of a cache with a
window or chunked layers; attention weights output (``output_attentions``) with the
pagedkv attention; dropout.
"""
from __future__ import annotations

from math import gcd
from typing import Any

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

try:  # where transformers collects output_attentions (5.x); checked to refuse them
    from transformers.utils.output_capturing import _active_collector as _OUTPUT_COLLECTOR
except ImportError:  # pragma: no cover - other releases
    _OUTPUT_COLLECTOR = None
from transformers.cache_utils import Cache, CacheLayerMixin

import pagedkv
from pagedkv import KVCache
from pagedkv_c._checks import checked_int
from pagedkv import attention as paged_attention
from pagedkv import AttentionSetting
from pagedkv._hf_config import config_refusals, rotate_half_refusal
from pagedkv._hf_config import layer_attention as _layer_attention
from pagedkv._paged_requests import GroupStepPages as _GroupStepPages
from pagedkv._paged_requests import PagedRequests, check_prompts, default_group_num_pages, default_num_pages
from pagedkv._paged_requests import StepPages as _StepPages
from pagedkv._paged_requests import layer_layout
from pagedkv.models.attention_backend import check_positions

__all__ = ["ATTN_IMPLEMENTATION", "PagedCache", "paged_attention_forward"]

#: Name under which :func:`paged_attention_forward` is registered with ``AttentionInterface``.
ATTN_IMPLEMENTATION = "pagedkv"

_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}
# Page formats of torch dtypes, and the torch dtype gather returns per format (bfloat16: no conversion).
_TORCH_FORMATS = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_FORMAT_TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "int8": torch.float32, "int4": torch.float32}

#: Most OpenMP threads the attention kernels accept (``num_threads``).
_MAX_KERNEL_THREADS = 1024


# The kernel keywords of a layer without soft-capping or sink logits (shared, never changed).
_NO_FEATURES: dict = {}


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
    """Tag on the keys that update() returns: the cache, its rows and the layer the attention reads.

    ``deferred``: update() stored nothing (it got no ``position_ids``, as before
    transformers 5.24); the attention function stores the layer's K/V with the
    ``position_ids`` it receives.
    """

    __slots__ = ("cache", "requests", "layer_idx", "deferred")

    def __init__(self, cache: PagedCache, layer_idx: int, deferred: bool = False) -> None:
        self.cache = cache
        self.requests = cache._requests
        self.layer_idx = layer_idx
        self.deferred = deferred


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


def _host(array):
    """A tensor moved to the CPU (NumPy converts it without a copy); anything else unchanged."""
    return array.cpu() if isinstance(array, torch.Tensor) else array


def _check_size(name: str, value, low: int, allow_none: bool = True):
    """``value`` as an int in ``[low, 2**62]`` (None passes when allowed), else the shared error."""
    if value is None and allow_none:
        return None
    return checked_int(value, name, low, 2**62)  # TypeError for a float or a bool, ValueError out of range


def _config_value(config, name: str, default=None):
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, name, default)


def _rotary_inverse_frequencies(config, head_dim: int, layer_type: str | None = None) -> np.ndarray:
    """Rotary inverse frequencies ``[rotary_dim // 2]`` (float64, radians per token) of a config.

    Only rotary types whose angle is ``position * inv_freq`` with fixed frequencies
    qualify: ``default``, ``linear``, ``llama3``, ``yarn`` and the like (their constant
    ``attention_factor`` scales queries and keys alike and commutes with a rotation).
    ``dynamic`` and ``longrope`` change the frequencies with the sequence length: ValueError.
    Per-layer-type rotary settings (Gemma 3: ``{"sliding_attention": ..., "full_attention":
    ...}``) are read for ``layer_type``; without one they differ between the layers that
    would be turned: ValueError.
    """
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text_config, "rope_parameters", None) or {}
    extra = {}
    if params and "rope_type" not in params and all(isinstance(v, dict) for v in params.values()):
        if layer_type not in params:
            raise ValueError("Invalid value of positions: 'cache' needs one rotary setting for every layer, "
                             f"got per-layer-type settings {sorted(params)}")
        params = params[layer_type]
        extra = {"layer_type": layer_type}
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
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](text_config, **extra)
    return inv_freq.detach().cpu().double().numpy()


def _rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x[..., D]`` by angles with ``cos``/``sin`` ``[..., R/2]`` (transformers' rotate_half).

    The first ``R`` of the ``D`` features rotate, pairing feature ``i`` with ``i + R/2``
    (the GPT-NeoX / Llama convention of transformers); the rest pass unchanged.
    """
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


def _cache_layer_attention(model_settings: list, window: int | None, sink_tokens: int):
    """The cache's window and per-layer settings from the model's settings and the user's window/sinks.

    Parameters
    ----------
    model_settings : list of AttentionSetting or None
        Per layer, as :func:`pagedkv._hf_config.layer_attention` reads the config.
    window : int or None
        The user's window (validated), or None for the config's.
    sink_tokens : int
        The user's sinks (validated).

    Returns
    -------
    window : int or None
        The window of the layers that slide: the user's, else the config's one
        ``sliding_window`` of the sliding layers; for a model whose layers are all full
        attention, the user's window for every layer (None without one).
    layer_attention : list of AttentionSetting or None, or None
        None when every layer has one setting without chunks (the cache is built with
        ``window``/``sink_tokens`` as before per-layer settings); otherwise one entry per
        layer, the sliding layers with ``(window, sink_tokens)``.

    Raises
    ------
    ValueError
        A window or sinks for a model with chunked layers and no sliding one, or sliding
        layers with different windows.
    """
    sliding = {s.window for s in model_settings if s is not None and s.window is not None}
    chunked = any(s is not None and s.chunk_size is not None for s in model_settings)
    if len(sliding) > 1:
        raise ValueError(f"Invalid value of config: expected one sliding window for every sliding layer, "
                         f"got {sorted(sliding)}")
    if not sliding and chunked and window is not None:
        raise ValueError(f"Invalid value of window: this model's layers are full and chunked attention, none slides "
                         f"(a window applies to the sliding layers only), got {window}")
    if not sliding and chunked and sink_tokens:
        raise ValueError(f"Invalid value of sink_tokens: expected 0, this model's layers are full and chunked "
                         f"attention, none slides (attention sinks exist only in sliding layers), got {sink_tokens}")
    if window is None and sliding:
        window = next(iter(sliding))
    if not chunked and (not sliding or all(s is not None for s in model_settings)):
        return window, None  # one setting for every layer: the cache of today
    sliding_setting = AttentionSetting(window, sink_tokens, None)
    return window, [sliding_setting if s is not None and s.window is not None else s for s in model_settings]


def _num_page_groups(layer_attention: list) -> int:
    """Page groups of a cache with these per-layer settings (the pool layout of :class:`pagedkv.KVCache`).

    Layers with one setting are a kind; with ``G`` the gcd of the kinds' layer counts, a
    kind of ``n`` layers makes ``n / G`` groups.
    """
    counts = {}
    for setting in layer_attention:
        counts[setting] = counts.get(setting, 0) + 1
    size = 0
    for n in counts.values():
        size = gcd(size, n)
    return sum(n // size for n in counts.values())


class PagedCache(Cache):
    """A transformers ``Cache`` whose K/V live in the pages of a :class:`pagedkv.KVCache`.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config (``model.config``): ``num_hidden_layers``,
        ``num_key_value_heads`` (default ``num_attention_heads``), ``head_dim`` (default
        ``hidden_size // num_attention_heads``), ``max_position_embeddings``, the layer
        types (``layer_types``, ``sliding_window``, ``attention_chunk_size``, ...) and the
        attention features are read; ``_attn_implementation`` is read at each step
        (``"pagedkv"`` selects the in-place attention path).
    num_pages : int, optional
        Pages in the pool, ``>= 1``. Default: enough for every row of the first batch to
        hold ``max_tokens`` tokens (with a window: the windowed bound), plus one page per
        row for copy-on-write; for a model whose layers differ, that much for every page
        group (a group that slides holds a whole prompt until the next append, so the
        default does not count on its window). Computed at the first forward, when the
        batch size is known.
    max_tokens : int, optional
        Tokens per sequence used to size the default pool, ``>= 1``. Default:
        ``config.max_position_embeddings``. Ignored when ``num_pages`` is given.
    page_size : int
        Tokens per page, ``>= 1``. Default 16.
    dtype : torch.dtype or numpy dtype, optional
        Pool dtype, float32 or float16 (the older spelling of ``kv_dtype`` for the float
        formats).
    kv_dtype : str or torch.dtype, optional
        The page format (:attr:`pagedkv.KVCache.kv_dtype`): ``"float32"``, ``"float16"``,
        ``"bfloat16"``, ``"int8"`` or ``"int4"`` (or torch.float32 / float16 / bfloat16).
        Default: the dtype of the first keys stored (a bfloat16 model gets bfloat16 pages:
        its keys and values are stored and read back without a conversion). int8 and int4
        pages hold quantized K/V (:class:`pagedkv.KVCache`, *Page formats*).
    window : int, optional
        Sliding window ``W`` in tokens, ``>= 1`` (the query at position ``p`` attends to
        ``[p - W + 1, p]``, Hugging Face's ``sliding_window = W``), of the layers that
        slide; for a model whose layers are all full attention, of every layer. Default:
        the config's ``sliding_window`` for the sliding layers, none for the others.
        Needs ``attn_implementation="pagedkv"``.
    sink_tokens : int
        Attention-sink tokens ``S >= 0`` kept in attention with a window (StreamingLLM,
        Xiao et al. 2023), in the layers the window applies to. Default 0.
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
        OpenMP threads of the attention kernels, ``1 <= num_threads <= 1024``. Default:
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
        A config the cache cannot serve exactly (the message names the layer and its type,
        or the feature: see the module docstring), a window for a model with chunked
        layers and no sliding one, a size out of range (``num_threads`` above 1024
        included), a config without the attention sizes, ``sink_tokens`` without a window
        (or for a model with chunked layers and no sliding one), a dtype other than float32/float16
        (use ``kv_dtype`` for the other formats), an unknown ``kv_dtype`` or one that contradicts
        ``dtype``, ``positions`` not ``"absolute"``
        or ``"cache"``, or ``"cache"`` without a window and sinks or with a rotary type
        whose frequencies change (``dynamic``, ``longrope``) or differ between layers.

    Notes
    -----
    Memory layout and page semantics are those of :class:`pagedkv.KVCache`; see the module
    docstring for padding, beams, windows and prefix reuse.
    """

    def __init__(self, config, *, num_pages=None, max_tokens=None, page_size=16, dtype=None,
                 window=None, sink_tokens=0, positions="absolute", enable_prefix_caching=False,
                 prefix_hash="xxh3_128", num_threads=None, kv_dtype=None) -> None:
        num_layers = _config_value(config, "num_hidden_layers")
        num_heads = _config_value(config, "num_attention_heads")
        if not isinstance(num_layers, int) or not isinstance(num_heads, int):
            raise ValueError(
                "Invalid value of config: expected integer num_hidden_layers and num_attention_heads, "
                f"got {num_layers!r} and {num_heads!r}"
            )
        problems = config_refusals(config)
        if problems:
            raise ValueError(
                "Invalid value of config: PagedCache cannot serve this model exactly: " + "; ".join(problems)
                + ". Supported: decoder-only models with full, sliding-window and chunked attention layers in "
                "any mix, with logit soft-capping and learned sink logits; no ALiBi"
            )
        num_kv_heads = _config_value(config, "num_key_value_heads") or num_heads
        head_dim = _config_value(config, "head_dim") or _config_value(config, "hidden_size") // num_heads
        self._num_pages = _check_size("num_pages", num_pages, 1)
        self._max_tokens = _check_size("max_tokens", max_tokens, 1)
        self._page_size = _check_size("page_size", page_size, 1, allow_none=False)
        window = _check_size("window", window, 1)
        self._sink_tokens = _check_size("sink_tokens", sink_tokens, 0, allow_none=False)
        # The window of the layers that slide (the user's, else the config's) and, for a
        # model whose layers differ, every layer's setting (None: one setting for all).
        model_settings = _layer_attention(config)
        self._window, self._layer_attention = _cache_layer_attention(model_settings, window, self._sink_tokens)
        if self._sink_tokens and self._window is None:
            raise ValueError(f"Invalid value of sink_tokens: expected 0 without a window (pass window=W too), "
                             f"got {sink_tokens}")
        self._positions = check_positions(positions, self._window, self._sink_tokens)
        # The kernels' range, checked here rather than at the first forward.
        self._num_threads = None if num_threads is None else checked_int(num_threads, "num_threads", 1,
                                                                          _MAX_KERNEL_THREADS)
        if dtype is not None:
            dtype = _NUMPY_DTYPES.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
            try:
                pool_dtype = None if isinstance(dtype, torch.dtype) else np.dtype(dtype)
            except TypeError:  # a name NumPy does not know ("bfloat16")
                pool_dtype = None
            if pool_dtype not in (np.float32, np.float16):
                raise ValueError(f"Invalid value of dtype: expected float32 or float16, got {dtype}")
            dtype = np.dtype(dtype)
        if kv_dtype is not None:
            if isinstance(kv_dtype, torch.dtype):
                kv_dtype = _TORCH_FORMATS.get(kv_dtype, str(kv_dtype))
            if kv_dtype not in _FORMAT_TORCH:
                raise ValueError(f"Invalid value of kv_dtype: expected one of {tuple(_FORMAT_TORCH)}, got {kv_dtype!r}")
            if dtype is not None and dtype.name != kv_dtype:
                raise ValueError(f"Invalid value of dtype: {dtype.name} contradicts kv_dtype={kv_dtype!r}; "
                                 "give kv_dtype only")
            dtype = kv_dtype
        elif dtype is not None:
            dtype = dtype.name
        if prefix_hash not in ("xxh3_128", "sha256"):
            raise ValueError(f"Invalid value of prefix_hash: expected 'xxh3_128' or 'sha256', got {prefix_hash!r}")
        self._dtype = dtype  # the page format, or None: the first keys' dtype
        self._prefix_caching = bool(enable_prefix_caching)
        self._prefix_hash = prefix_hash
        self._config = config
        self._num_layers = num_layers
        self._num_kv_heads = int(num_kv_heads)
        self._head_dim = int(head_dim)
        settings = self._layer_attention or [AttentionSetting(self._window, self._sink_tokens, None)] * num_layers
        inv_freq = None
        if positions == "cache":
            refusal = rotate_half_refusal(config)
            if refusal is not None:
                raise ValueError(f"Invalid value of positions: 'cache' turns the sink queries by Llama's rotary "
                                 f"convention, but {refusal}")
            # Only the layers the window applies to keep sinks: the sliding layers if the
            # model has some, else every (full) layer; their rotary setting turns the queries.
            slides = any(s is not None and s.window is not None for s in model_settings)
            inv_freq = _rotary_inverse_frequencies(config, self._head_dim,
                                                   "sliding_attention" if slides else "full_attention")
        # Whether some layer releases keys (window or chunks): crop and dense attention are refused.
        self._releases = any(s is not None and (s.window is not None or s.chunk_size is not None) for s in settings)
        # Per layer: the window the attention function must see passed by the model (a
        # model's sliding_window for a layer the cache holds whole is refused), and
        # whether its sinks are scored with the rotated sink query (positions="cache").
        self._layer_windows = [None if s is None else s.window for s in settings]
        self._layer_sink_query = [s is not None and s.sink_tokens > 0 for s in settings]
        # Without the user's window/sink_tokens the layers must attend as the cache does:
        # the window or chunk size each layer's mask (and sliding_window keyword) gives.
        self._user_window = window is not None or self._sink_tokens > 0
        self._layer_spans = [None if s is None else (s.window if s.window is not None else s.chunk_size)
                             for s in settings]
        self._layer_pages_layout: list | None = None  # per layer (pages, group, settings), with the pool
        # Rows, lengths and what each forward stores: NumPy bookkeeping apart from the glue.
        self._requests = PagedRequests(window=self._window, sink_tokens=self._sink_tokens,
                                       positions=self._positions, inv_freq=inv_freq, releases=self._releases)
        # With positions="cache": cos/sin [T, 1, R/2] that turn this forward's stored
        # queries into their sink queries (None when no query is past S + W - 1).
        self._sink_rotation: tuple[torch.Tensor, torch.Tensor] | None = None
        self._next_layer = 0
        # Decided once per forward, at layer 0, for every layer: the attention
        # implementation and the kernels' thread count.
        self._step_paged = False
        self._step_threads: int | None = 1
        self._layer_steps = [_Step(self, i) for i in range(num_layers)]
        super().__init__(layers=[_PagedLayer(self, i) for i in range(num_layers)])

    # ------------------------------------------------------------------ sizes
    @property
    def page_size(self) -> int:
        """Tokens per page."""
        return self._page_size

    @property
    def window(self) -> int | None:
        """Sliding window in tokens of the layers that slide (every layer for a uniform model), or None."""
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
    def kv_cache(self) -> KVCache | None:
        """The paged storage, created at the first forward (None before)."""
        return self._requests.kv_cache

    @property
    def num_stored_tokens(self) -> int:
        """Tokens whose K/V were written into pages since the cache was made (see the class docstring)."""
        return self._requests.num_stored_tokens

    @property
    def seq_ids(self) -> list[int]:
        """The ``KVCache`` sequence id of each batch row, in row order."""
        return list(self._requests.seq_ids)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Dense columns held per row (left padding included), as ``DynamicCache`` counts them."""
        return self._requests.num_columns

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        """Return ``(kv_length, kv_offset)`` of the dense mask for ``query_length`` new tokens.

        ``query_length`` is an int (transformers >= 5.x current) or the ``cache_position``
        tensor of the new tokens (earlier 5.x releases); ``kv_offset`` is always 0.
        """
        if isinstance(query_length, torch.Tensor):
            query_length = int(query_length.shape[0])
        return self._requests.num_columns + int(query_length), 0

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
    def _make_kv_cache(self, batch_size: int, key_dtype: torch.dtype) -> KVCache:
        """The pool, sized at the first forward or request (``batch_size`` rows)."""
        dtype = self._dtype
        if dtype is None:
            dtype = _TORCH_FORMATS.get(key_dtype, "float32")
        num_pages = self._num_pages
        max_tokens = self._max_tokens or int(_config_value(self._config, "max_position_embeddings", 4096))
        if self._layer_attention is None:
            if num_pages is None:
                num_pages = default_num_pages(batch_size, max_tokens, self._page_size, self._window,
                                              self._sink_tokens)
            return KVCache(
                self._num_layers, self._num_kv_heads, self._head_dim, num_pages, page_size=self._page_size,
                kv_dtype=dtype, window=self._window, sink_tokens=self._sink_tokens,
                enable_prefix_caching=self._prefix_caching, prefix_hash=self._prefix_hash,
            )
        if num_pages is None:
            num_pages = default_group_num_pages(batch_size, max_tokens, self._page_size,
                                                _num_page_groups(self._layer_attention))
        kv_cache = KVCache(
            self._num_layers, self._num_kv_heads, self._head_dim, num_pages, page_size=self._page_size,
            kv_dtype=dtype, layer_attention=self._layer_attention,
            enable_prefix_caching=self._prefix_caching, prefix_hash=self._prefix_hash,
        )
        self._layer_pages_layout = layer_layout(kv_cache)
        return kv_cache

    def pool_tensor(self, layer: int | None = None) -> torch.Tensor:
        """The pool as a torch tensor sharing its memory (``torch.from_numpy``, no copy).

        Parameters
        ----------
        layer : int, optional
            Return only this layer's pages: shape ``(num_pages, 2, page_size,
            num_kv_heads, head_dim)`` (FlashInfer's NHD layout); bfloat16 pages as a
            torch.bfloat16 tensor, int8 and int4 pages as uint8 with the last axis the bytes
            of a head row (:class:`pagedkv.KVCache`, *Page formats*). Default: the whole pool,
            ``(num_layers, num_pages, 2, page_size, num_kv_heads, head_dim)``; for a model
            whose layers differ, ``(G, num_pages, ...)`` with page groups of ``G`` layers
            (see :class:`pagedkv.KVCache`).

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
        if self.kv_cache.kv_dtype == "bfloat16":
            pool = pool.view(torch.bfloat16)
        if layer is None:
            return pool
        if not 0 <= layer < self._num_layers:
            raise IndexError(f"Invalid value of layer: expected 0 <= layer < {self._num_layers}, got {layer}")
        if self._layer_attention is not None:
            pages = torch.from_numpy(self.kv_cache.layer_pages(layer))
            return pages.view(torch.bfloat16) if self.kv_cache.kv_dtype == "bfloat16" else pages
        return pool[layer]

    def stats(self) -> dict:
        """``KVCache.stats()`` plus ``num_stored_tokens``; empty dict before the first forward."""
        return self._requests.stats()

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
        ids, padded = check_prompts(_host(input_ids), None if attention_mask is None else _host(attention_mask))
        self.reset()
        requests = self._requests
        if requests.kv_cache is None:
            # dtype=None: float32 before any keys are seen
            requests.kv_cache = self._make_kv_cache(ids.shape[0], torch.float32)
        return requests.add_prompts(ids, padded)

    def reset(self) -> None:
        """Release every row's pages (cached prefix pages stay findable) and empty the cache."""
        self._requests.reset()
        self._next_layer = 0

    # ------------------------------------------------------------------ update
    def _begin_step(self, key_states: torch.Tensor, attn_kwargs: dict) -> None:
        """Layer 0: append the forward's new tokens to the rows (:meth:`PagedRequests.begin_step`)."""
        batch_size, _, num_new, _ = key_states.shape
        requests = self._requests
        if requests.kv_cache is None:
            requests.kv_cache = self._make_kv_cache(batch_size, key_states.dtype)
        position_ids = attn_kwargs.get("position_ids")
        positions = None if position_ids is None else position_ids.detach().cpu().numpy()
        if (positions is None and self._step_paged and requests.num_columns == 0 and batch_size > 1
                and not all(torch.equal(key_states[row], key_states[0]) for row in range(1, batch_size))):
            # Without positions every new token counts as a token: left padding would be
            # attended to. Rows that repeat one prompt (beams) cannot differ in padding.
            raise ValueError(
                "Invalid call of the pagedkv attention: the model passes no position_ids to its attention layers "
                "(Llama 4's decoder layers keep them), so PagedCache cannot tell left padding from tokens in a "
                f"first forward of {batch_size} different rows; generate one prompt at a time"
            )
        rotation = requests.begin_step(batch_size, num_new, positions,
                                       lambda row, source: torch.equal(key_states[row], key_states[source]))
        self._sink_rotation = None if rotation is None else (torch.from_numpy(rotation[0]),
                                                             torch.from_numpy(rotation[1]))

    def _stored_rows(self, states: torch.Tensor, dense_rows: bool) -> np.ndarray:
        """The stored tokens' rows of ``states`` [B, H, T, D] as one ``[n, H, D]`` array.

        ``dense_rows``: every row stores all its new tokens (no padding, no duplicate rows).
        """
        if dense_rows and states.shape[2] == 1 and states.dtype in _NUMPY_DTYPES:
            # A decode step: [B, H, 1, D] is [B, H, D] in memory; a NumPy view skips
            # three torch calls per layer (about 3 us, as much as the store itself).
            return _numpy_view(states)[:, :, 0]
        rows = states.detach().transpose(1, 2)
        bits = rows.dtype == torch.bfloat16  # passed as bit patterns (KVCache.store(bfloat16_bits=True))
        if rows.dtype not in _NUMPY_DTYPES and not bits:
            rows = rows.float()
        batch_size, num_new = rows.shape[0], rows.shape[1]
        if dense_rows:
            flat = rows.reshape(batch_size * num_new, rows.shape[2], rows.shape[3])
        else:
            flat = torch.cat([rows[b, num_new - int(n):] for b, n in enumerate(self._requests.stored)], dim=0)
        flat = flat.contiguous()
        return flat.view(torch.int16).numpy() if bits else flat.numpy()

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
        if not paged and self._releases:
            raise ValueError(
                f"Invalid attn_implementation {self._config._attn_implementation!r} for a PagedCache with a window "
                f"or chunked layers: expected {ATTN_IMPLEMENTATION!r} (dense attention would read released positions)"
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
        requests = self._requests
        if layer_idx == 0:
            self._begin_step(key_states, attn_kwargs)
        dense_rows = requests.dense_rows
        requests.kv_cache.store(layer_idx, requests.slots, self._stored_rows(key_states, dense_rows),
                                self._stored_rows(value_states, dense_rows),
                                bfloat16_bits=key_states.dtype == torch.bfloat16)

    def _gather_dense(self, layer_idx: int, dtype: torch.dtype):
        """The rows' context ``[batch, kv_heads, columns, head_dim]``, zero in the padding columns."""
        requests = self._requests
        num_columns = requests.num_columns
        shape = (len(requests.seq_ids), self._num_kv_heads, num_columns, self._head_dim)
        keys = torch.zeros(shape, dtype=dtype)
        values = torch.zeros(shape, dtype=dtype)
        bits = dtype == torch.bfloat16
        out_dtype = "bfloat16" if bits else _NUMPY_DTYPES.get(dtype, np.float32)
        for row, seq_id in enumerate(requests.seq_ids):
            k, v, _ = requests.kv_cache.gather(layer_idx, seq_id, dtype=out_dtype)
            n = k.shape[0]
            if n:
                k, v = torch.from_numpy(k), torch.from_numpy(v)
                if bits:
                    k, v = k.view(torch.bfloat16), v.view(torch.bfloat16)
                keys[row, :, num_columns - n:] = k.transpose(0, 1)
                values[row, :, num_columns - n:] = v.transpose(0, 1)
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
        self._requests.crop(tokens_to_remove)

    @staticmethod
    def _as_index_array(indices) -> np.ndarray:
        """Row indices (integer or boolean tensor or array) as an int64 NumPy vector."""
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
        self._requests.select_rows(self._as_index_array(beam_idx))

    def batch_select_indices(self, indices) -> None:
        """Keep the rows ``indices`` (integer or boolean tensor), in that order, as forks."""
        self._requests.select_rows(self._as_index_array(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times in place (``num_return_sequences``, beams), as forks."""
        repeats = _check_size("repeats", repeats, 1, allow_none=False)
        self._requests.select_rows(np.repeat(np.arange(len(self._requests.seq_ids)), repeats))

    def __repr__(self) -> str:
        requests = self._requests
        if self._layer_attention is None:
            attention = f"window={self._window}, sink_tokens={self._sink_tokens}"
        else:  # layers per setting, in order of first appearance
            counts: dict = {}
            for setting in self._layer_attention:
                if setting is None or (setting.window is None and setting.chunk_size is None):
                    text = "full"
                elif setting.window is not None:
                    text = f"window={setting.window}" + (f" sink_tokens={setting.sink_tokens}" if setting.sink_tokens else "")
                else:
                    text = f"chunk_size={setting.chunk_size}"
                counts[text] = counts.get(text, 0) + 1
            attention = "layers={" + ", ".join(f"{text}: {n}" for text, n in counts.items()) + "}"
        return (f"PagedCache(rows={len(requests.seq_ids)}, seq_length={requests.num_columns}, page_size={self._page_size}, "
                f"{attention}, positions={self._positions!r})")


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
    attention_mask : torch.Tensor or None
        What the model passes: with this module's mask function, bool ``[batch,
        columns]`` (1 for tokens) tagged with the mask's window or chunk size. The page
        tables carry padding, window and sinks; the mask is only checked, at layer 0,
        against the tokens the rows hold (and its span against the layer's).
    scaling : float, optional
        Score scale, default ``1 / sqrt(head_dim)``.
    dropout : float
        Must be 0 (inference only).
    kwargs
        The attention layer's keyword arguments. ``softcap`` (float, Gemma 2's
        ``attn_logit_softcapping``) and ``s_aux`` (tensor ``[heads]``, gpt-oss's learned
        sink logits) go to the kernels as ``softcap`` and ``sink_logits``;
        ``sliding_window`` is checked against the layer's window in the cache; the
        ``position_ids`` are used when :meth:`PagedCache.update` had none to store the
        layer's K/V with (transformers before 5.24); ``output_attentions`` must not be
        true; the rest is ignored.

    Returns
    -------
    out : torch.Tensor, shape ``[batch, new_tokens, heads, head_dim]``, the query's dtype
        Zero at padding tokens.
    weights : None

    Raises
    ------
    ValueError
        ``key`` does not come from a :class:`PagedCache` (the model ran without one, or
        with ``use_cache=False``), ``dropout`` is not 0, the layer's ``sliding_window``
        or mask span differs from the window or chunk size the cache applies to it (see
        the module docstring), the mask hides columns the rows hold as tokens (pass
        ``position_ids`` derived from the mask), attention weights are requested
        (``output_attentions``), or, when this call stores the K/V, the errors of
        :meth:`PagedCache.update` and a first forward of different rows without
        ``position_ids``. After the mask and ``output_attentions`` errors the forward's
        tokens are taken back (a first forward's rows removed).
    pagedkv.OutOfPagesError
        When this call stores the K/V and the pool has no room for them.

    Notes
    -----
    One-token steps call :func:`pagedkv.attention.decode`; prompts and multi-token steps
    call :func:`pagedkv.attention.prefill` over the stored tokens of each row (ragged,
    FlashInfer's ``qo_indptr`` layout). With page groups the kernels read the layer's
    pages, page tables and mask settings (window, sinks, chunk size) through
    ``layer_attention_view``. With ``positions="cache"`` the keys at positions
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
    layer = step.layer_idx
    softcap = kwargs.get("softcap")
    s_aux = kwargs.get("s_aux")
    if cache._user_window:
        mismatch = kwargs.get("sliding_window") is not None and cache._layer_windows[layer] is None
    else:
        # The cache's window or chunk size of the layer must be what the model applies:
        # its sliding_window keyword (when it passes one) and the span of its mask.
        span = cache._layer_spans[layer]
        mismatch = (("sliding_window" in kwargs and kwargs["sliding_window"] != cache._layer_windows[layer])
                    or getattr(attention_mask, "_pagedkv_span", span) != span)
    if mismatch:
        # The construction checks of PagedCache refuse such models; a model whose layers
        # differ from the config the cache was built from must not be served silently wrong.
        setting = cache._layer_attention[layer] if cache._layer_attention is not None else None
        raise ValueError(
            f"Invalid attention for layer {layer}: the model passes softcap={softcap!r}, "
            f"s_aux={'set' if s_aux is not None else None}, sliding_window={kwargs.get('sliding_window')!r}"
            f"{_mask_span_text(attention_mask)}, which the pagedkv attention of this cache (window "
            f"{cache._layer_windows[layer]}, chunk size {None if setting is None else setting.chunk_size}) does "
            "not apply: build the PagedCache from the model's own config (model.config)"
        )
    features = _NO_FEATURES
    if softcap is not None or s_aux is not None:
        features = {}
        if softcap is not None:
            features["softcap"] = float(softcap)
        if s_aux is not None:
            features["sink_logits"] = _numpy_view(s_aux if s_aux.dtype == torch.float32 else s_aux.float())
    requests = step.requests
    if step.deferred:
        try:
            cache._store_layer(step.layer_idx, key, value, kwargs)
        except Exception:
            if step.layer_idx == 0:
                cache._next_layer = 0  # nothing was appended: the next forward starts at layer 0
            raise
        step.deferred = False
    if layer == 0:
        if kwargs.get("output_attentions") or _attentions_requested():
            requests.undo_step(query.shape[2])
            cache._next_layer = 0
            raise ValueError("Invalid value of output_attentions: expected False, the pagedkv attention computes no "
                             "attention weights (use attn_implementation='eager' to get them)")
        if getattr(attention_mask, "_pagedkv_padded", False):
            _check_padding(cache, attention_mask, query.shape[2])
    pages = requests.pages
    if pages is None:
        if cache._layer_pages_layout is None:
            pages = requests.pages = _StepPages(requests.kv_cache, requests.step_seq_ids)
        else:  # page groups: one export per group, made by the group's first layer
            pages = requests.pages = _GroupStepPages(requests.kv_cache, requests.step_seq_ids,
                                                     cache._layer_pages_layout)
    seq_ids = requests.step_seq_ids
    batch_size, num_heads, num_new, head_dim = query.shape
    num_threads = cache._step_threads
    sink_rotation = cache._sink_rotation
    if sink_rotation is not None and not cache._layer_sink_query[layer]:
        sink_rotation = None  # a layer without sinks (full or chunked among sliding ones)
    unpadded = requests.unpadded
    if num_new == 1 and unpadded:
        # [B, Hq, 1, D] is [B, Hq, D] in memory: NumPy views in and out, no torch reshapes.
        q = _numpy_view(query if query.dtype == torch.float32 else query.float())[:, :, 0]
        q_sink = (None if sink_rotation is None
                  else _rotate_half(torch.from_numpy(q).double(), *sink_rotation).float().numpy())
        out = paged_attention.decode(q, pages, layer, seq_ids, scale=scaling, num_threads=num_threads,
                                     q_sink=q_sink, **features)
        result = torch.from_numpy(out[:, None])
    else:
        rows = query.detach().transpose(1, 2)
        if rows.dtype != torch.float32:
            rows = rows.float()  # the kernels read float32 queries
        padded = not unpadded
        starts = requests.starts
        if not padded:
            q = rows.reshape(batch_size * num_new, num_heads, head_dim)
        else:
            q = torch.cat([rows[b, int(s):] for b, s in enumerate(starts)], dim=0)
        qo_indptr = np.zeros(batch_size + 1, dtype=np.int64)
        np.cumsum(requests.counts, out=qo_indptr[1:])
        q_sink = None if sink_rotation is None else _rotate_half(q.double(), *sink_rotation).float().numpy()
        out = paged_attention.prefill(q.contiguous().numpy(), pages, layer, seq_ids, qo_indptr,
                                      scale=scaling, num_threads=num_threads, q_sink=q_sink, **features)
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


def _attentions_requested() -> bool:
    """Whether the running forward collects attention weights (``output_attentions=True``).

    transformers 5.x records them with hooks on the attention layers, which read a context
    variable of its output capturing; without that module (another release) False.
    """
    if _OUTPUT_COLLECTOR is None:
        return False
    collected = _OUTPUT_COLLECTOR.get()
    return collected is not None and "attentions" in collected


def _mask_span_text(attention_mask) -> str:
    """``", a mask of window or chunk span N"`` when the model's mask says so, else empty."""
    span = getattr(attention_mask, "_pagedkv_span", None)
    return "" if span is None else f", a mask of window or chunk {span}"


def _check_padding(cache: PagedCache, mask: torch.Tensor, num_new: int) -> None:
    """Raise ValueError, taking the forward's append back, if ``mask`` hides a column the rows hold as a token.

    ``mask``: bool ``[batch or 1, columns]`` (:func:`_paged_mask`). The cache holds each
    row's tokens in its trailing ``lengths[b]`` columns; the rest is left padding.
    """
    requests = cache._requests
    num_columns = mask.shape[-1]
    lengths = torch.from_numpy(requests.lengths)
    columns = torch.arange(num_columns)
    tokens = columns[None, :] >= (num_columns - lengths)[:, None]
    hidden = tokens & ~mask
    if not bool(hidden.any()):
        return
    row = int(hidden.any(dim=-1).nonzero()[0, 0])
    requests.undo_step(num_new)
    cache._next_layer = 0
    raise ValueError(
        f"Invalid attention_mask for the pagedkv attention: row {row} masks columns that its position_ids count as "
        "tokens (the model numbers every column when it gets no position_ids), so they would be attended to; pass "
        "position_ids derived from the mask, e.g. (attention_mask.cumsum(-1) - 1).clamp(min=0), as generate does"
    )


def _paged_mask(*args, attention_mask=None, batch_size=None, kv_length=None, local_size=None, **kwargs):
    """The mask the model passes to the pagedkv attention: the 2-D padding mask, with two tags.

    transformers builds a layer type's mask once per forward with the function registered
    for the attention implementation (``AttentionMaskInterface``). The pagedkv attention
    needs no dense mask (page tables carry padding, window and chunks), only what lets it
    check them: the bool ``[batch, kv_length]`` mask of padding (1 for tokens) tagged with
    ``_pagedkv_padded`` (whether some column is masked) and ``_pagedkv_span`` (the mask's
    window or chunk size, ``local_size``; None for full causal attention).
    """
    if attention_mask is None or attention_mask.ndim != 2:
        mask = torch.ones((batch_size, kv_length), dtype=torch.bool)
        padded = False
    else:
        mask = attention_mask[:, -kv_length:]
        if mask.dtype != torch.bool:
            mask = mask.bool()
        padded = not bool(mask.all())
    mask._pagedkv_padded = padded
    mask._pagedkv_span = local_size
    return mask


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _paged_mask)
