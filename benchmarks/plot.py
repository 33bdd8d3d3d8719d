"""Draw benchmark results (JSON written by the bench_*.py scripts) with matplotlib.

Usage::

    python benchmarks/plot.py benchmarks/results/bench_core.json -o docs/bench_core_sweep.png

The kind of plot follows the ``benchmark`` field of the JSON file; add a
function to ``PLOTTERS`` for a new benchmark.
"""
import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402


def plot_core(results, path):
    """Lookup sweep of bench_core: latency and throughput against max_pages, one line per page_size."""
    sweep = results["sweep"]
    page_sizes = sorted({row["page_size"] for row in sweep})
    fig, (ax_latency, ax_rate) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    styles = {"get": "o-", "get_many": "s--", "baseline get": ":"}
    for i, page_size in enumerate(page_sizes):
        rows = sorted((r for r in sweep if r["page_size"] == page_size), key=lambda r: r["max_pages"])
        max_pages = [r["max_pages"] for r in rows]
        color = f"C{i}"
        ax_latency.plot(max_pages, [r["pagedkv_get_s"] * 1e6 for r in rows], styles["get"], color=color)
        ax_latency.plot(max_pages, [r["pagedkv_get_many_s"] * 1e6 for r in rows], styles["get_many"], color=color)
        ax_latency.plot(max_pages, [r["baseline_get_s"] * 1e6 for r in rows], styles["baseline get"], color=color)
        ax_rate.plot(max_pages, [r["get_lookups_per_s"] / 1e6 for r in rows], styles["get"], color=color)
        ax_rate.plot(max_pages, [r["get_many_lookups_per_s"] / 1e6 for r in rows], styles["get_many"], color=color)
    for ax in (ax_latency, ax_rate):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("max_pages (pages)")
        ax.grid(True, which="both", alpha=0.3)
    ax_latency.set_ylabel("microseconds per lookup")
    ax_latency.set_title("Latency (lower is better)")
    ax_rate.set_ylabel("million lookups per second")
    ax_rate.set_title("Throughput (higher is better)")
    # One legend entry per colour (page_size) and per line style (operation).
    handles = [Line2D([], [], color=f"C{i}", lw=3, label=f"page_size={p}") for i, p in enumerate(page_sizes)]
    handles += [Line2D([], [], color="gray", linestyle=style[1:] if style[0] in "os" else style,
                       marker=style[0] if style[0] in "os" else None, label=name)
                for name, style in styles.items()]
    fig.legend(handles=handles, fontsize=7, loc="outside right upper")
    machine = results.get("machine", {})
    fig.suptitle(
        f"PagedKVCache lookups of random resident tokens, dim={results['dim']} {results['dtype']}, "
        f"medians of {results['repeats']} ({machine.get('cpu_count', '?')} CPUs, "
        f"load {machine.get('load_average', ['?'])[0]:.1f})",
        fontsize=9,
    )
    fig.savefig(path, dpi=80)
    plt.close(fig)


PLOTTERS = {"core": plot_core}


def main(argv=None):
    parser = argparse.ArgumentParser(description="Plot a benchmark's JSON results into one PNG.")
    parser.add_argument("results", type=Path, help="JSON file written by a benchmark")
    parser.add_argument("-o", "--output", type=Path, help="PNG path (default: beside the JSON file)")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text())
    kind = results.get("benchmark")
    if kind not in PLOTTERS:
        parser.error(f"no plot for benchmark {kind!r}; known: {', '.join(sorted(PLOTTERS))}")
    output = args.output or args.results.with_suffix(".png")
    output.parent.mkdir(parents=True, exist_ok=True)
    PLOTTERS[kind](results, output)
    print(f"wrote {output} ({output.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
