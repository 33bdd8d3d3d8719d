"""Subcommands of the ``pagedkv`` command line, one module each."""
from pagedkv.commands import data, generate, perplexity, replay

COMMANDS: list = [generate, perplexity, replay, data]
