"""Trace replay with prefix caching (``pagedkv.replay``, ``pagedkv replay``).

References:

* ``reference_replayer.ReferenceReplayer``, a pure-Python model of the policy
  (least-recently-freed allocation, tail-first release, chained page keys,
  last-prompt-token rule, all-or-nothing admission), driven against the
  replay engine on real traffic and on random traces from hypothesis;
* with no eviction possible, the hit rate that follows from the trace alone:
  which prompt blocks had their whole prefix of blocks seen before.

Real data is read from ``<repo root>/../shared/data`` (or the nearest
ancestor's ``shared/data``); the tests that need it are skipped without it.
"""
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pagedkv.cli import main
from pagedkv.replay import capacity_pages, replay
from pagedkv.traces import Trace, load_trace
from reference_replayer import ReferenceReplayer
from _llama_support import data_file_or_skip

MOONCAKE = "mooncake_conversation_trace.jsonl"
AZURE = "AzureLLMInferenceTrace_conv.csv"


@pytest.fixture(scope="module")
def mooncake_path():
    return data_file_or_skip(MOONCAKE)


@pytest.fixture(scope="module")
def first_1000(mooncake_path):
    return load_trace(mooncake_path, limit=1000)


def run_reference(trace, num_pages, page_size):
    reference = ReferenceReplayer(num_pages, page_size, trace.block_tokens)
    for prompt, output, blocks in zip(trace.input_lengths.tolist(), trace.output_lengths.tolist(),
                                      trace.request_blocks()):
        reference.run(prompt, output, blocks)
    return reference


def assert_same_as_reference(result, reference):
    np.testing.assert_array_equal(result.cached_tokens, np.asarray(reference.cached_tokens, dtype=np.int64))
    assert result.num_rejected == reference.num_rejected
    assert result.hit_tokens == reference.hit_tokens
    assert result.prompt_tokens == reference.prompt_tokens
    assert result.prefix_evictions == reference.evictions
    assert result.pages_allocated == reference.pages_allocated
    assert result.pages_matched == reference.pages_matched
    assert result.pages_freed == reference.pages_freed
    cache = result.cache
    np.testing.assert_array_equal(cache.pool.free_pages(), reference.free_queue())
    np.testing.assert_array_equal(cache.prefix_index.cached_pages(), reference.cached_pages())
    cache.check_invariants()


# ------------------------------------------------------------- real traffic
@pytest.mark.parametrize("capacity_tokens", [50_000, 500_000, 2_000_000])
def test_first_1000_conversation_requests_match_the_reference(first_1000, capacity_tokens):
    page_size = 16
    result = replay(first_1000, capacity_tokens, page_size=page_size, keep_cache=True)
    reference = run_reference(first_1000, capacity_pages(capacity_tokens, page_size), page_size)
    assert_same_as_reference(result, reference)
    # The capacities are chosen so that the cache is under pressure: pages are
    # evicted at every one, and the smallest also rejects requests.
    assert reference.evictions > 0
    assert result.hit_tokens > 0
    if capacity_tokens == 50_000:
        assert reference.num_rejected > 0


