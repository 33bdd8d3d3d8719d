"""Subcommands of the ``pagedkv`` command line, one module each."""
COMMANDS: list = []
