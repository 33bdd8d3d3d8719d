"""Loaders for production LLM serving traces (request arrival, lengths, prefix block ids).

Two public formats are read:

``mooncake``
    JSON Lines, one request per line, as released by the Mooncake project
    (kvcache-ai/Mooncake, traces of the FAST'25 paper "Mooncake: Trading More
    Storage for Less Computation"), e.g. ``mooncake_conversation_trace.jsonl``::

        {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

    ``timestamp`` is the arrival in milliseconds from the start of the trace,
    ``input_length`` and ``output_length`` are token counts, and ``hash_ids``
    holds one id per ``block_tokens``-token block of the prompt (512 in the
    released traces; the last block may be partial). Equal ids mean equal
    content given equal earlier ids, so a request's prompt is identified, for
    prefix caching, by its list of block ids.
``azure``
    CSV with the header ``TIMESTAMP,ContextTokens,GeneratedTokens``, as in the
    Azure LLM inference traces of the Azure Public Dataset (Azure/AzurePublicDataset,
    the 2023 traces of the Splitwise paper, ISCA'24), e.g.
    ``AzureLLMInferenceTrace_conv.csv``. Timestamps are ISO-8601 date-times;
    there is no content, so no prefix sharing can be replayed.

Both loaders return a :class:`Trace`: NumPy columns in file order, which is
the order a replay follows (Mooncake timestamps come in bins of several
requests, so file order is the only total order).
"""
from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from pagedkv_c._checks import checked_int

FORMATS = ("mooncake", "azure")
MOONCAKE_BLOCK_TOKENS = 512
MAX_BLOCK_TOKENS = 2**31 - 1  # the largest block_tokens KVCache.add_sequence takes
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class TraceFormatError(ValueError):
    """A trace file does not follow its format.

    The message names the file, the line (1-based, counting the CSV header),
    the field and what was expected.
    """


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests of a serving trace, in file order, as NumPy columns.

    Attributes
    ----------
    format : str
        ``"mooncake"`` or ``"azure"``.
    source : str
        Path the trace was read from.
    arrival_seconds : numpy.ndarray
        float64, shape ``[n]``: arrival of each request in seconds after the
        first request of the file (negative if a later line arrived earlier).
    input_lengths : numpy.ndarray
        int64, shape ``[n]``: prompt tokens per request, ``>= 1``.
    output_lengths : numpy.ndarray
        int64, shape ``[n]``: generated tokens per request, ``>= 0``.
    block_ids : numpy.ndarray or None
        int64, shape ``[total_blocks]``: the prompt block ids of all requests,
        concatenated (Mooncake ``hash_ids``); None for traces without content.
    block_offsets : numpy.ndarray or None
        int64, shape ``[n + 1]``: request ``i`` owns
        ``block_ids[block_offsets[i]:block_offsets[i + 1]]``, which is
        ``ceil(input_lengths[i] / block_tokens)`` ids long.
    block_tokens : int or None
        Tokens per block id (512 in the Mooncake traces).
    """

    format: str
    source: str
    arrival_seconds: np.ndarray
    input_lengths: np.ndarray
    output_lengths: np.ndarray
    block_ids: np.ndarray | None = None
    block_offsets: np.ndarray | None = None
    block_tokens: int | None = None

    def __len__(self) -> int:
        return int(self.input_lengths.shape[0])

    @property
    def has_block_ids(self) -> bool:
        """True when requests carry prefix block ids (prefix caching can be replayed)."""
        return self.block_ids is not None

    def blocks(self, index: int) -> np.ndarray:
        """Block ids of request ``index`` (an int64 view, shape ``[ceil(input_length / block_tokens)]``).

        Raises
        ------
        ValueError
            The trace has no block ids.
        TypeError
            ``index`` is not an integer (a float or a bool is refused).
        IndexError
            ``index`` is out of range.
        """
        if self.block_ids is None or self.block_offsets is None:
            raise ValueError(f"Invalid trace: the {self.format} trace {self.source} has no block ids")
        index = checked_int(index, "index")
        if not -len(self) <= index < len(self):
            raise IndexError(f"Invalid value of index: expected -{len(self)} <= index < {len(self)}, got {index}")
        index %= len(self)
        return self.block_ids[self.block_offsets[index]:self.block_offsets[index + 1]]

    def request_blocks(self) -> list[np.ndarray]:
        """Block ids of every request as a list of int64 views (see :meth:`blocks`).

        Raises
        ------
        ValueError
            The trace has no block ids.
        """
        if self.block_ids is None or self.block_offsets is None:
            raise ValueError(f"Invalid trace: the {self.format} trace {self.source} has no block ids")
        return np.split(self.block_ids, self.block_offsets[1:-1]) if len(self) else []


def infer_format(path: str | Path) -> str:
    """Trace format from the file extension: ``.jsonl``/``.json`` -> mooncake, ``.csv`` -> azure.

    Raises
    ------
    ValueError
        Any other extension (name the format explicitly then).
    """
    suffix = Path(path).suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    if suffix == ".csv":
        return "azure"
    raise ValueError(
        f"Invalid value of path: cannot infer the trace format from the extension {suffix!r} of {path}; "
        f"expected .jsonl (mooncake) or .csv (azure), or give the format explicitly"
    )


def load_trace(path: str | Path, format: str | None = None, limit: int | None = None,
               block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a trace file.

    Parameters
    ----------
    path : str or Path
        The trace file.
    format : {"mooncake", "azure"} or None
        None: inferred from the extension (see :func:`infer_format`).
    limit : int or None
        Read only the first ``limit`` requests (``>= 1``); None reads all.
    block_tokens : int
        Tokens per block id of a Mooncake trace, ``1 <= block_tokens <=
        2**31 - 1`` (default 512).

    Returns
    -------
    Trace

    Raises
    ------
    ValueError
        Unknown format, or ``limit`` / ``block_tokens`` out of range.
    TypeError
        ``limit`` or ``block_tokens`` is not an integer (a float or a bool
        is refused).
    TraceFormatError
        The file does not follow the format (subclass of ValueError).
    FileNotFoundError
        No such file.
    """
    if format is None:
        format = infer_format(path)
    if format == "mooncake":
        return load_mooncake(path, limit=limit, block_tokens=block_tokens)
    if format == "azure":
        return load_azure(path, limit=limit)
    raise ValueError(f"Invalid value of format: expected one of {FORMATS}, got {format!r}")


