"""StreamingLLM positions inside the cache against a dense float64 oracle.

The oracle follows the definition of StreamingLLM (Xiao et al., 2023, "Efficient
Streaming Language Models with Attention Sinks", section 3.2) literally: for every query
it takes the keys the cache holds (the ``S`` sinks and the last ``W`` positions), numbers
them ``0, 1, ...`` in order, and rotates every key (kept unrotated) and the query to those
cache positions, in float64, at every step. The backends store keys rotated once to their
absolute positions and score the sinks with a second query; they must agree with it for
decode steps, prefill chunks (longer than the window too), forks and truncation.
"""
import argparse
import json

import numpy as np
import pytest

from pagedkv import cli
from pagedkv.commands.perplexity import parse_setting
from pagedkv.models import (
    DenseBackend,
    LayerWeights,
    LlamaConfig,
    LlamaModel,
    LlamaWeights,
    PagedBackend,
)

RELATIVE_TOLERANCE = 1e-4


# ------------------------------------------------------------------- tiny model

def tiny_model(seed=0, num_layers=3):
    """A random Llama: 3 layers, 4 query / 2 KV heads of 8, vocabulary 40."""
    rng = np.random.default_rng(seed)
    hidden, ffn, heads, kv_heads, dim, vocab = 32, 48, 4, 2, 8, 40
    config = LlamaConfig(num_layers=num_layers, hidden_size=hidden, intermediate_size=ffn,
                         num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, rope_base=100.0,
                         rms_norm_eps=1e-5, context_length=64, vocab_size=vocab, tied_embeddings=True)

    def mat(rows, cols, gain=1.0):
        return (gain * rng.standard_normal((rows, cols)) / np.sqrt(rows)).astype(np.float32)

    def norm_weight():
        return (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    layers = [LayerWeights(attn_norm=norm_weight(),
                           # larger Q/K weights: peaked attention, so positions matter
                           qkv_proj=np.concatenate([mat(hidden, (heads + kv_heads) * dim, 3.0),
                                                    mat(hidden, kv_heads * dim)], axis=1),
                           o_proj=mat(heads * dim, hidden), ffn_norm=norm_weight(),
                           gate_up_proj=mat(hidden, 2 * ffn), down_proj=mat(ffn, hidden))
              for _ in range(num_layers)]
    embedding = rng.standard_normal((vocab, hidden)).astype(np.float32)
    weights = LlamaWeights(token_embedding=embedding, layers=layers, output_norm=norm_weight(),
                           output_proj=embedding)
    return LlamaModel(config, weights)


# ----------------------------------------------------------------------- oracle

def _rotate(x, positions, inv_freq):
    """Rotate-half RoPE of x[..., n, D] to positions[n], float64."""
    half = x.shape[-1] // 2
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def streaming_oracle(model, tokens, window, sinks, positions="cache"):
    """Logits ``[len(tokens), vocab]`` of StreamingLLM, float64, one query at a time.

    The keys are kept unrotated; for the query at position p the cache holds the
    positions [0, S) and [max(S, p - W + 1), p]. With ``positions="cache"`` every one of
    them is rotated to its index in that list and the query to the last index; with
    ``"absolute"`` all are rotated to their positions in the sequence.
    """
    c, w = model.config, model.weights
    hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
    group = hq // hkv
    inv_freq = c.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)

    def norm(x, weight):
        return x / np.sqrt(np.mean(x * x) + c.rms_norm_eps) * weight

    f64 = [{name: getattr(lw, name).astype(np.float64) for name in
            ("attn_norm", "qkv_proj", "o_proj", "ffn_norm", "gate_up_proj", "down_proj")}
           for lw in w.layers]
    output_norm = w.output_norm.astype(np.float64)

    keys = [[] for _ in w.layers]     # unrotated, [Hkv, D] per position
    values = [[] for _ in w.layers]
    finals = []
    for p, token in enumerate(tokens):
        held = list(range(min(sinks, p + 1))) + list(range(max(sinks, p - window + 1), p + 1))
        key_positions = np.arange(len(held)) if positions == "cache" else np.array(held)
        query_position = key_positions[-1:]
        x = w.token_embedding[token].astype(np.float64)
        for li, lw in enumerate(f64):
            h = norm(x, lw["attn_norm"])
            qkv = h @ lw["qkv_proj"]
            q = qkv[: hq * d].reshape(hq, 1, d)
            keys[li].append(qkv[hq * d:(hq + hkv) * d].reshape(hkv, d))
            values[li].append(qkv[(hq + hkv) * d:].reshape(hkv, d))
            k = np.stack([keys[li][j] for j in held], axis=1)      # [Hkv, n, D]
            v = np.stack([values[li][j] for j in held], axis=1)
            k = _rotate(k, key_positions, inv_freq)
            q = _rotate(q, query_position, inv_freq)[:, 0]          # [Hq, D]
            scores = np.einsum("hgd,hnd->hgn", q.reshape(hkv, group, d), k) / np.sqrt(d)
            scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
            scores /= scores.sum(axis=-1, keepdims=True)
            out = np.einsum("hgn,hnd->hgd", scores, v).reshape(hq * d)
            x = x + out @ lw["o_proj"]
            h = norm(x, lw["ffn_norm"])
            gate_up = h @ lw["gate_up_proj"]
            gate, up = gate_up[: c.intermediate_size], gate_up[c.intermediate_size:]
            x = x + (gate / (1 + np.exp(-gate)) * up) @ lw["down_proj"]
        finals.append(norm(x, output_norm))
    return np.array(finals) @ w.output_proj.astype(np.float64).T


