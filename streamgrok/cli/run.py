"""`streamgrok run PIPELINE.py --source ...`: run a pipeline file on a file or URL."""

from __future__ import annotations

import argparse

from streamgrok.cli.options import (
    DEFAULTS,
    add_cache_options,
    add_model_options,
    cache_config,
    load_from_args,
)


def add_run_command(commands) -> None:
    """The `run` command's arguments."""
    run = commands.add_parser("run", formatter_class=DEFAULTS,
                              help="run a pipeline file on a video file or URL")
    run.add_argument("pipeline", help="pipeline file, or a sample's name (live_qa, alert, "
                     "commentary)")
    run.add_argument("--source", required=True, help="video file or URL (http, rtsp)")
    run.add_argument("--live", action="store_true", help="real-time pacing, drop old frames")
    run.add_argument("--ask", action="append", metavar="QUESTION",
                     help="ask when the stream ends (repeatable)")
    run.add_argument("--ask-at", action="append", nargs=2, metavar=("TIME", "QUESTION"),
                     help="ask at a stream time such as 10s or 1:30 (repeatable)")
    run.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="pipeline option (repeatable), e.g. fps=2 or clip_weights=PATH")
    run.add_argument("--jsonl", help="also write every event to this JSON lines file")
    run.add_argument("--quiet-notes", action="store_true", help="do not print observer notes")
    add_cache_options(run)
    add_model_options(run)


def cmd_run(args: argparse.Namespace) -> int:
    from streamgrok.cli.run_pipeline import run_command
    from streamgrok.media.decode import probe_source

    print(f"source {args.source}: {probe_source(args.source)}", flush=True)  # before the model
    return run_command(load_from_args(args), args, cache_config(args))
