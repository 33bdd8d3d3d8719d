"""Subcommands of the ``pagedkv`` command line, one module each."""
from pagedkv.commands import data, generate, perplexity, replay, tier

COMMANDS: list = [generate, perplexity, replay, data, tier]
