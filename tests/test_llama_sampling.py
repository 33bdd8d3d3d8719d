"""Sampled generation: temperature, top-k, top-p and seeds, against hand-computed distributions.

The distribution tests use small logit vectors whose softmax is worked out by hand; the
generation tests use the tiny random Llama of ``_llama_support`` (no real model needed)
and compare with greedy decoding, which the llama.cpp tests pin down.
"""
import warnings

import numpy as np
import pytest

from pagedkv.models import (
    DenseBackend,
    LlamaModel,
    generate,
    generate_greedy,
    load_llama_gguf,
    sample_token,
    sampling_distribution,
)

from _llama_support import tiny_llama_path

# softmax(log p) = p: logits chosen so that the probabilities are exact decimals.
PROBS = np.array([0.05, 0.4, 0.1, 0.3, 0.15])
LOGITS = np.log(PROBS)


def test_distribution_without_filters_is_the_softmax_sorted():
    ids, probs = sampling_distribution(LOGITS, temperature=1.0)
    assert ids.tolist() == [1, 3, 4, 2, 0]
    np.testing.assert_allclose(probs, [0.4, 0.3, 0.15, 0.1, 0.05], rtol=1e-12)


def test_temperature_scales_the_logits():
    ids, probs = sampling_distribution(LOGITS, temperature=0.5)
    # p_i^2 / sum p^2: 0.16, 0.09, 0.0225, 0.01, 0.0025 over 0.285
    np.testing.assert_allclose(probs, np.array([0.16, 0.09, 0.0225, 0.01, 0.0025]) / 0.285, rtol=1e-12)


@pytest.mark.parametrize("top_p, kept", [(0.01, [1]), (0.39, [1]), (0.41, [1, 3]), (0.69, [1, 3]),
                                         (0.71, [1, 3, 4]), (0.84, [1, 3, 4]), (0.86, [1, 3, 4, 2]),
                                         (0.94, [1, 3, 4, 2]), (0.96, [1, 3, 4, 2, 0]), (1.0, [1, 3, 4, 2, 0])])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p, kept):
    """Cumulative masses in order 1, 3, 4, 2, 0: 0.4, 0.7, 0.85, 0.95, 1.0 (exact ties are float-rounded)."""
    ids, probs = sampling_distribution(LOGITS, temperature=1.0, top_p=top_p)
    assert ids.tolist() == kept
    np.testing.assert_allclose(probs, PROBS[kept] / PROBS[kept].sum(), rtol=1e-12)


def test_top_k_then_top_p():
    ids, probs = sampling_distribution(LOGITS, temperature=1.0, top_k=3)
    assert ids.tolist() == [1, 3, 4]
    np.testing.assert_allclose(probs, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85], rtol=1e-12)
    # Within the top 3 the renormalised cumulative masses are 0.4706, 0.8235, 1.
    for top_p, kept in ((0.47, [1]), (0.8, [1, 3]), (0.83, [1, 3, 4])):
        ids, probs = sampling_distribution(LOGITS, temperature=1.0, top_k=3, top_p=top_p)
        assert ids.tolist() == kept
        np.testing.assert_allclose(probs, PROBS[kept] / PROBS[kept].sum(), rtol=1e-12)


def test_samples_follow_the_distribution():
    rng = np.random.default_rng(0)
    draws = np.array([sample_token(LOGITS, rng, temperature=1.0, top_p=0.8) for _ in range(20_000)])
    assert set(np.unique(draws)) == {1, 3, 4}
    freq = np.array([(draws == i).mean() for i in (1, 3, 4)])
    # Binomial standard error at 20,000 draws is at most 0.0036: 5 of them.
    np.testing.assert_allclose(freq, np.array([0.4, 0.3, 0.15]) / 0.85, atol=0.018)


def test_greedy_choices_need_no_generator():
    tied = np.array([1.0, 3.0, 3.0, 0.0])
    assert sample_token(tied) == 1  # argmax: the first of equal maxima
    assert sample_token(tied, None, temperature=0.7, top_k=1) == 1
    with pytest.raises(TypeError, match="numpy.random.Generator"):
        sample_token(tied, 42, temperature=0.7)


@pytest.mark.parametrize("kwargs, match", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"temperature": 1.0, "top_k": 0}, "top_k"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p"), ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
])
def test_bad_sampling_parameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=f"Invalid value of {match}"):
        sample_token(LOGITS, np.random.default_rng(0), **kwargs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path_factory.mktemp("tiny")))
    return LlamaModel(config, weights)


PROMPTS = [[1, 2, 3], [7, 8], [20, 4, 4, 9]]


def test_temperature_zero_and_top_k_one_equal_greedy(tiny):
    backend = DenseBackend.for_config(tiny.config)
    greedy = generate_greedy(tiny, backend, PROMPTS, max_new_tokens=10).token_ids
    assert generate(tiny, backend, PROMPTS, max_new_tokens=10).token_ids == greedy
    assert generate(tiny, backend, PROMPTS, max_new_tokens=10, temperature=0.0, seed=5).token_ids == greedy
    assert generate(tiny, backend, PROMPTS, max_new_tokens=10, temperature=1.3, top_k=1, seed=5).token_ids == greedy


def test_a_seed_reproduces_the_tokens(tiny):
    backend = DenseBackend.for_config(tiny.config)
    settings = dict(max_new_tokens=12, temperature=1.5, top_k=20, top_p=0.95)
    first = generate(tiny, backend, PROMPTS, seed=1234, **settings).token_ids
    again = generate(tiny, backend, PROMPTS, seed=1234, **settings).token_ids
    assert first == again
    others = [generate(tiny, backend, PROMPTS, seed=seed, **settings).token_ids for seed in range(5)]
    # Random logits of a 50-token vocabulary at temperature 1.5: other seeds draw other tokens.
    assert any(tokens != first for tokens in others)
    greedy = generate_greedy(tiny, backend, PROMPTS, max_new_tokens=12).token_ids
    assert first != greedy
    assert all(0 <= t < tiny.config.vocab_size for seq in first for t in seq)


def test_sampling_parameters_are_checked_before_the_backend_changes(tiny):
    backend = DenseBackend.for_config(tiny.config)
    with pytest.raises(ValueError, match="top_p"):
        generate(tiny, backend, PROMPTS, max_new_tokens=4, temperature=1.0, top_p=0.0)
    assert backend.seq_ids == []


@pytest.mark.parametrize("temperature", [1e-300, 1e-308, 5e-324])
def test_a_temperature_so_small_that_logits_overflow_samples_the_top_token(temperature):
    """logits / 1e-308 overflow to inf: the distribution was NaN (warnings, then any token)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow or invalid-value warning either
        ids, probs = sampling_distribution(LOGITS, temperature=temperature)
    assert ids[0] == int(np.argmax(LOGITS)) and probs[0] == 1.0 and np.isfinite(probs).all()
