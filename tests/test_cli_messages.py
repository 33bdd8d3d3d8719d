"""Messages of the command line for inputs a user gets wrong or may not expect."""
import json
import os

import pytest

from pagedkv import data
from pagedkv.cli import main


@pytest.fixture
def short_text(tmp_path):
    """A text file of a few tokens."""
    path = tmp_path / "text.txt"
    path.write_text("To be, or not to be", encoding="utf-8")
    return path


@pytest.fixture
def azure_trace(tmp_path):
    """An Azure-format trace of two requests (40 + 10 and 20 + 3 tokens)."""
    path = tmp_path / "trace.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:15:46.6805900,40,10\n2023-11-16 18:15:50.9951690,20,3\n", encoding="utf-8")
    return path


def test_mistyped_dataset_name_gets_the_names_and_a_suggestion(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no file of these names here
    assert main(["perplexity", "tinyshakespear"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv perplexity: cannot read 'tinyshakespear': No such file or directory, "
                          "nor a dataset name (did you mean tinyshakespeare? known: ")
    assert all(name in err for name in data.DATASETS) and "see `pagedkv data list`" in err

    assert main(["replay", "mooncake-conversaton", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot read 'mooncake-conversaton'" in err and "did you mean mooncake-conversation?" in err

    assert main(["replay", "trace-of-last-week", "--format", "mooncake", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "nor a dataset name (known: " in err and "did you mean" not in err  # nothing close


def test_missing_path_with_a_directory_is_not_taken_for_a_name(tmp_path, capsys):
    missing = tmp_path / "tinyshakespear"
    assert main(["perplexity", str(missing)]) == 2
    assert capsys.readouterr().err == f"pagedkv perplexity: cannot read {str(missing)!r}: No such file or directory\n"


def test_perplexity_refuses_fewer_than_two_tokens_before_loading_the_model(short_text, tmp_path, monkeypatch,
                                                                               capsys):
    from pagedkv.commands import perplexity

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded for an input that cannot be scored")

    monkeypatch.setattr(perplexity, "load_model", no_model)
    try:
        main(["perplexity", str(short_text), "--tokens", "1"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--tokens 1 was accepted")
    assert "argument --tokens: expected an integer >= 2" in capsys.readouterr().err

    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    assert main(["perplexity", str(empty)]) == 2
    assert capsys.readouterr().err == f"pagedkv perplexity: {str(empty)!r} is empty; at least 2 tokens are needed to score one\n"

    one_id = tmp_path / "ids.json"
    one_id.write_text("[42]", encoding="utf-8")
    assert main(["perplexity", str(one_id), "--token-ids"]) == 2
    assert capsys.readouterr().err == (f"pagedkv perplexity: {str(one_id)!r} holds 1 token(s); "
                                       "at least 2 are needed to score one\n")


def test_perplexity_help_example_uses_the_dataset_name(capsys):
    # The example in --help must run for a user of the installed package, who has no checkout
    # with data beside it: `pagedkv data fetch tinyshakespeare` makes the name work anywhere.
    try:
        main(["perplexity", "--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    assert "pagedkv perplexity tinyshakespeare --tokens 4096" in out
    assert "shared/data" not in out


def test_perplexity_plot_of_a_single_segment_says_so_before_scoring(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (pagedkv[cli])")
    for module in ("gguf", "threadpoolctl"):
        pytest.importorskip(module, reason=f"the model commands need {module}")
    from _llama_support import tiny_llama_path

    from pagedkv.commands import perplexity
    from pagedkv.models import LlamaModel
    from pagedkv.models.gguf_loader import load_llama_gguf

    # A tiny random Llama scores token ids (--token-ids needs no tokenizer), in place of SmolLM2.
    config, weights, _ = load_llama_gguf(tiny_llama_path(tmp_path))
    monkeypatch.setattr(perplexity, "load_model", lambda gguf, threads: (LlamaModel(config, weights), None))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(1, 13))), encoding="utf-8")
    common = ["perplexity", str(ids), "--token-ids", "--no-progress", "--threads", "1"]
    assert main(common + ["--plot", str(tmp_path / "one.png")]) == 0
    err = capsys.readouterr().err
    assert ("note: 12 tokens make a single 512-token segment, so --plot draws one point per setting; "
            "for a curve give --tokens above 512 or a smaller --segment-tokens") in err
    assert err.index("note: 12 tokens") < err.index("full cache: perplexity")  # before the scoring
    assert f"{str(ids)!r} holds 12 tokens, fewer than --tokens {perplexity.DEFAULT_NUM_TOKENS:,}: scoring all" in err
    assert (tmp_path / "one.png").is_file()

    assert main(common + ["--segment-tokens", "4", "--plot", str(tmp_path / "three.png")]) == 0
    assert "single" not in capsys.readouterr().err  # three segments: a curve, no note


@pytest.mark.parametrize("command", [["generate", "hi"], ["replay", "mooncake-conversation", "--no-progress"]])
@pytest.mark.parametrize("url", ["foo://bar", "redis://", "127.0.0.1:6379"])
def test_a_tier_url_of_another_form_is_a_usage_error_before_any_work(command, url, monkeypatch, capsys):
    from pagedkv.commands import generate

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before --tier was checked")

    monkeypatch.setattr(generate, "load_model", no_model, raising=False)
    with pytest.raises(SystemExit) as info:
        main([*command, "--tier", url])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --tier: expected redis://HOST:PORT/DB" in err and repr(url) in err


def test_replay_instances_without_a_tier_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["replay", "mooncake-conversation", "--instances", "4", "--no-progress"])
    assert info.value.code == 2
    assert "argument --instances: only used with --tier URL" in capsys.readouterr().err


def test_tier_warnings_wait_until_the_streamed_answer_ends(caplog):
    import logging

    from pagedkv.commands.generate import held_tier_warnings

    log = logging.getLogger("pagedkv.tiers")
    with caplog.at_level(logging.WARNING, logger="pagedkv.tiers"):
        with held_tier_warnings(True):
            log.warning("ConnectionError from RedisTier: %s", "refused")
            assert not caplog.records  # held: printed now it would land inside the streamed line
        assert [r.getMessage() for r in caplog.records] == ["ConnectionError from RedisTier: refused"]
        assert log.propagate and not log.handlers  # the logger is as it was
        with held_tier_warnings(False):
            log.warning("at once")
            assert caplog.records[-1].getMessage() == "at once"


def test_range_errors_give_the_real_bound_at_once(short_text, azure_trace, capsys):
    """The first error names the bound that following it satisfies (it used to say >= 1, then >= 2 or >= 16)."""
    for tokens in ("0", "1", "-3"):
        with pytest.raises(SystemExit):
            main(["perplexity", str(short_text), "--tokens", tokens])
        assert "argument --tokens: expected an integer >= 2 (the first token is only context" in capsys.readouterr().err

    trace = azure_trace
    for capacity in ("0", "10", "-16"):
        with pytest.raises(SystemExit) as info:
            main(["replay", str(trace), "--capacity-tokens", capacity, "--no-progress"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "error: argument --capacity-tokens: expected 16 <= N <= " in err and err.startswith("usage:")
    assert main(["replay", str(trace), "--capacity-tokens", "16", "--no-progress"]) == 0  # the bound it named
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[:4] == ["16", "1", "2", "2"] and row[-2:] == ["-", "-"]  # both rejected: no rate


def test_replay_capacity_this_machine_cannot_hold_is_one_line(azure_trace, monkeypatch, capsys):
    """A capacity in range whose page records do not fit in memory: the cache's MemoryError, no traceback."""
    from pagedkv.commands import replay as replay_command

    def out_of_memory(*args, **kwargs):
        raise MemoryError("Invalid value of num_pages: 1073741824 pages need 32.0 GiB of page records; use fewer pages")

    monkeypatch.setattr(replay_command, "replay", out_of_memory)
    assert main(["replay", str(azure_trace), "--capacity-tokens", "1000000", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("pagedkv replay: argument --capacity-tokens: a cache of that capacity does not "
                                       "fit in this machine's memory; give a smaller --capacity-tokens (the cache: "
                                       "Invalid value of num_pages: 1073741824 pages need 32.0 GiB of page records; "
                                       "use fewer pages)\n")


def test_block_size_mismatch_names_the_option(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}\n')
    assert main(["replay", str(trace), "--block-tokens", "7", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "got 2 (are the trace's blocks 7 tokens? block_tokens=B, or `pagedkv replay --block-tokens B`, sets it" in err


def test_setting_with_sinks_and_no_window_reads_as_one_message(short_text, capsys):
    with pytest.raises(SystemExit):
        main(["perplexity", str(short_text), "--setting", "sinks=4"])
    err = capsys.readouterr().err
    assert "argument --setting: sinks: " in err and "Invalid value" not in err


def test_a_word_that_begins_dataset_names_suggests_all_of_them(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["replay", "mooncake", "--no-progress"]) == 2
    assert "did you mean mooncake-conversation or mooncake-synthetic?" in capsys.readouterr().err


# A machine of 1 GiB: the up-front memory checks refuse what would not fit there.
ONE_GIB = 2**30


@pytest.fixture
def one_gib_machine(monkeypatch):
    from pagedkv.commands import _model_options

    monkeypatch.setattr(_model_options, "memory_limit_bytes", lambda: ONE_GIB)


def test_memory_limit_is_the_machines_memory_or_less():
    from pagedkv.commands._model_options import memory_limit_bytes

    limit = memory_limit_bytes()
    assert limit is None or 0 < limit <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_replay_capacity_larger_than_memory_is_refused_before_the_replay(azure_trace, one_gib_machine,
                                                                         monkeypatch, capsys):
    """It used to zero 24 GB of records and get killed by the kernel (--capacity-gib 100000)."""
    from pagedkv.commands import replay as replay_command

    def no_replay(*args, **kwargs):
        raise AssertionError("a capacity larger than memory was replayed")

    monkeypatch.setattr(replay_command, "replay", no_replay)
    assert main(["replay", str(azure_trace), "--capacity-gib", "100000", "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("pagedkv replay: argument --capacity-gib: a cache of 4,660,337,777 tokens "
                              "(291,271,111 pages) takes ")
    assert err[-1].endswith("more than the 1.0 GiB of memory this process may use; give a smaller --capacity-gib "
                            "(about 357,913,936 tokens fit)")
    assert main(["replay", str(azure_trace), "--capacity-tokens", "1000000000", "--no-progress"]) == 2
    assert "argument --capacity-tokens: a cache of 1,000,000,000 tokens" in capsys.readouterr().err


def test_replay_memory_error_names_the_option_given(azure_trace, monkeypatch, capsys):
    from pagedkv.commands import replay as replay_command

    def out_of_memory(*args, **kwargs):
        raise MemoryError("the records cannot be allocated")

    monkeypatch.setattr(replay_command, "replay", out_of_memory)
    assert main(["replay", str(azure_trace), "--capacity-gib", "1", "--no-progress"]) == 2
    assert "pagedkv replay: argument --capacity-gib: a cache of that capacity does not fit in this machine's " \
           "memory; give a smaller --capacity-gib" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["99999999999", "2147483647"])
def test_num_pages_past_the_cache_limit_is_a_usage_error(value, capsys):
    for command in (["generate", "Hi"], ["perplexity", "tinyshakespeare"]):
        with pytest.raises(SystemExit) as info:
            main(command + ["--num-pages", value])
        assert info.value.code == 2
        assert "argument --num-pages: expected an integer in 1 .. 2,147,483,646" in capsys.readouterr().err


@pytest.fixture
def model_without_loading(smollm2, monkeypatch):
    from pagedkv.models import LlamaModel

    model, tokenizer = smollm2
    monkeypatch.setattr(LlamaModel, "from_gguf", classmethod(lambda cls, path=None, **kw: (model, tokenizer)))
    return model


@pytest.mark.parametrize("options, advice", [
    (["--num-pages", "100000"], "give a smaller --num-pages"),
    (["--num-pages", "2147483646"], "give a smaller --num-pages"),
    (["--max-new-tokens", "10000000"], "give a smaller --max-new-tokens, or --window W"),
    # the needed pages cannot fit: no advice to raise --num-pages to them
    (["--max-new-tokens", "10000000", "--num-pages", "100"], "give a smaller --max-new-tokens, or --window W"),
    (["--max-new-tokens", "99999999999"], "is more than a cache's 2,147,483,646 pages"),
])
def test_generate_pool_larger_than_memory_is_one_line(options, advice, model_without_loading, one_gib_machine,
                                                      capsys):
    assert main(["generate", "Hi", *options]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("pagedkv generate: a float16 pool of ") and advice in err, err
    assert "Traceback" not in err


def test_a_pool_whose_allocation_fails_is_one_line(model_without_loading, monkeypatch, capsys):
    from pagedkv.models.paged_backend import PagedBackend

    def fails(*args, **kwargs):
        raise MemoryError("the pool cannot be allocated")

    monkeypatch.setattr(PagedBackend, "for_config", fails)
    assert main(["generate", "Hi", "--max-new-tokens", "4"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "pagedkv generate: a float16 pool of 1 page of 16 tokens cannot be allocated: not enough memory; the run "
        "may hold up to 1 page at once: give a smaller --max-new-tokens, or --window W to keep only the last W "
        "tokens of each sequence")


def test_perplexity_pool_larger_than_memory_is_one_line(short_text, model_without_loading, one_gib_machine, capsys):
    assert main(["perplexity", str(short_text), "--num-pages", "100000"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("pagedkv perplexity: a float16 pool of 100,000 pages of 16 tokens takes ")
    assert err.endswith("give a smaller --num-pages")


@pytest.mark.parametrize("command, option, value, bound", [
    (["generate", "Hi"], "--page-size", "99999999999", "1 .. 1,048,576"),
    (["replay", "mooncake-conversation"], "--page-size", "2147483647", "1 .. 1,048,576"),
    (["generate", "Hi"], "--threads", "99999999999", "1 .. 1,024"),
    (["replay", "mooncake-conversation"], "--block-tokens", "99999999999", "1 .. 2,147,483,647"),
])
def test_options_past_their_limit_are_usage_errors(command, option, value, bound, capsys):
    with pytest.raises(SystemExit) as info:
        main(command + [option, value])
    assert info.value.code == 2
    assert f"argument {option}: expected an integer in {bound}, got {int(value):,}" in capsys.readouterr().err


def test_replay_capacity_errors_name_the_option_given(azure_trace, one_gib_machine, capsys):
    with pytest.raises(SystemExit):
        main(["replay", str(azure_trace), "--capacity-gib", "99999999999", "--no-progress"])
    err = capsys.readouterr().err
    assert "argument --capacity-gib: expected 16 <= N <= 34,359,738,336 tokens" in err
    assert "got 1e+11 GiB = " in err
    # the memory message suggests a capacity that fits, and names --instances with a tier
    assert main(["replay", str(azure_trace), "--capacity-tokens", "1000000000", "--no-progress"]) == 2
    assert "give a smaller --capacity-tokens (about 357,913,936 tokens fit)" in capsys.readouterr().err


def test_replay_instances_share_the_blame_for_memory(tmp_path, one_gib_machine, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}\n')
    assert main(["replay", str(trace), "--tier", "redis://127.0.0.1:1/0", "--instances", "1000000",
                 "--capacity-tokens", "100000", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "in each of 1,000,000 instances takes " in err and "give a smaller --capacity-tokens or --instances" in err


def test_generate_page_larger_than_any_sequence_says_page_size(model_without_loading, one_gib_machine, capsys):
    assert main(["generate", "Hi", "--page-size", "1048576", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert "give a smaller --page-size: a page of 1,048,576 tokens is larger than the longest sequence" in err


def test_a_setting_given_twice_is_a_usage_error(short_text, capsys):
    with pytest.raises(SystemExit) as info:
        main(["perplexity", str(short_text), "--setting", "full", "--setting", "window=4", "--setting", "full"])
    assert info.value.code == 2
    assert "argument --setting: full cache given more than once" in capsys.readouterr().err


def test_tier_info_refuses_an_empty_namespace(capsys):
    with pytest.raises(SystemExit) as info:
        main(["tier", "info", "redis://127.0.0.1:6379/0", "--namespace", ""])
    assert info.value.code == 2
    assert "argument --namespace: expected a non-empty namespace, got ''" in capsys.readouterr().err


def test_inputs_that_never_end_are_refused(tmp_path, capsys):
    """/dev/zero was read whole (MemoryError after 4 GB) by --prompts, perplexity and replay."""
    assert main(["generate", "--prompts", "/dev/zero"]) == 2
    assert "--prompts: cannot read /dev/zero: not a regular file" in capsys.readouterr().err
    assert main(["perplexity", "/dev/zero"]) == 2
    assert "cannot read /dev/zero: not a regular file" in capsys.readouterr().err
    assert main(["replay", "/dev/zero", "--format", "mooncake", "--no-progress"]) == 2
    assert "cannot read /dev/zero: not a regular file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--gguf", "/dev/zero"])
    assert "argument --gguf: cannot read /dev/zero: not a regular file" in capsys.readouterr().err


def test_a_token_id_past_int64_is_one_line(tmp_path, model_without_loading, capsys):
    ids = tmp_path / "ids.json"
    ids.write_text("[99999999999999999999999, 1]", encoding="utf-8")
    assert main(["perplexity", str(ids), "--token-ids", "--no-progress"]) == 2
    assert "token ids of " in capsys.readouterr().err


def test_a_truncated_gguf_is_one_line(tmp_path, capsys):
    from pagedkv.models import find_smollm2_gguf

    try:
        source = find_smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    for size in (4, 24, 100):
        cut = tmp_path / f"cut{size}.gguf"
        with open(source, "rb") as f:
            cut.write_bytes(f.read(size))
        assert main(["generate", "hi", "--gguf", str(cut), "--max-new-tokens", "2"]) == 2
        err = capsys.readouterr().err
        assert f"Invalid GGUF file '{cut}'" in err and "(a truncated file, or not a GGUF file?)" in err


def test_settings_conflict_is_said_before_the_window_advice(short_text, capsys):
    with pytest.raises(SystemExit):
        main(["perplexity", str(short_text), "--setting", "full", "--sinks", "2"])
    assert "give the cache settings either with --setting (repeatable) or with --window" in capsys.readouterr().err


def test_perplexity_page_larger_than_the_text_says_page_size(short_text, model_without_loading, monkeypatch,
                                                             capsys):
    from pagedkv.models.paged_backend import PagedBackend

    def fails(*args, **kwargs):
        raise MemoryError("the pool cannot be allocated")

    monkeypatch.setattr(PagedBackend, "for_config", fails)
    assert main(["perplexity", str(short_text), "--page-size", "1048576", "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("pagedkv perplexity: full cache: the pool cannot be allocated: not enough memory; ")
    assert "give a smaller --page-size: a page of 1,048,576 tokens is larger than the" in err


def test_max_new_tokens_past_its_limit_is_a_usage_error(capsys):
    """2**62 new tokens passed argparse and ended in the cache's ValueError traceback."""
    for value in ("99999999999999999999", "4611686018427387904"):
        with pytest.raises(SystemExit) as info:
            main(["generate", "hi", "--max-new-tokens", value])
        assert info.value.code == 2
        assert "argument --max-new-tokens: expected an integer in 1 .. 1,152,921,504,606,846,976" in \
            capsys.readouterr().err


def test_memory_limit_counts_the_address_space_limit(monkeypatch):
    # getrlimit is replaced, not setrlimit called: a real limit would also bind this process
    # (and a sanitizer build reserves terabytes of address space for its shadow memory).
    resource = pytest.importorskip("resource", reason="no address-space limits on this platform")
    from pagedkv.commands._model_options import memory_limit_bytes

    one_mib = 2**20
    monkeypatch.setattr(resource, "getrlimit",
                        lambda which: (one_mib, resource.RLIM_INFINITY) if which == resource.RLIMIT_AS
                        else (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert memory_limit_bytes() == one_mib


def test_tier_info_of_a_string_that_is_no_url_says_it_once(capsys):
    pytest.importorskip("redis", reason="tier info checks the URL with redis-py: pip install 'pagedkv[redis]'")
    with pytest.raises(SystemExit):
        main(["tier", "info", "notaurl"])
    err = capsys.readouterr().err
    assert err.count("expected redis://") == 1 and "redis.Redis" not in err
