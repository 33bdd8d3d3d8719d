"""Paged attention benchmark: decode over float16 and float32 pools.

Decode with B=16 sequences, Hq=32 query heads, Hkv=8 KV heads, head_dim=128,
page size 16, contexts 512 / 4096 / 16384 tokens. Every figure is timed in
the same run, interleaved round by round with its baselines (median of the
rounds):

- ``pagedkv`` decode with 1 and 2 OpenMP threads: microseconds per call and
  achieved K/V read bandwidth (bytes of the cached K and V rows / time);
- NumPy read-bandwidth probe: ``np.max`` over a float32 array with as many
  bytes as the call reads (streams memory at the rate one core can read);
- NumPy dense reference: gather each sequence's pages with fancy indexing,
  then ``np.einsum`` scores, softmax, ``np.einsum`` with V (float32);
- ``torch.nn.functional.scaled_dot_product_attention`` (when torch is
  installed) on dense contiguous K/V tensors ``[B, Hkv, context, D]`` of the
  pool dtype with ``enable_gqa=True``, at the same thread count;
- windowed decode: context 16384 with window 1024 against full attention
  over context 1024 (cost should follow the window, not the length);
- arithmetic ceiling: the 16 sequences are forks of one short sequence that
  share its pages (512 KiB of K/V, resident in the core's L2), so the rate
  at which decode consumes K/V there is what the arithmetic allows when
  memory costs nothing;
- one sequence (SmolLM2-135M's attention: Hq=9, Hkv=3, head_dim=64, float32
  pool) at contexts 4096 and 16384 (``--quick``: 4096), the split decode
  (partitions of the sequence's pages merged by log-sum-exp) against the
  same kernel without the split (one work item per KV-head block), on 1
  and 2 threads, and torch SDPA on the same K/V;
- page formats: decode over pools of float16, bfloat16, int8 and int4 pages
  (B=4, Hq=32, Hkv=8: GQA 4; head_dim 128 and 64; contexts 4096 and 16384,
  ``--quick``: 4096), on 1 thread, each format's median against float16's
  from the same rounds, and GB/s of page bytes read (every attended row,
  scales included) against the read-bandwidth probe over float16's byte
  count. The pools are encoded with the NumPy oracle of the formats
  (tests/reference_formats.py), so this part needs a checkout.

Writes benchmarks/results/bench_attention.json and prints a table.

Run: python benchmarks/bench_attention.py [--quick] [--repeats N] [--formats-only]
"""
import argparse
import json
import os
import platform
from pathlib import Path

import numpy as np

from _timing import compare
from pagedkv import KVCache, attention

BATCH, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 16, 32, 8, 128, 16
# Page formats: a smaller batch, as the oracle encodes the pools in NumPy.
FORMAT_BATCH = 4
FORMATS = ("float16", "bfloat16", "int8", "int4")
FORMAT_POOL_DTYPES = {"float16": np.float16, "bfloat16": np.uint16, "int8": np.uint8, "int4": np.uint8}


def interleaved_medians(tasks, repeats, min_seconds=0.05):
    """Median seconds per call of each task, timing the tasks in turn each round.

    Interleaving (``_timing.compare``) keeps a slow phase of a shared machine
    from landing on one task only. Also returns ``<name>_min``, the fastest
    round, for the JSON.
    """
    stats = compare(tasks, repeats=repeats, min_seconds=min_seconds)
    medians = {name: s["median"] for name, s in stats.items()}
    medians.update({f"{name}_min": s["min"] for name, s in stats.items()})
    return medians


def fill_random(cache, rng):
    """Random K/V in every page of the pool (layer 0), written in blocks to bound memory."""
    pool = cache.kv[0]
    for start in range(0, pool.shape[0], 256):
        block = pool[start:start + 256]
        block[...] = rng.standard_normal(block.shape, dtype=np.float32).astype(pool.dtype)


