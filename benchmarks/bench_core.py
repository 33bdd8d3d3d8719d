"""Core benchmark: the classic PagedKVCache and the PagePool against pure-Python baselines.

Run from the repository root against the installed package::

    python benchmarks/bench_core.py

Everything is measured in one run: each figure is the median of >= 5
repetitions, and each ratio compares against the baseline (``baseline_classic``,
``baseline_pool``) or the ``np.copyto`` probe timed in the same run, in
interleaved rounds (``_timing.compare``) so that load from other processes
falls on both sides of a ratio alike. Prints
Markdown tables and writes ``benchmarks/results/bench_core.json``, which
``benchmarks/plot.py`` draws.

Sections
--------
single calls
    ``put`` / ``get`` per call at ``dim`` (default 128), float32, on a cache of
    64 pages of 64 tokens. ``put`` streams tokens over 4x the capacity (a page
    is evicted every 64 puts); ``get`` reads resident tokens and returns two
    fresh arrays. Times include the Python ``for`` loop that drives the calls,
    for both sides alike.
batch calls
    ``put_many`` / ``get_many`` of ``--batch`` tokens (default 4096) per call;
    ``put_many`` alternates between two blocks that each fill the cache, so
    every call evicts and remaps every page. Per-token speedup against the
    baseline's per-token loop (a loop of its ``put`` / ``get``; for
    ``get_many`` also against a hand-inlined loop that skips ``get``'s
    copies), and the fraction of the bandwidth that ``np.copyto`` reaches
    when copying the same bytes (keys + values) into preallocated arrays.
page pool
    ``allocate(1)`` + ``free`` per call, and ``allocate(1024)`` + ``free`` in
    pages per second.
sweep
    page_size x max_pages: single ``get`` latency and ``get_many`` throughput
    for random resident tokens of a full cache.
"""
import argparse
import sys
import time

import numpy as np

import pagedkv
from _timing import compare, copyto_task, fmt_time, format_table, machine_info, write_json
from baseline_classic import BaselinePagedKVCache
from baseline_pool import BaselinePagePool

GOALS = {
    "put": 5.0,          # x faster than the baseline, per call
    "get": 2.0,
    "put_many": 30.0,    # x faster per token than the baseline's per-token loop
    "get_many": 30.0,
    "copyto_fraction": 0.5,
    "pool_mpages_per_s": 30.0,
}


def bench_single_calls(dim, repeats, dtype):
    max_pages, page_size = 64, 64
    rng = np.random.default_rng(0)
    key = rng.standard_normal(dim).astype(dtype)
    value = rng.standard_normal(dim).astype(dtype)
    stream = list(range(4 * max_pages * page_size))
    resident = stream[-max_pages * page_size:]
    caches = {"pagedkv": pagedkv.PagedKVCache(max_pages, dim, page_size=page_size, dtype=dtype),
              "baseline": BaselinePagedKVCache(max_pages, dim, page_size=page_size, dtype=dtype)}

    def put_loop(put):
        def run():
            for token in stream:
                put(token, key, value)
        return run

    def get_loop(get):
        def run():
            for token in resident:
                get(token)
        return run

    put_stats = compare({name: put_loop(c.put) for name, c in caches.items()}, repeats=repeats,
                        min_seconds=0.05)
    for name, cache in caches.items():
        if cache.get(resident[0]) is None or cache.get(stream[0]) is not None:
            raise RuntimeError(f"{name}: unexpected cache contents after the put stream")
    get_stats = compare({name: get_loop(c.get) for name, c in caches.items()}, repeats=repeats,
                        min_seconds=0.05)
    result = {"max_pages": max_pages, "page_size": page_size,
              "calls_per_loop": {"put": len(stream), "get": len(resident)}}
    for name in caches:
        result[name] = {"put_s": put_stats[name]["median"] / len(stream),
                        "get_s": get_stats[name]["median"] / len(resident)}
    result["put_speedup"] = result["baseline"]["put_s"] / result["pagedkv"]["put_s"]
    result["get_speedup"] = result["baseline"]["get_s"] / result["pagedkv"]["get_s"]
    return result


