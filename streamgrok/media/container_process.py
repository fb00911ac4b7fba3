"""One pushed container stream (fragmented MP4/WebM from a browser or ffmpeg), decoded in its
own `demux_worker` process: a crash or hang inside FFmpeg ends that stream with a MediaError,
never the server. The asyncio side feeds chunks with backpressure and puts the decoded
frames and audio into the ingest's input channels, paced in real time for live sessions."""

from __future__ import annotations

import asyncio
import sys

import numpy as np

from streamgrok.channel import Channel, ChannelClosed
from streamgrok.media.decode import RealTimePacer
from streamgrok.media.items import AudioChunk, MediaError, VideoFrame
from streamgrok.media.native_pool import worker_env
from streamgrok.media.wire import read_message_async, write_message


class ContainerProcess:
    """Decodes one pushed stream in a worker process; `feed`, then `end`, while `run_into`
    delivers what it decodes."""

    def __init__(self, live: bool = True) -> None:
        self.live = live
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "streamgrok.media.demux_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=worker_env(),
            limit=2**26,
        )

    async def feed(self, chunk: bytes) -> None:
        """Send bytes to the decoder; waits while its pipe is full (backpressure)."""
        write_message(_Writer(self.process.stdin), {"op": "data"}, chunk)
        try:
            await self.process.stdin.drain()
        except (ConnectionError, BrokenPipeError) as exc:
            raise ValueError("the container decoder has stopped") from exc

    async def end(self) -> None:
        """No more bytes: the decoder finishes what it has."""
        if self.process.stdin.is_closing():
            return
        write_message(_Writer(self.process.stdin), {"op": "end"})
        self.process.stdin.close()

    async def run_into(self, video_in: Channel, audio_in: Channel) -> None:
        """Deliver decoded items until the stream ends; a dead decoder becomes a MediaError."""
        pacer = RealTimePacer()
        try:
            while True:
                try:
                    message = await read_message_async(self.process.stdout)
                except (EOFError, ValueError):
                    message = None
                if message is None:
                    code = await self.process.wait()
                    await video_in.put(MediaError(
                        f"the container decoder stopped (exit code {code}); the stream ended",
                        stage="decode"))
                    return
                header, body = message
                if header["kind"] == "end":
                    return
                item = _item(header, body)
                pts = getattr(item, "pts", None)
                if self.live and pts is not None:
                    await asyncio.sleep(pacer.delay(pts))
                await (audio_in if isinstance(item, AudioChunk) else video_in).put(item)
        except ChannelClosed:
            return

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


class _Writer:
    """Adapts an asyncio StreamWriter to `write_message` (its flush is the later drain)."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer

    def write(self, data: bytes) -> None:
        self.writer.write(data)

    def flush(self) -> None:
        pass


def _item(header: dict, body: bytes) -> VideoFrame | AudioChunk | MediaError:
    if header["kind"] == "video":
        image = np.frombuffer(body, dtype=np.uint8).reshape(header["shape"])
        return VideoFrame(image, float(header["pts"]), int(header["index"]))
    if header["kind"] == "audio":
        return AudioChunk(np.frombuffer(body, dtype=np.float32), float(header["pts"]),
                          int(header["rate"]))
    return MediaError(str(header.get("message")), pts=header.get("pts"),
                      stage=str(header.get("stage", "decode")))
