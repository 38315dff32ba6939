"""The `tgc` command line (`tgc.cli.app`): thin click commands over the library,
one module per command family, with one error boundary (`tgc.cli.errors`).

Stage: the last; it may import every other part of tgc, and nothing imports it."""
from tgc.cli.app import main

__all__ = ["main"]