def assert_logits_close(got, want):
    error = np.abs(got - want).max() / np.abs(want).max()
    assert error <= RELATIVE_TOLERANCE, f"relative logit error {error:.3g} > {RELATIVE_TOLERANCE}"


def relative_difference(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def paged(model, window, sinks, page_size, positions=None, num_pages=256):
    if positions is None:
        positions = "cache" if sinks > 0 else "absolute"
    return PagedBackend.for_config(model.config, num_pages, page_size=page_size, dtype=np.float32,
                                   window=window, sink_tokens=sinks, positions=positions)


# ---------------------------------------------------------------------- oracle

def test_oracle_uses_cache_positions_only_once_keys_leave():
    # The two oracles agree while nothing has left the cache, then differ.
    model = tiny_model()
    tokens = np.random.default_rng(1).integers(0, 40, size=20)
    cache = streaming_oracle(model, tokens, window=6, sinks=2)
    absolute = streaming_oracle(model, tokens, window=6, sinks=2, positions="absolute")
    np.testing.assert_allclose(cache[:8], absolute[:8], rtol=1e-12, atol=1e-12)
    assert relative_difference(cache[8:], absolute[8:]) > 1e-2


# --------------------------------------------------- backend against the oracle

CASES = [(page_size, window, sinks) for page_size in (1, 3, 16) for window in (5, 20)
         for sinks in (0, 1, 4, 5)]


@pytest.mark.parametrize("page_size, window, sinks", CASES)
def test_paged_backend_matches_the_oracle(page_size, window, sinks):
    """Prefill chunks (one longer than the window), decode steps, a fork in the middle.

    With ``sinks=0`` StreamingLLM's cache positions change no query-key distance, so
    the backend runs with absolute positions (cache positions need sinks) and must
    still match the cache-position oracle.
    """
    model = tiny_model()
    rng = np.random.default_rng(page_size * 100 + window * 10 + sinks)
    prompt = rng.integers(0, 40, size=2 * window + 7)      # one chunk longer than the window
    steps = rng.integers(0, 40, size=6)
    branch_a = rng.integers(0, 40, size=window + 3)       # after the fork: a chunk, then decode
    branch_b = rng.integers(0, 40, size=4)
    backend = paged(model, window, sinks, page_size)
    backend.add_sequence(0)
    got = [model.forward(backend, [0], [prompt[:3]], all_logits=True),
           model.forward(backend, [0], [prompt[3:]], all_logits=True)]
    got += [model.forward(backend, [0], [[t]]) for t in steps]
    trunk = np.concatenate([prompt, steps])
    assert_logits_close(np.concatenate(got), streaming_oracle(model, trunk, window, sinks))

    backend.cache.fork(0, 1)
    # both branches in one ragged batch, then decode together
    chunk = model.forward(backend, [0, 1], [branch_a[:-2], branch_b[:1]], all_logits=True)
    rows_a = len(branch_a) - 2
    got_a, got_b = [chunk[:rows_a]], [chunk[rows_a:]]
    for t_a, t_b in zip(branch_a[-2:], branch_b[1:3], strict=True):
        both = model.forward(backend, [0, 1], [[t_a], [t_b]])
        got_a.append(both[:1])
        got_b.append(both[1:])
    seq_a = np.concatenate([trunk, branch_a])
    seq_b = np.concatenate([trunk, branch_b[:3]])
    assert_logits_close(np.concatenate(got_a), streaming_oracle(model, seq_a, window, sinks)[len(trunk):])
    assert_logits_close(np.concatenate(got_b), streaming_oracle(model, seq_b, window, sinks)[len(trunk):])

    # truncation: drop the last token of branch b and continue with another one
    backend.cache.truncate(1, backend.seq_len(1) - 1)
    replaced = np.concatenate([seq_b[:-1], branch_b[3:]])
    got_t = model.forward(backend, [1], [branch_b[3:]])
    assert_logits_close(got_t, streaming_oracle(model, replaced, window, sinks)[-1:])


@pytest.mark.parametrize("window, sinks", [(5, 1), (20, 4)])
def test_absolute_positions_differ_from_the_oracle(window, sinks):
    """The comparison above can fail: absolute positions are far from the oracle."""
    model = tiny_model()
    tokens = np.random.default_rng(3).integers(0, 40, size=2 * (window + sinks) + 5)
    backend = paged(model, window, sinks, 3, positions="absolute")
    backend.add_sequence(0)
    got = model.forward(backend, [0], [tokens], all_logits=True)
    want = streaming_oracle(model, tokens, window, sinks)
    assert relative_difference(got, want) > 100 * RELATIVE_TOLERANCE
    assert_logits_close(got, streaming_oracle(model, tokens, window, sinks, positions="absolute"))


@pytest.mark.parametrize("window, sinks", [(5, 1), (20, 4)])
def test_dense_backend_with_cache_positions_matches_the_oracle(window, sinks):
    model = tiny_model()
    tokens = np.random.default_rng(4).integers(0, 40, size=2 * (window + sinks) + 5)
    backend = DenseBackend.for_config(model.config, window=window, sink_tokens=sinks, positions="cache")
    backend.add_sequence(0)
    got = [model.forward(backend, [0], [tokens[:window + 2]], all_logits=True)]
    got += [model.forward(backend, [0], [[t]]) for t in tokens[window + 2:]]
    assert_logits_close(np.concatenate(got), streaming_oracle(model, tokens, window, sinks))


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_modes_agree_until_the_first_key_leaves(page_size):
    window, sinks = 9, 4
    model = tiny_model()
    tokens = np.random.default_rng(5).integers(0, 40, size=30)
    logits = {}
    for mode in ("absolute", "cache"):
        backend = paged(model, window, sinks, page_size, positions=mode)
        backend.add_sequence(0)
        logits[mode] = np.concatenate([model.forward(backend, [0], [tokens[:7]], all_logits=True)] +
                                      [model.forward(backend, [0], [[t]]) for t in tokens[7:]])
    last_shared = sinks + window - 1  # the last query whose window reaches down to the sinks
    np.testing.assert_allclose(logits["cache"][:last_shared + 1], logits["absolute"][:last_shared + 1],
                               rtol=0, atol=1e-5)
    assert relative_difference(logits["cache"][last_shared + 1:], logits["absolute"][last_shared + 1:]) > 1e-2


# ------------------------------------------------------- Hugging Face SinkCache bugs

def used_positions(backend, seq_id, batch):
    """Cache positions the last query of ``seq_id`` gives its keys, from the page table.

    A window key k is scored with q rotated to p: distance p - k, so it sits at
    ``c - (p - k)`` where c is the query's cache position (``batch.sink_positions``, or p);
    a sink key j is scored with q_sink rotated to c: it sits at j.
    """
    p = int(batch.positions[-1])
    c = p if batch.sink_positions is None else int(batch.sink_positions[-1])
    view = backend.cache.page_table([seq_id])
    held = np.concatenate([start + np.arange(backend.page_size) for start in view.page_positions])
    held = held[held <= p]
    seen = held[(held >= p - backend.window + 1) | (held < backend.sink_tokens)]
    return sorted(int(k) if k < backend.sink_tokens else int(c - (p - k)) for k in seen)


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_one_sink_and_a_cache_of_four_after_a_long_prompt(page_size):
    """SinkCache's failing case: 1 sink + window 3, a 10-token prompt in one call, one more token."""
    model = tiny_model()
    tokens = np.random.default_rng(6).integers(0, 40, size=11)
    backend = paged(model, 3, 1, page_size)
    backend.add_sequence(0)
    batches = []
    original = backend.begin_forward

    def recording(*args):
        batches.append(original(*args))
        return batches[-1]

    backend.begin_forward = recording
    prompt_logits = model.forward(backend, [0], [tokens[:10]], all_logits=True)
    assert used_positions(backend, 0, batches[-1]) == [0, 1, 2, 3]
    step_logits = model.forward(backend, [0], [tokens[10:]])
    assert used_positions(backend, 0, batches[-1]) == [0, 1, 2, 3]
    assert batches[0].sink_positions.tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3, 3]
    assert batches[1].sink_positions.tolist() == [3]
    want = streaming_oracle(model, tokens, 3, 1)
    assert_logits_close(np.concatenate([prompt_logits, step_logits]), want)


