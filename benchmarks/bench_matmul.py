"""Weight products of a SmolLM2-135M decode step: the small-batch kernel against BLAS call shapes.

For each product of a decode step (hidden 576, intermediate 1536, vocabulary 49152) and
each row count M of ``--rows``, on one thread (threadpoolctl), the candidates take
turns ``--repeats`` times and the medians of their thread CPU time per product are
printed with the median of the per-round ratio to the first candidate:

* ``numpy x @ W``: NumPy's BLAS on ``[in, out]`` C-contiguous weights (the model
  before the kernel); ``x @ E.T`` for the output projection ``E`` ``[vocab, hidden]``;
* ``numpy x @ WT.T``: NumPy's BLAS on the ``[out, in]`` weights the loader keeps now
  (what products of more than ``LlamaModel.kernel_max_rows`` rows run);
* ``kernel``: ``pagedkv_c._matmul.matmul(x, WT, transpose_w=True)``;
* with ``--libraries``, when they are importable: SciPy's ``sgemm`` and the BLIS wheel
  (``pip install blis``) on both layouts.

Every candidate's result is checked against float64 NumPy first. Each matrix is
copied until ``--bytes`` of weights are in play, and a round multiplies by every copy,
so every call reads its weights from memory, not from a cache. Thread CPU time
ignores the time the thread waits for a core (the machine may be shared); it does not
remove other processes' use of the memory bus.

Example::

    python benchmarks/bench_matmul.py --rows 1 4 16 64 --repeats 7
"""
import argparse
import statistics
import time

import numpy as np
from threadpoolctl import threadpool_limits

from _timing import format_table, machine_info
from pagedkv_c import _matmul

PRODUCTS = {  # name: (in, out)
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "output": (576, 49152),
}


def library_candidates(x, weights_io, weights_oi):
    """Optional candidates: SciPy's sgemm and BLIS, on both layouts, if importable."""
    found = {}
    try:
        import scipy.linalg.blas as sblas
    except ImportError:
        pass
    else:
        found["scipy sgemm(W.T, x.T)"] = lambda: [sblas.sgemm(1.0, w.T, x.T) for w in weights_io]
        found["scipy sgemm(WT.T, x.T, trans_a)"] = lambda: [sblas.sgemm(1.0, w.T, x.T, trans_a=True)
                                                            for w in weights_oi]
    try:
        import blis.py
    except ImportError:
        pass
    else:
        out = np.zeros((x.shape[0], weights_oi[0].shape[0]), np.float32)
        found["blis x @ W"] = lambda: [blis.py.gemm(x, w, out=out, beta=0.0) for w in weights_io]
        found["blis x @ WT.T"] = lambda: [blis.py.gemm(x, w, out=out, trans2=True, beta=0.0) for w in weights_oi]
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="rows M of x")
    parser.add_argument("--repeats", type=int, default=7, help="rounds per candidate")
    parser.add_argument("--bytes", type=float, default=150e6, help="bytes of weight copies per product")
    parser.add_argument("--products", nargs="+", default=list(PRODUCTS), choices=list(PRODUCTS))
    parser.add_argument("--libraries", action="store_true", help="also SciPy's sgemm and BLIS if importable")
    args = parser.parse_args()
    print(f"kernel: {_matmul.kernel_info()}; load average {machine_info()['load_average']}")
    rng = np.random.default_rng(0)
    rows = []
    with threadpool_limits(1):
        for name in args.products:
            k, n = PRODUCTS[name]
            copies = max(1, int(args.bytes // (k * n * 4)))
            weights_oi = [rng.standard_normal((n, k), dtype=np.float32) for _ in range(copies)]
            weights_io = [np.ascontiguousarray(w.T) for w in weights_oi]
            for m in args.rows:
                x = rng.standard_normal((m, k), dtype=np.float32)
                if name == "output":  # the model multiplied by E.T before, too
                    before = lambda: [x @ w.T for w in weights_oi]  # noqa: E731
                else:
                    before = lambda: [x @ w for w in weights_io]  # noqa: E731
                candidates = {
                    "numpy x @ W": before,
                    "numpy x @ WT.T": lambda: [x @ w.T for w in weights_oi],
                    "kernel": lambda: [_matmul.matmul(x, w, transpose_w=True) for w in weights_oi],
                }
                if args.libraries:
                    candidates.update(library_candidates(x, weights_io, weights_oi))
                want = x.astype(np.float64) @ weights_io[-1].astype(np.float64)
                for label, fn in candidates.items():
                    got = np.asarray(fn()[-1])
                    got = got.T if got.shape != want.shape else got
                    if not np.allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max()):
                        raise SystemExit(f"{label} computed a wrong product for {name}, M={m}")
                times = {label: [] for label in candidates}
                labels = list(candidates)
                for repeat in range(args.repeats):
                    for label in labels[repeat % len(labels):] + labels[:repeat % len(labels)]:
                        start = time.thread_time()
                        candidates[label]()
                        times[label].append((time.thread_time() - start) / copies)
                base = times[labels[0]]
                for label, t in times.items():
                    seconds = statistics.median(t)
                    rows.append([name, m, label, f"{seconds * 1e6:.0f} us", f"{k * n * 4 / seconds / 1e9:.1f} GB/s",
                                 f"{2 * m * k * n / seconds / 1e9:.1f} GFLOPS",
                                 f"{statistics.median(b / a for a, b in zip(t, base, strict=True)):.2f}x"])
                print(f"{name}, M={m}: " + ", ".join(f"{label} {statistics.median(t) * 1e6:.0f} us"
                                                       for label, t in times.items()), flush=True)
    print()
    print(format_table(["product", "M", "candidate", "CPU time", "weights", "arithmetic",
                        "speed vs numpy x @ W"], rows))


if __name__ == "__main__":
    main()
