"""The `streamgrok` command line: chat, info, bench."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

# Idle torch worker threads must not spin while another process or thread needs the cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=".gguf file or Hugging Face folder (default: SmolLM2)")
    parser.add_argument("--dtype", default="auto",
                        help="auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton"),
                        help="attention/norm kernels: auto = Triton on CUDA, PyTorch on CPU")


def _add_served_options(parser: argparse.ArgumentParser) -> None:
    """Options of the benchmarks that start a `streamgrok serve` process."""
    parser.add_argument("--pipeline", default="pipelines/live_qa.py")
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-budget", type=int, default=2048)
    parser.add_argument("--kv-memory-gib", type=float, default=None)
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="pipeline option")
    parser.add_argument("--out", default="bench-results", help="folder for the plot")


def build_parser() -> argparse.ArgumentParser:
    """Argument parser with one sub-command per job."""
    parser = argparse.ArgumentParser(prog="streamgrok", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    chat = commands.add_parser("chat", help="stream an answer (interactive without a question)")
    chat.add_argument("question", nargs="?", help="the question; omit for an interactive prompt")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--temperature", type=float, default=0.0)
    chat.add_argument("--top-k", type=int, default=0)
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--seed", type=int, default=None)
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--repetition-penalty", type=float, default=1.0)
    _add_model_options(chat)

    info = commands.add_parser("info", help="print model, parameters, dtype, device, threads")
    _add_model_options(info)

    run = commands.add_parser("run", help="run a pipeline file on a video file or URL")
    run.add_argument("pipeline", help="path to a pipeline .py file")
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
    run.add_argument("--kv-policy", default="redundancy")
    run.add_argument("--kv-budget", type=int, default=2048, help="tokens per layer")
    run.add_argument("--kv-dtype", default="auto", help="auto (the model's dtype), float32, "
                     "bfloat16, float16 or int8")
    run.add_argument("--kv-memory-gib", type=float, default=None,
                     help="KV page pool size (default: 80%% of free GPU memory, 2 GiB on CPU)")
    _add_model_options(run)

    srv = commands.add_parser("serve", help="websocket server, demo page and /metrics")
    srv.add_argument("pipeline", nargs="?", default="pipelines/live_qa.py")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8765)
    srv.add_argument("--token", default=None, help="required off loopback (or STREAMGROK_TOKEN)")
    srv.add_argument("--allow-origin", action="append", default=[],
                     help="extra browser origin allowed to connect (repeatable)")
    srv.add_argument("--set", action="append", metavar="KEY=VALUE", help="pipeline option")
    srv.add_argument("--kv-policy", default="redundancy")
    srv.add_argument("--kv-budget", type=int, default=2048)
    srv.add_argument("--kv-memory-gib", type=float, default=None,
                     help="KV page pool size (default: 80%% of free GPU memory, 2 GiB on CPU)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight answers may finish after SIGTERM/SIGINT")
    srv.add_argument("--media-workers", type=int, default=2,
                     help="processes that decode frames and run OpenCV detectors")
    srv.add_argument("--load-tick", type=float, default=2.0,
                     help="seconds between load governor readings; 0 turns the governor off "
                          "(no busy refusals, no degraded sampling)")
    _add_model_options(srv)

    bench = commands.add_parser("bench", help="run a benchmark")
    benches = bench.add_subparsers(dest="bench", required=True)
    decode = benches.add_parser("decode", help="prefill and batched decode throughput")
    decode.add_argument("--prompt-tokens", type=int, default=512)
    decode.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    decode.add_argument("--steps", type=int, default=12, help="timed decode steps per batch")
    decode.add_argument("--repeats", type=int, default=3, help="prefill repeats (median)")
    _add_model_options(decode)
    kv = benches.add_parser("kv", help="KV cache: flat memory, passkey, perplexity, overhead")
    kv.add_argument("--parts", default="flat,passkey,ppl,overhead")
    kv.add_argument("--tokens", type=int, default=100_000, help="tokens streamed (flat part)")
    kv.add_argument("--budget", type=int, default=2048, help="tokens per layer")
    kv.add_argument("--flat-policy", default="h2o")
    kv.add_argument("--contexts", default="2048,4096,7168")
    kv.add_argument("--depths", default="0,0.25,0.5,0.75,1")
    kv.add_argument("--budget-fractions", default="0.1,0.25,0.5")
    kv.add_argument("--policies", default="sink_window,h2o,snapkv,redundancy,pyramid")
    kv.add_argument("--ppl-tokens", type=int, default=16_384)
    kv.add_argument("--out", default="bench-results", help="folder for plots")
    _add_model_options(kv)
    kv.set_defaults(dtype="bfloat16")
    serve = benches.add_parser("serve", help="concurrent live sessions vs one at a time")
    serve.add_argument("--sessions", default="1,8,32")
    serve.add_argument("--max-tokens", type=int, default=24)
    serve.add_argument("--baseline-sessions", type=int, default=4)
    serve.add_argument("--nano-batches", type=int, default=1)
    _add_model_options(serve)
    kernels = benches.add_parser(
        "kernels", help="Triton kernels vs references, decode attention vs SDPA (GPU check)")
    kernels.add_argument("--small", action="store_true", help="small shapes")
    kernels.add_argument("--no-timing", action="store_true", help="correctness only")
    soak = benches.add_parser("soak", help="a real server under many live clients: answers, "
                              "TTFT, RSS, KV pages, drops")
    soak.add_argument("--clients", type=int, default=16)
    soak.add_argument("--seconds", type=float, default=300.0)
    soak.add_argument("--ask-every", type=float, default=15.0, help="seconds between questions")
    soak.add_argument("--storm", type=int, default=0,
                      help="then this many clients connect, ask and drop mid-answer")
    _add_served_options(soak)
    live = benches.add_parser("live", help="N live websocket clients per row: answers, TTFT, "
                              "TBT, frames processed and dropped, server CPU")
    live.add_argument("--clients", default="1,4,8,16,32", help="rows (the first is the baseline)")
    live.add_argument("--fps", type=float, default=1.0, help="frames each client sends a second")
    live.add_argument("--question-every", type=float, default=15.0, help="seconds")
    live.add_argument("--seconds", type=float, default=120.0, help="per row")
    live.add_argument("--answer-timeout", type=float, default=30.0,
                      help="seconds after the row an open question may still be answered")
    live.add_argument("--url", default=None, help="a running server's /ws (else one is started)")
    _add_served_options(live)
    grounding = benches.add_parser(
        "grounding", help="questions with known answers on generated clips, by category")
    grounding.add_argument("--pipeline", default="pipelines/live_qa.py")
    grounding.add_argument("--clips", default=None, help="comma-separated clip names")
    grounding.add_argument("--out", default="bench-results", help="folder for the plot")
    _add_model_options(grounding)
    media = benches.add_parser("media", help="decode, CLIP, dedup and ingest rates")
    media.add_argument("--clip-weights", default=None, help="open_clip checkpoint file")
    media.add_argument("--fps", type=float, default=2.0)
    media.add_argument("--threads", type=int, default=None)
    return parser


def _load(args: argparse.Namespace):
    from kernels.ops import KernelOps
    from streamgrok.model.loader import load_model
    from streamgrok.runtime import configure_threads, resolve_device, resolve_dtype

    configure_threads(args.threads)
    device = resolve_device(args.device)
    loaded = load_model(args.model, resolve_dtype(args.dtype, device), device)
    loaded.model.kernels = KernelOps(args.kernels)
    return loaded


def cmd_chat(args: argparse.Namespace) -> int:
    from streamgrok.model.generate import Generator
    from streamgrok.model.sampling import SamplingParams

    generator = Generator(_load(args))
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
    )
    questions = [args.question] if args.question else _interactive_questions()
    for question in questions:
        for delta in generator.stream(generator.chat_prompt(question, args.system), params):
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def _interactive_questions():
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            return
        if line in ("exit", "quit"):
            return
        if line:
            yield line


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    loaded = _load(args)
    cfg, model = loaded.config, loaded.model
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    rows = [
        ("model", str(loaded.source)),
        ("architecture", cfg.architecture),
        ("parameters", f"{params / 1e6:.1f} M"),
        ("layers / hidden / ffn",
         f"{cfg.num_layers} / {cfg.hidden_size} / {cfg.intermediate_size}"),
        ("heads / kv heads / head dim", f"{cfg.num_heads} / {cfg.num_kv_heads} / {cfg.head_dim}"),
        ("rope theta / scaling", f"{cfg.rope_theta:g} / {cfg.rope_scaling.kind}"),
        ("context", str(cfg.max_positions)),
        ("vocab", str(cfg.vocab_size)),
        ("tied embeddings", str(cfg.tie_embeddings)),
        ("dtype", str(model.dtype).removeprefix("torch.")),
        ("weights in memory", f"{model.weight_bytes() / 2**20:.0f} MiB"),
        ("device", str(model.device)),
        ("threads", str(torch.get_num_threads())),
    ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench == "decode":
        from streamgrok.bench.decode import run_decode_bench

        run_decode_bench(
            _load(args),
            prompt_tokens=args.prompt_tokens,
            batch_sizes=[int(b) for b in args.batches.split(",")],
            steps=args.steps,
            repeats=args.repeats,
        )
        return 0
    if args.bench == "kv":
        from pathlib import Path

        from streamgrok.bench.kv import KvBenchOptions, run_kv_bench

        def floats(text: str) -> tuple[float, ...]:
            return tuple(float(x) for x in text.split(","))

        run_kv_bench(
            _load(args),
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
                out_dir=Path(args.out),
            ),
        )
        return 0
    if args.bench == "kernels":
        from kernels.check import main as check_kernels

        return check_kernels((["--small"] if args.small else [])
                             + (["--no-timing"] if args.no_timing else []))
    if args.bench == "media":
        from streamgrok.bench.media import run_media_bench
        from streamgrok.runtime import configure_threads

        configure_threads(args.threads)
        run_media_bench(args.clip_weights, args.fps)
        return 0
    if args.bench == "grounding":
        from streamgrok.bench.grounding import run_grounding_bench

        run_grounding_bench(_load(args), args.pipeline, out=args.out, only=args.clips)
        return 0
    if args.bench == "live":
        from streamgrok.bench.live import run_live_bench

        run_live_bench(args)
        return 0
    if args.bench == "soak":
        from streamgrok.bench.soak import run_soak_bench

        run_soak_bench(args)
        return 0
    if args.bench == "serve":
        from streamgrok.bench.serve import run_serve_bench

        run_serve_bench(_load(args), [int(x) for x in args.sessions.split(",")],
                        args.max_tokens, args.baseline_sessions, args.nano_batches)
        return 0
    raise AssertionError(args.bench)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvloop

    from streamgrok.cache.config import CacheConfig
    from streamgrok.run import parse_options
    from streamgrok.server.app import ServerConfig, serve_forever

    config = ServerConfig(args.pipeline, args.host, args.port, args.token, args.allow_origin,
                          parse_options(args.set or []), media_workers=args.media_workers,
                          shutdown_timeout_s=args.shutdown_timeout,
                          load_tick_s=args.load_tick if args.load_tick > 0 else None)
    cache = CacheConfig(policy=args.kv_policy, budget_tokens=args.kv_budget,
                        memory_gib=args.kv_memory_gib)
    try:
        uvloop.run(serve_forever(lambda: _load(args), config, cache))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from streamgrok.media.decode import probe_source
    from streamgrok.run import run_command

    print(f"source {args.source}: {probe_source(args.source)}", flush=True)  # before the model
    return run_command(_load(args), args)


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run,
    "serve": cmd_serve,
    "chat": cmd_chat,
    "info": cmd_info,
    "bench": cmd_bench,
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `streamgrok` console script."""
    from streamgrok.errors import StreamgrokError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (StreamgrokError, ValueError) as exc:
        print(f"streamgrok: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
