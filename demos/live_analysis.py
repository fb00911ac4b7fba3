"""Live-analysis client: stream a video file to a running `streamgrok serve` in real time as
a fragmented MP4 (as ffmpeg or a MediaRecorder would; any file PyAV reads is remuxed to one
first, without re-encoding), ask questions at set times, print answers and events with
timestamps. Concurrent answers print whole, one at a time; only the first streams live.

    streamgrok serve pipelines/live_qa.py &
    python demos/live_analysis.py --ask-at 3 "Who is on screen?" --ask-at 12 "What happened?"
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import time
from pathlib import Path

import av
from websockets.asyncio.client import connect

from streamgrok.media.items import format_time
from streamgrok.server.protocol import pack_media

DEFAULT_CLIP = Path(__file__).parent / "media" / "demo.mp4"
FRAGMENTED = {"movflags": "frag_keyframe+empty_moov+default_base_moof"}


def fragmented_mp4(path: str) -> tuple[bytes, float]:
    """The file's video and audio streams remuxed (stream copy) into a fragmented MP4 that
    can be sent as it is read, and the clip's duration in seconds."""
    try:
        source = av.open(path)
    except (av.error.FFmpegError, OSError) as exc:
        raise SystemExit(f"live_analysis: cannot read {path}: {exc}") from None
    out = io.BytesIO()
    with source, av.open(out, "w", format="mp4", options=FRAGMENTED) as target:
        streams = {}
        for stream in source.streams:
            if stream.type in ("video", "audio"):
                try:
                    streams[stream.index] = target.add_stream_from_template(stream)
                except (av.error.FFmpegError, ValueError) as exc:
                    raise SystemExit(f"live_analysis: {stream.codec_context.name} cannot go "
                                     f"into MP4 without re-encoding: {exc}") from None
        if not any(s.type == "video" for s in source.streams):
            raise SystemExit(f"live_analysis: {path} has no video stream")
        for packet in source.demux(*[s for s in source.streams if s.index in streams]):
            if packet.dts is None:  # the demuxer's flush packet
                continue
            packet.stream = streams[packet.stream.index]
            target.mux(packet)
        duration = float(source.duration / av.time_base) if source.duration else 0.0
    return out.getvalue(), duration


class AnswerPrinter:
    """One answer streams at a time; the others are kept and printed whole when the live
    one is done, so two answers never interleave token by token."""

    def __init__(self) -> None:
        self.live: str | None = None
        self.waiting: dict[str, list[str]] = {}
        self.done: dict[str, str] = {}
        self.held: list[str] = []  # event lines that came while an answer streamed

    def event(self, line: str) -> None:
        if self.live is None:
            print(line)
        else:
            self.held.append(line)

    def delta(self, query: str, text: str) -> None:
        if self.live is None:
            self.live = query
            print(f"  > {query} ", end="")
        if query == self.live:
            print(text, end="", flush=True)
        else:
            self.waiting.setdefault(query, []).append(text)

    def finish(self, query: str, summary: str) -> None:
        if query != self.live and self.live is not None:
            self.done[query] = summary
            return
        if self.live is None:
            print(f"  > {query} " + "".join(self.waiting.pop(query, [])), end="")
        print(f"\n    ({summary})")
        self.live = None
        for other in list(self.waiting):  # the next one: whole if done, else live from here
            print(f"  > {other} " + "".join(self.waiting.pop(other)), end="", flush=True)
            if other in self.done:
                print(f"\n    ({self.done.pop(other)})")
                continue
            self.live = other
            break
        if self.live is None:
            for line in self.held:
                print(line)
            self.held.clear()


async def main(args: argparse.Namespace) -> None:
    url = f"ws://{args.host}:{args.port}/ws" + (f"?token={args.token}" if args.token else "")
    data, clip_seconds = fragmented_mp4(args.video)
    duration = args.duration or clip_seconds or 14.0
    printer = AnswerPrinter()
    async with connect(url, max_size=2**24) as ws:
        await ws.send(json.dumps({"type": "session.start", "id": "start",
                                  "options": {"fps": args.fps}}))
        started = time.monotonic()
        pending = sorted(args.ask_at or [], key=lambda x: float(x[0]))
        finished = asyncio.Event()
        open_queries: set[str] = set()

        async def send_media() -> None:
            # push the file in chunks paced so the clip plays out over its duration
            chunk = max(4096, len(data) // max(1, int(duration * 4)))
            for start in range(0, len(data), chunk):
                await ws.send(pack_media("video.chunk", 0, time.monotonic() - started,
                                         data[start : start + chunk]))
                await asyncio.sleep(0.25)
            while pending:
                await asyncio.sleep(0.2)

        async def ask() -> None:
            for i, (at, question) in enumerate(pending[:]):
                await asyncio.sleep(max(0.0, float(at) - (time.monotonic() - started)))
                query_id = f"q{i + 1}"
                open_queries.add(query_id)
                print(f"[{format_time(time.monotonic() - started)}] Q {query_id}: {question}")
                await ws.send(json.dumps({"type": "query", "id": query_id, "text": question}))
                pending.remove((at, question))

        async def receive() -> None:
            async for raw in ws:
                m = json.loads(raw)
                if m["type"] == "response.delta":
                    printer.delta(str(m["query_id"]), m["delta"])
                elif m["type"] == "response.done":
                    printer.finish(str(m["query_id"]), f"{m['query_id']}: {m['tokens']} "
                                   f"tokens, TTFT {m['ttft_ms']} ms")
                    open_queries.discard(m["query_id"])
                    if not pending and not open_queries:
                        finished.set()
                elif m["type"] == "event":
                    printer.event(f"[{format_time(m.get('t') or 0)}] {m['kind']}: {m['text']}")
                elif m["type"] == "error":
                    print(f"error {m['code']}: {m['message']}", file=sys.stderr)

        receiver = asyncio.create_task(receive())
        await asyncio.gather(send_media(), ask())
        await asyncio.wait_for(finished.wait(), timeout=300)
        receiver.cancel()


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("video", nargs="?", default=str(DEFAULT_CLIP))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--token", default=None)
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds to stream over (default: the clip's own length)")
    parser.add_argument("--ask-at", action="append", nargs=2, metavar=("SECONDS", "QUESTION"))
    args = parser.parse_args()
    if not args.ask_at:
        args.ask_at = [("3", "Who is on screen?"), ("12", "What has happened so far?")]
    args.ask_at = [tuple(a) for a in args.ask_at]
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
