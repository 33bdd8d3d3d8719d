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
import pagedkv  # noqa: E402
from pagedkv import AttentionSetting  # noqa: E402

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

MIXED = [
    ("gemma2", gemma2_config),
    ("gemma3", gemma3_config),
    ("gpt_oss", gpt_oss_config),
    ("qwen2_max_window_layers", qwen2_config),
    ("llama4_chunked", llama4_config),
]


@pytest.mark.parametrize("name, make_config", MIXED, ids=[r[0] for r in MIXED])
def test_mixed_models_get_every_layers_own_setting(name, make_config):
    config = make_config()
    cache = pt.PagedCache(config, num_pages=16)
    assert cache._layer_attention == pt._layer_attention(config)  # the model's own settings


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
    pt.PagedCache(config, num_pages=16)  # the kernels cap the scores
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
    config = llama_config(num_layers=3)
    config.num_kv_shared_layers = 1
    with pytest.raises(ValueError, match="reuse another layer's K/V"):
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
    config.initializer_range = 0.2  # peaked attention: a wrong window changes the tokens
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
    """A model whose layers pass a window the cache does not apply is refused at the
    attention call, before any output."""
    config = llama_config(num_layers=1)
    config._attn_implementation = pt.ATTN_IMPLEMENTATION
    keys = torch.zeros((1, 2, 3, 16))
    query = torch.zeros((1, 4, 3, 16))
    for extra in [{"sliding_window": 8}]:
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


def test_user_window_and_sinks_apply_to_the_sliding_layers_only():
    full, c8 = None, AttentionSetting(chunk_size=8)
    model = [AttentionSetting(window=8), full, AttentionSetting(window=8), full]
    assert pt._cache_layer_attention(model, None, 0) == (8, model)
    assert pt._cache_layer_attention(model, 5, 2) == (5, [AttentionSetting(5, 2, None), full] * 2)
    # One setting for every layer: the cache without per-layer settings, the window for all.
    assert pt._cache_layer_attention([full] * 3, None, 0) == (None, None)
    assert pt._cache_layer_attention([full] * 3, 6, 1) == (6, None)
    assert pt._cache_layer_attention([AttentionSetting(window=8)] * 2, 4, 1) == (4, None)
    # Chunked layers keep their chunks; a window has no sliding layer to apply to.
    assert pt._cache_layer_attention([c8, full], None, 0) == (None, [c8, full])
    assert pt._cache_layer_attention([c8, c8], None, 0) == (None, [c8, c8])
    with pytest.raises(ValueError, match="none slides"):
        pt._cache_layer_attention([c8, full], 4, 0)
    with pytest.raises(ValueError, match="one sliding window"):
        pt._cache_layer_attention([AttentionSetting(window=8), AttentionSetting(window=4)], None, 0)


def test_page_groups_and_default_pages_follow_the_pool_layout():
    s8, c8 = AttentionSetting(window=8), AttentionSetting(chunk_size=8)
    assert pt._num_page_groups([s8, None, s8, None]) == 2             # G = 2: one group per kind
    assert pt._num_page_groups([s8, s8, None, s8, s8, None]) == 3     # 4 sliding, 2 full: G = 2
    assert pt._num_page_groups([c8, c8, c8, None]) == 4               # 3 and 1: G = 1
    from pagedkv._paged_requests import default_group_num_pages

    # 2 rows of 30 tokens in pages of 4: 8 pages a row and group, plus 1 for copy-on-write.
    assert default_group_num_pages(2, 30, 4, 3) == 3 * 2 * 9


# ---------------------------------------------------------------------------------------
# Models whose layers differ: the same tokens and logits as DynamicCache. These need the
# per-layer core (KVCache(layer_attention=...)) and kernels (softcap, sink_logits, chunks).
# Windows and chunks of 8 tokens; prompts cross each of them at least three times.

HYBRID = [
    # sliding/full alternating; soft-capping at 5 (the weights below give scores up to about 10)
    ("gemma2", lambda: gemma2_config(attn_logit_softcapping=5.0)),
    ("gemma3", gemma3_config),     # two sliding layers per full one: 3 page groups of 2 layers
    ("gpt_oss", gpt_oss_config),   # sliding/full alternating, learned sink logits
    ("qwen2", qwen2_config),       # full below max_window_layers, sliding from it
    ("llama4", llama4_config),     # three chunked layers per full one: 4 page groups of 1 layer
]
HYBRID_IDS = [h[0] for h in HYBRID]
# The oracle: transformers' eager attention (the reference of soft-capping and sinks) on DynamicCache.
ORACLE = "eager"


