"""Snapshot benchmark: KVCache.save / load / load(mmap=True) / verify against NumPy baselines.

The cache: about ``--size`` GiB of float16 K/V (30 layers per GiB, 8 KV
heads, head dim 64, 1092 pages of 16 tokens), 64 sequences of different
lengths under a 144-token window with 4 sink tokens (most have wrapped
rings, the short ones are still inside the window), 16 of them forks, every
page's bytes random.

Baselines, timed in the same run, interleaved round by round, in the same
directory:

* ``save`` vs ``np.save`` of the pool array to an open file, then
  ``flush`` and ``os.fsync`` of that file (no temporary file, no rename, no
  directory fsync, no checksums: ``save`` does all four on top), with the
  default two threads (a helper hashes the next run of pages while one is
  written) and with one (``num_threads=1``, as ``np.save``);
* ``load`` (read every page, check every page checksum, rebuild the page
  tables) vs ``np.load`` of that file, with two threads and with one;
  both read files just written, from the page cache; ``np.load`` checks
  nothing;
* ``load(mmap=True)`` until the cache is usable vs the full ``load``;
* ``verify_pages`` (recompute the checksum of every sealed page of a cache
  made with ``page_checksums=True``) in GB/s vs a NumPy read-bandwidth probe
  (``np.bitwise_xor.reduce`` over the pool's bytes as uint64, one thread).

Run: python benchmarks/bench_snapshot.py [--size GiB] [--repeats N] [--dir DIR]
"""
import argparse
import os
import shutil
import tempfile

import numpy as np

from _timing import compare, fmt_time, format_table, machine_info, write_json
from pagedkv import KVCache, snapshot

HEADS, DIM, PAGE_SIZE, SINKS, NUM_PAGES = 8, 64, 16, 4, 1092
# Pages one of the 64 sequences holds at most (a fifth of the pool stays free).
BUDGET = NUM_PAGES * 4 // 5 // 64
WINDOW = PAGE_SIZE * (BUDGET - 4)  # in tokens: a full window plus a 16-token append fits the budget


