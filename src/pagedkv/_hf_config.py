"""What a transformers model config says about each layer's attention, and what pagedkv can serve.

:class:`pagedkv.transformers.PagedCache` reads the config here, without torch: the type of
each decoder layer as transformers itself reads it (``config.layer_types``, else the
``sliding_window`` / ``attention_chunk_size`` fields, as ``transformers.cache_utils``
infers them), and the model features that change the attention arithmetic (logit
soft-capping, learned sink logits, ALiBi, bidirectional or cross attention). A config
whose attention the cache or the attention function would compute differently from the
model is refused at construction, naming the layer or the feature: nothing is served
silently wrong.
"""
from __future__ import annotations

from pagedkv import AttentionSetting

__all__ = ["ROTATE_HALF_MODEL_TYPES", "rotate_half_refusal", "config_refusals", "layer_attention", "layer_types", "text_config"]


#: Layer types whose K/V rows a paged cache holds (one row per token and layer).
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

# transformers' older names of layer types (``configuration_utils._LEGACY_LAYER_TYPE_REMAP``).
_LEGACY_LAYER_TYPES = {"attention": "full_attention", "mamba": "linear_attention"}

# Layer types that hold no per-token K/V, or K/V under another rule than a causal mask.
_NOT_HELD = {
    "linear_attention": "linear attention / state-space (recurrent state, no per-token K/V)",
    "conv": "convolution state (no per-token K/V)",
    "hybrid": "attention combined with a linear-attention state",
    "hybrid_sliding": "sliding attention combined with a linear-attention state",
    "indexed_attention": "indexer-selected sparse attention",
    "compressed_sparse_attention": "compressed sparse attention",
    "heavily_compressed_attention": "heavily compressed attention",
    "minimax_m3_sparse": "lightning-index sparse attention",
    "window_attention": "non-overlapping window attention",
    "reference_sliding_attention": "full attention over the prompt and a ring buffer over generated tokens",
    "moe": "no attention",
    "mlp": "no attention",
}

def text_config(config):
    """The decoder's text config of ``config`` (itself for a plain causal LM)."""
    if not hasattr(config, "get_text_config"):
        return config
    try:
        return config.get_text_config(decoder=True)
    except TypeError:  # a release whose get_text_config takes no decoder argument
        return config.get_text_config()


def layer_types(config) -> list[str]:
    """The attention type of every decoder layer, read as transformers reads it.

    ``config.layer_types`` when set (legacy names mapped to current ones); otherwise, as
    ``transformers.cache_utils.get_layer_types_and_kwargs`` infers it, every layer is
    ``"sliding_attention"`` when ``sliding_window`` is set, ``"chunked_attention"`` when
    ``attention_chunk_size`` is, else ``"full_attention"``; except that a Qwen2-style
    config (``use_sliding_window``, ``max_window_layers``) slides only from layer
    ``max_window_layers`` on, as ``Qwen2Config`` writes its ``layer_types``.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config or its text config.

    Returns
    -------
    list of str
        One entry per layer (``num_hidden_layers``).

    Raises
    ------
    ValueError
        ``num_hidden_layers`` is not an integer, or ``layer_types`` has another length.
    """
    config = text_config(config)
    num_layers = getattr(config, "num_hidden_layers", None)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise ValueError(f"Invalid value of config: expected an integer num_hidden_layers, got {num_layers!r}")
    types = getattr(config, "layer_types", None)
    if types is not None:
        types = [_LEGACY_LAYER_TYPES.get(t, t) for t in types]
        if len(types) != num_layers:
            raise ValueError(f"Invalid value of config: expected {num_layers} layer_types (num_hidden_layers), "
                             f"got {len(types)}")
        return types
    sliding_window = getattr(config, "sliding_window", None)
    if hasattr(config, "use_sliding_window") and hasattr(config, "max_window_layers"):
        # Qwen2Config.__post_init__: the window is dropped without use_sliding_window, and
        # only layers from max_window_layers on slide.
        if not config.use_sliding_window or sliding_window is None:
            return ["full_attention"] * num_layers
        return ["sliding_attention" if i >= config.max_window_layers else "full_attention" for i in range(num_layers)]
    if sliding_window is not None:
        return ["sliding_attention"] * num_layers
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * num_layers
    return ["full_attention"] * num_layers