def _hybrid_model(make_config, seed=0):
    """A random-weight model whose attention is peaked enough for windows, chunks, caps and
    sinks to change the tokens (weights of standard deviation 0.2 instead of 0.02)."""
    config = make_config()
    config.initializer_range = 0.2
    return build(config, ORACLE, seed=seed)


@pytest.mark.parametrize("name, make_config", HYBRID, ids=HYBRID_IDS)
def test_hybrid_greedy_tokens_of_a_left_padded_batch_equal_dynamic_cache(name, make_config):
    model = _hybrid_model(make_config)
    ids = prompts(3, 34)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0   # 27 tokens: past three windows of 8
    mask[2, :2] = 0
    if name == "llama4":
        # Llama 4's decoder layers do not pass position_ids on to attention: the cache
        # cannot tell padding from tokens, so it refuses different rows, and serves one.
        model.set_attn_implementation("pagedkv")
        with pytest.raises(ValueError, match="no position_ids"):
            greedy(model, ids, pt.PagedCache(model.config, num_pages=64), mask, max_new_tokens=2)
        model.set_attn_implementation(ORACLE)
        ids, mask = ids[1:2, 7:], None
    expected = greedy(model, ids, DynamicCache(config=model.config), mask, max_new_tokens=12)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, page_size=4, max_tokens=64)   # the default pool size
    got = greedy(model, ids, cache, mask, max_new_tokens=12)
    assert got.tolist() == expected.tolist()
    kv = cache.kv_cache
    assert kv.num_groups > 1
    assert [kv.layer_setting(i) for i in range(kv.num_layers)] == [
        AttentionSetting() if s is None else s for s in pt._layer_attention(model.config)]
    kv.check_invariants()


@pytest.mark.parametrize("name, make_config", HYBRID, ids=HYBRID_IDS)
def test_hybrid_beam_search_equals_dynamic_cache(name, make_config):
    model = _hybrid_model(make_config, seed=1)
    ids = prompts(1, 30, seed=2)
    kwargs = dict(num_beams=3, num_return_sequences=3, max_new_tokens=10)
    expected = greedy(model, ids, DynamicCache(config=model.config), **kwargs)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=512, page_size=4)
    got = greedy(model, ids, cache, **kwargs)
    assert got.tolist() == expected.tolist()
    cache.kv_cache.check_invariants()


def _logits(model, input_ids, cache):
    with torch.no_grad():
        return model(input_ids=input_ids, **{CACHE_KWARG: cache}, use_cache=True).logits.float().numpy()


@pytest.mark.parametrize("name, make_config", HYBRID, ids=HYBRID_IDS)
def test_hybrid_logits_within_1e4_through_prefill_decode_forks_and_long_chunks(name, make_config):
    """float32 pool: every position's logits within 1e-4 of the largest magnitude, through a
    prompt, decode steps, repeated and reordered rows, and a chunk longer than the window."""
    model = _hybrid_model(make_config, seed=3)
    dense = DynamicCache(config=model.config)
    paged = pt.PagedCache(model.config, num_pages=512, page_size=4, dtype=torch.float32)
    made = []

    class CountingGroupStepPages(pt._GroupStepPages):
        def __init__(self, *args):
            super().__init__(*args)
            self.views = {}  # group -> the page tables each of its layers read
            made.append(self)

        def layer_attention_view(self, layer, seq_ids):
            answer = super().layer_attention_view(layer, seq_ids)
            self.views.setdefault(self._kv_cache.layer_group(layer), []).append(answer[1])
            return answer

    rows = 1 if name == "llama4" else 2   # Llama 4 passes no position_ids: one prompt at a time
    steps = [(None, prompts(rows, 26, seed=4))] + [(None, prompts(rows, 1, seed=10 + i)) for i in range(3)]
    order = torch.tensor([2 * rows - 1, 0, 0, 1][:2 * rows])
    steps += [(lambda c: c.batch_repeat_interleave(2), prompts(2 * rows, 1, seed=20)),
              (lambda c: c.reorder_cache(order), prompts(2 * rows, 1, seed=21)),
              (None, prompts(2 * rows, 19, seed=22))] + [(None, prompts(2 * rows, 1, seed=30 + i)) for i in range(3)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pt, "_GroupStepPages", CountingGroupStepPages)
        for edit, ids in steps:
            if edit is not None:
                edit(dense)
                edit(paged)
            model.set_attn_implementation(ORACLE)
            want = _logits(model, ids, dense)
            model.set_attn_implementation("pagedkv")
            got = _logits(model, ids, paged)
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
    num_groups = paged.kv_cache.num_groups
    # One page-table export per group per forward, shared by the group's layers.
    assert len(made) == len(steps)
    for step_pages in made:
        assert sorted(step_pages.views) == list(range(num_groups))
        for views in step_pages.views.values():
            assert all(view is views[0] for view in views)
    paged.kv_cache.check_invariants()


