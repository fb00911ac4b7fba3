"""`streamgrok bench ...`: the benchmarks' arguments and dispatch."""

from __future__ import annotations

import argparse
from importlib import import_module
from pathlib import Path

from streamgrok.cli.options import (
    CHAT_KV_DTYPES,
    DEFAULTS,
    POLICIES,
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
    decode = benches.add_parser("decode", formatter_class=DEFAULTS,
                                help="prefill and batched decode throughput")
    decode.add_argument("--prompt-tokens", type=int, default=512, help="prefill length")
    decode.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    decode.add_argument("--context", type=int, default=512,
                        help="context of each sequence for the batched decode rows")
    decode.add_argument("--batch1-context", type=int, default=64,
                        help="context of the batch-1 decode row (llama-bench's tg128 spans 0-128)")
    decode.add_argument("--steps", type=int, default=12, help="timed decode steps per batch")
    decode.add_argument("--repeats", type=int, default=3, help="runs per number (median)")
    decode.add_argument("--formats", default="f32,bf16,q8,q4",
                        help="weight formats compared (f32 is the accuracy reference); "
                             "FORMAT:KV gives one its own K/V cache dtype, e.g. q4:int8")
    decode.add_argument("--kv-dtype", default="auto", choices=CHAT_KV_DTYPES,
                        help="K/V cache dtype of every format: auto is bfloat16 for the "
                             "quantized formats where the CPU has native bfloat16 (llama.cpp's "
                             "default cache is float16), else the model's compute dtype; int8 "
                             "keeps a scale per token and head")
    decode.add_argument("--peer", default=None, choices=("llama.cpp",),
                        help="also measure llama.cpp's own benchmarks on the same GGUF")
    decode.add_argument("--peer-bin", default=None,
                        help="folder with llama-bench and llama-batched-bench (default: PATH)")
    decode.add_argument("--out", default="bench-results", help="folder for the plot")
    add_model_options(decode)
    kv = benches.add_parser("kv", formatter_class=DEFAULTS,
                            help="KV cache: flat memory, passkey, perplexity, overhead")
    kv.add_argument("--parts", default="flat,passkey,ppl,overhead",
                    help="which parts to run (also: kvp, KV parallelism over local ranks; "
                         "recall, the host tier and recall; paged, decode steps with the "
                         "native CPU attention kernel vs the PyTorch path; moe, a mixture "
                         "of experts with experts and KV over the kvp ranks)")
    kv.add_argument("--tokens", type=int, default=100_000, help="tokens streamed (flat part)")
    kv.add_argument("--budget", type=int, default=2048, help="tokens per layer")
    kv.add_argument("--flat-policy", default="h2o", choices=POLICIES,
                    help="policy of the flat-memory part")
    kv.add_argument("--contexts", default="2048,4096,7168", help="passkey context lengths")
    kv.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="passkey depths")
    kv.add_argument("--budget-fractions", default="0.1,0.25,0.5",
                    help="budgets as fractions of the context")
    kv.add_argument("--policies", default="sink_window,h2o,snapkv,redundancy,pyramid",
                    help="policies compared")
    kv.add_argument("--ppl-tokens", type=int, default=16_384, help="perplexity text length")
    kv.add_argument("--kvp-ranks", default="1,2,4", help="rank counts of the kvp part")
    kv.add_argument("--kvp-contexts", default="1024,4096",
                    help="contexts of the kvp part (the moe part: the largest)")
    kv.add_argument("--recall-contexts", default="4096,7168",
                    help="stream lengths of the recall part (within the trained context)")
    kv.add_argument("--recall-fractions", default="0.05,0.1,0.25",
                    help="resident budgets of the recall part, as fractions of the context")
    kv.add_argument("--recall-policy", default="redundancy", choices=POLICIES[1:],
                    help="eviction policy of the recall part")
    kv.add_argument("--recall-trials", type=int, default=2,
                    help="needles per task and depth in the recall part")
    kv.add_argument("--recall-stream-tokens", type=int, default=200_000,
                    help="tokens of the recall part's long stream")
    kv.add_argument("--recall-stream-questions", type=int, default=5,
                    help="questions (and measured rows) along the long stream")
    kv.add_argument("--recall-in-stream", default="off,on",
                    help="the recall part's fidelity with streamed chunks recalling off, on "
                         "or both (off,on)")
    kv.add_argument("--recall-parts", default="stream,fidelity,retrieval",
                    help="what the recall part runs")
    kv.add_argument("--out", default="bench-results", help="folder for plots")
    add_model_options(kv)
    kv.set_defaults(dtype="bfloat16")
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
    soak.add_argument("--speech", action=argparse.BooleanOptionalAction, default=True,
                      help="clients speak espeak-ng sentences about half the time (else room "
                           "noise)")
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
    live.add_argument("--speech", action=argparse.BooleanOptionalAction, default=True,
                      help="clients speak espeak-ng sentences about half the time (else room "
                           "noise)")
    add_served_options(live)
    grounding = benches.add_parser(
        "grounding", formatter_class=DEFAULTS,
        help="questions with known answers on generated clips: as the notes word them, "
             "in other words, and about what never happened")
    grounding.add_argument("--pipeline", default="pipelines/live_qa.py", help="pipeline file")
    grounding.add_argument("--clips", default=None, help="comma-separated clip names")
    grounding.add_argument("--seed", type=int, default=0,
                           help="seed the generated clips are drawn from")
    grounding.add_argument("--generated", type=int, default=5,
                           help="how many clips to draw from --seed")
    grounding.add_argument("--configs", default="words,current",
                           help="comma-separated: current, words (the old note selection), "
                                "stream, pocketsphinx")
    grounding.add_argument("--out", default="bench-results", help="folder for the plot")
    add_model_options(grounding)
    speech = benches.add_parser(
        "speech", formatter_class=DEFAULTS,
        help="numbers, times and names heard right by Whisper base under each decoding option")
    speech.add_argument("--threads", type=int, default=1, help="recogniser threads")
    media = benches.add_parser("media", formatter_class=DEFAULTS,
                               help="decode, CLIP, dedup and ingest rates")
    media.add_argument("--clip-weights", default=None, help="open_clip checkpoint file")
    media.add_argument("--fps", type=float, default=2.0, help="sampling rate")
    media.add_argument("--threads", type=int, default=None, help="torch threads")
    media.add_argument("--parts", default="all", choices=("all", "vision"),
                       help="all, or only the vision towers' throughput")
    media.add_argument("--out", default="bench-results", help="folder for the plot")


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "decode":
        from streamgrok.bench.decode import run_decode_bench

        run_decode_bench(args.model, args.formats.split(","), args.threads,
                         prompt_tokens=args.prompt_tokens,
                         batches=[int(b) for b in args.batches.split(",")],
                         context=args.context, batch1_context=args.batch1_context,
                         steps=args.steps, repeats=args.repeats, peer=args.peer,
                         peer_bin=args.peer_bin, kv_dtype=args.kv_dtype, out=args.out)
        return 0
    if args.bench == "kv":

        from streamgrok.bench.kv import KvBenchOptions, run_kv_bench
        from streamgrok.bench.recall import RecallBenchOptions

        def floats(text: str) -> tuple[float, ...]:
            return tuple(float(x) for x in text.split(","))

        def on_off(text: str, option: str) -> tuple[bool, ...]:
            values = text.split(",")
            if set(values) - {"on", "off"}:
                raise ValueError(f"{option} takes off, on or off,on, not {text!r}")
            return tuple(value == "on" for value in values)

        run_kv_bench(
            load_from_args(args),
            KvBenchOptions(
                parts=tuple(args.parts.split(",")),
                tokens=args.tokens,
                budget=args.budget,
                flat_policy=args.flat_policy,
                contexts=tuple(int(x) for x in args.contexts.split(",")),
                depths=floats(args.depths),
                budget_fractions=floats(args.budget_fractions),
                policies=tuple(args.policies.split(",")),
                ppl_tokens=args.ppl_tokens,
                kvp_ranks=tuple(int(x) for x in args.kvp_ranks.split(",")),
                kvp_contexts=tuple(int(x) for x in args.kvp_contexts.split(",")),
                recall=RecallBenchOptions(
                    contexts=tuple(int(x) for x in args.recall_contexts.split(",")),
                    fractions=floats(args.recall_fractions), policy=args.recall_policy,
                    trials=args.recall_trials, flat_tokens=args.recall_stream_tokens,
                    flat_questions=args.recall_stream_questions,
                    parts=tuple(args.recall_parts.split(",")),
                    in_stream=on_off(args.recall_in_stream, "--recall-in-stream"),
                    budget=args.budget),
                weights=args.weights,
                out_dir=Path(args.out),
            ),
        )
        return 0
    if args.bench == "kernels":
        from streamgrok_kernels.check import main as check_kernels

        return check_kernels((["--small"] if args.small else [])
                             + (["--no-timing"] if args.no_timing else []))
    if args.bench == "media":
        from streamgrok.bench.media import run_media_bench
        from streamgrok.runtime import configure_threads

        configure_threads(args.threads)
        run_media_bench(args.clip_weights, args.fps, args.parts, args.out)
        return 0
    if args.bench == "speech":
        from streamgrok.bench.speech import DECODINGS, speech_numbers_bench

        speech_numbers_bench(DECODINGS, args.threads)
        return 0
    if args.bench == "grounding":
        from streamgrok.bench.grounding import run_grounding_bench

        run_grounding_bench(load_from_args(args), args.pipeline, out=args.out, only=args.clips,
                            seed=args.seed, generated=args.generated, configs=args.configs)
        return 0
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