def test_unlimited_capacity_hit_rate_equals_blocks_whose_prefix_was_seen(mooncake_path):
    """With no eviction, a block hits iff its whole prefix of blocks came before.

    Page size = block size = 512 tokens, so page i of a request is its block
    i. Blocks that can ever be served are those that do not hold the last
    prompt token: the last-token rule serves at most ``(P - 1) // 512``
    blocks, and ``(P - 1) // 512 == ceil(P / 512) - 1``, i.e. every block but
    the request's last one (full or partial). Those are the *eligible* blocks.

    A block becomes findable when an earlier request held it as a full
    block of its prompt (only full prompt pages are keyed; a partial block
    holds fewer than 512 tokens and cannot stand for a full one). The pool
    has more pages than all requests together allocate, so allocation never
    reaches a used page: nothing is evicted, and "findable" equals "the same
    prefix of block ids was a full block of an earlier prompt". That set is
    closed under prefixes, so the seen eligible blocks of a request are a
    leading run, which is exactly the run the cache serves. Hence
    ``hit tokens == 512 * (seen eligible blocks)`` exactly, and the
    cache's hit rate over the eligible blocks equals the fraction of
    eligible blocks whose whole prefix appeared earlier.
    """
    trace = load_trace(mooncake_path)
    block = trace.block_tokens
    total_pages = int(((trace.input_lengths + trace.output_lengths + block - 1) // block).sum())
    result = replay(trace, total_pages * block, page_size=block)
    assert result.num_rejected == 0
    assert result.prefix_evictions == 0

    seen = set()  # tuples of block ids: prefixes that were full blocks of earlier prompts
    eligible = seen_eligible = 0
    for prompt, blocks in zip(trace.input_lengths.tolist(), trace.request_blocks()):
        ids = tuple(blocks.tolist())
        for i in range(len(ids) - 1):
            eligible += 1
            seen_eligible += ids[:i + 1] in seen
        for i in range(prompt // block):
            seen.add(ids[:i + 1])
    fraction_seen = seen_eligible / eligible
    assert result.hit_tokens == block * seen_eligible
    assert result.hit_tokens / (block * eligible) == pytest.approx(fraction_seen, rel=1e-12)
    assert 0.2 < fraction_seen < 0.9  # real sharing, neither none nor all


def test_rejected_request_leaves_the_cache_unchanged(first_1000):
    """Replaying with an oversized request inserted equals replaying without it."""
    head = 300
    big = capacity_pages(300_000, 16) * 16 + 1  # one token more than the pool holds
    trace = first_1000
    ids = trace.request_blocks()
    prompts = trace.input_lengths[:head].tolist()
    outputs = trace.output_lengths[:head].tolist()
    blocks = [b.tolist() for b in ids[:head]]
    insert_at = 150
    with_big = make_trace(
        prompts[:insert_at] + [big] + prompts[insert_at:],
        outputs[:insert_at] + [0] + outputs[insert_at:],
        blocks[:insert_at] + [blocks[insert_at - 1][:1] + list(range(10**9, 10**9 + -(-big // 512) - 1))]
        + blocks[insert_at:],
        512,
    )
    without = make_trace(prompts, outputs, blocks, 512)
    a = replay(with_big, 300_000, page_size=16, keep_cache=True)
    b = replay(without, 300_000, page_size=16, keep_cache=True)
    assert a.num_rejected == 1 and b.num_rejected == 0
    assert a.cached_tokens[insert_at] == -1
    np.testing.assert_array_equal(np.delete(a.cached_tokens, insert_at), b.cached_tokens)
    assert (a.hit_tokens, a.prompt_tokens, a.prefix_evictions, a.pages_allocated) == \
           (b.hit_tokens, b.prompt_tokens, b.prefix_evictions, b.pages_allocated)
    np.testing.assert_array_equal(a.cache.pool.free_pages(), b.cache.pool.free_pages())
    np.testing.assert_array_equal(a.cache.prefix_index.cached_pages(), b.cache.prefix_index.cached_pages())
    assert a.prefix_evictions > 0


def test_azure_trace_replays_without_prefix_caching():
    trace = load_trace(data_file_or_skip(AZURE), limit=2000)
    page_size = 16
    result = replay(trace, 1_000_000, page_size=page_size)
    pages = (trace.input_lengths + trace.output_lengths + page_size - 1) // page_size
    assert not result.prefix_caching
    assert result.num_rejected == 0
    assert result.hit_tokens == 0 and result.pages_matched == 0
    assert result.pages_allocated == result.pages_freed == int(pages.sum())
    assert result.pages_peak == int(pages.max())  # one request at a time
    assert (result.cached_tokens == 0).all()
    small = replay(trace, int(pages.max() - 1) * page_size, page_size=page_size)
    assert small.num_rejected == int((pages > pages.max() - 1).sum()) >= 1


# -------------------------------------------------------- random traces
def make_trace(prompts, outputs, blocks, block_tokens):
    offsets = np.zeros(len(blocks) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blocks], out=offsets[1:])
    return Trace(
        format="mooncake",
        source="<test>",
        arrival_seconds=np.zeros(len(prompts)),
        input_lengths=np.asarray(prompts, dtype=np.int64),
        output_lengths=np.asarray(outputs, dtype=np.int64),
        block_ids=np.asarray([i for b in blocks for i in b], dtype=np.int64),
        block_offsets=offsets,
        block_tokens=block_tokens,
    )


@st.composite
def small_traces(draw):
    page_size = draw(st.sampled_from([1, 2, 3, 4]))
    block_tokens = page_size * draw(st.sampled_from([1, 2, 3]))
    prompts, outputs, blocks = [], [], []
    for _ in range(draw(st.integers(1, 25))):
        # Few distinct ids and short prompts, so prefixes are shared often.
        ids = draw(st.lists(st.integers(0, 3), min_size=1, max_size=5))
        prompts.append(draw(st.integers((len(ids) - 1) * block_tokens + 1, len(ids) * block_tokens)))
        outputs.append(draw(st.integers(0, 3 * page_size)))
        blocks.append(ids)
    num_pages = draw(st.integers(1, 40))
    return make_trace(prompts, outputs, blocks, block_tokens), page_size, num_pages


@settings(max_examples=300, deadline=None)
@given(small_traces())
def test_random_traces_match_the_reference(case):
    trace, page_size, num_pages = case
    result = replay(trace, num_pages * page_size, page_size=page_size, keep_cache=True)
    assert_same_as_reference(result, run_reference(trace, num_pages, page_size))


def test_prompt_of_exact_block_multiple_is_served_all_but_its_last_page():
    trace = make_trace([64, 64, 65], [0, 0, 0], [[7, 8], [7, 8], [7, 8, 9]], 32)
    result = replay(trace, 1024, page_size=16)
    # 2nd: 4 pages cached but the last holds the last prompt token; 3rd: all 4 full pages.
    np.testing.assert_array_equal(result.cached_tokens, [0, 48, 64])


def test_bad_arguments_are_rejected_before_replaying(first_1000):
    with pytest.raises(ValueError, match="page_size"):
        replay(first_1000, 10_000, page_size=24)  # 512 is not a multiple of 24
    with pytest.raises(ValueError, match="capacity_tokens"):
        replay(first_1000, 15, page_size=16)
    with pytest.raises(TypeError, match="trace"):
        replay([1, 2, 3], 1000)
    with pytest.raises(TypeError, match="capacity_tokens"):
        replay(first_1000, 1e6)
    with pytest.raises(ValueError, match="prefix_hash"):
        replay(first_1000, 10_000, prefix_hash="md5")
    # Prefix caching allows at most 2**30 pages: the message names capacity_tokens.
    with pytest.raises(ValueError, match=r"capacity_tokens.*1,073,741,824 pages"):
        replay(first_1000, (2**30 + 1) * 16)


# ------------------------------------------------------------------- CLI
def test_cli_replays_a_mooncake_prefix_and_plots(mooncake_path, tmp_path, capsys):
    plot = tmp_path / "hit_rate.png"
    status = main(["replay", str(mooncake_path), "--limit", "200", "--capacity-tokens", "100000", "1000000",
                   "--page-size", "32", "--plot", str(plot), "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0
    assert "200 requests" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("100,000", "1,000,000"))]
    assert len(rows) == 2
    expected = replay(load_trace(mooncake_path, limit=200), 1_000_000, page_size=32)
    assert f"{100 * expected.hit_rate:.2f}%" in rows[1]
    assert f"{expected.pages_allocated:,}" in rows[1]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_replays_an_azure_prefix_with_progress():
    path = data_file_or_skip(AZURE)
    # -P: a checkout's pagedkv_c/ source directory in the working directory must not shadow the package.
    done = subprocess.run([sys.executable, "-P", "-m", "pagedkv", "replay", str(path), "--limit", "100",
                           "--capacity-tokens", "50000"], capture_output=True, text=True, check=True)
    assert "azure trace" in done.stdout and "prefix caching off" in done.stdout
    assert "50,000" in done.stdout
    assert "req" in done.stderr  # the tqdm bar


def test_cli_reports_bad_input(tmp_path, capsys):
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n')
    assert main(["replay", str(bad), "--no-progress"]) == 2
    assert "missing field 'output_length'" in capsys.readouterr().err
    unknown = tmp_path / "trace.txt"
    unknown.write_text("")
    assert main(["replay", str(unknown), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "cannot tell the format of" in err and "give --format mooncake or --format azure" in err
    azure = tmp_path / "trace.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,2\n")
    assert main(["replay", str(azure), "--plot", str(tmp_path / "x.png"), "--no-progress"]) == 2
    assert "--plot needs a trace with block ids" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # argument errors take argparse's form: usage, then the error
        main(["replay", str(azure), "--capacity-tokens", "1000", "8", "--no-progress"])
    assert info.value.code == 2
    assert "error: argument --capacity-tokens: expected 16 <= N <=" in capsys.readouterr().err
    mooncake = tmp_path / "trace.jsonl"
    mooncake.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(SystemExit) as info:
        main(["replay", str(mooncake), "--page-size", "24", "--no-progress"])
    assert info.value.code == 2
    assert "error: argument --page-size: expected a divisor" in capsys.readouterr().err


def test_cli_reports_unreadable_traces_without_a_traceback(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"pagedkv replay: cannot read {str(tmp_path / 'missing.jsonl')!r}: "
                                       "No such file or directory\n")
    assert main(["replay", str(tmp_path), "--format", "mooncake", "--no-progress"]) == 2
    assert "cannot read" in capsys.readouterr().err
    binary = tmp_path / "trace.jsonl"
    binary.write_bytes(b"\xff\xfe\n")
    assert main(["replay", str(binary), "--no-progress"]) == 2
    assert f"{binary}: invalid text: expected UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "plot, reason",
    [
        ("{tmp}/missing/x.png", "directory {tmp}/missing does not exist"),
        ("{tmp}/trace.jsonl/x.png", "{tmp}/trace.jsonl is not a directory"),
        ("{tmp}", "it is a directory"),
        ("{tmp}/x.txt", "expected an image file name ending in one of "),
        ("{tmp}/x.txt", ".pdf, "),
        ("{tmp}/x.txt", ".png, "),
        ("{tmp}/x.txt", "got '.txt'"),
        ("{tmp}/x", "got no extension"),
    ],
)
def test_cli_rejects_a_plot_path_before_loading_the_trace(tmp_path, capsys, monkeypatch, plot, reason):
    import pagedkv.commands.replay as command

    def no_load(*args, **kwargs):
        raise AssertionError("the trace must not be loaded for a bad command line")

    monkeypatch.setattr(command, "load_trace", no_load)
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    plot = plot.format(tmp=tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace), "--plot", plot, "--no-progress"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"pagedkv replay: error: argument --plot: cannot write {plot}: " in err
    assert reason.format(tmp=tmp_path) in err


def test_cli_formats_come_from_matplotlib(tmp_path, capsys, monkeypatch):
    from matplotlib.backend_bases import FigureCanvasBase

    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    # Upper-case extensions and any format matplotlib writes are accepted.
    for name in ("x.PDF", "x.svg"):
        assert main(["replay", str(trace), "--plot", str(tmp_path / name), "--no-progress"]) == 0
        assert (tmp_path / name).stat().st_size > 0
    monkeypatch.setattr(FigureCanvasBase, "filetypes", {"png": "Portable Network Graphics"})
    with pytest.raises(SystemExit):
        main(["replay", str(trace), "--plot", str(tmp_path / "x.svg"), "--no-progress"])
    assert "ending in one of .png, got '.svg'" in capsys.readouterr().err


def test_cli_plot_without_matplotlib_is_a_usage_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.backend_bases", None)  # import fails
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(tmp_path / "trace.jsonl"), "--plot", str(tmp_path / "x.png")])
    assert exc.value.code == 2
    assert "argument --plot: needs matplotlib" in capsys.readouterr().err


def test_cli_reports_a_plot_that_cannot_be_written(tmp_path, capsys, monkeypatch):
    import errno

    import pagedkv.commands.replay as command

    def full_disk(results, path, title):
        raise OSError(errno.ENOSPC, "No space left on device", path)

    monkeypatch.setattr(command, "plot_hit_rate", full_disk)
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    plot = tmp_path / "x.png"
    assert main(["replay", str(trace), "--capacity-tokens", "1000", "--plot", str(plot), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"pagedkv replay: cannot write --plot {str(plot)!r}: No space left on device\n"


def test_cli_stops_quietly_when_stdout_is_closed(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    # -P: a checkout's pagedkv_c/ source directory in the working directory must not shadow the package.
    with subprocess.Popen([sys.executable, "-P", "-m", "pagedkv", "replay", str(trace), "--no-progress"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        process.stdout.close()  # the reader goes away before the first line, as `| head -c 0` does
        err = process.stderr.read()
    assert process.returncode == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err


def test_sha256_page_hash_serves_the_same_hits(first_1000):
    head = make_trace(first_1000.input_lengths[:200].tolist(), first_1000.output_lengths[:200].tolist(),
                      [b.tolist() for b in first_1000.request_blocks()[:200]], 512)
    fast = replay(head, 300_000, page_size=32)
    safe = replay(head, 300_000, page_size=32, prefix_hash="sha256")
    np.testing.assert_array_equal(fast.cached_tokens, safe.cached_tokens)
    assert fast.prefix_evictions == safe.prefix_evictions > 0


def test_split_round_robin_deals_requests_in_turn():
    from pagedkv.replay import split_round_robin

    blocks = [[i, i + 1] for i in range(7)]
    trace = make_trace([40] * 7, list(range(7)), blocks, 32)
    parts = [split_round_robin(trace, 3, part) for part in range(3)]
    assert [len(p) for p in parts] == [3, 2, 2]
    for part, piece in enumerate(parts):
        np.testing.assert_array_equal(piece.output_lengths, np.arange(part, 7, 3))
        for j in range(len(piece)):
            np.testing.assert_array_equal(piece.blocks(j), blocks[part + 3 * j])
    with pytest.raises(ValueError, match="part"):
        split_round_robin(trace, 3, 3)
