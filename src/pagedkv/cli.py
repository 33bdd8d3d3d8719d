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
    """Parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand, return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except BrokenPipeError:
        # The reader of stdout has gone (``pagedkv replay ... | head``): stop without a traceback.
        # Python flushes stdout again at exit, which would fail the same way, so point it at devnull.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
