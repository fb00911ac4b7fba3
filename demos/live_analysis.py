"""Live-analysis client: stream a video file to a running `streamgrok serve` in real time as
a fragmented MP4 (as ffmpeg or a MediaRecorder would), ask questions at set times, print
answers and events with timestamps.

    streamgrok serve pipelines/live_qa.py &
    python demos/live_analysis.py --ask-at 3 "Who is on screen?" --ask-at 12 "What happened?"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from websockets.asyncio.client import connect

from streamgrok.media.items import format_time
from streamgrok.server.protocol import pack_media

DEFAULT_CLIP = Path(__file__).parent / "media" / "demo.mp4"


async def main(args: argparse.Namespace) -> None:
    url = f"ws://{args.host}:{args.port}/ws" + (f"?token={args.token}" if args.token else "")
    data = Path(args.video).read_bytes()
    async with connect(url, max_size=2**24) as ws:
        await ws.send(json.dumps({"type": "session.start", "id": "start",
                                  "options": {"fps": args.fps}}))
        started = time.monotonic()
        pending = sorted(args.ask_at or [], key=lambda x: float(x[0]))
        finished = asyncio.Event()
        open_queries: set[str] = set()

        async def send_media() -> None:
            # push the file in chunks paced so the clip plays out over its duration
            chunk = max(4096, len(data) // max(1, int(args.duration * 4)))
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
                    print(m["delta"], end="", flush=True)
                elif m["type"] == "response.done":
                    print(f"\n  ({m['query_id']}: {m['tokens']} tokens, TTFT {m['ttft_ms']} ms)")
                    open_queries.discard(m["query_id"])
                    if not pending and not open_queries:
                        finished.set()
                elif m["type"] == "event":
                    print(f"[{format_time(m.get('t') or 0)}] {m['kind']}: {m['text']}")
                elif m["type"] == "error":
                    print(f"error {m['code']}: {m['message']}")

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
    parser.add_argument("--duration", type=float, default=14.0, help="seconds to stream over")
    parser.add_argument("--ask-at", action="append", nargs=2, metavar=("SECONDS", "QUESTION"))
    args = parser.parse_args()
    if not args.ask_at:
        args.ask_at = [("3", "Who is on screen?"), ("12", "What has happened so far?")]
    args.ask_at = [tuple(a) for a in args.ask_at]
    return args


if __name__ == "__main__":
    asyncio.run(main(parse()))
