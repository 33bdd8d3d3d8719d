"""The benchmarks that read real data find it where the README's `pagedkv data fetch` puts it.

The README tells a user to run `pagedkv data fetch mooncake-conversation` and then
`python benchmarks/bench_replay.py`: without a developer's `shared/data` beside the
checkout, the fetched copy in the data directory must be found.
"""
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
pytestmark = pytest.mark.skipif(not BENCHMARKS.is_dir(), reason="benchmarks/ is not beside the tests")


@pytest.fixture
def bench(monkeypatch, tmp_path):
    """Import a benchmark script with a repository root that has no shared/data above it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("PAGEDKV_DATA_DIR", str(tmp_path / "data"))

    def load(name):
        module = importlib.import_module(name)
        monkeypatch.setattr(module, "REPO_ROOT", tmp_path / "checkout")
        return module

    yield load
    for name in ("bench_replay", "bench_llama", "baseline_block_pool", "_timing"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("script, finder, filename", [
    ("bench_replay", "default_trace_path", "mooncake_conversation_trace.jsonl"),
    ("bench_llama", "find_text", "tinyshakespeare.txt"),
])
def test_fetched_copy_in_the_data_directory_is_found(bench, tmp_path, script, finder, filename):
    find = getattr(bench(script), finder)
    assert find() is None  # neither shared/data nor a fetched copy
    fetched = tmp_path / "data" / filename
    fetched.parent.mkdir()
    fetched.write_text("x")
    assert find() == fetched
