"""The container worker process: demuxes and decodes one pushed MP4/WebM stream with PyAV.

Run as `python -m streamgrok.media.demux_worker` by `ContainerProcess`, one process per
pushed stream. Reads `{"op": "data"}` chunks (then `{"op": "end"}`) from stdin and writes the
decoded items to stdout: `{"kind": "video", "pts", "index", "shape"}` + RGB bytes,
`{"kind": "audio", "pts", "rate"}` + float32 samples, `{"kind": "error", ...}`, and a final
`{"kind": "end"}`. A crash inside FFmpeg ends this process only. Imports no torch.
"""

from __future__ import annotations

import sys
import threading
from typing import BinaryIO

from streamgrok.media.decode import ByteFeed, decode_container
from streamgrok.media.items import AudioChunk, MediaError, VideoFrame
from streamgrok.media.native_worker import ImageLimits
from streamgrok.media.wire import read_message, write_message


def _pump(inp: BinaryIO, feed: ByteFeed, out_lock: threading.Lock, out: BinaryIO) -> None:
    """stdin -> the byte feed PyAV reads, until `end` or the parent goes away."""
    try:
        while (message := read_message(inp)) is not None:
            header, payload = message
            if header.get("op") != "data":
                break
            feed.feed(payload)
    except (ValueError, EOFError) as exc:  # backlog over its bound, or a cut message
        with out_lock:
            write_message(out, {"kind": "error", "message": str(exc), "stage": "decode"})
    finally:
        feed.close_feed()


def serve(inp: BinaryIO, out: BinaryIO, limits: ImageLimits) -> None:
    feed = ByteFeed()
    lock = threading.Lock()
    threading.Thread(target=_pump, args=(inp, feed, lock, out), daemon=True).start()
    for item in decode_container(feed):
        if isinstance(item, VideoFrame):
            height, width = item.image.shape[:2]
            try:
                limits.check(width, height)
            except ValueError as exc:
                header, body = {"kind": "error", "message": f"video frame dropped: {exc}",
                                "pts": item.pts, "stage": "decode"}, b""
            else:
                header = {"kind": "video", "pts": item.pts, "index": item.index,
                          "shape": list(item.image.shape)}
                body = item.image.tobytes()
        elif isinstance(item, AudioChunk):
            header, body = {"kind": "audio", "pts": item.pts, "rate": item.rate}, \
                item.samples.tobytes()
        else:
            assert isinstance(item, MediaError)
            header, body = {"kind": "error", "message": item.message, "pts": item.pts,
                            "stage": item.stage}, b""
        with lock:
            write_message(out, header, body)
    with lock:
        write_message(out, {"kind": "end"})


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer, ImageLimits())
