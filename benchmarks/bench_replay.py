"""Trace replay: pagedkv's page manager against a pure-Python vLLM-style block pool.

Replays the Mooncake conversation trace (12,031 requests of production chat
traffic) at one capacity, request by request as ``pagedkv replay`` does: match
the prompt's cached prefix pages, allocate the rest of the prompt, cache its
full pages, allocate the output, free the request (pages newest first).

* ``pagedkv``: :func:`pagedkv.replay.replay` over ``KVCache(num_layers=0)``
  (the typed core: hash chain, prefix index and free queue in C).
* ``pagedkv, no prefix cache``: the same requests with prefix caching off
  (no hashing, no index; every page allocated), to show what the prefix
  index costs. It serves no hits, so it is not compared with the baseline.
* ``python baseline``: ``baseline_block_pool.PrefixCachingManager``, built like
  vLLM's v1 block pool (``KVCacheBlock`` objects, a dict from hash to block, a
  doubly linked free queue of block objects, a Python hash call per page),
  with the same policy and the same hash function.

Both runs time the request loop only; the trace is loaded and split into
per-request block id lists once, before any timing. Every run of both must
serve exactly the same tokens from cache to every request, evict the same
number of pages and allocate the same number: the script stops otherwise.
Runs alternate between the two managers; the table gives medians.

Page operations = pages allocated + pages matched + pages freed
(``2 * ceil((P + O) / page_size)`` per admitted request; see
``pagedkv.replay``). Prints a table and writes
``benchmarks/results/bench_replay.json``.

Example::

    python benchmarks/bench_replay.py
    python benchmarks/bench_replay.py --limit 2000 --repeats 3 --baseline-repeats 1
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from pagedkv import data
from pagedkv.replay import capacity_pages, replay
from pagedkv.traces import Trace, load_trace
from pagedkv_c._prefix import xxh3_in_c

sys.path.insert(0, str(Path(__file__).resolve().parent))
import baseline_block_pool  # noqa: E402  (a sibling script, not a package)

REPO_ROOT = Path(__file__).resolve().parents[1]
TRACE_NAME = "mooncake_conversation_trace.jsonl"


def default_trace_path() -> Path | None:
    """``<repo root>/../shared/data/<trace>``, else the nearest ancestor's ``shared/data``,
    else the copy that ``pagedkv data fetch mooncake-conversation`` put in the data directory."""
    for base in [REPO_ROOT.parent, *REPO_ROOT.parent.parents]:
        candidate = base / "shared" / "data" / TRACE_NAME
        if candidate.is_file():
            return candidate
    fetched = data.dataset_path("mooncake-conversation")
    return fetched if fetched.is_file() else None


def run_baseline(trace, num_pages, page_size, hash_name):
    """Replay with the Python block pool; return (seconds, per-request cached tokens, manager)."""
    manager = baseline_block_pool.PrefixCachingManager(num_pages, page_size, trace.block_tokens,
                                                       hash_name=hash_name)
    prompts = trace.input_lengths.tolist()
    outputs = trace.output_lengths.tolist()
    blocks = [b.tolist() for b in trace.request_blocks()]
    serve = manager.replay_request
    start = time.perf_counter()
    cached = [serve(prompts[i], outputs[i], blocks[i]) for i in range(len(prompts))]
    seconds = time.perf_counter() - start
    return seconds, np.asarray(cached, dtype=np.int64), manager


def check_identical(result, cached, manager):
    """Stop unless the baseline served, evicted and allocated exactly what pagedkv did."""
    problems = []
    if not np.array_equal(result.cached_tokens, cached):
        first = int(np.flatnonzero(result.cached_tokens != cached)[0])
        problems.append(f"request {first}: pagedkv served {result.cached_tokens[first]} tokens, "
                        f"the baseline {cached[first]}")
    pairs = [("evictions", result.prefix_evictions, manager.block_pool.num_evictions),
             ("pages allocated", result.pages_allocated, manager.blocks_allocated),
             ("pages matched", result.pages_matched, manager.blocks_matched),
             ("pages freed", result.pages_freed, manager.blocks_freed),
             ("hit tokens", result.hit_tokens, manager.hit_tokens)]
    problems += [f"{name}: pagedkv {a}, baseline {b}" for name, a, b in pairs if a != b]
    if problems:
        raise SystemExit("the two managers disagree: " + "; ".join(problems))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default=None, help=f"Mooncake trace (default: shared/data/{TRACE_NAME}, else "
                                                    "the one `pagedkv data fetch mooncake-conversation` placed)")
    parser.add_argument("--capacity-tokens", type=int, default=10_000_000)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--limit", type=int, default=None, help="replay only the first N requests (both managers)")
    parser.add_argument("--repeats", type=int, default=5, help="pagedkv runs")
    parser.add_argument("--baseline-repeats", type=int, default=3, help="Python baseline runs")
    parser.add_argument("--hash", choices=("xxh3_128", "sha256"), default="xxh3_128",
                        help="page hash of both managers (default xxh3_128)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_replay.json"))
    args = parser.parse_args()
    if args.repeats < 1 or args.baseline_repeats < 0:
        parser.error("--repeats must be >= 1 and --baseline-repeats >= 0")

    path = args.trace or default_trace_path()
    if path is None:
        raise SystemExit(f"{TRACE_NAME} not found in {REPO_ROOT.parent / 'shared' / 'data'} nor in "
                         f"{data.data_dir()}: run `pagedkv data fetch mooncake-conversation` or pass --trace")
    trace = load_trace(path, "mooncake", limit=args.limit)
    num_pages = capacity_pages(args.capacity_tokens, args.page_size)
    load_before = os.getloadavg()

    # The same requests without block ids: prefix caching off.
    lengths_only = Trace(trace.format, trace.source, trace.arrival_seconds, trace.input_lengths,
                         trace.output_lengths)
    core_seconds, plain_seconds, baseline_seconds = [], [], []
    result = None
    for run in range(max(args.repeats, args.baseline_repeats)):
        if run < args.repeats:
            result = replay(trace, args.capacity_tokens, page_size=args.page_size, prefix_hash=args.hash)
            core_seconds.append(result.seconds)
            plain = replay(lengths_only, args.capacity_tokens, page_size=args.page_size)
            plain_seconds.append(plain.seconds)
        if run < args.baseline_repeats:
            seconds, cached, manager = run_baseline(trace, num_pages, args.page_size, args.hash)
            check_identical(result, cached, manager)
            baseline_seconds.append(seconds)
    load_after = os.getloadavg()

    core = statistics.median(core_seconds)
    rows = [("pagedkv", core, len(core_seconds), result.page_operations),
            ("  no prefix cache", statistics.median(plain_seconds), len(plain_seconds), plain.page_operations)]
    if baseline_seconds:
        rows.append(("python baseline", statistics.median(baseline_seconds), len(baseline_seconds),
                     manager.blocks_allocated + manager.blocks_matched + manager.blocks_freed))
    requests, operations = result.num_requests, result.page_operations
    print(f"Mooncake conversation trace: {requests:,} requests, capacity {args.capacity_tokens:,} tokens "
          f"({num_pages:,} pages of {args.page_size}), hash {args.hash}"
          f"{' (compiled XXH3)' if args.hash == 'xxh3_128' and xxh3_in_c() else ''}")
    print(f"token hit rate {100 * result.hit_rate:.2f}%, {result.num_rejected} rejected, "
          f"{result.pages_allocated:,} pages allocated, {result.prefix_evictions:,} evicted, "
          f"{operations:,} page operations per replay")
    if baseline_seconds:
        print(f"identical per-request hits, evictions and allocations in all {len(baseline_seconds)} baseline runs")
    header = (f"{'manager':<17} {'runs':>4} {'median s':>9} {'requests/s':>11} {'M page ops/s':>13} "
              f"{'vs baseline':>12}")
    print(header)
    print("-" * len(header))
    for name, seconds, runs, page_ops in rows:
        # The run without prefix cache does other work (no hits), so it gets no ratio.
        speedup = f"{rows[-1][1] / seconds:.1f}x" if baseline_seconds and "no prefix" not in name else "-"
        print(f"{name:<17} {runs:>4} {seconds:>9.3f} {requests / seconds:>11,.0f} "
              f"{page_ops / seconds / 1e6:>13.2f} {speedup:>12}")
    print(f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after ({os.cpu_count()} CPUs, shared)")

    report = {
        "trace": str(path),
        "limit": args.limit,
        "requests": requests,
        "capacity_tokens": args.capacity_tokens,
        "page_size": args.page_size,
        "num_pages": num_pages,
        "hash": args.hash,
        "xxh3_in_c": xxh3_in_c(),
        "counters": result.to_dict(),
        "pagedkv_seconds": core_seconds,
        "pagedkv_no_prefix_cache_seconds": plain_seconds,
        "pagedkv_no_prefix_cache_median_seconds": statistics.median(plain_seconds),
        "baseline_seconds": baseline_seconds,
        "pagedkv_median_seconds": core,
        "baseline_median_seconds": statistics.median(baseline_seconds) if baseline_seconds else None,
        "speedup": statistics.median(baseline_seconds) / core if baseline_seconds else None,
        "identical_hits": bool(baseline_seconds),
        "load_average_before": load_before,
        "load_average_after": load_after,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
