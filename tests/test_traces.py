"""Trace loaders (``pagedkv.traces``): known facts of the real traces, and malformed files."""
import json

import numpy as np
import pytest

from _llama_support import data_file_or_skip
from pagedkv.traces import TraceFormatError, infer_format, load_azure, load_mooncake, load_trace



# ---------------------------------------------------------------- real data
def test_mooncake_conversation_trace_matches_its_published_facts():
    path = data_file_or_skip("mooncake_conversation_trace.jsonl")
    trace = load_trace(path)
    # Facts from the data README: 12,031 requests, mean input 12,035 and
    # output 343 tokens, 182,790 distinct block ids, every request starting
    # with block 0, about 59 minutes of traffic.
    assert trace.format == "mooncake" and len(trace) == 12031
    assert round(trace.input_lengths.mean()) == 12035
    assert round(trace.output_lengths.mean()) == 343
    assert np.unique(trace.block_ids).size == 182790
    assert (trace.block_ids[trace.block_offsets[:-1]] == 0).all()
    assert 55 * 60 < trace.arrival_seconds[-1] < 60 * 60
    # Cross-check the columns against a plain read of the first lines.
    with open(path) as stream:
        first = [json.loads(next(stream)) for _ in range(3)]
    for i, record in enumerate(first):
        assert trace.input_lengths[i] == record["input_length"]
        assert trace.output_lengths[i] == record["output_length"]
        assert trace.blocks(i).tolist() == record["hash_ids"]
    assert [b.tolist() for b in trace.request_blocks()[:3]] == [r["hash_ids"] for r in first]


def test_azure_conversation_trace_matches_its_published_facts():
    path = data_file_or_skip("AzureLLMInferenceTrace_conv.csv")
    trace = load_trace(path)
    assert trace.format == "azure" and len(trace) == 19366
    assert not trace.has_block_ids
    assert trace.input_lengths.min() >= 1 and trace.output_lengths.min() >= 0
    with open(path) as stream:
        next(stream)
        first = next(stream).strip().split(",")
    assert trace.input_lengths[0] == int(first[1]) and trace.output_lengths[0] == int(first[2])
    assert trace.arrival_seconds[0] == 0.0
    assert 0 < trace.arrival_seconds[-1] < 2 * 3600  # one hour of traffic


def test_limit_reads_a_prefix():
    path = data_file_or_skip("mooncake_conversation_trace.jsonl")
    full, head = load_trace(path), load_trace(path, limit=10)
    assert len(head) == 10
    np.testing.assert_array_equal(head.input_lengths, full.input_lengths[:10])
    np.testing.assert_array_equal(head.block_ids, full.block_ids[:full.block_offsets[10]])


# ---------------------------------------------------------------- formats
def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_format_is_inferred_from_the_extension(tmp_path):
    assert infer_format("a/b.jsonl") == "mooncake"
    assert infer_format("b.JSON") == "mooncake"
    assert infer_format("c.csv") == "azure"
    with pytest.raises(ValueError, match="cannot infer the trace format"):
        infer_format("d.txt")
    path = write(tmp_path, "t.txt", '{"timestamp": 5, "input_length": 3, "output_length": 1, "hash_ids": [9]}\n')
    trace = load_trace(path, format="mooncake")
    assert trace.input_lengths.tolist() == [3] and trace.blocks(0).tolist() == [9]
    with pytest.raises(ValueError, match="format"):
        load_trace(path, format="sharegpt")


def test_small_mooncake_file_is_read_exactly(tmp_path):
    path = write(tmp_path, "t.jsonl",
                 '{"timestamp": 3000, "input_length": 5, "output_length": 0, "hash_ids": [4, 5], "x": 1}\n'
                 "\n"
                 '{"timestamp": 4500.5, "input_length": 4, "output_length": 7, "hash_ids": [4]}\n')
    trace = load_mooncake(path, block_tokens=4)
    assert trace.input_lengths.tolist() == [5, 4]
    assert trace.output_lengths.tolist() == [0, 7]
    assert trace.block_offsets.tolist() == [0, 2, 3]
    assert trace.block_ids.tolist() == [4, 5, 4]
    np.testing.assert_allclose(trace.arrival_seconds, [0.0, 1.5005])
    assert trace.block_tokens == 4
    assert trace.blocks(-1).tolist() == [4]
    with pytest.raises(IndexError):
        trace.blocks(2)


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", ":2: not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "invalid timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "invalid input_length: expected >= 1"),
        ('{"timestamp": 0, "input_length": 5.0, "output_length": 1, "hash_ids": [1]}', "invalid input_length: expected an integer"),
        ('{"timestamp": 0, "input_length": 5, "output_length": -2, "hash_ids": [1]}', "invalid output_length"),
        ('{"timestamp": 0, "input_length": 5, "output_length": true, "hash_ids": [1]}', "invalid output_length"),
        ('{"timestamp": 0, "input_length": 513, "output_length": 1, "hash_ids": [1]}', "expected ceil\\(input_length / 512\\) = 2"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, 2]}', "= 1 block ids"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "invalid hash_ids"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [18446744073709551616]}', "int64 range"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 3}', "invalid hash_ids"),
    ],
)
def test_malformed_mooncake_lines_are_named(tmp_path, line, message):
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    path = write(tmp_path, "t.jsonl", good + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=message) as info:
        load_mooncake(path)
    assert f"{path}:2" in str(info.value)


