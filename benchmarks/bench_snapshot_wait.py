"""How long other threads wait while ``KVCache.save`` runs: the cost of a point-in-time snapshot.

A save takes the cache's state and a copy of its pool in one hold of the
cache's lock; every other call waits for that copy. This benchmark fills a
pool of about ``--size`` GiB (float16, 16 layers, 8 KV heads, head dim 128,
pages of 16 tokens: 1 MiB per page over all layers), then runs a decode-like
loop in a second thread, one iteration = ``append`` of one token and a
``store`` into every layer, and reports the loop's iteration latency
(median, 99th percentile, longest) while no save runs and while saves run
back to back, and how long ``KVCache._snapshot`` (the part under the lock)
holds the lock, per GiB of pool. Also: the save's wall time and the memory
the copy of the pool takes (as much as the pool).

Run: python benchmarks/bench_snapshot_wait.py [--size GiB] [--saves N] [--dir DIR]
"""
import argparse
import os
import statistics
import tempfile
import threading
import time

import numpy as np

from _timing import machine_info, write_json
from pagedkv import KVCache
from pagedkv_c._file_io import prefault

LAYERS, HEADS, DIM, PAGE_SIZE = 16, 8, 128, 16


def build_cache(size_gib: float) -> KVCache:
    """A cache of about ``size_gib`` GiB whose every pool byte is written (so a copy reads real memory)."""
    page_bytes = LAYERS * 2 * PAGE_SIZE * HEADS * DIM * 2
    num_pages = max(64, int(size_gib * 2**30) // page_bytes)
    cache = KVCache(LAYERS, HEADS, DIM, num_pages, page_size=PAGE_SIZE, dtype=np.float16,
                    enable_prefix_caching=True, page_checksums=True)
    flat = cache.kv.reshape(LAYERS, -1)
    for layer in range(LAYERS):
        flat[layer] = np.float16(layer + 1)
    return cache


def decode_loop(cache: KVCache, stop: threading.Event, latencies: list, active: list) -> None:
    """append + store into every layer, one token at a time; each iteration's latency and whether a save ran."""
    k = np.ones((1, HEADS, DIM), dtype=np.float16)
    seq_id = 0
    cache.add_sequence(seq_id)
    while not stop.is_set():
        saving = active[0]
        start = time.perf_counter()
        slots = cache.append([seq_id], [1])
        for layer in range(LAYERS):
            cache.store(layer, slots, k, k)
        latencies.append((time.perf_counter() - start, saving and active[0]))
        if cache.seq_len(seq_id) >= 64 * PAGE_SIZE:
            cache.truncate(seq_id, 0)


def summary(values: list) -> dict:
    values = sorted(values)
    return {"iterations": len(values), "median_ms": 1e3 * statistics.median(values),
            "p99_ms": 1e3 * values[int(0.99 * (len(values) - 1))], "max_ms": 1e3 * values[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=float, default=1.0, help="pool size in GiB (default 1.0)")
    parser.add_argument("--saves", type=int, default=3, help="saves run back to back (default 3)")
    parser.add_argument("--dir", default=None, help="directory of the snapshot file (default: a temp dir)")
    args = parser.parse_args()
    cache = build_cache(args.size)
    gib = cache.kv.nbytes / 2**30

    # The part under the lock alone: state + memcpy of the pool into a faulted-in array.
    holds = []
    out = np.zeros(cache.kv.shape, dtype=cache.kv.dtype)
    prefault(out)
    for _ in range(args.saves):
        start = time.perf_counter()
        cache._snapshot(out)
        holds.append(time.perf_counter() - start)
    del out

    stop, latencies, active = threading.Event(), [], [False]
    worker = threading.Thread(target=decode_loop, args=(cache, stop, latencies, active), daemon=True)
    worker.start()
    time.sleep(1.0)  # the loop without saves
    save_times = []
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path = os.path.join(directory, "wait.pkv")
        for _ in range(args.saves):
            active[0] = True
            start = time.perf_counter()
            cache.save(path)
            save_times.append(time.perf_counter() - start)
            active[0] = False
            time.sleep(0.2)
    stop.set()
    worker.join()
    idle = summary([t for t, saving in latencies if not saving])
    during = summary([t for t, saving in latencies if saving])
    result = {
        "pool_gib": gib, "machine": machine_info(),
        "lock_hold_ms_per_gib": {"median": 1e3 * statistics.median(holds) / gib, "max": 1e3 * max(holds) / gib},
        "save_s": {"median": statistics.median(save_times), "max": max(save_times)},
        "loop_without_save": idle, "loop_during_save": during,
        "copy_bytes": cache.kv.nbytes,
    }
    print(f"pool {gib:.2f} GiB; {args.saves} saves, median {result['save_s']['median']:.2f} s each; "
          f"extra memory during a save: {cache.kv.nbytes / 2**30:.2f} GiB (the copy)")
    print(f"lock held by the snapshot copy: median {result['lock_hold_ms_per_gib']['median']:.0f} ms/GiB, "
          f"longest {result['lock_hold_ms_per_gib']['max']:.0f} ms/GiB")
    for name, stats in (("append+store x16 layers, no save", idle), ("append+store x16 layers, during saves", during)):
        print(f"{name:40s} {stats['iterations']:7d} iterations  median {stats['median_ms']:.3f} ms  "
              f"p99 {stats['p99_ms']:.3f} ms  longest {stats['max_ms']:.1f} ms")
    write_json("bench_snapshot_wait", result)


if __name__ == "__main__":
    main()
