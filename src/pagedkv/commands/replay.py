"""``pagedkv replay``: replay a production trace through the page manager with prefix caching."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from pagedkv.commands import _model_options
from pagedkv.commands._metrics_options import RunMetrics, add_metrics_arguments
from pagedkv.commands._model_options import (
    DTYPES,
    MAX_PAGE_SIZE,
    CommandError,
    check_fits_in_memory,
    int_in_range,
    integer,
    kv_bytes_per_token,
    page_size_tokens,
    positive_int,
    tier_url,
)
from pagedkv.commands._paths import (
    dataset_or_path,
    not_a_dataset_hint,
    not_a_regular_file,
    plot_file,
    redacted_in,
)
from pagedkv.data import DataError
from pagedkv.replay import (
    MAX_PAGES,
    MAX_PREFIX_PAGES,
    PREFIX_HASHES,
    ReplayResult,
    capacity_pages,
    replay,
)
from pagedkv.traces import (
    FORMATS,
    MAX_BLOCK_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    infer_format,
    load_trace,
)

DEFAULT_CAPACITIES = [1_000_000, 2_000_000, 5_000_000, 10_000_000, 20_000_000, 50_000_000]

DESCRIPTION = """\
Replay a serving trace through a KVCache page manager (no K/V bytes), one
request at a time in file order: add the sequence with its prompt block ids
(prefix caching reuses the longest run of cached pages; the last prompt token
is never served from cache), append the rest of the prompt, append the
output, release the sequence (pages newest first). Freed pages stay findable
by hash until the allocator hands them out again, least recently freed first.

A request that needs more than the pool's pages is rejected: counted, with
the cache left unchanged, and the replay goes on.

Page operations = pages allocated (taken from the free queue for new tokens)
+ pages matched (cached pages taken for a prefix hit) + pages freed (returned
at the end of the request); an admitted request of P prompt and O output
tokens costs 2 * ceil((P + O) / page_size) of them. Throughput is measured
over the request loop only (not the trace loading).

Capacity in memory: --capacity-gib G gives the pool G GiB of K/V of a model of
--model-shape LAYERS,KV_HEADS,HEAD_DIM (default 30,3,64: SmolLM2-135M) in the page
format --kv-dtype (default float16), i.e. G * 2**30 / (2 * LAYERS * KV_HEADS * row bytes)
tokens, the row bytes including the scales of int8 and int4 (see KVCache): compare
the hit rates of one memory budget across formats.