def build_cache(context, dtype, window=None, seed=0):
    """A KVCache of BATCH sequences of ``context`` tokens, appended as a server does.

    The sequences grow round-robin one page at a time, so their pages
    interleave in the pool as they do under batched serving; with a window
    the ring releases and reuses pages along the way.
    """
    pages_per_seq = -(-context // PAGE_SIZE)
    if window is not None:
        pages_per_seq = -(-(window - 1) // PAGE_SIZE) + 2
    cache = KVCache(1, NUM_KV_HEADS, HEAD_DIM, BATCH * pages_per_seq, page_size=PAGE_SIZE, dtype=dtype,
                    window=window)
    seq_ids = np.arange(BATCH)
    for seq_id in range(BATCH):
        cache.add_sequence(seq_id)
    for start in range(0, context, PAGE_SIZE):
        cache.append(seq_ids, np.full(BATCH, min(PAGE_SIZE, context - start)))
    fill_random(cache, np.random.default_rng(seed))
    return cache


def kv_bytes(cache, seq_ids):
    """Bytes of K and V a decode call reads: every attended cached row, once."""
    view = cache.page_table(seq_ids)
    tokens = 0
    for b, seq_len in enumerate(view.seq_lens.tolist()):
        lo = 0 if cache.window is None else max(0, seq_len - cache.window)
        tokens += seq_len - lo
    return tokens * NUM_KV_HEADS * HEAD_DIM * 2 * cache.kv.itemsize


def numpy_reference(cache, q, seq_ids):
    """Dense NumPy decode: gather the pages of each sequence, then einsum/softmax/einsum."""
    view = cache.page_table(seq_ids)
    group = NUM_QO_HEADS // NUM_KV_HEADS
    scale = 1.0 / np.sqrt(HEAD_DIM)
    out = np.empty((len(seq_ids), NUM_QO_HEADS, HEAD_DIM), np.float32)
    pool = cache.kv[0]
    for b in range(len(seq_ids)):
        pages = view.indices[view.indptr[b]:view.indptr[b + 1]]
        n = int(view.seq_lens[b])
        k = pool[pages, 0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].astype(np.float32)
        v = pool[pages, 1].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].astype(np.float32)
        qh = q[b].reshape(NUM_KV_HEADS, group, HEAD_DIM)
        scores = np.einsum("hgd,nhd->hgn", qh, k) * scale
        scores -= scores.max(axis=-1, keepdims=True)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        out[b] = np.einsum("hgn,nhd->hgd", weights, v).reshape(NUM_QO_HEADS, HEAD_DIM)
    return out


def torch_task(cache, q, seq_ids, threads):
    """SDPA on dense contiguous K/V of the same length, or None without torch."""
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        return None, None
    view = cache.page_table(seq_ids)
    pool = cache.kv[0]
    ks, vs = [], []
    for b in range(len(seq_ids)):
        pages = view.indices[view.indptr[b]:view.indptr[b + 1]]
        n = int(view.seq_lens[b])
        ks.append(pool[pages, 0].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].transpose(1, 0, 2))
        vs.append(pool[pages, 1].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:n].transpose(1, 0, 2))
    k = torch.from_numpy(np.ascontiguousarray(np.stack(ks)))  # [B, Hkv, L, D]
    v = torch.from_numpy(np.ascontiguousarray(np.stack(vs)))
    tq = torch.from_numpy(q[:, :, None, :].astype(cache.kv.dtype))  # [B, Hq, 1, D]

    def run():
        torch.set_num_threads(threads)
        with torch.inference_mode():
            return F.scaled_dot_product_attention(tq, k, v, enable_gqa=True)

    return run, torch.__version__