# ------------------------------------------------------------------- validation

@pytest.mark.parametrize("window, sinks", [(None, 0), (8, 0)])
@pytest.mark.parametrize("backend_class", ["paged", "dense"])
def test_cache_positions_need_a_window_and_sinks(window, sinks, backend_class):
    config = tiny_model().config
    with pytest.raises(ValueError, match="'cache' needs a sliding window and at least one attention sink"):
        if backend_class == "paged":
            PagedBackend.for_config(config, 16, window=window, sink_tokens=sinks, positions="cache")
        else:
            DenseBackend.for_config(config, window=window, sink_tokens=sinks, positions="cache")
    with pytest.raises(ValueError, match="Invalid value of positions: expected one of"):
        PagedBackend.for_config(config, 16, window=8, sink_tokens=2, positions="relative")


# --------------------------------------------------------------------- SmolLM2

def test_smollm2_cache_positions_match_the_oracle(smollm2):
    model, _ = smollm2
    tokens = np.random.default_rng(7).integers(0, model.config.vocab_size, size=28)
    window, sinks = 8, 4
    backend = paged(model, window, sinks, 3)
    backend.add_sequence(0)
    got = [model.forward(backend, [0], [tokens[:20]], all_logits=True)]
    got += [model.forward(backend, [0], [[t]]) for t in tokens[20:]]
    assert_logits_close(np.concatenate(got), streaming_oracle(model, tokens, window, sinks))