def bench_batch_calls(dim, n, repeats, dtype):
    page_size = 64
    max_pages = -(-n // page_size)  # one block of n tokens fills the cache
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((n, dim)).astype(dtype)
    values = rng.standard_normal((n, dim)).astype(dtype)
    blocks = [np.arange(n, dtype=np.int64), np.arange(n, 2 * n, dtype=np.int64)]
    copy_all, nbytes = copyto_task([keys, values])
    candidates = {"copyto": copy_all}
    caches = {}
    for name, cls in (("pagedkv", pagedkv.PagedKVCache), ("baseline", BaselinePagedKVCache)):
        # One cache streams (put_many alternates between the blocks, evicting
        # every page each call); another holds block 0 for get_many.
        writer = cls(max_pages, dim, page_size=page_size, dtype=dtype)
        reader = cls(max_pages, dim, page_size=page_size, dtype=dtype)
        reader.put_many(blocks[0], keys, values)
        caches[name] = reader
        candidates[f"{name}_put_many"] = _alternating_put_many(writer, blocks, keys, values)
        candidates[f"{name}_get_many"] = (lambda cache: lambda: cache.get_many(blocks[0]))(reader)
        if name == "baseline":
            candidates["baseline_get_many_inlined"] = (
                lambda cache: lambda: cache.get_many_inlined(blocks[0]))(reader)
    out = tuple(np.empty_like(a) for a in caches["pagedkv"].get_many(blocks[0]))
    candidates["pagedkv_get_many_out"] = lambda: caches["pagedkv"].get_many(blocks[0], out=out)
    stats = compare(candidates, repeats=repeats)
    # The two implementations must agree on what they return.
    ours, theirs = caches["pagedkv"].get_many(blocks[0]), caches["baseline"].get_many(blocks[0])
    inlined = caches["baseline"].get_many_inlined(blocks[0])
    if not all(np.array_equal(a, b) and np.array_equal(a, c) for a, b, c in zip(ours, theirs, inlined)):
        raise RuntimeError("pagedkv and the baseline disagree on get_many")
    if not ours[2].all() or not np.array_equal(ours[0], keys) or not np.array_equal(ours[1], values):
        raise RuntimeError("get_many did not return what put_many stored")
    copy_s = stats["copyto"]["median"]
    result = {"n": n, "max_pages": max_pages, "page_size": page_size, "bytes": nbytes,
              "copyto_s": copy_s, "copyto_gbps": nbytes / copy_s / 1e9}
    for name in caches:
        result[name] = {f"{op}_s": stats[f"{name}_{op}"]["median"] for op in ("put_many", "get_many")}
    result["pagedkv"]["get_many_out_s"] = stats["pagedkv_get_many_out"]["median"]
    result["baseline"]["get_many_inlined_s"] = stats["baseline_get_many_inlined"]["median"]
    result["get_many_vs_inlined_speedup"] = (
        result["baseline"]["get_many_inlined_s"] / result["pagedkv"]["get_many_s"]
    )
    for op in ("put_many", "get_many"):
        result[f"{op}_speedup"] = result["baseline"][f"{op}_s"] / result["pagedkv"][f"{op}_s"]
        result[f"{op}_copyto_fraction"] = copy_s / result["pagedkv"][f"{op}_s"]
    result["get_many_out_speedup"] = result["baseline"]["get_many_s"] / result["pagedkv"]["get_many_out_s"]
    result["get_many_out_copyto_fraction"] = copy_s / result["pagedkv"]["get_many_out_s"]
    return result


def _alternating_put_many(cache, blocks, keys, values):
    turn = [0]

    def run():
        turn[0] ^= 1
        cache.put_many(blocks[turn[0]], keys, values)

    return run


def bench_pool(repeats, num_pages=1024):
    pools = {"pagedkv": pagedkv.PagePool(num_pages), "baseline": BaselinePagePool(num_pages)}
    candidates = {}
    for name, pool in pools.items():
        candidates[f"{name}_one"] = (lambda p: lambda: p.free(p.allocate(1)))(pool)
        candidates[f"{name}_batch"] = (lambda p: lambda: p.free(p.allocate(num_pages)))(pool)
    stats = compare(candidates, repeats=repeats)
    result = {"num_pages": num_pages}
    for name in pools:
        result[name] = {"one_s": stats[f"{name}_one"]["median"], "batch_s": stats[f"{name}_batch"]["median"]}
        result[name]["batch_mpages_per_s"] = num_pages / result[name]["batch_s"] / 1e6
    result["one_speedup"] = result["baseline"]["one_s"] / result["pagedkv"]["one_s"]
    result["batch_speedup"] = result["baseline"]["batch_s"] / result["pagedkv"]["batch_s"]
    return result


def bench_sweep(dim, repeats, dtype, page_sizes, max_pages_list, num_lookups, num_single):
    rng = np.random.default_rng(2)
    rows = []
    for page_size in page_sizes:
        for max_pages in max_pages_list:
            capacity = page_size * max_pages
            ours = pagedkv.PagedKVCache(max_pages, dim, page_size=page_size, dtype=dtype)
            base = BaselinePagedKVCache(max_pages, dim, page_size=page_size, dtype=dtype)
            chunk = min(capacity, 8192)
            for start in range(0, capacity, chunk):
                tokens = np.arange(start, min(start + chunk, capacity), dtype=np.int64)
                block = rng.standard_normal((tokens.size, dim)).astype(dtype)
                ours.put_many(tokens, block, -block)
                base.put_many(tokens, block, -block)
            lookups = rng.integers(0, capacity, size=num_lookups, dtype=np.int64)
            singles = [int(t) for t in lookups[:num_single]]
            got, expected = ours.get_many(lookups), base.get_many(lookups)
            if not all(np.array_equal(a, b) for a, b in zip(got, expected)) or not got[2].all():
                raise RuntimeError(f"sweep page_size={page_size} max_pages={max_pages}: results disagree")
            row = {"page_size": page_size, "max_pages": max_pages, "tokens": capacity,
                   "pool_bytes": ours.nbytes}
            candidates = {}
            for name, cache in (("pagedkv", ours), ("baseline", base)):
                candidates[f"{name}_get"] = _get_loop(cache.get, singles)
                candidates[f"{name}_get_many"] = (lambda c: lambda: c.get_many(lookups))(cache)
            stats = compare(candidates, repeats=repeats)
            for name in ("pagedkv", "baseline"):
                row[f"{name}_get_s"] = stats[f"{name}_get"]["median"] / len(singles)
                row[f"{name}_get_many_s"] = stats[f"{name}_get_many"]["median"] / len(lookups)
            row["get_speedup"] = row["baseline_get_s"] / row["pagedkv_get_s"]
            row["get_many_speedup"] = row["baseline_get_many_s"] / row["pagedkv_get_many_s"]
            row["get_lookups_per_s"] = 1.0 / row["pagedkv_get_s"]
            row["get_many_lookups_per_s"] = 1.0 / row["pagedkv_get_many_s"]
            rows.append(row)
            print(f"  swept page_size={page_size:4d} max_pages={max_pages:5d}", file=sys.stderr)
            del ours, base
    return rows


def _get_loop(get, tokens):
    def run():
        for token in tokens:
            get(token)

    return run


def verdict(value, goal):
    return f"{value:.1f}x (goal >= {goal:g}x {'met' if value >= goal else 'NOT met'})"


def print_tables(results):
    single, batch, pool = results["single"], results["batch"], results["pool"]
    n = batch["n"]
    print(f"\nClassic PagedKVCache, dim={results['dim']}, {results['dtype']} "
          f"(medians of {results['repeats']} repetitions)\n")
    rows = [
        ["put (per call)", fmt_time(single["pagedkv"]["put_s"]), fmt_time(single["baseline"]["put_s"]),
         verdict(single["put_speedup"], GOALS["put"]), "-"],
        ["get (per call)", fmt_time(single["pagedkv"]["get_s"]), fmt_time(single["baseline"]["get_s"]),
         verdict(single["get_speedup"], GOALS["get"]), "-"],
    ]
    for op in ("put_many", "get_many"):
        rows.append([
            f"{op} N={n} (per token)",
            fmt_time(batch["pagedkv"][f"{op}_s"] / n), fmt_time(batch["baseline"][f"{op}_s"] / n),
            verdict(batch[f"{op}_speedup"], GOALS[op]),
            f"{100 * batch[f'{op}_copyto_fraction']:.0f}% (goal >= 50%)",
        ])
    rows.append([
        f"get_many N={n} vs inlined baseline loop (per token)", fmt_time(batch["pagedkv"]["get_many_s"] / n),
        fmt_time(batch["baseline"]["get_many_inlined_s"] / n), f"{batch['get_many_vs_inlined_speedup']:.1f}x",
        f"{100 * batch['get_many_copyto_fraction']:.0f}%",
    ])
    rows.append([
        f"get_many N={n}, out= buffers (per token)", fmt_time(batch["pagedkv"]["get_many_out_s"] / n),
        "-", f"{batch['get_many_out_speedup']:.1f}x",
        f"{100 * batch['get_many_out_copyto_fraction']:.0f}%",
    ])
    print(format_table(["operation", "pagedkv", "baseline", "speedup", "of np.copyto bandwidth"], rows))
    print(f"\nnp.copyto of the same {batch['bytes'] / 2**20:.1f} MiB (keys + values): "
          f"{fmt_time(batch['copyto_s'])}, {batch['copyto_gbps']:.1f} GB/s read")

    print(f"\nPagePool, {pool['num_pages']} pages\n")
    rows = [
        ["allocate(1) + free", fmt_time(pool["pagedkv"]["one_s"]), fmt_time(pool["baseline"]["one_s"]),
         f"{pool['one_speedup']:.1f}x", "-"],
        [f"allocate({pool['num_pages']}) + free", f"{pool['pagedkv']['batch_mpages_per_s']:.1f} M pages/s",
         f"{pool['baseline']['batch_mpages_per_s']:.1f} M pages/s", f"{pool['batch_speedup']:.1f}x",
         f"{pool['pagedkv']['batch_mpages_per_s']:.1f} M pages/s (goal >= 30: "
         f"{'met' if pool['pagedkv']['batch_mpages_per_s'] >= GOALS['pool_mpages_per_s'] else 'NOT met'})"],
    ]
    print(format_table(["operation", "pagedkv", "baseline", "speedup", "goal"], rows))

    print(f"\nLookup sweep: random resident tokens of a full cache, dim={results['dim']}\n")
    rows = []
    for row in results["sweep"]:
        rows.append([
            row["page_size"], row["max_pages"],
            f"{row['pagedkv_get_s'] * 1e6:.3f}", f"{row['get_lookups_per_s'] / 1e6:.2f}",
            f"{row['get_speedup']:.1f}x",
            f"{row['pagedkv_get_many_s'] * 1e6:.4f}", f"{row['get_many_lookups_per_s'] / 1e6:.1f}",
            f"{row['get_many_speedup']:.1f}x",
        ])
    print(format_table(
        ["page_size", "max_pages", "get us/lookup", "get M lookups/s", "get speedup",
         "get_many us/lookup", "get_many M lookups/s", "get_many speedup (vs loop of get)"], rows))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="repetitions per measurement (>= 5)")
    parser.add_argument("--dim", type=int, default=128, help="key/value length (elements)")
    parser.add_argument("--batch", type=int, default=4096, help="tokens per put_many/get_many call")
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--max-pages", type=int, nargs="+", default=[4, 64, 1024])
    parser.add_argument("--lookups", type=int, default=4096, help="tokens per get_many call in the sweep")
    parser.add_argument("--single-lookups", type=int, default=2048, help="get calls per repetition in the sweep")
    parser.add_argument("--output", default="bench_core", help="name of the JSON file in benchmarks/results/")
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be >= 5")
    dtype = np.float32
    started = time.perf_counter()
    results = {
        "benchmark": "core",
        "command": " ".join(["python", "benchmarks/bench_core.py", *sys.argv[1:]]),
        "pagedkv_version": pagedkv.__version__,
        "pagedkv_path": pagedkv.__file__,
        "machine": machine_info(),
        "repeats": args.repeats,
        "dim": args.dim,
        "dtype": np.dtype(dtype).name,
        "goals": GOALS,
    }
    print("single calls ...", file=sys.stderr)
    results["single"] = bench_single_calls(args.dim, args.repeats, dtype)
    print("batch calls ...", file=sys.stderr)
    results["batch"] = bench_batch_calls(args.dim, args.batch, args.repeats, dtype)
    print("page pool ...", file=sys.stderr)
    results["pool"] = bench_pool(args.repeats)
    print("sweep ...", file=sys.stderr)
    results["sweep"] = bench_sweep(args.dim, args.repeats, dtype, args.page_sizes, args.max_pages,
                                   args.lookups, args.single_lookups)
    results["machine"]["load_average_after"] = machine_info()["load_average"]
    results["seconds"] = time.perf_counter() - started
    print_tables(results)
    path = write_json(args.output, results)
    print(f"\nwrote {path} ({results['seconds']:.0f} s; load average before/after: "
          f"{results['machine']['load_average']} / {results['machine']['load_average_after']})")


if __name__ == "__main__":
    main()