def decode_case(context, dtype, repeats, thread_counts):
    cache = build_cache(context, dtype)
    seq_ids = list(range(BATCH))
    q = np.random.default_rng(1).standard_normal((BATCH, NUM_QO_HEADS, HEAD_DIM), dtype=np.float32)
    nbytes = kv_bytes(cache, seq_ids)
    probe = np.ones(nbytes // 4, np.float32)

    # Correctness guard: the figures below are only worth something if the
    # kernel agrees with the reference it is compared with.
    got = attention.decode(q, cache, 0, seq_ids)
    want = numpy_reference(cache, q, seq_ids)
    max_err = float(np.abs(got - want).max())
    assert max_err < 1e-4, f"decode disagrees with the NumPy reference: {max_err}"

    tasks = {"probe": lambda: probe.max()}
    for t in thread_counts:
        tasks[f"pagedkv_{t}t"] = lambda t=t: attention.decode(q, cache, 0, seq_ids, num_threads=t)
    torch_version = None
    for t in thread_counts:
        run, torch_version = torch_task(cache, q, seq_ids, t)
        if run is not None:
            tasks[f"torch_{t}t"] = run
    medians = interleaved_medians(tasks, repeats)
    # The dense reference is slow; time it apart, fewer calls per round.
    medians.update(interleaved_medians({"numpy_ref": lambda: numpy_reference(cache, q, seq_ids)},
                                       repeats, min_seconds=0.0))
    del cache, probe

    row = {
        "dtype": np.dtype(dtype).name,
        "context": context,
        "kv_bytes": nbytes,
        "max_abs_err_vs_numpy": max_err,
        "seconds": medians,
        "probe_gbs": nbytes / medians["probe"] / 1e9,
        "numpy_ref_ms": medians["numpy_ref"] * 1e3,
        "torch_version": torch_version,
    }
    for t in thread_counts:
        s = medians[f"pagedkv_{t}t"]
        row[f"us_{t}t"] = s * 1e6
        row[f"gbs_{t}t"] = nbytes / s / 1e9
        row[f"frac_probe_{t}t"] = medians["probe"] / s
        row[f"speedup_vs_numpy_{t}t"] = medians["numpy_ref"] / s
        if f"torch_{t}t" in medians:
            row[f"torch_over_pagedkv_{t}t"] = medians[f"torch_{t}t"] / s
    return row


class _FormatPool:
    """One layer of pages in one page format with the attention contract (``kv_dtype`` set).

    Sequence b holds pages b, b + B, b + 2B, ... (interleaved, as sequences
    that grow round-robin place them).
    """

    def __init__(self, kv, fmt, head_dim, page_table):
        self.kv = kv
        self.kv_dtype = fmt
        self.num_layers, self.num_kv_heads, self.head_dim, self.page_size = 1, NUM_KV_HEADS, head_dim, PAGE_SIZE
        self.window, self.sink_tokens, self.chunk_size = None, 0, None
        self._view = page_table

    def page_table(self, seq_ids):
        return self._view


def format_pools(context, head_dim, seed=5):
    """{format: _FormatPool} of the same random K/V, encoded block by block (bounded memory)."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import reference_formats as rf
    from types import SimpleNamespace

    pages_per_seq = context // PAGE_SIZE
    num_pages = FORMAT_BATCH * pages_per_seq
    rng = np.random.default_rng(seed)
    pools = {fmt: np.empty((1, num_pages, 2, PAGE_SIZE, NUM_KV_HEADS, rf.row_bytes(fmt, head_dim)),
                           np.uint8).view(FORMAT_POOL_DTYPES[fmt]) for fmt in FORMATS}
    for start in range(0, num_pages, 256):
        block = rng.standard_normal((min(256, num_pages - start), 2, PAGE_SIZE, NUM_KV_HEADS, head_dim),
                                    dtype=np.float32)
        for fmt in FORMATS:
            pools[fmt][0, start:start + len(block)] = rf.encode(block, fmt).view(FORMAT_POOL_DTYPES[fmt])
    indices = (np.arange(pages_per_seq)[None, :] * FORMAT_BATCH + np.arange(FORMAT_BATCH)[:, None])
    view = SimpleNamespace(
        indptr=(np.arange(FORMAT_BATCH + 1) * pages_per_seq).astype(np.int32),
        indices=indices.reshape(-1).astype(np.int32),
        page_positions=np.tile(np.arange(pages_per_seq) * PAGE_SIZE, FORMAT_BATCH).astype(np.int64),
        seq_lens=np.full(FORMAT_BATCH, context, np.int64))
    row_bytes = {fmt: rf.row_bytes(fmt, head_dim) for fmt in FORMATS}
    return {fmt: _FormatPool(pools[fmt], fmt, head_dim, view) for fmt in FORMATS}, row_bytes


def format_case(context, head_dim, repeats):
    """Decode over each page format on 1 thread, interleaved with float16 and the probe."""
    pools, row_bytes = format_pools(context, head_dim)
    seq_ids = list(range(FORMAT_BATCH))
    q = np.random.default_rng(6).standard_normal((FORMAT_BATCH, NUM_QO_HEADS, head_dim), dtype=np.float32)
    # bytes read: every cached row of K and V, once
    nbytes = {fmt: FORMAT_BATCH * context * NUM_KV_HEADS * 2 * row_bytes[fmt] for fmt in FORMATS}
    probe = np.ones(nbytes["float16"] // 4, np.float32)
    tasks = {"probe": lambda: probe.max()}
    for fmt in FORMATS:
        tasks[fmt] = lambda fmt=fmt: attention.decode(q, pools[fmt], 0, seq_ids, num_threads=1)
    medians = interleaved_medians(tasks, repeats)
    row = {"context": context, "head_dim": head_dim, "seconds": medians,
           "probe_gbs": nbytes["float16"] / medians["probe"] / 1e9}
    for fmt in FORMATS:
        row[f"us_{fmt}"] = medians[fmt] * 1e6
        row[f"bytes_{fmt}"] = nbytes[fmt]
        row[f"gbs_{fmt}"] = nbytes[fmt] / medians[fmt] / 1e9
        row[f"speed_vs_float16_{fmt}"] = medians["float16"] / medians[fmt]
    del pools, probe
    return row


def print_formats(formats):
    print(f"| page format decode, B={FORMAT_BATCH} Hq={NUM_QO_HEADS} Hkv={NUM_KV_HEADS}, 1 thread "
          "| head_dim | context | us | speed vs float16 | GB/s of pages | probe GB/s |")
    print("|" + "|".join(["---"] * 7) + "|")
    for r in formats:
        for fmt in FORMATS:
            print(f"| {fmt} | {r['head_dim']} | {r['context']} | {r[f'us_{fmt}']:.0f} "
                  f"| {r[f'speed_vs_float16_{fmt}']:.2f}x | {r[f'gbs_{fmt}']:.1f} | {r['probe_gbs']:.1f} |")


def window_case(dtype, repeats, window=1024, long_context=16384):
    seq_ids = list(range(BATCH))
    q = np.random.default_rng(2).standard_normal((BATCH, NUM_QO_HEADS, HEAD_DIM), dtype=np.float32)
    windowed = build_cache(long_context, dtype, window=window, seed=3)
    full = build_cache(window, dtype, seed=4)
    medians = interleaved_medians({
        "windowed": lambda: attention.decode(q, windowed, 0, seq_ids, num_threads=1),
        "full": lambda: attention.decode(q, full, 0, seq_ids, num_threads=1),
    }, repeats)
    return {
        "dtype": np.dtype(dtype).name,
        "window": window,
        "long_context": long_context,
        "us_windowed": medians["windowed"] * 1e6,
        "us_full_window_length": medians["full"] * 1e6,
        "ratio": medians["windowed"] / medians["full"],
    }


def hot_case(dtype, repeats):
    """Decode over 16 forks sharing one sequence's pages (K/V stays in L2)."""
    context = 512 * 1024 // (NUM_KV_HEADS * HEAD_DIM * 2 * np.dtype(dtype).itemsize)
    cache = KVCache(1, NUM_KV_HEADS, HEAD_DIM, -(-context // PAGE_SIZE), page_size=PAGE_SIZE, dtype=dtype)
    cache.add_sequence(0)
    cache.append([0], [context])
    fill_random(cache, np.random.default_rng(5))
    for seq_id in range(1, BATCH):
        cache.fork(0, seq_id)
    seq_ids = list(range(BATCH))
    q = np.random.default_rng(6).standard_normal((BATCH, NUM_QO_HEADS, HEAD_DIM), dtype=np.float32)
    nbytes = kv_bytes(cache, seq_ids)
    medians = interleaved_medians({
        "hot": lambda: attention.decode(q, cache, 0, seq_ids, num_threads=1)}, repeats)
    return {"dtype": np.dtype(dtype).name, "context": context, "kv_bytes": nbytes,
            "us": medians["hot"] * 1e6, "gbs": nbytes / medians["hot"] / 1e9}


SINGLE_QO_HEADS, SINGLE_KV_HEADS, SINGLE_HEAD_DIM = 9, 3, 64


def single_sequence_case(context, repeats, thread_counts):
    """One sequence of SmolLM2's attention shape: split decode against the unsplit kernel."""
    from pagedkv_c import _attention

    cache = KVCache(1, SINGLE_KV_HEADS, SINGLE_HEAD_DIM, -(-context // PAGE_SIZE), page_size=PAGE_SIZE,
                    dtype=np.float32)
    cache.add_sequence(0)
    cache.append([0], [context])
    fill_random(cache, np.random.default_rng(7))
    q = np.random.default_rng(8).standard_normal((1, SINGLE_QO_HEADS, SINGLE_HEAD_DIM), dtype=np.float32)
    nbytes = context * SINGLE_KV_HEADS * SINGLE_HEAD_DIM * 2 * 4

    def unsplit(t):
        previous = _attention._set_decode_partition(0)
        try:
            return attention.decode(q, cache, 0, [0], num_threads=t)
        finally:
            _attention._set_decode_partition(previous)

    split_out, unsplit_out = attention.decode(q, cache, 0, [0]), unsplit(1)
    max_diff = float(np.abs(split_out - unsplit_out).max())
    assert max_diff < 1e-5, f"split decode disagrees with the unsplit kernel: {max_diff}"

    tasks = {}
    for t in thread_counts:
        tasks[f"split_{t}t"] = lambda t=t: attention.decode(q, cache, 0, [0], num_threads=t)
        tasks[f"unsplit_{t}t"] = lambda t=t: unsplit(t)
    view = cache.page_table([0])
    pool = cache.kv[0]
    pages = view.indices
    k = pool[pages, 0].reshape(-1, SINGLE_KV_HEADS, SINGLE_HEAD_DIM)[:context].transpose(1, 0, 2)
    v = pool[pages, 1].reshape(-1, SINGLE_KV_HEADS, SINGLE_HEAD_DIM)[:context].transpose(1, 0, 2)
    try:
        import torch
        import torch.nn.functional as F

        tk = torch.from_numpy(np.ascontiguousarray(k)[None])
        tv = torch.from_numpy(np.ascontiguousarray(v)[None])
        tq = torch.from_numpy(q[:, :, None, :])
        for t in thread_counts:
            def run(t=t):
                torch.set_num_threads(t)
                with torch.inference_mode():
                    return F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
            tasks[f"torch_{t}t"] = run
    except ImportError:
        pass
    medians = interleaved_medians(tasks, repeats)
    row = {"context": context, "kv_bytes": nbytes, "max_abs_diff_split_vs_unsplit": max_diff,
           "seconds": medians}
    for t in thread_counts:
        row[f"us_split_{t}t"] = medians[f"split_{t}t"] * 1e6
        row[f"us_unsplit_{t}t"] = medians[f"unsplit_{t}t"] * 1e6
        row[f"split_speedup_{t}t"] = medians[f"unsplit_{t}t"] / medians[f"split_{t}t"]
        if f"torch_{t}t" in medians:
            row[f"torch_over_split_{t}t"] = medians[f"torch_{t}t"] / medians[f"split_{t}t"]
    return row


def _ratio_cell(row, key):
    """``row[key]`` as a table cell ``1.23x``, or ``n/a`` when the row has no such ratio (torch absent)."""
    return f"{row[key]:.2f}x" if key in row else "n/a"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="contexts 512 and 4096 only, 5 rounds")
    parser.add_argument("--repeats", type=int, default=7, help="rounds per figure (median; >= 5)")
    parser.add_argument("--formats-only", action="store_true",
                        help="only the page-format comparison (writes bench_attention_formats.json)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).resolve().parent / "results" / "bench_attention.json")
    args = parser.parse_args()
    repeats = 5 if args.quick else max(5, args.repeats)
    contexts = [512, 4096] if args.quick else [512, 4096, 16384]
    thread_counts = [1, 2]
    load_before = os.getloadavg()
    format_contexts = [4096] if args.quick else [4096, 16384]
    formats = [format_case(c, d, repeats) for d in (128, 64) for c in format_contexts]
    if args.formats_only:
        info = attention.kernel_info()
        print(f"kernel {info['isa']}, int8 scores {info['int8_scores']}; medians of {repeats} rounds; "
              f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
        print_formats(formats)
        out = args.out.with_name("bench_attention_formats.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({
            "benchmark": "bench_attention --formats-only", "repeats": repeats, "kernel_info": info,
            "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                        "load_average_before": load_before, "load_average_after": os.getloadavg()},
            "formats": formats}, indent=2))
        print(f"\nwrote {out}")
        return

    rows = [decode_case(c, dtype, repeats, thread_counts)
            for dtype in (np.float16, np.float32) for c in contexts]
    windows = [window_case(dtype, repeats) for dtype in (np.float16, np.float32)]
    hot = [hot_case(dtype, repeats) for dtype in (np.float16, np.float32)]
    single = [single_sequence_case(c, repeats, thread_counts) for c in ([4096] if args.quick else [4096, 16384])]

    info = attention.kernel_info()
    print(f"pagedkv decode, B={BATCH} Hq={NUM_QO_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} "
          f"page_size={PAGE_SIZE}; kernel {info['isa']}, OpenMP {info['openmp']}; "
          f"medians of {repeats} rounds; load average {load_before[0]:.1f} on {os.cpu_count()} CPUs")
    header = ("| pool | context | us 1T | us 2T | GB/s 1T | probe GB/s | 1T/probe | 2T speedup "
              "| NumPy ref ms | vs NumPy 1T | torch/pagedkv 1T | torch/pagedkv 2T |")
    print(header)
    print("|" + "|".join(["---"] * 12) + "|")
    for r in rows:
        torch1 = _ratio_cell(r, "torch_over_pagedkv_1t")
        torch2 = _ratio_cell(r, "torch_over_pagedkv_2t")
        print(f"| {r['dtype']} | {r['context']} | {r['us_1t']:.0f} | {r['us_2t']:.0f} "
              f"| {r['gbs_1t']:.1f} | {r['probe_gbs']:.1f} | {100 * r['frac_probe_1t']:.0f}% "
              f"| {r['us_1t'] / r['us_2t']:.2f}x | {r['numpy_ref_ms']:.1f} "
              f"| {r['speedup_vs_numpy_1t']:.1f}x | {torch1} | {torch2} |")
    print()
    print("| pool | windowed: context 16384, window 1024 | full: context 1024 | ratio |")
    print("|---|---|---|---|")
    for w in windows:
        print(f"| {w['dtype']} | {w['us_windowed']:.0f} us | {w['us_full_window_length']:.0f} us "
              f"| {w['ratio']:.2f} |")
    print()
    print("| pool | L2-resident K/V (arithmetic ceiling, 1 thread) |")
    print("|---|---|")
    for h in hot:
        print(f"| {h['dtype']} | {h['gbs']:.1f} GB/s ({h['us']:.0f} us per call, 16 x 512 KiB) |")

    print()
    print(f"| one sequence, Hq={SINGLE_QO_HEADS} Hkv={SINGLE_KV_HEADS} D={SINGLE_HEAD_DIM} float32 | unsplit 1T "
          "| split 1T | split speedup 1T | unsplit 2T | split 2T | split speedup 2T | torch/split 1T | torch/split 2T |")
    print("|" + "|".join(["---"] * 9) + "|")
    for r in single:
        torch1 = _ratio_cell(r, "torch_over_split_1t")
        torch2 = _ratio_cell(r, "torch_over_split_2t")
        print(f"| context {r['context']} | {r['us_unsplit_1t']:.0f} us | {r['us_split_1t']:.0f} us "
              f"| {r['split_speedup_1t']:.2f}x | {r['us_unsplit_2t']:.0f} us | {r['us_split_2t']:.0f} us "
              f"| {r['split_speedup_2t']:.2f}x | {torch1} | {torch2} |")
    print()
    print_formats(formats)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "bench_attention",
        "shape": {"batch": BATCH, "num_qo_heads": NUM_QO_HEADS, "num_kv_heads": NUM_KV_HEADS,
                  "head_dim": HEAD_DIM, "page_size": PAGE_SIZE},
        "repeats": repeats,
        "kernel_info": info,
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(),
                    "load_average_before": load_before, "load_average_after": os.getloadavg()},
        "decode": rows,
        "window": windows,
        "l2_resident": hot,
        "single_sequence": single,
        "page_formats": formats,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