# ----------------------------------------------------------------- command line

def test_setting_specs_take_positions():
    setting = parse_setting("window=1024,sinks=4,positions=cache")
    assert (setting.window, setting.sink_tokens, setting.positions) == (1024, 4, "cache")
    assert setting.label == "window 1024 + 4 sinks, cache positions"
    assert parse_setting("window=8,sinks=2,positions=absolute").positions == "absolute"
    assert parse_setting("window=8").positions == "absolute"
    for bad, reason in (("window=8,positions=cache", "needs window=W and sinks=S >= 1"),
                        ("positions=cache", "needs window=W and sinks=S >= 1"),
                        ("window=8,sinks=2,positions=relative", "expected 'full'"),
                        ("window=8,sinks=2,positions=cache,positions=cache", "expected 'full'")):
        with pytest.raises(argparse.ArgumentTypeError, match=reason):
            parse_setting(bad)


def test_commands_reject_cache_positions_without_window_and_sinks(capsys, monkeypatch):
    def no_load(cls, path=None):
        raise AssertionError("the model must not be loaded for a bad command line")

    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(no_load))
    for argv, reason in (
        (["generate", "hi", "--positions", "cache"], "argument --positions: 'cache' needs --window W"),
        (["generate", "hi", "--positions", "cache", "--window", "8"], "without sinks every distance"),
        (["perplexity", "x.txt", "--positions", "cache", "--window", "8"], "argument --positions"),
        (["perplexity", "x.txt", "--setting", "window=8,positions=cache"], "argument --setting"),
        (["perplexity", "x.txt", "--setting", "full", "--positions", "cache", "--window", "4",
          "--sinks", "1"], "either with --setting"),
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
        assert reason in capsys.readouterr().err


def test_perplexity_command_scores_with_cache_positions(tmp_path, capsys, monkeypatch):
    """The --setting spec reaches the backend: the NLL equals the oracle's."""
    model = tiny_model()
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None: (model, None)))
    tokens = np.random.default_rng(8).integers(0, 40, size=40)
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps(tokens.tolist()))
    out = tmp_path / "ppl.json"
    status = cli.main(["perplexity", str(ids_file), "--token-ids", "--tokens", "40", "--dtype", "float32",
                       "--no-progress", "--segment-tokens", "20", "--json", str(out),
                       "--setting", "window=6,sinks=2", "--setting", "window=6,sinks=2,positions=cache"])
    capsys.readouterr()
    assert status == 0
    absolute, cache = json.loads(out.read_text())["settings"]
    assert (absolute["positions"], cache["positions"]) == ("absolute", "cache")
    for result, positions in ((absolute, "absolute"), (cache, "cache")):
        logits = streaming_oracle(model, tokens, 6, 2, positions=positions)[:-1]
        top = logits.max(axis=1)
        log_z = top + np.log(np.exp(logits - top[:, None]).sum(axis=1))
        nll = log_z - logits[np.arange(39), tokens[1:]]
        assert result["mean_nll"] == pytest.approx(nll.mean(), rel=1e-5)
    assert abs(absolute["mean_nll"] - cache["mean_nll"]) > 1e-3
