"""pagedkv.transformers with models whose layers attend differently (sliding, chunked, full).

Random-weight models built from tiny configs (hidden 64, a few layers, small vocabulary):
no download, a few seconds each. The cache must either serve a model exactly (the same
greedy tokens as transformers' own DynamicCache) or refuse it at construction, naming the
layer or the feature it cannot serve.
"""
import importlib.util
import os

import numpy as np
import pytest

REQUIRED = os.environ.get("PAGEDKV_REQUIRE_TRANSFORMERS") == "1"
_MISSING = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
if _MISSING:
    if REQUIRED:
        raise ImportError(f"PAGEDKV_REQUIRE_TRANSFORMERS=1 but {_MISSING} are not installed")
    pytest.skip(f"{_MISSING} not installed (pip install 'pagedkv[transformers]')", allow_module_level=True)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import pagedkv.transformers as pt  # noqa: E402
from pagedkv._hf_config import AttentionSetting  # noqa: E402  (pagedkv.AttentionSetting once the core has it)

TRANSFORMERS_VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])
CACHE_KWARG = "cache" if TRANSFORMERS_VERSION >= (5, 24) else "past_key_values"
VOCAB = 96

# The sizes every tiny config shares: hidden 64, 4 query heads of 16, 2 KV heads.
_SIZES = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def llama_config(num_layers=2, **extra):
    return transformers.LlamaConfig(num_hidden_layers=num_layers, **_SIZES, **extra)


def mistral_config(num_layers=2, sliding_window=8, **extra):
    return transformers.MistralConfig(num_hidden_layers=num_layers, sliding_window=sliding_window, **_SIZES, **extra)


def qwen2_config(num_layers=4, use_sliding_window=True, max_window_layers=2, sliding_window=8, **extra):
    return transformers.Qwen2Config(num_hidden_layers=num_layers, use_sliding_window=use_sliding_window,
                                    max_window_layers=max_window_layers, sliding_window=sliding_window,
                                    **_SIZES, **extra)


def gemma2_config(num_layers=4, sliding_window=8, **extra):
    return transformers.Gemma2Config(num_hidden_layers=num_layers, sliding_window=sliding_window,
                                     query_pre_attn_scalar=16, **_SIZES, **extra)


def gemma3_config(num_layers=6, sliding_window=8, **extra):
    extra.setdefault("sliding_window_pattern", 3)
    return transformers.Gemma3TextConfig(num_hidden_layers=num_layers, sliding_window=sliding_window,
                                         query_pre_attn_scalar=16, **_SIZES, **extra)


def gpt_oss_config(num_layers=2, sliding_window=8, **extra):
    sizes = dict(_SIZES, intermediate_size=64)
    return transformers.GptOssConfig(num_hidden_layers=num_layers, sliding_window=sliding_window,
                                     num_local_experts=4, num_experts_per_tok=2,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                     **sizes, **extra)


def llama4_config(num_layers=4, attention_chunk_size=8, **extra):
    sizes = dict(_SIZES, intermediate_size=64)
    return transformers.Llama4TextConfig(num_hidden_layers=num_layers, attention_chunk_size=attention_chunk_size,
                                         intermediate_size_mlp=96, num_local_experts=2, num_experts_per_tok=1,
                                         **sizes, **extra)


def build(config, implementation, seed=0):
    """A random-weight causal LM of ``config`` (float32, eval mode) with the given attention."""
    torch.manual_seed(seed)
    config._attn_implementation = implementation
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    model.set_attn_implementation(implementation)
    return model


def greedy(model, input_ids, cache, attention_mask=None, **kwargs):
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **{CACHE_KWARG: cache},
                              do_sample=False, pad_token_id=0, **kwargs)


