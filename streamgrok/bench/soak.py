"""`streamgrok bench soak`: a real `streamgrok serve` process under many live clients.

The server runs as its own process on loopback. First one client alone measures the idle
time to first token (the baseline, in the same run) and warms the server up; the server's
RSS then is the baseline memory. Then N clients each stream a 320x240 JPEG a second and a
second of PCM audio a second (espeak-ng sentences about half the time, as `bench live`'s
speaking clients, or room noise with `--no-speech`) and ask a question every `--ask-every`
seconds, for `--seconds`.
Optionally a storm of K clients connects, asks and drops mid-answer. At the end: per-client
answers, errors, TTFT p50/p95 against the idle baseline, server RSS start/peak/end, KV pages
before/after, frames dropped by reason, and a PNG plot of RSS and TTFT over time.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from websockets.asyncio.client import connect

from streamgrok.bench.live_client import (
    PHOTOS,
    QUESTIONS,
    ClientResult,
    frame_bytes,
    live_client,
)
from streamgrok.bench.server_process import ServerProcess, serve_arguments, settle
from streamgrok.bench.speech_track import SpeechTrack, sentence_clips, speech_line, speech_summary
from streamgrok.bench.timing import milliseconds, percentile
from streamgrok.openmp_wait import set_idle_spin
from streamgrok.server.protocol import pack_media


async def storm_client(port: int, name: str, frame: bytes, limit_s: float = 120.0
                       ) -> ClientResult:
    """Connect, start, ask, and drop the connection as soon as the answer starts (or after
    `limit_s` without a first token, counted as unanswered)."""
    result = ClientResult(name)
    try:
        async with asyncio.timeout(limit_s):
            return await _storm(port, frame, result)
    except TimeoutError:
        result.errors["no first token"] += 1
        return result


async def _storm(port: int, frame: bytes, result: ClientResult) -> ClientResult:
    try:
        async with await asyncio.wait_for(connect(f"ws://127.0.0.1:{port}/ws"), 30) as ws:
            await ws.send(json.dumps({"type": "session.start", "id": result.name}))
            await ws.send(pack_media("video.frame", 0, 0.0, frame))
            await ws.send(json.dumps({"type": "query", "id": "q", "text": QUESTIONS[0]}))
            result.asked = 1
            asked = time.monotonic()
            async for raw in ws:
                message = json.loads(raw)
                if message["type"] == "response.delta":
                    result.ttfts.append(time.monotonic() - asked)
                    return result  # drop mid-answer
                if message["type"] == "error":
                    result.errors[message["code"]] += 1
                    if message["code"] in ("busy", "no_session"):
                        return result  # refused: the server is full
    except (OSError, TimeoutError):
        result.handshake_failed = True
    return result


async def run_soak(server_args: list[str], clients: int, seconds: float, ask_every: float,
                   storm: int, out: Path, speech: bool = True) -> None:
    frames = [frame_bytes(i) for i in range(10 * len(PHOTOS))]
    clips = sentence_clips() if speech else None
    if speech and clips is None:
        print("espeak-ng is not installed: the clients send room noise")
    server = ServerProcess(server_args)
    await server.start()
    samples: list[tuple[float, float]] = []
    started = time.monotonic()

    async def sample_rss() -> None:
        while True:
            samples.append((time.monotonic() - started, sum(server.rss_mb())))
            await asyncio.sleep(0.5)

    sampler = asyncio.create_task(sample_rss())
    try:
        print(f"server pid {server.process.pid} on port {server.port}; warm-up client alone")
        url = f"ws://127.0.0.1:{server.port}/ws"
        idle = await live_client(url, "idle", frames, 16.0, 1.0, 5.0, 2.0, 120.0)
        await settle(server)
        baseline_mb = sum(server.rss_mb())
        pages_before = server.metric("streamgrok_kv_pages_in_use")
        print(f"baseline: idle TTFT p50 {milliseconds(percentile(idle.ttfts, 50))} ms; server RSS "
              f"{baseline_mb:.0f} MB (media workers included); KV pages {pages_before:.0f}")
        live_started = time.monotonic() - started
        results = await asyncio.gather(*(
            live_client(url, f"c{i:02d}", frames, seconds, 1.0, ask_every,
                        offset=2.0 + ask_every * i / max(1, clients), answer_timeout=90.0,
                        speech=SpeechTrack(clips, first=i, seed=i) if clips else None)
            for i in range(clients)))
        live_ended = time.monotonic() - started
        storm_results = []
        if storm:
            storm_results = await asyncio.gather(*(
                storm_client(server.port, f"s{i:02d}", frames[i % len(frames)])
                for i in range(storm)))
        await settle(server)
        await asyncio.sleep(2.0)
        end_mb = sum(server.rss_mb())
        pages_after = server.metric("streamgrok_kv_pages_in_use")
        peak_mb = max(mb for _, mb in samples)
    finally:
        sampler.cancel()
        code = await server.stop()
    idle_ttft = percentile(idle.ttfts, 50)
    _print_report(results, storm_results, idle_ttft, baseline_mb, peak_mb, end_mb,
                  pages_before, pages_after, code)
    _plot(out, samples, results, live_started, live_ended, baseline_mb)


def _print_report(results, storm_results, idle_ttft, baseline_mb, peak_mb, end_mb,
                  pages_before, pages_after, exit_code) -> None:
    print(f"\n{'client':8} {'asked':>5} {'answered':>8} {'TTFT p50':>9} {'TTFT p95':>9} "
          f"{'frames dropped':>14} {'rate-limited':>12}  errors")
    for r in results:
        print(f"{r.name:8} {r.asked:5d} {r.answered:8d} {milliseconds(percentile(r.ttfts, 50)):>9} "
              f"{milliseconds(percentile(r.ttfts, 95)):>9} {r.drops.get('frames', 0):14d} "
              f"{r.drops.get('rate_limited', 0):12d}  {dict(r.errors) or '-'}")
    ttfts = [t for r in results for t in r.ttfts]
    asked = sum(r.asked for r in results)
    answered = sum(r.answered for r in results)
    p95 = percentile(ttfts, 95)
    print(f"\nlive: {len(results)} clients, {answered}/{asked} questions answered; TTFT p50 "
          f"{milliseconds(percentile(ttfts, 50))} ms, p95 {milliseconds(p95)} ms (idle baseline "
          f"{milliseconds(idle_ttft)} ms: p95 x{p95 / idle_ttft:.1f})")
    print("frames dropped by reason: " + ", ".join(
        f"{reason} {sum(r.drops.get(reason, 0) for r in results)}"
        for reason in ("frames", "rate_limited", "outbound")))
    if (speech := speech_summary(results)) is not None:
        print(f"speech: {speech_line(speech)}")
    if storm_results:
        failed = sum(r.handshake_failed for r in storm_results)
        print(f"storm: {len(storm_results)} clients connected, asked and dropped mid-answer; "
              f"{failed} handshakes failed; first-token p95 "
              f"{milliseconds(percentile([t for r in storm_results for t in r.ttfts], 95))} ms")
    print(f"server RSS: baseline {baseline_mb:.0f} MB, peak {peak_mb:.0f} MB, end "
          f"{end_mb:.0f} MB (end/baseline x{end_mb / baseline_mb:.3f})")
    print(f"KV pages: before {pages_before:.0f}, after {pages_after:.0f}; server exit code "
          f"{exit_code} after SIGTERM")


def _plot(out: Path, samples, results, live_started, live_ended, baseline_mb) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=False)
    top.plot([t for t, _ in samples], [mb for _, mb in samples], label="server + workers RSS")
    top.axhline(baseline_mb, color="grey", linestyle="--", label="warmed-up baseline")
    top.axvspan(live_started, live_ended, alpha=0.1, label="live clients")
    top.set_xlabel("seconds")
    top.set_ylabel("MB")
    top.legend()
    ttfts = sorted(t for r in results for t in r.ttfts)
    bottom.plot(ttfts, [i / max(1, len(ttfts)) for i in range(1, len(ttfts) + 1)])
    bottom.set_xlabel("time to first token (s)")
    bottom.set_ylabel("fraction of answers")
    fig.tight_layout()
    path = out / "soak.png"
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def run_soak_bench(args) -> None:
    """Entry point of `streamgrok bench soak`."""
    set_idle_spin()  # the server it starts inherits it
    asyncio.run(run_soak(serve_arguments(args), args.clients, args.seconds, args.ask_every,
                         args.storm, Path(args.out), args.speech))
