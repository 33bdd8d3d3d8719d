"""The ``pagedkv`` command line (also ``python -m pagedkv``).

Each subcommand lives in a module of :mod:`pagedkv.commands` that defines
``add_parser(subparsers)`` and ``run(args) -> int``.
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from pagedkv import __version__
from pagedkv.commands import COMMANDS


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser with one subcommand per module in ``COMMANDS``."""
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="Paged KV cache for transformer inference: run a real model, score text, replay traces.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        subparser = module.add_parser(subparsers)
        subparser.set_defaults(run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit status.

    The status is the subcommand's (0 on success, 2 on a usage or input error), 130 when
    the run is interrupted with Ctrl-C (SIGINT; a one-line notice on stderr, no traceback)
    and 1 when the reader of stdout goes away.
    """
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        # Ctrl-C while a model loads, a text is scored or a trace replays: a one-line notice
        # instead of a traceback from deep inside NumPy or gguf, and the shell's status for
        # SIGINT (128 + 2), so scripts still see the run as interrupted.
        print(f"\npagedkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader of stdout has gone (``pagedkv replay ... | head``): stop without a traceback.
        # Python flushes stdout again at exit, which would fail the same way, so point it at devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
