"""KVCache benchmark: one decode step (append + store per layer) and page-table export.

Decode step: B sequences each get one token; one ``append`` reserves the
slots, then one ``store`` per layer scatters K and V into the pool. The
store moves ``2 * B * Hkv * D * itemsize`` bytes per layer; it is compared
with ``np.copyto`` of the same bytes timed in the same run (the physical
limit: a scatter cannot beat a contiguous copy).

Export: ``page_table`` of B sequences (FlashInfer CSR plus first positions),
compared with what a Python block manager does: per-sequence lists of block
ids concatenated into the same CSR arrays with NumPy.

Page checksums: the same decode step on two caches built alike, one with
``page_checksums=True`` (each page's checksum is computed when the next
append seals it), timed in interleaved rounds of ``page_size`` steps so that
every round seals one page per sequence; once as append + store, once with
paged attention after each layer's store (a whole decode step but the
model's matrix products). Then ``verify_pages`` over every sealed page, in
GB/s, against a NumPy read-bandwidth probe on one thread
(``np.add.reduce`` of the pool's bytes as uint64). Everything in this part
runs on the calling thread, and it is timed in CPU seconds of that thread
(``time.thread_time``): on a shared machine, wall time would also count the
time the process waits for a core, which swamps a few-percent difference.

Run: python benchmarks/bench_kvcache.py [--quick] [--checksums-only]
"""
import argparse
import time

import numpy as np

from _timing import compare, copyto_task, fmt_time, format_table, machine_info, write_json
from pagedkv import KVCache, attention