def _shortened(text: str, limit: int = 80) -> str:
    """``text``, cut to ``limit`` characters with an ellipsis: a message quotes the start of a long line."""
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_limit(limit) -> None:
    if limit is not None:
        checked_int(limit, "limit", 1, 2**63 - 1)


def _text_lines(stream: Iterable[str], path: str | Path) -> Iterator[str]:
    """Lines of a text file opened as UTF-8; a byte that does not decode raises TraceFormatError.

    The decoder reads ahead in chunks, so the line of the bad byte is unknown.
    """
    try:
        yield from stream
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            f"{path}: invalid text: expected UTF-8, got the byte 0x{exc.object[exc.start]:02x} ({exc.reason})"
        ) from None


def _in_length_range(value: int, name: str, low: int, where: str) -> int:
    """``value`` if ``low <= value <= 2**63 - 1`` (lengths are held as int64), else TraceFormatError."""
    if value < low:
        raise TraceFormatError(f"{where}: invalid {name}: expected >= {low}, got {_shortened(str(value))}")
    if value > _INT64_MAX:
        raise TraceFormatError(f"{where}: invalid {name}: expected at most {_INT64_MAX}, got {_shortened(str(value))}")
    return value


def _int_field(record: dict, name: str, low: int, where: str) -> int:
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceFormatError(f"{where}: invalid {name}: expected an integer, got {_shortened(repr(value))}")
    return _in_length_range(value, name, low, where)


