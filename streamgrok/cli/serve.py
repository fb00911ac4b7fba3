"""`streamgrok serve`: the websocket, HTTP and Realtime server (and its KV-parallel
ranks under torchrun)."""

from __future__ import annotations

import argparse
import logging
import os

from streamgrok.cli.options import (
    DEFAULT_PIPELINE,
    DEFAULTS,
    add_cache_options,
    add_model_options,
    cache_config,
    load_from_args,
    parse_options,
    resolve_pipeline,
)


def add_serve_command(commands) -> None:
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
    add_cache_options(srv)
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
    add_model_options(srv)


def cmd_serve(args: argparse.Namespace) -> int:
    from streamgrok.engine.config import EngineConfig
    from streamgrok.errors import StreamgrokError
    from streamgrok.logs import configure_logging
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
        loaded = load_from_args(args)
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


def _event_loop_runner():
    """uvloop where it is installed (not on Windows), else asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        import asyncio

        return asyncio.run
    return uvloop.run