def test_invalid_json_names_the_column_once(tmp_path):
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    # json's own message for a control character ends in "at"; the column completes it.
    for line, reason in (('{"timestamp": "a\tb"}', "Invalid control character at column 17"),
                         ("{not json", "Expecting property name enclosed in double quotes at column 2")):
        path = write(tmp_path, "t.jsonl", good + "\n" + line + "\n")
        with pytest.raises(TraceFormatError) as info:
            load_mooncake(path)
        assert str(info.value) == f"{path}:2: not valid JSON ({reason})"


def test_bytes_that_are_not_utf8_are_a_format_error(tmp_path):
    good = b'{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
    mooncake = tmp_path / "t.jsonl"
    mooncake.write_bytes(good + b'{"timestamp": 0, "x": "\xff"}\n')
    azure = tmp_path / "t.csv"
    azure.write_bytes(b"TIMESTAMP,ContextTokens,GeneratedTokens\n\xfe,1,2\n")
    for path, load in ((mooncake, load_mooncake), (azure, load_azure)):
        with pytest.raises(TraceFormatError, match="invalid text: expected UTF-8, got the byte 0x") as info:
            load(path)
        assert str(info.value).startswith(f"{path}: ")


def test_small_azure_file_is_read_exactly(tmp_path):
    path = write(tmp_path, "t.csv",
                 "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:15:46.6805900,374,44\n"
                 "2023-11-16 18:15:50.9951690,396,0\n")
    trace = load_azure(path)
    assert trace.input_lengths.tolist() == [374, 396]
    assert trace.output_lengths.tolist() == [44, 0]
    np.testing.assert_allclose(trace.arrival_seconds, [0.0, 4.314579], atol=1e-6)
    with pytest.raises(ValueError, match="no block ids"):
        trace.blocks(0)


@pytest.mark.parametrize(
    "text, message",
    [
        ("TIMESTAMP,Context,GeneratedTokens\n", "missing ContextTokens"),
        ("", "invalid header"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", "no requests"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n", ":2: invalid TIMESTAMP"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,2\n", ":2: invalid ContextTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,0,2\n", "invalid ContextTokens: expected >= 1"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,-1\n", "invalid GeneratedTokens"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3\n", ":2: expected 3 fields"),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3,1,9\n", ":2: expected 3 fields"),
    ],
)
def test_malformed_azure_files_are_named(tmp_path, text, message):
    path = write(tmp_path, "t.csv", text)
    with pytest.raises(TraceFormatError, match=message):
        load_azure(path)


def test_empty_mooncake_file_and_bad_arguments(tmp_path):
    path = write(tmp_path, "t.jsonl", "\n\n")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_mooncake(path)
    with pytest.raises(ValueError, match="limit"):
        load_mooncake(path, limit=0)
    with pytest.raises(ValueError, match="block_tokens"):
        load_mooncake(path, block_tokens=0)
    with pytest.raises(FileNotFoundError):
        load_trace(tmp_path / "missing.jsonl")


def test_a_long_first_line_is_quoted_shortened(tmp_path):
    """A Mooncake file read as Azure: the message quotes the start of its first line, not all of it."""
    line = '{"timestamp": 0, "input_length": 6758, "hash_ids": [' + ", ".join(map(str, range(400))) + "]}\n"
    with pytest.raises(TraceFormatError) as info:
        load_azure(write(tmp_path, "t.csv", line))
    message = str(info.value)
    assert "invalid header" in message and '{"timestamp": 0' in message and "..." in message
    assert len(message) < 300


def test_a_length_past_int64_is_named(tmp_path):
    path = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                    "2023-11-16 18:15:46,99999999999999999999,2\n")
    with pytest.raises(TraceFormatError, match="invalid ContextTokens: expected at most 9223372036854775807"):
        load_azure(path)
