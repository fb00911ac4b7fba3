"""The `streamgrok` command line, one module per command (`run`, `serve`, `chat`, `info`,
`bench`); `main` is the console script."""

from streamgrok.cli.entry import build_parser, main

__all__ = ["build_parser", "main"]