Formats: mooncake (JSON Lines: timestamp, input_length, output_length,
hash_ids of 512-token blocks) and azure (CSV: TIMESTAMP, ContextTokens,
GeneratedTokens; no content, so no prefix caching: occupancy and allocation
speed only).
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``replay`` subcommand to ``subparsers`` and return its parser."""
    parser = subparsers.add_parser(
        "replay",
        help="replay a Mooncake or Azure trace through the page manager (prefix caching hit rate, throughput)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("trace", metavar="TRACE",
                        help="trace file (.jsonl: mooncake, .csv: azure), or the name of a downloaded "
                             "dataset (mooncake-conversation, azure-conversation...; see `pagedkv data list`)")
    parser.add_argument("--format", choices=FORMATS, default=None,
                        help="trace format (default: from the file extension)")
    parser.add_argument("--capacity-tokens", type=integer, nargs="+", default=None, metavar="N",
                        help="pool capacities to replay, in tokens (rounded down to whole pages); "
                             f"default: {' '.join(str(c) for c in DEFAULT_CAPACITIES)}")
    parser.add_argument("--capacity-gib", type=_positive_float, nargs="+", default=None, metavar="G",
                        help="pool capacities in GiB of K/V instead of tokens (see --kv-dtype and --model-shape)")
    parser.add_argument("--kv-dtype", choices=DTYPES, default="float16",
                        help="with --capacity-gib: the page format whose bytes per token size the pool "
                             "(default float16)")
    parser.add_argument("--model-shape", type=_model_shape, default=(30, 3, 64), metavar="L,H,D",
                        help="with --capacity-gib: layers, KV heads and head dim of the model (default 30,3,64: "
                             "SmolLM2-135M)")
    parser.add_argument("--page-size", type=page_size_tokens, default=16, metavar="P",
                        help=f"tokens per page, at most {MAX_PAGE_SIZE:,} (default 16); must divide the trace's "
                             "block size")
    parser.add_argument("--limit", type=positive_int, default=None, metavar="N",
                        help="replay only the first N requests")
    parser.add_argument("--block-tokens", type=_block_tokens, default=MOONCAKE_BLOCK_TOKENS, metavar="B",
                        help=f"tokens per hash id of a mooncake trace (default {MOONCAKE_BLOCK_TOKENS})")
    parser.add_argument("--prefix-hash", choices=PREFIX_HASHES, default="xxh3_128",
                        help="page hash of the prefix index (default xxh3_128)")
    parser.add_argument("--plot", type=plot_file, default=None, metavar="OUT.png",
                        help="draw the token hit rate against capacity (needs matplotlib and a mooncake trace; "
                             "the extension gives the image format)")
    parser.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                        help="publish the prefix cache's KV events as vLLM does (ZeroMQ PUB socket bound to "
                             "ENDPOINT, e.g. tcp://127.0.0.1:5557; needs pagedkv[events], a mooncake trace and "
                             "one --capacity-tokens); a batch every 256 requests")
    parser.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                        help="with --kv-events: bind a ROUTER socket that replays missed batches (vLLM's replay)")
    parser.add_argument("--no-progress", action="store_true", help="do not show the tqdm progress bar")
    parser.add_argument("--tier", type=tier_url, default=None, metavar="URL",
                        help="a shared prefix tier (redis://HOST:PORT/DB or redis+cluster://HOST:PORT,...; needs "
                             "the redis extra): deal the trace round-robin over --instances caches that share it "
                             "(served in file order, each request's tier writes landing before the next one), and "
                             "compare with isolated caches and one cache of the total capacity")
    parser.add_argument("--instances", type=positive_int, default=None, metavar="N",
                        help="with --tier: caches sharing the tier, each of --capacity-tokens (default 4)")
    add_metrics_arguments(parser)
    parser.set_defaults(parser=parser)
    return parser


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _model_shape(text: str) -> tuple[int, int, int]:
    """argparse type: ``LAYERS,KV_HEADS,HEAD_DIM``, each an integer >= 1 (head dim <= 65536)."""
    parts = text.split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if len(shape) != 3 or min(shape) < 1 or shape[2] > 2**16:
        raise argparse.ArgumentTypeError(f"expected LAYERS,KV_HEADS,HEAD_DIM (integers >= 1), got {text!r}")
    return shape


def _block_tokens(text: str) -> int:
    """argparse type of ``--block-tokens``: tokens per hash id, 1 .. the largest a KVCache takes."""
    return int_in_range(text, 1, MAX_BLOCK_TOKENS)


def _format_row(result: ReplayResult) -> list[str]:
    hit = f"{100 * result.hit_rate:.2f}%" if result.prefix_caching else "-"
    replayed = result.num_rejected < result.num_requests  # all rejected: nothing ran, a rate would mean nothing
    return [
        f"{result.capacity_tokens:,}",
        f"{result.num_pages:,}",
        f"{result.num_requests:,}",
        f"{result.num_rejected:,}",
        hit,
        f"{result.pages_allocated:,}",
        f"{result.prefix_evictions:,}" if result.prefix_caching else "-",
        f"{result.pages_peak:,}",
        f"{result.requests_per_second:,.0f}" if replayed else "-",
        f"{result.page_operations_per_second / 1e6:,.2f}" if replayed else "-",
    ]


HEADER = ["capacity (tokens)", "pages", "requests", "rejected", "token hit rate", "pages allocated",
          "pages evicted", "peak pages in use", "requests/s", "M page ops/s"]


def format_table(results: list[ReplayResult]) -> str:
    """Render replay results as an aligned text table, one row per capacity."""
    rows = [HEADER] + [_format_row(r) for r in results]
    widths = [max(len(row[c]) for row in rows) for c in range(len(HEADER))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def plot_hit_rate(results: list[ReplayResult], path: str, title: str) -> None:
    """Save a plot of token hit rate (%) against capacity (tokens, log scale) to ``path``."""
    from matplotlib.figure import Figure  # optional dependency; no pyplot state or GUI backend needed

    ordered = sorted(results, key=lambda r: r.capacity_tokens)
    figure = Figure(figsize=(6, 3.6), dpi=100)
    axes = figure.add_subplot()
    axes.plot([r.capacity_tokens for r in ordered], [100 * r.hit_rate for r in ordered], marker="o")
    axes.set_xscale("log")
    axes.set_xlabel("KV cache capacity (tokens)")
    axes.set_ylabel("prompt tokens served from cache (%)")
    axes.set_title(title, fontsize=10)
    axes.set_ylim(bottom=0)
    axes.grid(True, which="both", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path)


# Bytes of a replay cache (no K/V) per page: the allocator's records and queue, and with
# prefix caching the page records, the tokens of each page and 4 to 8 index slots.
REPLAY_BYTES_PER_PAGE = 48
PREFIX_BYTES_PER_PAGE = 96
# Caches that share a --tier when --instances is not given.
DEFAULT_INSTANCES = 4


def _capacity_option(args: argparse.Namespace) -> str:
    """The option that set the capacities, as messages name it."""
    return "--capacity-gib" if args.capacity_gib is not None else "--capacity-tokens"


def _too_large(args: argparse.Namespace, exc: MemoryError) -> str:
    """The message for a capacity whose page records (and prefix index) do not fit in this machine's memory."""
    option = _capacity_option(args)
    return (f"pagedkv replay: argument {option}: a cache of that capacity does not fit in this "
            f"machine's memory; give a smaller {option} (the cache: {exc})")


