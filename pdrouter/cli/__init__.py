"""The ``pdrouter`` command line: subcommands, local clusters, process serving."""

from pdrouter.cli.main import main

__all__ = ["main"]
