"""The `specserve` command line (entry point `cluster.cli:main`)."""

from cluster.cli.main import main

__all__ = ["main"]