def test_hybrid_sliding_groups_release_pages():
    """Gemma 3's sliding groups hold a bounded number of pages; its full group holds the sequence."""
    from pagedkv.models import decode_page_bound

    model = _hybrid_model(gemma3_config)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=256, page_size=4)
    out = greedy(model, prompts(1, 20), cache, max_new_tokens=40, min_new_tokens=40)
    kv = cache.kv_cache
    length = out.shape[1] - 1
    full = sum(1 for g in range(kv.num_groups) if kv.group_setting(g).window is None)
    sliding = kv.num_groups - full
    held = cache.stats()["pages_in_use"]
    assert held <= full * -(-length // 4) + sliding * decode_page_bound(4, 8)
    assert held < kv.num_groups * -(-length // 4)


def test_hybrid_resident_kv_is_the_minimum_in_whole_pages_per_group():
    """After a long generation each group holds exactly the whole pages of what its layers'
    last query attends to (full: every position; window W: positions [n - W, n)). Against
    DynamicCache (every token of a full layer, the last W - 1 of a sliding one) the excess is
    the rounding to whole pages: under a page per full layer, under two per sliding layer."""
    from transformers import DynamicCache

    page_size, window = 4, 8
    model = _hybrid_model(gemma3_config)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=256, page_size=page_size)
    out = greedy(model, prompts(1, 30), cache, max_new_tokens=37, min_new_tokens=37)
    kv = cache.kv_cache
    n = out.shape[1] - 1  # the last token generated is not stored
    assert kv.seq_len(cache.seq_ids[0]) == n
    for group in range(kv.num_groups):
        view = kv.page_table(cache.seq_ids, group=group)
        if kv.group_setting(group).window is None:
            expected = -(-n // page_size)
        else:
            expected = (n - 1) // page_size - (n - window) // page_size + 1
        assert view.indptr[1] == expected, (group, kv.group_setting(group))
    row_bytes = 2 * kv.num_kv_heads * kv.head_dim * kv.kv.itemsize  # K and V of one token and layer
    paged = cache.stats()["pages_in_use"] * cache.stats()["bytes_per_page"]
    model.set_attn_implementation(ORACLE)
    dynamic = DynamicCache(config=model.config)
    greedy(model, prompts(1, 30), dynamic, max_new_tokens=37, min_new_tokens=37)
    dynamic_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in dynamic.layers)
    sliding_layers = sum(1 for t in model.config.layer_types if t == "sliding_attention")
    full_layers = len(model.config.layer_types) - sliding_layers
    rounding = full_layers * (page_size - 1) + sliding_layers * (2 * page_size - 1)
    assert dynamic_bytes < paged <= dynamic_bytes + rounding * row_bytes


def test_hybrid_user_window_and_sinks_reach_the_sliding_layers_only():
    config = gemma3_config()
    cache = pt.PagedCache(config, num_pages=64, page_size=4, window=6, sink_tokens=2)
    assert cache.window == 6
    cache.begin(prompts(1, 5))  # makes the pool
    kv = cache.kv_cache
    for layer, layer_type in enumerate(config.layer_types):
        setting = kv.layer_setting(layer)
        if layer_type == "sliding_attention":
            assert (setting.window, setting.sink_tokens) == (6, 2)
        else:
            assert (setting.window, setting.sink_tokens, setting.chunk_size) == (None, 0, None)


def test_hybrid_cache_refuses_dense_attention_and_crop():
    model = _hybrid_model(gemma3_config)
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="attn_implementation"):
        greedy(model, prompts(1, 10), pt.PagedCache(model.config, num_pages=64), max_new_tokens=2)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=64)
    greedy(model, prompts(1, 10), cache, max_new_tokens=2)
    with pytest.raises(ValueError, match="crop"):
        cache.crop(-1)