def decode_step_case(batch, num_layers, num_kv_heads, head_dim, context, page_size, repeats, headroom=128):
    pages_per_seq = -(-(context + headroom) // page_size)
    cache = KVCache(num_layers, num_kv_heads, head_dim, num_pages=batch * pages_per_seq,
                    page_size=page_size, dtype=np.float16)
    # Touch the whole pool once, as a serving engine's warm pool is: first-touch
    # page faults are a start-up cost, not a per-step one.
    cache.kv.fill(0)
    seq_ids = np.arange(batch, dtype=np.int64)
    for seq_id in seq_ids.tolist():
        cache.add_sequence(seq_id)
    cache.append(seq_ids, np.full(batch, context, dtype=np.int64))
    ones = np.ones(batch, dtype=np.int64)
    rng = np.random.default_rng(0)
    k = [rng.standard_normal((batch, num_kv_heads, head_dim)).astype(np.float16) for _ in range(num_layers)]
    v = [rng.standard_normal((batch, num_kv_heads, head_dim)).astype(np.float16) for _ in range(num_layers)]
    slots = cache.append(seq_ids, ones)

    def step():
        # Each call adds one token per sequence; the pool has room for `headroom` more.
        s = cache.append(seq_ids, ones)
        for layer in range(num_layers):
            cache.store(layer, s, k[layer], v[layer])

    def append_only():
        cache.append(seq_ids, ones)

    def store_only():
        for layer in range(num_layers):
            cache.store(layer, slots, k[layer], v[layer])

    copy_all, nbytes = copyto_task(k + v)
    results = compare({"store": store_only, "copyto": copy_all}, repeats=repeats)
    steps = compare({"step": step, "append": append_only}, repeats=repeats, number=4)
    store_s = results["store"]["median"]
    copy_s = results["copyto"]["median"]
    return {
        "batch": batch,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "context": context,
        "page_size": page_size,
        "bytes_stored_per_step": nbytes,
        "step_s": steps["step"]["median"],
        "append_s": steps["append"]["median"],
        "store_all_layers_s": store_s,
        "copyto_same_bytes_s": copy_s,
        "store_gbps": nbytes / store_s / 1e9,
        "copyto_gbps": nbytes / copy_s / 1e9,
        "store_fraction_of_copyto": copy_s / store_s,
    }


def export_case(batch, context, page_size, repeats):
    cache = KVCache(1, 1, 8, num_pages=batch * (context // page_size + 1), page_size=page_size)
    seq_ids = np.arange(batch, dtype=np.int64)
    for seq_id in seq_ids.tolist():
        cache.add_sequence(seq_id)
    cache.append(seq_ids, np.full(batch, context, dtype=np.int64))
    view = cache.page_table(seq_ids)
    # The Python block manager's state: one list of block ids per sequence.
    block_lists = [view.indices[view.indptr[b]:view.indptr[b + 1]].tolist() for b in range(batch)]
    lengths = [context] * batch

    def python_export():
        indptr = np.zeros(batch + 1, dtype=np.int32)
        np.cumsum([len(blocks) for blocks in block_lists], out=indptr[1:])
        indices = np.array([p for blocks in block_lists for p in blocks], dtype=np.int32)
        positions = np.concatenate([np.arange(len(blocks), dtype=np.int64) * page_size for blocks in block_lists])
        last = np.array([(n - 1) % page_size + 1 for n in lengths], dtype=np.int32)
        return indptr, indices, positions, last

    got = python_export()
    assert np.array_equal(got[0], view.indptr) and np.array_equal(got[1], view.indices)
    assert np.array_equal(got[2], view.page_positions) and np.array_equal(got[3], view.last_page_len)
    results = compare({"page_table": lambda: cache.page_table(seq_ids), "python": python_export},
                      repeats=repeats)
    return {
        "batch": batch,
        "context": context,
        "page_size": page_size,
        "nnz": int(view.indices.size),
        "page_table_s": results["page_table"]["median"],
        "python_lists_s": results["python"]["median"],
        "speedup": results["python"]["median"] / results["page_table"]["median"],
    }


def checksum_case(batch, num_layers, num_kv_heads, num_q_heads, head_dim, context, page_size, repeats):
    """Decode step with page_checksums on and off, and the verify_pages scan rate."""
    steps = 2 * repeats * page_size + 2 * page_size  # two comparisons plus the warm-up
    pages_per_seq = -(-(context + page_size + steps) // page_size)
    rng = np.random.default_rng(1)
    seq_ids = np.arange(batch, dtype=np.int64)
    ones = np.ones(batch, dtype=np.int64)
    k = [rng.standard_normal((batch, num_kv_heads, head_dim)).astype(np.float16) for _ in range(num_layers)]
    v = [rng.standard_normal((batch, num_kv_heads, head_dim)).astype(np.float16) for _ in range(num_layers)]
    q = rng.standard_normal((batch, num_q_heads, head_dim)).astype(np.float32)
    caches = {}
    for name, checksums in (("off", False), ("on", True)):
        cache = KVCache(num_layers, num_kv_heads, head_dim, num_pages=batch * pages_per_seq, page_size=page_size,
                        dtype=np.float16, page_checksums=checksums)
        cache.kv.fill(0)  # first-touch page faults are a start-up cost
        for seq_id in seq_ids.tolist():
            cache.add_sequence(seq_id)
        # Lengths differ by up to a page, as in serving: each step seals about batch / page_size pages.
        prompt = context + (seq_ids % page_size)
        slots = cache.append(seq_ids, prompt)
        for layer in range(num_layers):
            cache.store(layer, slots, rng.standard_normal((slots.size, num_kv_heads, head_dim)),
                        rng.standard_normal((slots.size, num_kv_heads, head_dim)))
        cache.seal()  # the prompt's pages: sealed once, outside the timed steps
        caches[name] = cache

    def step_of(cache, with_attention):
        def step():
            s = cache.append(seq_ids, ones)
            for layer in range(num_layers):
                cache.store(layer, s, k[layer], v[layer])
                if with_attention:
                    attention.decode(q, cache, layer, seq_ids, num_threads=1)
        return step

    for cache in caches.values():  # warm-up: one page of steps each
        for _ in range(page_size):
            step_of(cache, False)()
    store_only = compare({name: step_of(c, False) for name, c in caches.items()}, repeats=repeats,
                         number=page_size, clock=time.thread_time)
    with_attention = compare({name: step_of(c, True) for name, c in caches.items()}, repeats=repeats,
                             number=page_size, clock=time.thread_time)
    checked = caches["on"]
    assert not checked.verify_pages(), "a page changed after its seal"
    bytes_per_page = checked.stats()["bytes_per_page"]
    pool_words = checked.kv.reshape(-1).view(np.uint64)
    scan = compare({"verify_pages": checked.verify_pages, "numpy": lambda: np.add.reduce(pool_words)},
                   repeats=repeats, number=1, clock=time.thread_time)
    num_sealed = checked.verify_pages().num_pages_checked
    verify_gbps = num_sealed * bytes_per_page / scan["verify_pages"]["median"] / 1e9
    numpy_gbps = checked.kv.nbytes / scan["numpy"]["median"] / 1e9
    return {
        "batch": batch,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "num_q_heads": num_q_heads,
        "head_dim": head_dim,
        "context": context,
        "page_size": page_size,
        "step_off_s": store_only["off"]["median"],
        "step_on_s": store_only["on"]["median"],
        "step_overhead": store_only["on"]["median"] / store_only["off"]["median"] - 1,
        "attention_step_off_s": with_attention["off"]["median"],
        "attention_step_on_s": with_attention["on"]["median"],
        "attention_step_overhead": with_attention["on"]["median"] / with_attention["off"]["median"] - 1,
        "verify_pages_checked": num_sealed,
        "verify_bytes": num_sealed * bytes_per_page,
        "verify_s": scan["verify_pages"]["median"],
        "verify_gbps": verify_gbps,
        "numpy_read_gbps": numpy_gbps,
        "verify_fraction_of_numpy": verify_gbps / numpy_gbps,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and layers (smoke run)")
    parser.add_argument("--checksums-only", action="store_true",
                        help="run only the page-checksum comparison (about 1 GB of pools instead of 3)")
    args = parser.parse_args()
    repeats = 5 if args.quick else 9
    layers = 4 if args.quick else 30

    step = export = None
    if not args.checksums_only:
        step = decode_step_case(batch=64, num_layers=layers, num_kv_heads=8, head_dim=128, context=128,
                                page_size=16, repeats=repeats)
        export = export_case(batch=256, context=4096, page_size=16, repeats=repeats)
    # SmolLM2-135M's attention geometry: 30 layers, 3 KV heads, 9 query heads, head dim 64.
    checks = checksum_case(batch=32, num_layers=layers, num_kv_heads=3, num_q_heads=9, head_dim=64,
                           context=256, page_size=16, repeats=repeats)

    if step is not None:
        print(f"Decode step, B={step['batch']}, {step['num_layers']} layers, Hkv={step['num_kv_heads']}, "
              f"D={step['head_dim']}, float16, page size {step['page_size']}, context {step['context']}")
        print(format_table(
            ["step (append + store x layers)", "append", "store, all layers", "np.copyto, same bytes",
             "store GB/s", "copyto GB/s", "store / copyto"],
            [[fmt_time(step["step_s"]), fmt_time(step["append_s"]), fmt_time(step["store_all_layers_s"]),
              fmt_time(step["copyto_same_bytes_s"]), f"{step['store_gbps']:.1f}", f"{step['copyto_gbps']:.1f}",
              f"{step['store_fraction_of_copyto']:.0%}"]],
        ))
        print()
        print(f"page_table export, B={export['batch']} sequences of {export['context']} tokens "
              f"({export['nnz']} pages)")
        print(format_table(
            ["page_table", "Python block lists -> CSR", "speedup"],
            [[fmt_time(export["page_table_s"]), fmt_time(export["python_lists_s"]), f"{export['speedup']:.1f}x"]],
        ))
    print()
    print(f"Page checksums, B={checks['batch']}, {checks['num_layers']} layers, Hkv={checks['num_kv_heads']}, "
          f"Hq={checks['num_q_heads']}, D={checks['head_dim']}, float16, page size {checks['page_size']}, "
          f"context {checks['context']}+; attention on one thread; CPU time of the calling thread")
    print(format_table(
        ["decode step", "page_checksums=False", "page_checksums=True", "overhead"],
        [["append + store x layers", fmt_time(checks["step_off_s"]), fmt_time(checks["step_on_s"]),
          f"{checks['step_overhead']:+.1%}"],
         ["append + (store + attention) x layers", fmt_time(checks["attention_step_off_s"]),
          fmt_time(checks["attention_step_on_s"]), f"{checks['attention_step_overhead']:+.1%}"]],
    ))
    print(format_table(
        ["verify_pages", "pages", "GB/s", "np.add.reduce GB/s (pool, one thread)", "verify / numpy"],
        [[fmt_time(checks["verify_s"]), str(checks["verify_pages_checked"]), f"{checks['verify_gbps']:.1f}",
          f"{checks['numpy_read_gbps']:.1f}", f"{checks['verify_fraction_of_numpy']:.0%}"]],
    ))
    path = write_json("bench_kvcache", {"machine": machine_info(), "decode_step": step, "export": export,
                                        "page_checksums": checks})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
