"""Subcommands of the ``pagedkv`` command line, one module each."""
from pagedkv.commands import replay

COMMANDS: list = [replay]
