"""Running a pipeline file on a file or URL, for `streamgrok run` (imported when the command
runs: it brings the engine and torch)."""

from __future__ import annotations

import asyncio
import re
import sys
from typing import Any

from streamgrok.cache.config import CacheConfig
from streamgrok.cli.options import parse_options
from streamgrok.engine import Engine
from streamgrok.loading.loader import LoadedModel
from streamgrok.media.native_pool import NativeMediaPool
from streamgrok.pipeline.loader import load_pipeline
from streamgrok.pipeline.pipeline import Pipeline, PipelineRunner
from streamgrok.pipeline.resources import SharedResources
from streamgrok.pipeline.sinks import JsonLinesSink, StdoutSink
from streamgrok.pipeline.triggers import At


def parse_time(text: str) -> float:
    """'90', '90s', '1:30', '1m30s' -> seconds."""
    text = text.strip()
    if ":" in text:
        minutes, seconds = text.split(":", 1)
        return int(minutes) * 60 + float(seconds)
    match = re.fullmatch(r"(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?", text)
    if not text or match is None:
        raise ValueError(f"not a time: {text!r} (use 10s, 1m30s or 1:30)")
    return float(match.group(1) or 0) * 60 + float(match.group(2) or 0)


def progress_line(info: dict) -> str:
    """One plain progress line: every sampled frame is either used or dropped for a reason."""
    kv = info["kv_pages_used"] / max(1, info["kv_pages_total"])
    drops = info.get("frame_drops") or {}
    why = ", ".join(f"{n} {reason}" for reason, n in (
        ("duplicates", drops.get("duplicate", 0)), ("too late", drops.get("stale", 0)),
        ("queue full", drops.get("queue", 0))) if n)
    sampled, dropped = info["frames_sampled"], info["frames_dropped"]
    frames = f"{sampled} frames sampled: {max(0, sampled - dropped)} used"
    if dropped:
        frames += f", {dropped} dropped ({why})" if why else f", {dropped} dropped"
    return (f"  .. stream {info['stream_time']:6.1f} s | {frames} | {info['notes']} notes | "
            f"KV {info['kv_pages_used']} pages in use ({kv:.1%}), "
            f"{info['evicted_tokens']} tokens evicted")


async def run_pipeline_file(
    loaded: LoadedModel,
    path: str,
    source: str,
    options: dict[str, Any],
    asks: list[tuple[float | None, str]],
    cache: CacheConfig,
    jsonl: str | None = None,
    show_notes: bool = True,
) -> int:
    options.setdefault("hidden_size", loaded.config.hidden_size)
    resources = SharedResources(NativeMediaPool(workers=1))
    try:
        return await _run_pipeline(loaded, load_pipeline(path, options, resources), resources,
                                   source, asks, cache, jsonl, show_notes)
    finally:
        resources.close()


def describe_vision(path: dict) -> str:
    """One line on what the model sees of the frames."""
    if path["kind"] == "vlm":
        weights = ", RANDOM weights" if path.get("random_weights") else ""
        return (f"frames through the model's {path['family']} vision tower "
                f"({path['tokens_per_frame']} tokens a frame{weights})")
    if path["kind"] == "clip":
        return f"frames through CLIP + projector ({path['tokens_per_frame']} tokens a frame)"
    return "no frame tokens (the model reads the observers' notes)"


async def _run_pipeline(
    loaded: LoadedModel,
    pipeline: Pipeline,
    resources: SharedResources,
    source: str,
    asks: list[tuple[float | None, str]],
    cache: CacheConfig,
    jsonl: str | None,
    show_notes: bool,
) -> int:
    stdout = StdoutSink(notes=show_notes)
    sinks: list = [stdout]
    if jsonl:
        sinks.append(JsonLinesSink(jsonl))
    end = float("inf")
    triggers = [At(q, seconds=end if at is None else at) for at, q in asks]
    async with Engine(loaded, cache) as engine:
        runner = PipelineRunner(pipeline, engine, sinks,
                                progress=lambda info: stdout.progress(progress_line(info)),
                                resources=resources)
        runner.start()
        print(f"pipeline {pipeline.name} on {source} "
              f"({'live' if pipeline.ingest.live else 'as fast as possible'}, "
              f"{pipeline.ingest.fps:g} fps sampled); {describe_vision(runner.vision_path())}; "
              f"answers from the {runner.answer_context()}")
        stats = await runner.run(source, triggers)
        snap = engine.snapshot()
    for sink in sinks:
        if hasattr(sink, "close"):
            sink.close()
    answered = stats.answers
    ttfts = [a["ttft_ms"] for a in answered if a.get("ttft_ms") is not None]
    print(f"\nstream {stats.stream_time:.1f} s: {stats.notes} notes, {stats.frame_tokens} frame "
          f"tokens, {stats.errors} errors; {len(answered)} answers"
          + (f", TTFT mean {sum(ttfts) / len(ttfts):.0f} ms" if ttfts else ""))
    print(f"engine: {snap.steps} steps (p50 {snap.step_ms_p50:.0f} ms), "
          f"{snap.prefill_tokens} prefill + {snap.decode_tokens} decode tokens; "
          f"KV peak pages in use now {snap.kv_pages_used}/{snap.kv_pages_total}, "
          f"evicted {snap.evicted_tokens} tokens")
    if stats.stream_time == 0 and stats.notes == 0 and stats.frame_tokens == 0:
        print(f"streamgrok: error: nothing could be read from {source}", file=sys.stderr)
        return 2
    return 0


def run_command(loaded: LoadedModel, args, cache: CacheConfig) -> int:
    """Run `args.pipeline` on `args.source` with the questions `--ask`/`--ask-at` give."""
    asks = [(None, q) for q in args.ask or []]
    asks += [(parse_time(t), q) for t, q in args.ask_at or []]
    options = parse_options(args.set or [])
    if args.live:
        options["live"] = "true"
    return asyncio.run(run_pipeline_file(loaded, args.pipeline, args.source, options, asks,
                                         cache, args.jsonl, not args.quiet_notes))