def build_cache(size_gib, page_checksums=False, seed=0):
    """The benchmark cache: ~size_gib of pages, 64 sequences (forks, wrapped windows), random bytes.

    1092 pages of 16 tokens; the number of layers sets the size (30 layers:
    1.0 GiB of float16 K/V).
    """
    num_layers = max(1, round(size_gib * 30))
    cache = KVCache(num_layers, HEADS, DIM, NUM_PAGES, page_size=PAGE_SIZE, dtype=np.float16, window=WINDOW,
                    sink_tokens=SINKS, page_checksums=page_checksums)
    rng = np.random.default_rng(seed)
    flat = cache.kv.reshape(num_layers, -1).view(np.uint16)
    for layer in range(num_layers):  # random finite float16 bits (exponent below all-ones)
        flat[layer] = rng.integers(0, 0x7BFF, flat.shape[1], dtype=np.uint16)
    for seq_id in range(48):
        cache.add_sequence(seq_id)
        length = int(rng.integers(PAGE_SIZE, 3 * WINDOW))  # a third stay inside the window, the rest wrap
        for _ in range(length // PAGE_SIZE):
            cache.append([seq_id], [PAGE_SIZE])
        cache.append([seq_id], [length % PAGE_SIZE])
    for child in range(48, 64):
        cache.fork(child - 48, child)
        cache.append([child], [int(rng.integers(1, 2 * PAGE_SIZE))])
    if page_checksums:
        cache.seal()
    return cache


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=float, default=1.0, help="pool size in GiB (default 1.0)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds per comparison (>= 5)")
    parser.add_argument("--dir", default=None, help="directory for the files (default: a temporary "
                        "directory under the current one)")
    args = parser.parse_args()
    workdir = tempfile.mkdtemp(prefix="bench_snapshot_", dir=args.dir or ".")
    try:
        run(args, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def run(args, workdir):
    cache = build_cache(args.size)
    nbytes = cache.kv.nbytes
    snap_path = os.path.join(workdir, "cache.pkv")
    npy_path = os.path.join(workdir, "pool.npy")
    print(f"pool: {nbytes / 2**30:.2f} GiB, {cache.num_pages} pages, {cache.num_sequences} sequences, "
          f"{cache.stats()['pages_in_use']} pages in use")

    def np_save():
        with open(npy_path, "wb") as f:
            np.save(f, cache.kv)
            f.flush()
            os.fsync(f.fileno())

    save = compare({"KVCache.save": lambda: cache.save(snap_path), "np.save + fsync": np_save,
                    "save, 1 thread": lambda: snapshot.save_cache(cache, snap_path, num_threads=1)},
                   repeats=args.repeats, number=1)
    load = compare({"KVCache.load": lambda: KVCache.load(snap_path), "np.load": lambda: np.load(npy_path),
                    "load, 1 thread": lambda: snapshot.load_cache(snap_path, num_threads=1),
                    "KVCache.load(mmap=True)": lambda: KVCache.load(snap_path, mmap=True)},
                   repeats=args.repeats, number=1)
    del cache
    checked = build_cache(args.size, page_checksums=True, seed=1)
    words = checked.kv.reshape(-1).view(np.uint64)
    sealed = int(checked._sealed_state()["sealed"].sum())
    verified_bytes = sealed * checked.stats()["bytes_per_page"]
    scrub = compare({"verify_pages": checked.verify_pages, "numpy read probe": lambda: np.bitwise_xor.reduce(words)},
                    repeats=args.repeats, number=1)

    med = {name: stats["median"] for group in (save, load, scrub) for name, stats in group.items()}
    gbps = lambda n, s: n / s / 1e9  # noqa: E731
    rows = [
        ["save", fmt_time(med["KVCache.save"]), f"{gbps(nbytes, med['KVCache.save']):.2f} GB/s",
         "np.save + fsync", fmt_time(med["np.save + fsync"]),
         f"{med['np.save + fsync'] / med['KVCache.save']:.2f}x throughput"],
        ["save, 1 thread", fmt_time(med["save, 1 thread"]), f"{gbps(nbytes, med['save, 1 thread']):.2f} GB/s",
         "np.save + fsync", fmt_time(med["np.save + fsync"]),
         f"{med['np.save + fsync'] / med['save, 1 thread']:.2f}x throughput"],
        ["load", fmt_time(med["KVCache.load"]), f"{gbps(nbytes, med['KVCache.load']):.2f} GB/s",
         "np.load", fmt_time(med["np.load"]), f"{med['np.load'] / med['KVCache.load']:.2f}x throughput"],
        ["load, 1 thread", fmt_time(med["load, 1 thread"]), f"{gbps(nbytes, med['load, 1 thread']):.2f} GB/s",
         "np.load", fmt_time(med["np.load"]), f"{med['np.load'] / med['load, 1 thread']:.2f}x throughput"],
        ["load(mmap=True)", fmt_time(med["KVCache.load(mmap=True)"]), "",
         "KVCache.load", fmt_time(med["KVCache.load"]),
         f"{100 * med['KVCache.load(mmap=True)'] / med['KVCache.load']:.1f}% of the time"],
        ["verify_pages", fmt_time(med["verify_pages"]), f"{gbps(verified_bytes, med['verify_pages']):.2f} GB/s",
         "numpy read probe", fmt_time(med["numpy read probe"]),
         f"{(verified_bytes / med['verify_pages']) / (words.nbytes / med['numpy read probe']):.2f}x bandwidth"],
    ]
    print(format_table(["operation", "median", "throughput", "baseline", "baseline median", "ratio"], rows))
    print(f"verify_pages checked {sealed} sealed pages ({verified_bytes / 2**30:.2f} GiB); "
          f"machine load average: {os.getloadavg()}")
    path = write_json("bench_snapshot", {"machine": machine_info(), "pool_bytes": nbytes,
                                          "results": {"save": save, "load": load, "scrub": scrub}, "table": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