def load_mooncake(path: str | Path, limit: int | None = None,
                  block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a Mooncake JSON Lines trace (see the module notes for the format).

    Every line is a JSON object with ``timestamp`` (ms, a number ``>= 0``),
    ``input_length`` (int ``>= 1``), ``output_length`` (int ``>= 0``) and
    ``hash_ids`` (a list of exactly ``ceil(input_length / block_tokens)`` ints
    in the int64 range). Blank lines are skipped; other keys are ignored.

    Parameters
    ----------
    path : str or Path
    limit : int or None
        Read only the first ``limit`` requests.
    block_tokens : int
        Tokens per block id (512 in the released traces), ``1 <= block_tokens
        <= 2**31 - 1``.

    Returns
    -------
    Trace
        ``format == "mooncake"``, with ``block_ids``/``block_offsets``.

    Raises
    ------
    TraceFormatError
        A line that is not a JSON object, a missing or ill-typed field, a value
        out of range, a ``hash_ids`` list of the wrong length, no request, or
        bytes that are not UTF-8.
    ValueError
        ``limit`` or ``block_tokens`` out of range.
    TypeError
        ``limit`` or ``block_tokens`` is not an integer.
    FileNotFoundError
        No such file.

    Notes
    -----
    Source: kvcache-ai/Mooncake, ``FAST25-release/traces`` (Apache-2.0).
    """
    _check_limit(limit)
    block_tokens = checked_int(block_tokens, "block_tokens", 1, MAX_BLOCK_TOKENS)
    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    ids: list[int] = []
    counts: list[int] = []
    with open(path, encoding="utf-8") as stream:
        for line_number, line in enumerate(_text_lines(stream, path), start=1):
            if limit is not None and len(inputs) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                # Some of json's messages end in "at" ("Invalid control character at"),
                # which the column completes.
                reason = exc.msg.removesuffix(" at")
                raise TraceFormatError(f"{where}: not valid JSON ({reason} at column {exc.colno})") from None
            if not isinstance(record, dict):
                raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
            for name in ("timestamp", "input_length", "output_length", "hash_ids"):
                if name not in record:
                    raise TraceFormatError(f"{where}: missing field {name!r}")
            timestamp = record["timestamp"]
            if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) \
                    or not math.isfinite(timestamp) or timestamp < 0:
                raise TraceFormatError(f"{where}: invalid timestamp: expected a number of ms >= 0, got {timestamp!r}")
            input_length = _int_field(record, "input_length", 1, where)
            output_length = _int_field(record, "output_length", 0, where)
            hash_ids = record["hash_ids"]
            if not isinstance(hash_ids, list):
                raise TraceFormatError(f"{where}: invalid hash_ids: expected a list of integers, "
                                       f"got {_shortened(repr(hash_ids))}")
            expected = -(-input_length // block_tokens)
            if len(hash_ids) != expected:
                raise TraceFormatError(
                    f"{where}: invalid hash_ids: expected ceil(input_length / {block_tokens}) = {expected} "
                    f"block ids for input_length {input_length}, got {len(hash_ids)} (are the trace's blocks "
                    f"{block_tokens} tokens? block_tokens=B, or `pagedkv replay --block-tokens B`, sets it; the Mooncake traces use "
                    f"{MOONCAKE_BLOCK_TOKENS})"
                )
            for block_id in hash_ids:
                if isinstance(block_id, bool) or not isinstance(block_id, int) \
                        or not _INT64_MIN <= block_id <= _INT64_MAX:
                    raise TraceFormatError(
                        f"{where}: invalid hash_ids: expected integers in the int64 range, got {block_id!r}"
                    )
            arrivals.append(timestamp / 1000.0)
            inputs.append(input_length)
            outputs.append(output_length)
            ids.extend(hash_ids)
            counts.append(len(hash_ids))
    if not inputs:
        raise TraceFormatError(f"{path}: no requests")
    offsets = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    arrival = np.asarray(arrivals, dtype=np.float64)
    return Trace(
        format="mooncake",
        source=str(path),
        arrival_seconds=arrival - arrival[0],
        input_lengths=np.asarray(inputs, dtype=np.int64),
        output_lengths=np.asarray(outputs, dtype=np.int64),
        block_ids=np.asarray(ids, dtype=np.int64),
        block_offsets=offsets,
        block_tokens=block_tokens,
    )


def _csv_int(row: dict, name: str, low: int, where: str) -> int:
    text = row[name]
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise TraceFormatError(f"{where}: invalid {name}: expected an integer, got {text!r}") from None
    return _in_length_range(value, name, low, where)


def load_azure(path: str | Path, limit: int | None = None) -> Trace:
    """Read an Azure LLM inference trace (CSV; see the module notes for the format).

    The header must name ``TIMESTAMP``, ``ContextTokens`` and
    ``GeneratedTokens`` (other columns are ignored). ``TIMESTAMP`` is an
    ISO-8601 date-time (fractional seconds of any length), ``ContextTokens``
    an int ``>= 1`` (prompt tokens), ``GeneratedTokens`` an int ``>= 0``.

    Parameters
    ----------
    path : str or Path
    limit : int or None
        Read only the first ``limit`` requests.

    Returns
    -------
    Trace
        ``format == "azure"``, without block ids.

    Raises
    ------
    TraceFormatError
        A missing column, a row with the wrong number of fields, a value that
        does not parse or is out of range, no request, or bytes that are not
        UTF-8.
    ValueError
        ``limit`` out of range.
    TypeError
        ``limit`` is not an integer.
    FileNotFoundError
        No such file.

    Notes
    -----
    Source: Azure Public Dataset (Azure/AzurePublicDataset), "Azure LLM
    inference trace 2023" (CC-BY-4.0, credit "Azure Public Dataset, Microsoft").
    """
    _check_limit(limit)
    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    with open(path, encoding="utf-8", newline="") as stream:
        reader = csv.DictReader(_text_lines(stream, path), restkey="\x00extra")
        header = reader.fieldnames or []
        missing = [name for name in _AZURE_COLUMNS if name not in header]
        if missing:
            raise TraceFormatError(
                f"{path}:1: invalid header: expected the columns {', '.join(_AZURE_COLUMNS)}, "
                f"got {_shortened(', '.join(header)) or 'an empty file'} (missing {', '.join(missing)})"
            )
        for row in reader:
            if limit is not None and len(inputs) >= limit:
                break
            where = f"{path}:{reader.line_num}"
            if "\x00extra" in row or None in row.values():
                raise TraceFormatError(f"{where}: expected {len(header)} fields as in the header")
            stamp = row["TIMESTAMP"]
            try:
                moment = datetime.fromisoformat(stamp.strip())
            except ValueError:
                raise TraceFormatError(
                    f"{where}: invalid TIMESTAMP: expected an ISO-8601 date-time, got {stamp!r}"
                ) from None
            inputs.append(_csv_int(row, "ContextTokens", 1, where))
            outputs.append(_csv_int(row, "GeneratedTokens", 0, where))
            # Naive times are read as UTC, so that no local-time rule (DST) shifts them.
            arrivals.append((moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp())
    if not inputs:
        raise TraceFormatError(f"{path}: no requests")
    arrival_array = np.asarray(arrivals, dtype=np.float64)
    return Trace(
        format="azure",
        source=str(path),
        arrival_seconds=arrival_array - arrival_array[0],
        input_lengths=np.asarray(inputs, dtype=np.int64),
        output_lengths=np.asarray(outputs, dtype=np.int64),
    )
