"""pagedkv.data and `pagedkv data`: names, checksums, downloads. No test uses the network.

Downloads are served from file:// URLs of temporary files, and the failure path from a
localhost port with nothing listening on it.
"""
import hashlib
import socket

import pytest

from _llama_support import data_file_or_skip

from pagedkv import data
from pagedkv.cli import main


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    directory = tmp_path / "cache"
    monkeypatch.setenv(data.DATA_DIR_ENV, str(directory))
    return directory


@pytest.fixture
def fake_dataset(tmp_path, monkeypatch):
    """Replace the registry with one small dataset whose source is a local file."""
    payload = b"First Citizen:\nBefore we proceed any further, hear me speak.\n"
    source = tmp_path / "source.txt"
    source.write_bytes(payload)
    dataset = data.Dataset("tiny", "tiny.txt", source.as_uri(), hashlib.sha256(payload).hexdigest(), len(payload),
                           "two lines")
    monkeypatch.setattr(data, "DATASETS", {"tiny": dataset})
    return dataset, payload


def closed_port_url():
    """An http URL on localhost where nothing listens (the port was just bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/input.txt"


def test_registry_records_a_sha256_and_a_pinned_https_url_per_dataset():
    assert {"tinyshakespeare", "mooncake-conversation", "azure-conversation"} <= set(data.DATASETS)
    for name, d in data.DATASETS.items():
        assert d.name == name
        assert len(d.sha256) == 64 and int(d.sha256, 16) >= 0 and d.sha256 == d.sha256.lower()
        assert d.url.startswith("https://raw.githubusercontent.com/")
        # Pinned to a commit (40 hex digits), so that the recorded digest stays valid.
        parts = d.url.split("/")
        assert len(parts[5]) == 40 and int(parts[5], 16) >= 0, d.url


@pytest.mark.parametrize("name, filename", [("tinyshakespeare", "tinyshakespeare.txt"),
                                            ("mooncake-conversation", "mooncake_conversation_trace.jsonl"),
                                            ("azure-conversation", "AzureLLMInferenceTrace_conv.csv")])
def test_recorded_digest_matches_the_shared_copy(name, filename):
    """The digests in the package are those of the published files kept beside the checkout."""
    path = data_file_or_skip(filename)
    dataset = data.get_dataset(name)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == dataset.sha256
    assert path.stat().st_size == dataset.num_bytes
    assert data.verify(name, path) == path


def test_data_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setattr(data.sys, "platform", "linux")
    monkeypatch.delenv(data.DATA_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert data.data_dir() == tmp_path / "home" / ".cache" / "pagedkv"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert data.data_dir() == tmp_path / "xdg" / "pagedkv"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec: relative paths are invalid
    assert data.data_dir() == tmp_path / "home" / ".cache" / "pagedkv"
    monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path / "mine"))
    assert data.data_dir() == tmp_path / "mine"


def test_fetch_from_file_url_verifies_and_places_the_file(data_dir, fake_dataset):
    dataset, payload = fake_dataset
    seen = []
    path = data.fetch("tiny", progress=lambda done, total: seen.append(done))
    assert path == data_dir / "tiny.txt"
    assert path.read_bytes() == payload
    assert seen and seen[-1] == len(payload)
    assert data.resolve("tiny") == str(path)
    assert [p.name for p in data_dir.iterdir()] == ["tiny.txt"]  # no temporary file left behind


def test_fetch_keeps_a_verified_copy_and_replaces_a_corrupted_one(data_dir, fake_dataset, tmp_path):
    dataset, payload = fake_dataset
    data.fetch("tiny")
    # A source that would now fail is not contacted while the copy is good.
    assert data.fetch("tiny", url=closed_port_url()) == data_dir / "tiny.txt"
    (data_dir / "tiny.txt").write_bytes(payload[:-1] + b"?")
    with pytest.raises(data.DataError, match="has SHA-256 .* expected .*pagedkv data fetch tiny"):
        data.resolve("tiny")
    data.fetch("tiny")
    assert (data_dir / "tiny.txt").read_bytes() == payload


def test_fetch_of_wrong_bytes_saves_nothing(data_dir, fake_dataset, tmp_path):
    dataset, payload = fake_dataset
    wrong = tmp_path / "wrong.txt"
    wrong.write_bytes(payload.upper())
    with pytest.raises(data.DataError) as info:
        data.fetch("tiny", url=wrong.as_uri())
    message = str(info.value)
    assert hashlib.sha256(payload.upper()).hexdigest() in message and dataset.sha256 in message
    assert "nothing was saved" in message
    assert not (data_dir / "tiny.txt").exists()
    assert list(data_dir.iterdir()) == []


def test_offline_fetch_names_the_url_and_how_to_place_the_file(data_dir, fake_dataset):
    dataset, _ = fake_dataset
    url = closed_port_url()
    with pytest.raises(data.DataError) as info:
        data.fetch("tiny", url=url, timeout=5)
    message = str(info.value)
    assert url in message
    assert str(data_dir / "tiny.txt") in message  # where to put it
    assert dataset.sha256 in message  # what it must hash to
    assert dataset.url in message  # where to get it on another machine
    assert list(data_dir.iterdir()) == []


def test_resolve_prefers_paths_and_explains_missing_names(data_dir, tmp_path, monkeypatch):
    existing = tmp_path / "tinyshakespeare"
    existing.write_text("a file that happens to carry a dataset's name")
    monkeypatch.chdir(tmp_path)
    assert data.resolve("tinyshakespeare") == "tinyshakespeare"  # the path wins
    existing.unlink()
    with pytest.raises(data.DataError, match="not downloaded yet.*run `pagedkv data fetch tinyshakespeare`"):
        data.resolve("tinyshakespeare")
    with pytest.raises(FileNotFoundError, match="nor a dataset name"):
        data.resolve("no-such-thing")
    with pytest.raises(KeyError, match="expected one of"):
        data.get_dataset("no-such-thing")


def test_cli_list_and_fetch(data_dir, fake_dataset, capsys):
    assert main(["data", "list"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "not fetched" in out and str(data_dir) in out
    assert main(["data", "fetch", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"tiny: {data_dir / 'tiny.txt'} (SHA-256 verified)" in out
    assert main(["data", "list"]) == 0
    assert "not fetched" not in capsys.readouterr().out


def test_cli_fetch_over_a_damaged_copy_says_it_failed_its_check(data_dir, fake_dataset, capsys):
    dataset, payload = fake_dataset
    assert main(["data", "fetch", "tiny", "--no-progress"]) == 0
    assert "failed its check" not in capsys.readouterr().err  # a good copy is kept without a word
    (data_dir / "tiny.txt").write_bytes(payload[:-1] + b"?")
    assert main(["data", "fetch", "tiny", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert f"{data_dir / 'tiny.txt'} failed its check" in captured.err and dataset.sha256 in captured.err
    assert "downloading tiny again" in captured.err and "(SHA-256 verified)" in captured.out
    assert (data_dir / "tiny.txt").read_bytes() == payload


def test_cli_fetch_unknown_name_is_a_usage_error(data_dir, capsys):
    with pytest.raises(SystemExit) as info:
        main(["data", "fetch", "tinyshakespear"])
    assert info.value.code == 2
    assert "expected one of tinyshakespeare" in capsys.readouterr().err


def test_cli_fetch_offline_reports_and_fails(data_dir, fake_dataset, monkeypatch, capsys):
    dataset, _ = fake_dataset
    url = closed_port_url()
    monkeypatch.setitem(data.DATASETS, "tiny", data.Dataset("tiny", "tiny.txt", url, dataset.sha256,
                                                            dataset.num_bytes, ""))
    assert main(["data", "fetch", "tiny", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"cannot download tiny from {url}" in err and dataset.sha256 in err


def test_commands_accept_dataset_names(data_dir, monkeypatch, capsys):
    """`pagedkv replay NAME` reads the fetched file; before the fetch it says how to get it."""
    assert main(["replay", "mooncake-conversation", "--limit", "5", "--no-progress"]) == 2
    assert "run `pagedkv data fetch mooncake-conversation`" in capsys.readouterr().err
    assert main(["perplexity", "tinyshakespeare"]) == 2  # before the model is loaded
    assert "run `pagedkv data fetch tinyshakespeare`" in capsys.readouterr().err

    # A verified copy in the data directory stands for the name (bytes made up, digest recorded to match).
    lines = b'{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [0, 1]}\n' * 3
    (data_dir).mkdir()
    (data_dir / "mooncake_conversation_trace.jsonl").write_bytes(lines)
    real = data.DATASETS["mooncake-conversation"]
    fake = data.Dataset(real.name, real.filename, real.url, hashlib.sha256(lines).hexdigest(), len(lines), "")
    monkeypatch.setitem(data.DATASETS, "mooncake-conversation", fake)
    assert main(["replay", "mooncake-conversation", "--capacity-tokens", "8192", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"mooncake trace {data_dir / 'mooncake_conversation_trace.jsonl'}: 3 requests" in out


def test_replay_of_a_file_of_unknown_extension_says_what_to_do(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("# not a trace\n")
    assert main(["replay", str(readme), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Invalid value of path" not in err
    assert "cannot tell the format of" in err and "'.md'" in err and "--format mooncake" in err


def test_tests_find_data_where_data_fetch_puts_it(tmp_path, monkeypatch):
    """Without a shared/data directory, the tests read what `pagedkv data fetch` wrote; their
    skip message names the data directory and the command that fills it."""
    import _llama_support

    checkout = tmp_path / "checkout"
    checkout.mkdir()
    monkeypatch.setattr(_llama_support, "REPO_ROOT", checkout)
    monkeypatch.setenv(data.DATA_DIR_ENV, str(tmp_path / "fetched"))
    assert _llama_support.find_data_file("AzureLLMInferenceTrace_conv.csv") is None
    with pytest.raises(pytest.skip.Exception, match=r"get it with `pagedkv data fetch azure-conversation`") as info:
        _llama_support.data_file_or_skip("AzureLLMInferenceTrace_conv.csv")
    assert str(tmp_path / "fetched") in str(info.value) and data.DATA_DIR_ENV in str(info.value)
    (tmp_path / "fetched").mkdir()
    (tmp_path / "fetched" / "AzureLLMInferenceTrace_conv.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    assert _llama_support.data_file_or_skip("AzureLLMInferenceTrace_conv.csv") == (
        tmp_path / "fetched" / "AzureLLMInferenceTrace_conv.csv")
    with pytest.raises(pytest.skip.Exception, match="not published"):
        _llama_support.data_file_or_skip(_llama_support.REFERENCE_NAME)


def test_a_data_directory_that_is_a_file_is_named_as_such(tmp_path, fake_dataset, monkeypatch, capsys):
    not_a_dir = tmp_path / "data"
    not_a_dir.write_text("a file", encoding="utf-8")
    monkeypatch.setenv(data.DATA_DIR_ENV, str(not_a_dir))
    assert main(["data", "fetch", "tiny"]) != 0
    err = capsys.readouterr().err
    assert f"the data directory {not_a_dir} is a file, not a directory (set {data.DATA_DIR_ENV}" in err
