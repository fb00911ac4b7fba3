"""`streamgrok bench ...`: the benchmarks' arguments and dispatch."""

from __future__ import annotations

import argparse
from importlib import import_module
from pathlib import Path

from streamgrok.cli.options import (
    DEFAULTS,
    add_model_options,
    add_served_options,
    load_from_args,
)

# the benches that take the parsed arguments whole: (module, entry point), imported when run
SERVER_BENCHES = {
    "live": ("streamgrok.bench.live", "run_live_bench"),
    "long-stream": ("streamgrok.bench.long_stream", "run_long_stream_bench"),
    "resume": ("streamgrok.bench.resume", "run_resume_bench"),
    "soak": ("streamgrok.bench.soak", "run_soak_bench"),
}


def add_bench_commands(commands) -> None:
    bench = commands.add_parser("bench", help="run a benchmark")
    benches = bench.add_subparsers(dest="bench", required=True)
    serve = benches.add_parser("serve", formatter_class=DEFAULTS,
                               help="`streamgrok serve` over HTTP: N concurrent streaming "
                                    "chat completions, against llama-server with --peer")
    serve.add_argument("--sessions", default="1,8,32",
                       help="concurrent requests (sessions with --in-process) per row")
    serve.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    serve.add_argument("--peer", default=None, choices=("llama-server",),
                       help="the peer server, run on the same GGUF, threads and client")
    serve.add_argument("--peer-bin", default=None, help="folder holding llama-server")
    serve.add_argument("--rounds", type=int, default=3,
                       help="rounds per server, alternating; figures are medians")
    serve.add_argument("--serve-arg", action="append", default=[],
                       help="extra `streamgrok serve` argument (repeatable), e.g. "
                            "--serve-arg=--weights=f32")
    serve.add_argument("--out", default="bench-results", help="folder for JSON and plot")
    serve.add_argument("--in-process", action="store_true",
                       help="the engine in this process instead: live sessions pushing "
                            "frames and notes, concurrent vs one at a time")
    serve.add_argument("--baseline-sessions", type=int, default=4,
                       help="sessions of the one-at-a-time baseline")
    serve.add_argument("--nano-batches", type=int, default=1, help="engine nano-batches")
    serve.add_argument("--small-step-threads", default="auto",
                       help="threads of decode steps on CPU, comma-separated to compare in "
                            "one run, e.g. 2,1,2,1 (auto: --threads)")
    add_model_options(serve)
    kernels = benches.add_parser(
        "kernels", formatter_class=DEFAULTS,
        help="Triton kernels vs references, decode attention vs SDPA (GPU check)")
    kernels.add_argument("--small", action="store_true", help="small shapes")
    kernels.add_argument("--no-timing", action="store_true", help="correctness only")
    soak = benches.add_parser("soak", formatter_class=DEFAULTS,
                              help="a real server under many live clients: answers, TTFT, "
                                   "RSS, KV pages, drops")
    soak.add_argument("--clients", type=int, default=16, help="live clients")
    soak.add_argument("--seconds", type=float, default=300.0, help="how long")
    soak.add_argument("--ask-every", type=float, default=15.0, help="seconds between questions")
    _add_speech_option(soak)
    soak.add_argument("--storm", type=int, default=0,
                      help="then this many clients connect, ask and drop mid-answer")
    add_served_options(soak)
    resume = benches.add_parser("resume", formatter_class=DEFAULTS,
                                help="a dropped session resumed through streamgrok serve: "
                                     "time to resume, parked KV and RSS per KV size")
    resume.add_argument("--sizes", default="2048,8192,16384",
                        help="KV tokens per layer the session holds when it drops")
    resume.add_argument("--trials", type=int, default=5, help="drops and resumes per size")
    add_served_options(resume)
    long_stream = benches.add_parser(
        "long-stream", formatter_class=DEFAULTS,
        help="one session streams past a million tokens through streamgrok serve: facts "
             "asked along the way, RSS and KV pages watched")
    long_stream.add_argument("--tokens", type=int, default=1_000_000,
                             help="tokens to stream into the session")
    long_stream.add_argument("--checks", type=int, default=6,
                             help="facts stated and asked for along the stream (the first, "
                                  "early, is the baseline)")
    long_stream.add_argument("--seed", type=int, default=0, help="which passwords")
    add_served_options(long_stream)
    live = benches.add_parser("live", formatter_class=DEFAULTS,
                              help="N live websocket clients per row: answers, TTFT, TBT, "
                                   "frames processed and dropped, server CPU")
    live.add_argument("--clients", default="1,4,8,16,24,32",
                      help="rows (the first is the baseline)")
    live.add_argument("--fps", type=float, default=1.0, help="frames each client sends a second")
    live.add_argument("--question-every", type=float, default=15.0, help="seconds")
    live.add_argument("--seconds", type=float, default=120.0, help="per row")
    live.add_argument("--answer-timeout", type=float, default=30.0,
                      help="seconds after the row an open question may still be answered")
    live.add_argument("--url", default=None, help="a running server's /ws (else one is started)")
    _add_speech_option(live)
    add_served_options(live)


def _add_speech_option(bench: argparse.ArgumentParser) -> None:
    """`--speech/--no-speech` of the benches whose clients send audio."""
    bench.add_argument("--speech", action=argparse.BooleanOptionalAction, default=True,
                       help="clients speak espeak-ng sentences about half the time (else room "
                            "noise)")


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "kernels":
        from streamgrok_kernels.check import main as check_kernels

        return check_kernels((["--small"] if args.small else [])
                             + (["--no-timing"] if args.no_timing else []))
    if args.bench in SERVER_BENCHES:  # they start their own server from the arguments
        module, function = SERVER_BENCHES[args.bench]
        getattr(import_module(module), function)(args)
        return 0
    if args.bench == "serve" and not args.in_process:
        return _bench_serve_http(args)
    if args.bench == "serve":
        from streamgrok.bench.serve import run_serve_bench

        run_serve_bench(load_from_args(args), [int(x) for x in args.sessions.split(",")],
                        args.max_tokens, args.baseline_sessions, args.nano_batches,
                        tuple(None if x == "auto" else int(x)
                              for x in args.small_step_threads.split(",")))
        return 0
    raise AssertionError(args.bench)


def _bench_serve_http(args: argparse.Namespace) -> int:
    from streamgrok.bench.serve_http import ServeBenchOptions, run_http_serve_bench
    from streamgrok.errors import StreamgrokError
    from streamgrok.loading.hub import resolve
    from streamgrok.loading.loader import default_model_path
    from streamgrok.runtime import configure_threads

    if args.peer and not args.peer_bin:
        raise StreamgrokError("--peer llama-server needs --peer-bin DIR (its build folder)")
    model = Path(resolve(args.model, args.offline) if args.model else default_model_path())
    if args.peer and model.suffix != ".gguf":
        raise StreamgrokError("--peer llama-server needs a .gguf --model both servers load")
    serve_args = [*args.serve_arg]
    for flag, value, default in (("--weights", args.weights, "auto"),
                                 ("--dtype", args.dtype, "auto")):
        if value != default:
            serve_args += [flag, value]
    options = ServeBenchOptions(model, configure_threads(args.threads),
                                [int(x) for x in args.sessions.split(",")], args.max_tokens,
                                args.rounds, Path(args.peer_bin) if args.peer else None,
                                tuple(serve_args))
    run_http_serve_bench(options, Path(args.out))
    return 0