def _check_capacities_fit(args: argparse.Namespace, capacities: list[int], prefix_caching: bool) -> None:
    """Raise CommandError for a capacity whose cache takes more than the memory this process may use.

    Checked before the trace is replayed: the records are zeroed when the cache is
    made, so a cache larger than memory gets the process killed rather than refused.
    """
    per_page = REPLAY_BYTES_PER_PAGE + (PREFIX_BYTES_PER_PAGE + 4 * args.page_size if prefix_caching else 0)
    copies = (args.instances or DEFAULT_INSTANCES) if args.tier is not None else 1  # one cache per instance
    option = _capacity_option(args)
    limit = _model_options.memory_limit_bytes()  # the module's: tests replace it there
    fit = "" if limit is None else f" (about {limit // (copies * per_page) * args.page_size:,} tokens fit)"
    for capacity in capacities:
        pages = capacity // args.page_size
        what = f"argument {option}: a cache of {capacity:,} tokens ({pages:,} pages)"
        if copies > 1:
            what += f" in each of {copies:,} instances"
        check_fits_in_memory(copies * pages * per_page, what,
                             f"give a smaller {option}{' or --instances' if copies > 1 else ''}{fit}")


def run(args: argparse.Namespace) -> int:
    """Load the trace, replay it at every capacity, print the table; return the exit status."""
    capacities = args.capacity_tokens or DEFAULT_CAPACITIES
    if args.capacity_gib is not None:
        if args.capacity_tokens is not None:
            args.parser.error("argument --capacity-gib: give either --capacity-tokens or --capacity-gib")
        try:
            per_token = kv_bytes_per_token(args.kv_dtype, *args.model_shape)
        except ValueError as exc:
            args.parser.error(str(exc))
        capacities = [int(g * 2**30 // per_token) for g in args.capacity_gib]
        layers, heads, dim = args.model_shape
        print(f"capacity: {args.kv_dtype} pages of a {layers}-layer model with {heads} KV heads of dim {dim} take "
              f"{per_token:,} bytes per token: " + ", ".join(f"{g:g} GiB = {c:,} tokens"
                                                            for g, c in zip(args.capacity_gib, capacities)),
              file=sys.stderr)
    if args.instances is not None and args.tier is None:
        args.parser.error("argument --instances: only used with --tier URL")
    try:
        args.trace = dataset_or_path(args.trace)
    except DataError as exc:
        print(f"pagedkv replay: {exc}", file=sys.stderr)
        return 2
    if not os.path.exists(args.trace):  # before the format is guessed from a name that may be a typo
        print(f"pagedkv replay: cannot read {args.trace!r}: No such file or directory"
              f"{not_a_dataset_hint(args.trace)}", file=sys.stderr)
        return 2
    reason = not_a_regular_file(args.trace)
    if reason:
        print(f"pagedkv replay: {reason}", file=sys.stderr)
        return 2
    trace_format = args.format
    if trace_format is None:
        try:
            trace_format = infer_format(args.trace)
        except ValueError:
            suffix = Path(args.trace).suffix
            print(f"pagedkv replay: cannot tell the format of {args.trace} from its extension "
                  f"({repr(suffix) if suffix else 'none'}): a trace is .jsonl (mooncake) or .csv (azure); "
                  "rename it or give --format mooncake or --format azure", file=sys.stderr)
            return 2
    try:
        trace = load_trace(args.trace, trace_format, limit=args.limit, block_tokens=args.block_tokens)
    except OSError as exc:
        print(f"pagedkv replay: cannot read {args.trace!r}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"pagedkv replay: {exc}", file=sys.stderr)
        return 2
    max_pages = MAX_PREFIX_PAGES if trace.has_block_ids else MAX_PAGES
    option = _capacity_option(args)
    try:  # every capacity is checked before the first replay starts
        if trace.has_block_ids and trace.block_tokens % args.page_size:
            raise ValueError(f"argument --page-size: expected a divisor of the trace's block size "
                             f"{trace.block_tokens}, got {args.page_size}")
        for i, capacity in enumerate(capacities):
            try:
                capacity_pages(capacity, args.page_size, max_pages)
            except ValueError:
                # capacity_pages names its own parameter; name the option instead.
                given = f"{args.capacity_gib[i]:g} GiB = {capacity:,} tokens" if args.capacity_gib else f"{capacity}"
                raise ValueError(
                    f"argument {option}: expected {args.page_size:,} <= N <= "
                    f"{max_pages * args.page_size:,} tokens (1 to {max_pages:,} pages of --page-size {args.page_size:,} "
                    f"tokens), got {given}"
                ) from None
    except ValueError as exc:
        args.parser.error(str(exc))  # usage and "error: argument ...", as argparse's own checks print
    try:
        _check_capacities_fit(args, capacities, trace.has_block_ids)
    except CommandError as exc:
        print(f"pagedkv replay: {exc}", file=sys.stderr)
        return 2
    if args.kv_events_replay and not args.kv_events:
        print("pagedkv replay: --kv-events-replay needs --kv-events", file=sys.stderr)
        return 2
    if args.kv_events and (not trace.has_block_ids or len(capacities) != 1):
        print("pagedkv replay: --kv-events publishes the events of one prefix cache: it needs a trace with block "
              f"ids (mooncake; this one is {trace.format}) and one --capacity-tokens (got {len(capacities)})",
              file=sys.stderr)
        return 2
    if args.plot and not trace.has_block_ids:
        print(f"pagedkv replay: --plot needs a trace with block ids (mooncake); {trace.format} has none",
              file=sys.stderr)
        return 2
    progress_bar = _progress_bar_class(args)
    if args.tier is not None:
        try:
            return _run_shared(args, trace, capacities, progress_bar)
        except MemoryError as exc:  # a capacity in range whose page records this machine cannot hold
            print(_too_large(args, exc), file=sys.stderr)
            return 2
    publishers: list = []
    attach_publisher = None
    if args.kv_events:
        try:
            from pagedkv.events import ZmqEventPublisher
        except ImportError as exc:
            print(f"pagedkv replay: {exc}", file=sys.stderr)
            return 2

        def attach_publisher(cache):
            """Publish ``cache``'s KV events on ``--kv-events``; returns the publisher's ``publish``."""
            publishers.append(ZmqEventPublisher(cache, args.kv_events, replay_endpoint=args.kv_events_replay))
            return publishers[-1].publish
    try:
        metrics = RunMetrics(args, "replay")  # each capacity's cache is labelled capacity_tokens=N
    except CommandError as exc:
        print(f"pagedkv replay: {exc}", file=sys.stderr)
        return 2
    try:
        results = _replay_all(args, trace, capacities, progress_bar, metrics, attach_publisher)
    except MemoryError as exc:  # a capacity in range whose page records this machine cannot hold
        print(_too_large(args, exc), file=sys.stderr)
        return 2
    except OSError as exc:
        if not args.kv_events or isinstance(exc, BrokenPipeError):
            raise
        print(f"pagedkv replay: --kv-events: {exc}", file=sys.stderr)  # the publisher's socket could not bind
        return 2
    finally:
        metrics_error = metrics.close()
        for publisher in publishers:
            publisher.close()
    if metrics_error is not None:
        print(f"pagedkv replay: {metrics_error}", file=sys.stderr)
        return 2
    print(format_table(results))
    for publisher in publishers:
        print(f"KV events: {publisher.num_events:,} events in {publisher.num_batches:,} batches "
              f"({publisher.num_bytes:,} bytes) published on {publisher.endpoint}"
              + (f"; {publisher.num_dropped:,} dropped" if publisher.num_dropped else ""))
    if args.plot:
        # The path was checked when parsing; writing can still fail (a full disk, a directory removed since).
        try:
            plot_hit_rate(results, args.plot,
                          f"{Path(args.trace).name}: {len(trace):,} requests, page size {args.page_size}")
        except OSError as exc:
            print(f"pagedkv replay: cannot write --plot {args.plot!r}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        print(f"hit-rate plot written to {args.plot}")
    return 0


def _progress_bar_class(args: argparse.Namespace):
    """tqdm, or None with --no-progress or when tqdm is not installed (said on stderr)."""
    if args.no_progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print("pagedkv replay: tqdm is not installed, no progress bar (pip install tqdm)", file=sys.stderr)
        return None
    return tqdm


def _replay_all(args: argparse.Namespace, trace, capacities: list[int], progress_bar,
                metrics: RunMetrics, kv_events=None) -> list[ReplayResult]:
    """Replay ``trace`` at every capacity, in order; return the results (``kv_events``: see ``replay``)."""
    print(f"{trace.format} trace {args.trace}: {len(trace):,} requests, "
          f"{int(trace.input_lengths.sum()):,} prompt and {int(trace.output_lengths.sum()):,} output tokens; "
          f"page size {args.page_size}, prefix caching {'on' if trace.has_block_ids else 'off (no block ids)'}")
    results = []
    for capacity in capacities:
        bar = None
        if progress_bar is not None:
            bar = progress_bar(total=len(trace), unit="req", desc=f"{capacity:,} tokens", leave=False)
        try:
            result = replay(trace, capacity, page_size=args.page_size, prefix_hash=args.prefix_hash,
                            progress=bar.update if bar is not None else None,
                            on_cache=lambda cache: metrics.attach(cache, {"capacity_tokens": str(capacity)}),
                            kv_events=kv_events)
        finally:
            metrics.detach()
            if bar is not None:
                bar.close()
        results.append(result)
    return results


def _run_shared(args: argparse.Namespace, trace, capacities, progress_bar=None) -> int:
    """``--tier``: isolated caches, the same caches sharing the tier, one cache of the total capacity."""
    import uuid

    from pagedkv.replay import replay_shared, split_round_robin

    if not trace.has_block_ids:
        print(f"pagedkv replay: --tier needs a trace with block ids (mooncake); {trace.format} has none",
              file=sys.stderr)
        return 2
    try:
        from pagedkv.tiers import RedisTier

        RedisTier(args.tier, namespace="check")  # the URL's form, before any replay
    except ImportError:
        print("pagedkv replay: --tier needs the redis extra (pip install 'pagedkv[redis]'; from a checkout: "
              "pip install '.[redis]')", file=sys.stderr)
        return 2
    except (TypeError, ValueError) as exc:
        print(f"pagedkv replay: --tier: {redacted_in(str(exc), args.tier)}", file=sys.stderr)
        return 2
    n = args.instances if args.instances is not None else DEFAULT_INSTANCES
    print(f"{trace.format} trace {args.trace}: {len(trace):,} requests dealt round-robin over {n} instances; "
          f"page size {args.page_size}. Requests are served in file order, each one's tier writes landing "
          f"before the next starts. The tier stores page headers only: a replay has no K/V bytes. "
          f"Each capacity runs under a namespace of its own.")
    header = ["capacity per instance", f"{n} isolated", f"{n} sharing the tier", "of which from the tier",
              f"one cache of {n}x"]
    rows = [header]
    for capacity in capacities:
        # Each capacity replays the trace three times: dealt over isolated caches, over
        # caches sharing the tier, and into one cache of n times the capacity.
        bar = None
        if progress_bar is not None:
            bar = progress_bar(total=3 * len(trace), unit="req", desc=f"{capacity:,} tokens", leave=False)
        update = bar.update if bar is not None else None
        isolated_hits = prompt_tokens = 0
        tiers = []
        try:
            for part in range(n):
                result = replay(split_round_robin(trace, n, part), capacity, page_size=args.page_size,
                                prefix_hash=args.prefix_hash, progress=update)
                isolated_hits += result.hit_tokens
                prompt_tokens += result.prompt_tokens
            namespace = f"pagedkv-replay-{uuid.uuid4().hex}"
            tiers = [RedisTier(args.tier, namespace=namespace) for _ in range(n)]
            results = replay_shared(trace, capacity, tiers, page_size=args.page_size,
                                    prefix_hash=args.prefix_hash, progress=update)
            single = replay(trace, n * capacity, page_size=args.page_size, prefix_hash=args.prefix_hash,
                            progress=update)
        finally:
            for tier in tiers:
                tier.close()
            if bar is not None:
                bar.close()
        tier_stats = [tier.stats() for tier in tiers]
        shared_hits = sum(r.hit_tokens for r in results)
        tier_hits = sum(r.tier_hit_tokens for r in results)
        shared_prompt = sum(r.prompt_tokens for r in results)
        errors = sum(t["fetch_errors"] for t in tier_stats)
        lost_writes = sum(t["dropped_writes"] + t["write_errors"] for t in tier_stats)
        rows.append([f"{capacity:,}", f"{100 * isolated_hits / max(prompt_tokens, 1):.2f}%",
                     f"{100 * shared_hits / max(shared_prompt, 1):.2f}%",
                     f"{100 * tier_hits / max(shared_prompt, 1):.2f}%", f"{100 * single.hit_rate:.2f}%"])
        if errors or lost_writes:
            print(f"note: at {capacity:,} tokens the tier had {errors} failed fetches and {lost_writes} "
                  f"dropped or failed writes (counted as misses)", file=sys.stderr)
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    print("token hit rate (prompt tokens served from cache):")
    print("\n".join(lines))
    return 0