@pytest.mark.parametrize("name, make_config", HYBRID, ids=HYBRID_IDS)
def test_hybrid_prefix_caching_serves_a_second_turn_from_the_first(name, make_config):
    """A second chat turn, in a new request, starts on the first turn's cached prompt pages in
    every page group (the sliding and chunked groups on the pages their window still sees):
    the tokens are DynamicCache's, and only the rest of the prompt is computed."""
    model = _hybrid_model(make_config)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=128, page_size=4, enable_prefix_caching=True)
    first = prompts(1, 30)
    assert cache.begin(first) == 0
    answer = greedy(model, first, cache, max_new_tokens=6)
    assert cache.kv_cache.num_groups > 1 and cache.kv_cache.prefix_caching
    # The next turn: the first prompt, its answer and a new message (generated tokens are not hashed,
    # so the first prompt's 7 full pages of 4 are what can be reused).
    second = torch.cat([answer, prompts(1, 9, seed=2)], dim=1)
    computed_before = cache.num_stored_tokens
    hit = cache.begin(second)
    assert hit == 28
    kv = cache.kv_cache
    for group in range(kv.num_groups):
        assert kv.page_table(kv.seq_ids(), group=group).seq_lens.tolist() == [28]
    warm = greedy(model, second, cache, max_new_tokens=8)
    computed = cache.num_stored_tokens - computed_before
    assert computed == second.shape[1] - hit + warm.shape[1] - second.shape[1] - 1
    stats = cache.stats()
    assert stats["prefix_hits"] == 28 and stats["prefix_queries"] == first.shape[1] + second.shape[1]
    kv.check_invariants()
    model.set_attn_implementation(ORACLE)
    cold = greedy(model, second, DynamicCache(config=model.config), max_new_tokens=8)
    assert warm.tolist() == cold.tolist()


def test_hybrid_cache_positions_turn_the_queries_of_sliding_layers_only():
    """positions="cache" with sinks: the sliding layers score their sinks with the query turned
    by their own rotary setting (Gemma 3: the local base 10,000); full layers get no sink query."""
    config = gemma3_config()
    model = _hybrid_model(gemma3_config)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=128, page_size=4, window=6, sink_tokens=2, positions="cache")
    head_dim = config.head_dim
    np.testing.assert_allclose(cache._requests._inv_freq,
                               10000.0 ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    calls = []
    kernels = pt.paged_attention

    def spy(name):
        function = getattr(kernels, name)

        def call(q, pages, layer, *args, q_sink=None, **kwargs):
            calls.append((layer, q_sink is not None))
            return function(q, pages, layer, *args, q_sink=q_sink, **kwargs)
        return call

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "decode", spy("decode"))
        patch.setattr(kernels, "prefill", spy("prefill"))
        greedy(model, prompts(1, 12), cache, max_new_tokens=8)
    turned = {layer for layer, q_sink in calls if q_sink}
    assert turned == {i for i, t in enumerate(config.layer_types) if t == "sliding_attention"}


def test_rows_without_position_ids_are_refused_unless_they_repeat_one_prompt():
    """A model that passes no position_ids to attention (Llama 4) leaves padding unknowable:
    a first forward of different rows is refused before anything is stored; repeated rows
    (beams of one prompt) and single rows are served."""
    config = llama_config(num_layers=1)
    config._attn_implementation = pt.ATTN_IMPLEMENTATION
    rng = np.random.default_rng(0)
    keys = torch.from_numpy(rng.standard_normal((2, 2, 3, 16), dtype=np.float32))
    query = torch.from_numpy(rng.standard_normal((2, 4, 3, 16), dtype=np.float32))
    cache = pt.PagedCache(config, num_pages=8, page_size=4)
    tagged_k, tagged_v = cache.update(keys, keys, 0)
    with pytest.raises(ValueError, match="no position_ids"):
        pt.paged_attention_forward(None, query, tagged_k, tagged_v, None)
    assert cache.num_stored_tokens == 0
    same = keys[:1].repeat(2, 1, 1, 1)
    cache = pt.PagedCache(config, num_pages=8, page_size=4)
    tagged_k, tagged_v = cache.update(same, same, 0)
    out = pt.paged_attention_forward(None, query[:1].repeat(2, 1, 1, 1), tagged_k, tagged_v, None)[0]
    assert torch.equal(out[0], out[1]) and cache.get_seq_length() == 3


