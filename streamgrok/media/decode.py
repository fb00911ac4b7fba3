"""Decoding with PyAV (containers, pushed fragments) and OpenCV (single JPEG/PNG frames).

All PyAV work runs on worker threads (the callers' job: see sources.py); nothing here touches
the event loop.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import av
import numpy as np

from streamgrok.errors import StreamgrokError
from streamgrok.media.items import AudioChunk, MediaError, VideoFrame
from streamgrok.media.native_worker import ImageLimits, decode_frame

AUDIO_RATE = 16_000


def decode_container(
    source: str | BinaryIO,
    video: bool = True,
    audio: bool = True,
    container_format: str | None = None,
) -> Iterator[VideoFrame | AudioChunk | MediaError]:
    """Decode every frame of a file, URL or byte stream in presentation order per stream.

    Audio is resampled to 16 kHz mono float. Undecodable packets become MediaError items and
    decoding continues with the next packet.
    """
    try:
        container = av.open(source, format=container_format, timeout=10.0)
    except (av.error.FFmpegError, OSError) as exc:
        yield MediaError(f"cannot open media: {exc}", stage="decode")
        return
    with container:
        streams = []
        if video and container.streams.video:
            streams.append(container.streams.video[0])
        if audio and container.streams.audio:
            streams.append(container.streams.audio[0])
        if not streams:
            yield MediaError("the media holds no video or audio stream", stage="decode")
            return
        resampler = av.AudioResampler(format="flt", layout="mono", rate=AUDIO_RATE)
        index = 0
        try:
            packets = container.demux(*streams)
            for packet in packets:
                try:
                    decoded = packet.decode()
                except av.error.FFmpegError as exc:
                    yield MediaError(f"undecodable {packet.stream.type} packet: {exc}",
                                     pts=_seconds(packet.pts, packet.time_base), stage="decode")
                    continue
                for frame in decoded:
                    if isinstance(frame, av.VideoFrame):
                        pts = _seconds(frame.pts, frame.time_base) or 0.0
                        yield VideoFrame(frame.to_ndarray(format="rgb24"), pts, index)
                        index += 1
                    else:
                        yield from _resample(resampler, frame)
        except av.error.FFmpegError as exc:
            yield MediaError(f"media stream ended with an error: {exc}", stage="decode")
        yield from _resample(resampler, None)


class SourceError(StreamgrokError):
    """A media source that cannot be opened or holds nothing to decode."""


def probe_source(source: str, timeout_s: float = 15.0) -> str:
    """Open `source` and decode its first frame or audio chunk; returns a one-line summary,
    or raises SourceError naming what is wrong (missing, empty, not media, unreachable,
    truncated). Run it before loading a model for the source."""
    if "://" not in source:
        path = Path(source)
        if not path.exists():
            raise SourceError(f"source not found: {source}")
        if not path.is_file():
            raise SourceError(f"source is not a regular file: {source}")
        if path.stat().st_size == 0:
            raise SourceError(f"source is empty: {source}")
    try:
        container = av.open(source, timeout=timeout_s)
    except (av.error.FFmpegError, OSError) as exc:
        raise SourceError(f"cannot open {source} as media: {exc}") from exc
    with container:
        streams = [*container.streams.video[:1], *container.streams.audio[:1]]
        if not streams:
            raise SourceError(f"{source} holds no video or audio stream")
        try:
            for packet in container.demux(*streams):
                if packet.decode():
                    break
            else:
                raise SourceError(f"{source} has no decodable frame (truncated?)")
        except av.error.FFmpegError as exc:
            raise SourceError(f"{source} cannot be decoded: {exc}") from exc
        kinds = ", ".join(f"{s.type} {s.codec_context.name}" for s in streams)
        seconds = container.duration / 1e6 if container.duration else None
    return f"{kinds}" + (f", {seconds:.1f} s" if seconds else " (live or unknown length)")


def _resample(resampler: av.AudioResampler, frame) -> Iterator[AudioChunk]:
    for out in resampler.resample(frame):
        samples = out.to_ndarray().reshape(-1).astype(np.float32)
        pts = _seconds(out.pts, out.time_base) or 0.0
        if samples.size:
            yield AudioChunk(samples, pts, AUDIO_RATE)


def _seconds(pts: int | None, time_base) -> float | None:
    return None if pts is None or time_base is None else float(pts * time_base)


def decode_image(data: bytes, pts: float, index: int,
                 limits: ImageLimits | None = None) -> VideoFrame:
    """One JPEG/PNG frame decoded in this process; raises ValueError naming the problem if it
    is not an image or its header is outside `limits` (checked before decoding). The server
    decodes in worker processes instead (`NativeMediaPool.decode_image`)."""
    return VideoFrame(decode_frame(data, limits or ImageLimits()), pts, index)


def pcm16_chunk(data: bytes, pts: float, rate: int = AUDIO_RATE) -> AudioChunk:
    """Raw little-endian PCM16 mono at 16 kHz; raises ValueError for a wrong format."""
    if rate != AUDIO_RATE:
        raise ValueError(f"audio must be PCM16 mono at {AUDIO_RATE} Hz, got {rate} Hz")
    if len(data) % 2:
        raise ValueError(f"PCM16 audio needs an even number of bytes, got {len(data)}")
    samples = np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0
    return AudioChunk(samples, pts, rate)


def container_kind(head: bytes) -> str | None:
    """'mp4' or 'webm' when `head` (the first bytes of a pushed stream) starts like a
    fragmented MP4 (an ISO-BMFF box: ftyp, styp, moof) or WebM/Matroska (EBML magic), else
    None: such bytes never reach the demuxer."""
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if len(head) >= 8 and head[4:8] in (b"ftyp", b"styp", b"moof", b"moov"):
        return "mp4"
    return None


class RealTimePacer:
    """Live pacing: how long to wait before releasing an item at presentation time `pts`,
    so a stream plays no faster than real time (the first item sets the clock)."""

    def __init__(self) -> None:
        self._start: float | None = None

    def delay(self, pts: float) -> float:
        now = time.monotonic()
        if self._start is None:
            self._start = now - pts
        return max(0.0, self._start + pts - now)


class ByteFeed(io.RawIOBase):
    """A blocking byte stream: one thread feeds chunks (e.g. MediaRecorder/ffmpeg fragments),
    PyAV reads them on another. `close_feed()` marks the end."""

    def __init__(self, max_buffered: int = 64 * 2**20) -> None:
        self._buffer = bytearray()
        self._cond = threading.Condition()
        self._ended = False
        self.max_buffered = max_buffered

    def readable(self) -> bool:
        return True

    def feed(self, chunk: bytes) -> None:
        """Add bytes; raises ValueError when the unread backlog would exceed the bound."""
        with self._cond:
            if self._ended:
                raise ValueError("the byte stream is already closed")
            if len(self._buffer) + len(chunk) > self.max_buffered:
                raise ValueError(f"media backlog over {self.max_buffered} bytes")
            self._buffer.extend(chunk)
            self._cond.notify_all()

    def close_feed(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def readinto(self, target) -> int:
        with self._cond:
            while not self._buffer and not self._ended:
                self._cond.wait()
            n = min(len(target), len(self._buffer))
            target[:n] = self._buffer[:n]
            del self._buffer[:n]
            return n