def prompts(batch, length, seed=1):
    """Random token ids ``[batch, length]`` avoiding the special ids 0 to 2."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


# ---------------------------------------------------------------------------------------
# Refusals at construction: models the cache or the attention function would serve wrong.

REFUSED = [
    ("gemma2", gemma2_config, [r"layer 1 is 'full_attention'", r"attn_logit_softcapping=50\.0"]),
    ("gemma3", gemma3_config, [r"layer 2 is 'full_attention'"]),
    ("gpt_oss", gpt_oss_config, [r"layer 1 is 'full_attention'", r"sink logits \(s_aux\)"]),
    ("qwen2_max_window_layers", qwen2_config, [r"layer 0 is 'full_attention', layer 2 is 'sliding_attention'"]),
    ("llama4_chunked", llama4_config, [r"layer 0 is 'chunked_attention' \(attention_chunk_size=8\)"]),
]


@pytest.mark.parametrize("name, make_config, messages", REFUSED, ids=[r[0] for r in REFUSED])
def test_unservable_configs_are_refused_at_construction(name, make_config, messages):
    config = make_config()
    with pytest.raises(ValueError, match="cannot serve this model exactly") as raised:
        pt.PagedCache(config, num_pages=16)
    for message in messages:
        assert raised.match(message)
    assert raised.match("Supported: ")


@pytest.mark.parametrize("layer_type, what", [("linear_attention", "linear attention"), ("conv", "convolution"),
                                              ("hybrid", "linear-attention state"), ("moe", "no attention")])
def test_layers_without_held_kv_are_refused_by_index_and_type(layer_type, what):
    config = llama_config(num_layers=3)
    config.layer_types = ["full_attention", layer_type, "full_attention"]
    with pytest.raises(ValueError, match=f"layer 1 is '{layer_type}' \\(.*{what}"):
        pt.PagedCache(config, num_pages=16)


def test_attention_features_are_refused():
    config = llama_config()
    config.attn_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="soft-capping"):
        pt.PagedCache(config, num_pages=16)
    config = llama_config()
    config.alibi = True
    with pytest.raises(ValueError, match="ALiBi"):
        pt.PagedCache(config, num_pages=16)
    config = llama_config()
    config.is_encoder_decoder = True
    with pytest.raises(ValueError, match="cross-attention"):
        pt.PagedCache(config, num_pages=16)
    config = llama_config()
    config.use_bidirectional_attention = True
    with pytest.raises(ValueError, match="bidirectional"):
        pt.PagedCache(config, num_pages=16)


def test_uniform_configs_are_accepted_with_the_right_default_window():
    assert pt.PagedCache(llama_config(), num_pages=4).window is None
    assert pt.PagedCache(mistral_config(sliding_window=8), num_pages=4).window == 8
    # Qwen2 keeps sliding_window only with use_sliding_window; every layer then slides
    # from max_window_layers on (0: all of them).
    assert pt.PagedCache(qwen2_config(use_sliding_window=False), num_pages=4).window is None
    assert pt.PagedCache(qwen2_config(max_window_layers=0), num_pages=4).window == 8
    assert pt.PagedCache(qwen2_config(max_window_layers=4), num_pages=4).window is None
    # A config that carries sliding_window while every layer is full attention: no window.
    config = gemma3_config(sliding_window_pattern=1)
    config.attn_logit_softcapping = None
    assert set(config.layer_types) == {"full_attention"}
    assert pt.PagedCache(config, num_pages=4).window is None


# ---------------------------------------------------------------------------------------
# Uniform models: the same greedy tokens as DynamicCache.

@pytest.mark.parametrize("make_config", [llama_config, mistral_config], ids=["llama", "mistral"])
def test_uniform_models_generate_the_tokens_of_dynamic_cache(make_config):
    config = make_config()
    model = build(config, "sdpa")
    ids = prompts(2, 27)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second row is left-padded
    expected = greedy(model, ids, DynamicCache(config=model.config), mask, max_new_tokens=20)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=64, page_size=4)
    got = greedy(model, ids, cache, mask, max_new_tokens=20)
    assert got.tolist() == expected.tolist()
    assert cache.window == getattr(config, "sliding_window", None)
    cache.kv_cache.check_invariants()


def test_attention_keywords_the_cache_cannot_apply_are_refused():
    """A model whose layers pass soft-capping, sink logits or a window that the cache does
    not apply is refused at the attention call, before any output."""
    config = llama_config(num_layers=1)
    config._attn_implementation = pt.ATTN_IMPLEMENTATION
    keys = torch.zeros((1, 2, 3, 16))
    query = torch.zeros((1, 4, 3, 16))
    for extra in ({"softcap": 50.0}, {"s_aux": torch.zeros(4)}, {"sliding_window": 8}):
        cache = pt.PagedCache(config, num_pages=8, page_size=4)
        tagged_k, tagged_v = cache.update(keys, keys, 0, kwargs={"position_ids": torch.arange(3)[None]})
        with pytest.raises(ValueError, match="does not apply"):
            pt.paged_attention_forward(None, query, tagged_k, tagged_v, None, **extra)


# ---------------------------------------------------------------------------------------
# Reading each layer's attention from the config, as transformers reads it.

S8 = AttentionSetting(window=8)
C8 = AttentionSetting(chunk_size=8)

PARSED = [
    ("llama", llama_config, {}, [None, None]),
    ("mistral", mistral_config, {}, [S8, S8]),
    ("mistral_no_window", mistral_config, {"sliding_window": None}, [None, None]),
    ("qwen2_max_window_layers", qwen2_config, {}, [None, None, S8, S8]),
    ("qwen2_all_sliding", qwen2_config, {"max_window_layers": 0}, [S8] * 4),
    ("qwen2_no_sliding", qwen2_config, {"use_sliding_window": False}, [None] * 4),
    ("gemma2", gemma2_config, {}, [S8, None, S8, None]),
    ("gemma3_pattern_6", gemma3_config, {"sliding_window_pattern": 6}, [S8] * 5 + [None]),
    ("gemma3_pattern_3", gemma3_config, {}, [S8, S8, None, S8, S8, None]),
    ("gpt_oss", gpt_oss_config, {"num_layers": 4}, [S8, None, S8, None]),
    ("llama4_interval_4", llama4_config, {}, [C8, C8, C8, None]),
    ("llama4_no_rope_layers", llama4_config, {"no_rope_layers": [1, 0, 1, 0]}, [C8, None, C8, None]),
    ("llama4_no_chunks", llama4_config, {"attention_chunk_size": None}, [None] * 4),
]


@pytest.mark.parametrize("name, make_config, kwargs, expected", PARSED, ids=[p[0] for p in PARSED])
def test_layer_attention_reads_each_model_config(name, make_config, kwargs, expected):
    config = make_config(**kwargs)
    settings = pt._layer_attention(config)
    assert settings == expected
    for setting in settings:
        assert setting is None or isinstance(setting, AttentionSetting)
    # The same windows and chunks as transformers' own DynamicCache layers get.
    from transformers import cache_utils

    if hasattr(cache_utils, "get_layer_types_and_kwargs"):
        types, layer_kwargs = cache_utils.get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        for setting, layer_type, extra in zip(settings, types, layer_kwargs):
            if setting is None:
                assert layer_type == "full_attention"
            else:
                assert extra["sliding_window"] == (setting.window or setting.chunk_size)


@pytest.mark.parametrize("name, make_config", [("qwen2", qwen2_config), ("gemma3", gemma3_config),
                                               ("gpt_oss", gpt_oss_config)])
def test_layer_attention_agrees_with_the_model_layers(name, make_config):
    """The window each built attention layer passes to the attention function is the parsed one."""
    config = make_config()
    model = build(config, "eager")
    settings = pt._layer_attention(config)
    windows = [layer.self_attn.sliding_window for layer in model.model.layers]
    assert windows == [None if s is None else s.window for s in settings]


def test_layer_attention_without_layer_types_follows_transformers_inference():
    config = llama_config(num_layers=3)
    config.layer_types = None
    config.sliding_window = 5
    assert pt._layer_attention(config) == [AttentionSetting(window=5)] * 3
    config.sliding_window = None
    config.attention_chunk_size = 7
    assert pt._layer_attention(config) == [AttentionSetting(chunk_size=7)] * 3
    config.layer_types = ["attention", "full_attention", "chunked_attention"]  # legacy name first
    assert pt._layer_attention(config) == [None, None, AttentionSetting(chunk_size=7)]
    config.layer_types = ["full_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="layer 1 is 'linear_attention'"):
        pt._layer_attention(config)
    config.layer_types = ["full_attention", "sliding_attention", "full_attention"]
    config.sliding_window = None
    with pytest.raises(ValueError, match="layer 1 is 'sliding_attention', so sliding_window"):
        pt._layer_attention(config)