def test_rotary_frequencies_per_layer_type_are_read_for_the_sliding_layers():
    config = gemma3_config()
    got = pt._rotary_inverse_frequencies(config, 16, "sliding_attention")
    np.testing.assert_allclose(got, 10000.0 ** (-np.arange(0, 16, 2, dtype=np.float64) / 16))
    with pytest.raises(ValueError, match="per-layer-type"):
        pt._rotary_inverse_frequencies(config, 16)


def test_a_multimodal_config_is_refused():
    """Gemma 3 with a vision tower: its image tokens attend both ways, which causal paged attention does not."""
    config = transformers.Gemma3Config(text_config=gemma3_config().to_dict())
    with pytest.raises(ValueError, match=r"multimodal model \('gemma3' with vision_config\)"):
        pt.PagedCache(config, num_pages=16)
    pt.PagedCache(config.get_text_config(), num_pages=16)  # the text-only model is served


def test_cache_positions_are_refused_for_a_rotary_convention_other_than_rotate_half():
    """Cohere 2 pairs neighbouring rotary channels: the sink query cannot be turned Llama's way."""
    config = transformers.Cohere2Config(num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention"] * 2,
                                        **_SIZES)
    with pytest.raises(ValueError, match=r"model_type 'cohere2' is not one whose rotary embedding"):
        pt.PagedCache(config, num_pages=16, window=8, sink_tokens=2, positions="cache")
    pt.PagedCache(config, num_pages=16, window=8, sink_tokens=2)  # absolute positions need no turn
    pt.PagedCache(gemma3_config(), num_pages=16, window=8, sink_tokens=2, positions="cache")


# ---------------------------------------------------------------------------------------
# Direct forwards and config mismatches the cache must refuse rather than serve wrongly.

@pytest.mark.parametrize("make_config", [llama_config, gemma3_config], ids=["llama", "gemma3"])
def test_a_padding_mask_the_positions_do_not_account_for_is_refused(make_config):
    """A direct forward of a left-padded batch with attention_mask but without position_ids
    (the model then numbers every column as a token) would attend to the padding: refused,
    naming position_ids; with position_ids from the mask, as generate derives them, the
    logits equal the dense ones, and the refused cache still serves that forward."""
    model = _hybrid_model(make_config)
    ids = prompts(2, 30, seed=9)
    mask = torch.ones_like(ids)
    ids[1, :12] = 0
    mask[1, :12] = 0
    with torch.no_grad():
        expected = model(ids, attention_mask=mask, **{CACHE_KWARG: DynamicCache(config=model.config)}).logits
        model.set_attn_implementation("pagedkv")
        cache = pt.PagedCache(model.config, num_pages=64, page_size=4)
        with pytest.raises(ValueError, match=r"position_ids.*cumsum"):
            model(ids, attention_mask=mask, **{CACHE_KWARG: cache})
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        got = model(ids, attention_mask=mask, position_ids=position_ids, **{CACHE_KWARG: cache}).logits
    assert torch.allclose(got[0], expected[0], atol=1e-4)
    assert torch.allclose(got[1, 12:], expected[1, 12:], atol=1e-4)
    assert cache.kv_cache.seq_len(cache.seq_ids[1]) == 18
    cache.kv_cache.check_invariants()


def _mismatch_forward(model, cache_config, **cache_kwargs):
    model.set_attn_implementation("pagedkv")
    with torch.no_grad():
        return model(prompts(1, 20), **{CACHE_KWARG: pt.PagedCache(cache_config, num_pages=64, **cache_kwargs)})


@pytest.mark.parametrize("make_config, change", [
    (gemma3_config, {"sliding_window": 16}),                              # a larger window
    (gemma3_config, {"layer_types": ["sliding_attention"] * 6}),           # full layers windowed
    (gemma3_config, {"layer_types": ["full_attention"] * 6}),              # sliding layers held whole
    (mistral_config, {"sliding_window": 4}),
    (llama4_config, {"attention_chunk_size": 16}),                         # another chunk size
    (llama4_config, {"layer_types": ["full_attention"] * 4}),
    (llama4_config, {"layer_types": ["chunked_attention"] * 4}),
], ids=["gemma3_window", "gemma3_all_sliding", "gemma3_all_full", "mistral_window", "llama4_chunk",
        "llama4_all_full", "llama4_all_chunked"])
