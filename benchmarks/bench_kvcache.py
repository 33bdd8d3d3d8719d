"""KVCache benchmark: one decode step (append + store per layer) and page-table export.

Decode step: B sequences each get one token; one ``append`` reserves the
slots, then one ``store`` per layer scatters K and V into the pool. The
store moves ``2 * B * Hkv * D * itemsize`` bytes per layer; it is compared
with ``np.copyto`` of the same bytes timed in the same run (the physical
limit: a scatter cannot beat a contiguous copy).

Export: ``page_table`` of B sequences (FlashInfer CSR plus first positions),
compared with what a Python block manager does: per-sequence lists of block
ids concatenated into the same CSR arrays with NumPy.

Run: python benchmarks/bench_kvcache.py [--quick]
"""
import argparse

import numpy as np

from _timing import compare, copyto_task, fmt_time, format_table, machine_info, write_json
from pagedkv import KVCache


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and layers (smoke run)")
    args = parser.parse_args()
    repeats = 5 if args.quick else 9
    layers = 4 if args.quick else 30

    step = decode_step_case(batch=64, num_layers=layers, num_kv_heads=8, head_dim=128, context=128,
                            page_size=16, repeats=repeats)
    export = export_case(batch=256, context=4096, page_size=16, repeats=repeats)

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
    path = write_json("bench_kvcache", {"machine": machine_info(), "decode_step": step, "export": export})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
