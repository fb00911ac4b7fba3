"""The `streamgrok` command line: run, serve, chat, info, bench."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from streamgrok.cli.bench import add_bench_commands, cmd_bench
from streamgrok.cli.chat import add_chat_command, cmd_chat
from streamgrok.cli.info import add_info_command, cmd_info
from streamgrok.cli.options import DEFAULTS, resolve_pipeline
from streamgrok.cli.run import add_run_command, cmd_run
from streamgrok.cli.serve import add_serve_command, cmd_serve


def build_parser() -> argparse.ArgumentParser:
    """Argument parser with one sub-command per job."""
    from streamgrok import __version__

    parser = argparse.ArgumentParser(prog="streamgrok", description=__doc__,
                                     formatter_class=DEFAULTS)
    parser.add_argument("--version", action="version", version=f"streamgrok {__version__}")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML or YAML file of settings (flag names as keys, optionally "
                             "under [serve], [run], ...); the command line and STREAMGROK_* "
                             "environment variables take precedence")
    commands = parser.add_subparsers(dest="command", required=True)

    for add_command in (add_chat_command, add_info_command, add_run_command,
                        add_serve_command, add_bench_commands):
        add_command(commands)
    return parser


def _config_path(argv: list[str]) -> str | None:
    """`--config FILE` wherever it stands on the command line (or STREAMGROK_CONFIG)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return os.environ.get("STREAMGROK_CONFIG") or None


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "serve": cmd_serve,
    "chat": cmd_chat,
    "info": cmd_info,
    "bench": cmd_bench,
}


def process_defaults() -> None:
    """Environment defaults of a command's process, set before torch loads (so not at import:
    processes spawned from this module, such as benchmark workers, choose their own)."""
    from streamgrok.inductor_cache import separate_inductor_cache
    from streamgrok.openmp_wait import set_idle_spin

    set_idle_spin()  # idle torch workers spin briefly, then yield the cores
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    separate_inductor_cache()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `streamgrok` console script."""
    process_defaults()
    from streamgrok.cli.sources import apply_sources, read_config
    from streamgrok.errors import StreamgrokError

    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    try:
        config_file = _config_path(argv)
        apply_sources(parser, read_config(config_file) if config_file else {})
    except ValueError as exc:
        parser.error(str(exc))
    args = parser.parse_args(argv)
    try:
        if getattr(args, "pipeline", None) and args.command in ("serve", "run"):
            args.pipeline = resolve_pipeline(args.pipeline)  # before the model loads
        return COMMANDS[args.command](args)
    except (StreamgrokError, ValueError) as exc:
        print(f"streamgrok: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

