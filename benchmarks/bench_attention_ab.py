"""Decode attention of this checkout's kernels against another build of them, paired in one process.

Loads a second build of ``pagedkv_c._attention`` (``--other``, the ``_attention*.so`` of
another checkout built with ``python setup.py build_ext --inplace``) beside this one and,
for every shape, page format and size below, times one layer's decode call
(``decode_step``, one thread) of each build in turn, alternating which goes first. Each
size is either small enough to stay in the caches between calls (about 3 MiB of K/V: the
same layer timed again and again, as kernel tables do) or far larger than the last-level
cache (``--memory-mib``, default 96 MiB: the K/V comes from memory on every call, as in a
model's decode step, where the other layers' K/V and the weights pass through the caches
between two calls of a layer). Pages are 16 tokens (128 for the single long sequence),
listed in a shuffled order, as a cache's pool hands them out.

Printed per case: the median microseconds of each build, the GB/s of K/V read, the median
of the per-pair ratios (other / this: > 1 means this build is faster), and whether both
builds returned the same bits.

Example::

    python setup.py build_ext --inplace        # this checkout
    git -C ../base checkout HEAD~1 && (cd ../base && python setup.py build_ext --inplace)
    python benchmarks/bench_attention_ab.py --other ../base/pagedkv_c/_attention.cpython-311-x86_64-linux-gnu.so
"""
import argparse
import importlib.util
import statistics
import time

import numpy as np
from _timing import format_table, machine_info

from pagedkv_c import _attention

# (KV heads, head dim, query heads per KV head): SmolLM2-135M's layer, a Llama-3-8B-like
# layer with head dim 64, and Llama-3-8B's.
SHAPES = ((3, 64, 3), (8, 64, 4), (8, 128, 4))


def _load(path):
    spec = importlib.util.spec_from_file_location("other_build._attention", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(builds, rng, batch, context, page_size, dtype, kv_heads, head_dim, group, repeats):
    """Median seconds per build and the K/V bytes of one decode call."""
    pages_per_seq = -(-context // page_size)
    num_pages = batch * pages_per_seq
    pages = rng.standard_normal((num_pages + 1, 2, page_size, kv_heads, head_dim), dtype=np.float32).astype(dtype)
    indices = np.arange(1, num_pages + 1, dtype=np.int32)
    rng.shuffle(indices)
    table_args = ((np.arange(batch + 1) * pages_per_seq).astype(np.int32), indices,
                  np.tile(np.arange(pages_per_seq, dtype=np.int64) * page_size, batch),
                  np.full(batch, context, dtype=np.int64))
    q = rng.standard_normal((batch, kv_heads * group, head_dim), dtype=np.float32)
    tables = {name: module.StepTable(*table_args) for name, module in builds.items()}
    outs = {name: np.empty_like(q) for name in builds}
    times = {name: [] for name in builds}
    for name, module in builds.items():   # warm-up
        module.decode_step(q, pages, tables[name], None, 0.125, 1, outs[name])
    for r in range(repeats):
        for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
            start = time.perf_counter()
            builds[name].decode_step(q, pages, tables[name], None, 0.125, 1, outs[name])
            times[name].append(time.perf_counter() - start)
    same = np.array_equal(outs["this"], outs["other"])
    ratios = [o / t for t, o in zip(times["this"], times["other"], strict=True)]
    kv_bytes = batch * context * kv_heads * head_dim * 2 * np.dtype(dtype).itemsize
    return {name: statistics.median(ts) for name, ts in times.items()}, statistics.median(ratios), kv_bytes, same


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", required=True, help="path of the other build's _attention extension module")
    parser.add_argument("--repeats", type=int, default=15, help="paired calls per case (median)")
    parser.add_argument("--memory-mib", type=int, default=96, help="K/V of the from-memory cases, MiB")
    args = parser.parse_args()
    builds = {"this": _attention, "other": _load(args.other)}
    before = machine_info()
    rng = np.random.default_rng(0)
    rows = []
    for kv_heads, head_dim, group in SHAPES:
        for dtype in (np.float32, np.float16):
            row_bytes = kv_heads * head_dim * np.dtype(dtype).itemsize
            cached = 3 * 2**20 // row_bytes
            in_memory = args.memory_mib * 2**20 // row_bytes
            for where, batch, context, page_size in (("cache", 1, cached, 16), ("memory", 8, in_memory // 8, 16),
                                                     ("memory", 1, in_memory, 128)):
                medians, ratio, kv_bytes, same = _case(builds, rng, batch, context, page_size, dtype, kv_heads,
                                                       head_dim, group, args.repeats)
                rows.append([f"{kv_heads}x{head_dim}, {kv_heads * group} q heads", np.dtype(dtype).name, where,
                             batch, context, page_size,
                             f"{medians['this'] * 1e6:.0f}", f"{medians['other'] * 1e6:.0f}",
                             f"{kv_bytes / medians['this'] / 1e9:.1f}", f"{kv_bytes / medians['other'] / 1e9:.1f}",
                             f"{ratio:.2f}", same])
                print(" | ".join(str(c) for c in rows[-1]), flush=True)
    print(f"\nDecode attention, one thread, median of {args.repeats} paired calls; other: {args.other}; "
          f"kernels: {_attention.kernel_info()['isa']}")
    print(format_table(["KV heads x dim", "pages", "K/V in", "batch", "context", "page size", "this µs", "other µs",
                        "this GB/s", "other GB/s", "other / this (pairs)", "same bits"], rows))
    print(f"load average before {before['load_average']}, after {machine_info()['load_average']}")


if __name__ == "__main__":
    main()