def test_a_cache_config_that_disagrees_with_the_model_layers_is_refused(make_config, change):
    """A cache built from a config whose windows, chunks or layer types differ from the
    model's layers is refused at the first attention call, whichever side differs."""
    model = _hybrid_model(make_config)
    cache_config = make_config()
    for name, value in change.items():
        setattr(cache_config, name, value)
    cache_config._attn_implementation = "pagedkv"
    with pytest.raises(ValueError, match=r"Invalid attention for layer \d+"):
        _mismatch_forward(model, cache_config)


def test_a_users_window_may_differ_from_the_model_layers():
    """window= is the user's request: it applies to the sliding layers whatever they pass."""
    model = _hybrid_model(gemma3_config)
    assert _mismatch_forward(model, model.config, window=4).logits.shape == (1, 20, VOCAB)


def test_output_attentions_is_refused():
    """The pagedkv attention computes no weights: output_attentions=True is refused rather
    than answered with an empty tuple, and the cache serves the next forward."""
    model = _hybrid_model(gemma3_config)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=64)
    ids = prompts(1, 12)
    with torch.no_grad():
        with pytest.raises(ValueError, match="output_attentions"):
            model(ids, output_attentions=True, **{CACHE_KWARG: cache})
        assert model(ids, **{CACHE_KWARG: cache}).logits.shape == (1, 12, VOCAB)
    assert cache.get_seq_length() == 12


def test_sinks_for_a_model_without_sliding_layers_name_the_model():
    """Sinks live in sliding layers: a chunked model without one says so (no advice to add a window)."""
    with pytest.raises(ValueError, match="none slides"):
        pt.PagedCache(llama4_config(), sink_tokens=2)


def test_a_refused_mask_in_a_later_forward_takes_only_that_forward_back():
    """The refusal of a mask that hides held tokens in a later forward truncates the rows
    to what they held before it: the cache continues as if the forward had not run."""
    model = _hybrid_model(llama_config)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=64, page_size=4)
    ids = prompts(2, 14)
    with torch.no_grad():
        model(ids[:, :10], **{CACHE_KWARG: cache})
        mask = torch.ones_like(ids)
        mask[1, :3] = 0   # the cache holds these columns as tokens
        with pytest.raises(ValueError, match="position_ids"):
            model(ids[:, 10:], attention_mask=mask, **{CACHE_KWARG: cache})
        assert cache.get_seq_length() == 10
        assert [cache.kv_cache.seq_len(s) for s in cache.seq_ids] == [10, 10]
        got = model(ids[:, 10:], **{CACHE_KWARG: cache}).logits
        model.set_attn_implementation(ORACLE)
        expected = model(ids, **{CACHE_KWARG: DynamicCache(config=model.config)}).logits
    assert torch.allclose(got, expected[:, 10:], atol=1e-4)
    cache.kv_cache.check_invariants()


def test_crop_of_a_sliding_cache_says_why_without_claiming_a_release():
    """crop is refused for sliding or chunked layers even before the window released anything,
    and the message says so (and names the decoding modes that crop) instead of a release."""
    model = _hybrid_model(mistral_config)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=16)
    with torch.no_grad():
        model(prompts(1, 5), **{CACHE_KWARG: cache})  # 5 tokens, window 8: nothing released
    with pytest.raises(ValueError, match=r"sliding-window or chunked layers does not crop .*prompt-lookup"):
        cache.crop(3)
    assert cache.get_seq_length() == 5


def test_out_of_pages_in_a_generation_says_to_size_the_pool_for_the_whole_generation():
    """The core's figure covers the failing forward; the message adds what a generation needs,
    and following it (max_tokens = prompt + new tokens, no num_pages) generates."""
    model = _hybrid_model(gemma2_config)
    model.set_attn_implementation("pagedkv")
    ids = prompts(3, 40)
    with pytest.raises(pagedkv.OutOfPagesError, match=r"max_tokens=\.\.\.\) without num_pages"):
        greedy(model, ids, pt.PagedCache(model.config, num_pages=6), max_new_tokens=40, min_new_tokens=40)
    out = greedy(model, ids, pt.PagedCache(model.config, max_tokens=80), max_new_tokens=40, min_new_tokens=40)
    assert out.shape == (3, 80)