# Model types whose attention rotates queries and keys with Llama's rotate-half convention
# (``apply_rotary_pos_emb`` over the two halves of the head; gpt-oss splits the halves the
# same way): the sink query of ``positions="cache"`` is turned that way. Cohere, GLM and
# Llama 4 pair neighbouring channels instead.
ROTATE_HALF_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
    "gemma3", "gemma3_text", "gpt_oss", "phi", "phi3", "stablelm", "smollm3", "olmo2", "olmo3", "granite",
    "exaone4",
})


def rotate_half_refusal(config) -> str | None:
    """Why ``positions="cache"`` cannot turn this model's sink queries, or None when it can."""
    model_type = getattr(text_config(config), "model_type", None)
    if model_type in ROTATE_HALF_MODEL_TYPES:
        return None
    return (f"model_type {model_type!r} is not one whose rotary embedding pagedkv knows to follow (Llama's "
            f"rotate-half convention: {', '.join(sorted(ROTATE_HALF_MODEL_TYPES))})")


def _feature_refusals(config, outer=None) -> list[str]:
    """The model features of ``config`` the attention function would not compute, as sentences.

    ``outer``: the config the text config came from, when it is a multimodal one.
    """
    problems = []
    model_type = getattr(config, "model_type", None)
    if outer is not None and getattr(outer, "vision_config", None) is not None:
        problems.append(f"a multimodal model ({getattr(outer, 'model_type', None)!r} with vision_config): image "
                        "tokens may attend to each other in both directions, which the causal pagedkv attention "
                        "does not compute; use the text-only model")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        problems.append("cross-attention (an encoder-decoder model): only decoder self-attention is held")
    if getattr(config, "use_bidirectional_attention", False) or getattr(config, "is_causal", True) is False:
        problems.append("bidirectional attention (use_bidirectional_attention): the attention is causal only")
    attn_config = getattr(config, "attn_config", None)
    if (getattr(config, "alibi", False) or getattr(attn_config, "alibi", False) or model_type == "bloom"
            or getattr(config, "position_embedding_type", None) == "alibi"):
        problems.append("ALiBi position biases (passed in the attention mask, which the pagedkv attention ignores)")
    modes = getattr(config, "kv_sharing_modes", None)
    if getattr(config, "num_kv_shared_layers", 0) or (modes is not None and any(m == "reuse" for m in modes)):
        problems.append("layers that reuse another layer's K/V (num_kv_shared_layers / kv_sharing_modes)")
    return problems


def config_refusals(config) -> list[str]:
    """Why a paged cache cannot serve ``config`` exactly: one sentence per problem, empty if none.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config.

    Returns
    -------
    list of str
        Each names a layer (index and type) or a config feature.
    """
    outer, config = config, text_config(config)
    if getattr(config, "is_heterogeneous", False):
        return ["per-layer config overrides (per_layer_config): layers may differ in shape or attention"]
    problems = _feature_refusals(config, outer if outer is not config else None)
    for i, t in enumerate(layer_types(config)):
        if t not in ATTENTION_LAYER_TYPES:
            what = _NOT_HELD.get(t, "a layer type pagedkv does not know")
            problems.append(f"layer {i} is {t!r} ({what})")
    return problems


def layer_attention(config) -> list:
    """The attention setting of every decoder layer of a transformers config.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's config or its text config.

    Returns
    -------
    list of AttentionSetting or None
        One entry per layer (``num_hidden_layers``), from :func:`layer_types`: None for
        ``"full_attention"``; ``AttentionSetting(window=sliding_window)`` for
        ``"sliding_attention"`` (transformers' ``sliding_window = W``: the query at ``p``
        attends to ``[p - W + 1, p]``); ``AttentionSetting(chunk_size=attention_chunk_size)``
        for ``"chunked_attention"`` (Llama 4: ``[floor(p / C) * C, p]``). Sinks are 0:
        no transformers model keeps StreamingLLM sink tokens.

    Raises
    ------
    ValueError
        A layer whose type holds no per-token K/V or follows another rule (see
        :func:`config_refusals`), or a sliding or chunked layer without its size.
    """
    config = text_config(config)
    settings = []
    for i, t in enumerate(layer_types(config)):
        if t == "full_attention":
            settings.append(None)
            continue
        name = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}.get(t)
        if name is None:
            raise ValueError(f"Invalid value of config: layer {i} is {t!r} "
                             f"({_NOT_HELD.get(t, 'a layer type pagedkv does not know')})")
        size = getattr(config, name, None)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"Invalid value of config: layer {i} is {t!r}, so {name} must be a positive integer, "
                             f"got {size!r}")
        settings.append(AttentionSetting(window=size) if name == "sliding_window" else AttentionSetting(chunk_size=size))
    return settings
