"""``pagedkv data``: list and download the public inputs of the other commands."""
from __future__ import annotations

import argparse
import sys

from pagedkv import data

DESCRIPTION = f"""\
Download the public inputs of `pagedkv perplexity` and `pagedkv replay` (a text
corpus, production serving traces) into the data directory, and check each file's
SHA-256 against the one recorded in pagedkv. Once fetched, the commands accept the
dataset's name in place of a path:

    pagedkv data fetch tinyshakespeare mooncake-conversation
    pagedkv perplexity tinyshakespeare
    pagedkv replay mooncake-conversation

Data directory: ${data.DATA_DIR_ENV} if set, else the user cache directory
($XDG_CACHE_HOME/pagedkv or ~/.cache/pagedkv on Linux). `pagedkv data list`
prints it.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``data`` subcommand (with ``list`` and ``fetch``) to ``subparsers`` and return its parser."""
    parser = subparsers.add_parser(
        "data",
        help="list or download the public inputs (tinyshakespeare, Mooncake and Azure traces)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    actions.add_parser("list", help="list the datasets, whether each is downloaded, and where",
                       description="List the datasets, their size, whether each is downloaded (and "
                                   "passes its SHA-256 check), and the data directory.")
    fetch = actions.add_parser("fetch", help="download datasets and check their SHA-256",
                               description="Download the named datasets (default: all) into the data directory "
                                           "and check their SHA-256; a verified copy already there is kept.")
    fetch.add_argument("names", nargs="*", metavar="NAME",
                       help=f"datasets to download: {', '.join(data.DATASETS)} (default: all)")
    fetch.add_argument("--force", action="store_true", help="download again even if a verified copy is there")
    fetch.add_argument("--no-progress", action="store_true", help="do not show the tqdm progress bar")
    fetch.set_defaults(fetch_parser=fetch)
    return parser


def _status(name: str) -> str:
    try:
        data.verify(name)
    except data.DataError:
        return "damaged" if data.dataset_path(name).exists() else "not fetched"
    return "ok"


def _list() -> int:
    rows = [("name", "size", "status", "description")]
    for name, dataset in data.DATASETS.items():
        rows.append((name, f"{dataset.num_bytes / 1e6:.1f} MB", _status(name), dataset.description))
    widths = [max(len(row[c]) for row in rows) for c in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths)) + "  " + row[3])
    print(f"data directory: {data.data_dir()} (set {data.DATA_DIR_ENV} to change it)")
    return 0


class _ProgressBar:
    """A tqdm bar in bytes, drawn from the first chunk on (so a failed connection draws none)."""

    def __init__(self, name: str, enabled: bool) -> None:
        self._name = name
        self._bar = None
        self._tqdm = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:  # optional (extra 'cli'): no bar then
                pass
            else:
                self._tqdm = tqdm

    def update(self, done: int, total: int | None) -> None:
        """Progress callback of :func:`pagedkv.data.fetch`."""
        if self._tqdm is None:
            return
        if self._bar is None:
            self._bar = self._tqdm(desc=self._name, total=total, unit="B", unit_scale=True, unit_divisor=1024,
                                   leave=False)
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        """Close the progress bar, if one was shown."""
        if self._bar is not None:
            self._bar.close()


def _fetch(names: list[str], force: bool, progress: bool) -> int:
    failures = 0
    for name in names or list(data.DATASETS):
        bar = _ProgressBar(name, progress)
        try:
            path = data.fetch(name, force=force, progress=bar.update,
                              notify=lambda text: print(f"pagedkv data fetch: {text}", file=sys.stderr))
        except data.DataError as exc:
            bar.close()
            print(f"pagedkv data fetch: {exc}", file=sys.stderr)
            failures += 1
            continue
        bar.close()
        print(f"{name}: {path} (SHA-256 verified)")
    return 2 if failures else 0


def run(args: argparse.Namespace) -> int:
    """Run ``data list`` or ``data fetch``; return the exit status (0, or 2 if a fetch failed)."""
    if args.data_command == "list":
        return _list()
    unknown = [name for name in args.names if name not in data.DATASETS]
    if unknown:
        args.fetch_parser.error(f"argument NAME: expected one of {', '.join(data.DATASETS)}, "
                                f"got {', '.join(map(repr, unknown))}")
    return _fetch(list(dict.fromkeys(args.names)), args.force, not args.no_progress)
