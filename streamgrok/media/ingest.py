"""Media ingest as async stages joined by bounded channels, one ordered stream out.

    decoder thread ─► video channel ─► sample, pixel dedup, observers, CLIP ─┐
    (PyAV)            (drop-oldest live, block for files)                   ├─► interleave ─► out
                    └► audio channel ─► VAD, transcript ───────────────────┘

Live sources are paced in real time and drop the oldest waiting frames when a stage falls
behind; file sources block instead, so nothing is lost. Audio and text are never dropped.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import cv2

from streamgrok.channel import Channel, ChannelClosed
from streamgrok.errors import StreamgrokError
from streamgrok.media.audio import AudioObserver, PocketSphinxTranscriber, Transcriber
from streamgrok.media.clip import ClipEncoder, EmbeddingDedup
from streamgrok.media.decode import decode_container
from streamgrok.media.interleave import Interleaver
from streamgrok.media.items import AudioChunk, FrameTokens, MediaError, Note, Tick, VideoFrame
from streamgrok.media.observers import FrameDetectors, FrameObserver
from streamgrok.media.projector import Projector
from streamgrok.media.sampling import PixelDedup, RateSampler

TICK_SECONDS = 0.5


@dataclass
class IngestConfig:
    """What the ingest stages do."""

    fps: float = 1.0
    live: bool = False
    dedup_threshold: float = 2.0
    observers: bool = True
    audio: bool = True
    transcribe: bool = True
    frame_queue: int = 8
    embedding_dedup: float = 0.95

    def __post_init__(self) -> None:
        if not math.isfinite(self.fps) or not 0 < self.fps <= 1000:
            raise ValueError(f"fps must be a finite number in (0, 1000], not {self.fps}")
        if self.frame_queue < 1:
            raise ValueError(f"frame_queue must be >= 1, not {self.frame_queue}")


@dataclass
class IngestStats:
    decoded_frames: int = 0
    sampled_frames: int = 0
    kept_frames: int = 0
    pixel_dropped: int = 0
    embedding_dropped: int = 0
    queue_dropped: int = 0
    audio_seconds: float = 0.0
    notes: int = 0
    errors: int = 0
    started: float = field(default_factory=time.monotonic)
    stream_time: float = 0.0

    @property
    def dropped_frames(self) -> int:
        """Frames not turned into tokens: near-duplicates (pixels or embedding) and frames
        dropped from a full live queue."""
        return self.pixel_dropped + self.embedding_dropped + self.queue_dropped


class Ingest:
    """Turns one media source into an ordered stream of FrameTokens, Notes and MediaErrors."""

    def __init__(
        self,
        config: IngestConfig | None = None,
        clip: ClipEncoder | None = None,
        projector: Projector | None = None,
        transcriber: Transcriber | None = None,
        detectors: FrameDetectors | None = None,
    ) -> None:
        self.config = config or IngestConfig()
        self.clip = clip
        self.projector = projector
        if clip is not None and projector is None:
            raise ValueError("CLIP frame tokens need a projector to the language model")
        self.observer = FrameObserver(detectors) if self.config.observers else None
        self.audio = None
        if self.config.audio:
            if transcriber is None and self.config.transcribe:
                transcriber = PocketSphinxTranscriber()
            self.audio = AudioObserver(transcriber)
        self.stats = IngestStats()

    async def run(
        self, source: str | BinaryIO, container_format: str | None = None
    ) -> AsyncIterator[FrameTokens | Note | MediaError | Tick]:
        """Decode and process `source` (path, URL or byte stream); yields in time order,
        with a Tick every half second of stream time."""
        video_in, audio_in = self.open_inputs()
        stop = threading.Event()
        decoder = asyncio.create_task(asyncio.to_thread(
            self.decode_into, source, video_in, audio_in, asyncio.get_running_loop(), stop,
            container_format, True,
        ))
        try:
            async for item in self.process(video_in, audio_in):
                yield item
        finally:
            stop.set()
            video_in.close()
            audio_in.close()
            await asyncio.gather(decoder, return_exceptions=True)

    def open_inputs(self) -> tuple[Channel, Channel]:
        """The bounded channels the stages read: video (drop-oldest when live, else block)
        and audio (block). Push VideoFrame/AudioChunk/MediaError items into them directly
        (frames and PCM from a browser) or through `decode_into` (containers)."""
        policy = "drop_oldest" if self.config.live else "block"
        return (Channel(self.config.frame_queue, policy, "video"),
                Channel(256, "block", "audio"))

    def decode_into(
        self,
        source: str | BinaryIO,
        video_in: Channel,
        audio_in: Channel,
        loop: asyncio.AbstractEventLoop,
        stop: threading.Event,
        container_format: str | None = None,
        close_when_done: bool = True,
    ) -> None:
        """Decode a container on this (worker) thread into the input channels."""
        items = decode_container(source, audio=self.config.audio,
                                 container_format=container_format)
        for item in self._paced(items, stop):
            target = audio_in if isinstance(item, AudioChunk) else video_in
            try:
                asyncio.run_coroutine_threadsafe(target.put(item), loop).result()
            except (ChannelClosed, RuntimeError):
                return
        if close_when_done:
            loop.call_soon_threadsafe(video_in.close)
            loop.call_soon_threadsafe(audio_in.close)

    async def process(
        self, video_in: Channel, audio_in: Channel
    ) -> AsyncIterator[FrameTokens | Note | MediaError | Tick]:
        """Run the stages on items pushed into the input channels until both close."""
        out: Channel = Channel(64, "block", "ingest-out")
        # live: an input silent for 2 s of stream time (no microphone) must not stall the rest;
        # files: strict order
        merger = Interleaver(["video", "audio"],
                             max_delay=2.0 if self.config.live else float("inf"))

        async def release() -> None:
            for ready in merger.ready():
                await out.put(ready)

        async def emit(name: str, pts: float, item) -> None:
            merger.push(name, pts, item)
            await release()

        async def advance(name: str, pts: float) -> None:
            merger.advance(name, pts)
            await release()

        async def finish(name: str) -> None:
            merger.close(name)
            await release()

        async def video_stage() -> None:
            sampler = RateSampler(self.config.fps)
            dedup = PixelDedup(self.config.dedup_threshold)
            embed_dedup = EmbeddingDedup(self.config.embedding_dedup)
            last_tick = float("-inf")
            async for item in video_in:
                if isinstance(item, VideoFrame) and item.pts - last_tick >= TICK_SECONDS:
                    last_tick = item.pts
                    await emit("video", item.pts, Tick(item.pts))
                if isinstance(item, MediaError):
                    self.stats.errors += 1
                    await emit("video", item.pts or self.stats.stream_time, item)
                    continue
                self.stats.decoded_frames += 1
                self.stats.stream_time = max(self.stats.stream_time, item.pts)
                if not sampler.keep(item):
                    await advance("video", item.pts)
                    continue
                self.stats.sampled_frames += 1
                if not dedup.keep(item):
                    self.stats.pixel_dropped += 1
                    await advance("video", item.pts)
                    continue
                self.stats.kept_frames += 1
                try:
                    produced = await asyncio.to_thread(self._process_frame, item, embed_dedup)
                except (StreamgrokError, ValueError, cv2.error) as exc:  # that frame only
                    self.stats.errors += 1
                    produced = [MediaError(f"frame at {item.pts:.2f}s dropped: {exc}",
                                           pts=item.pts, stage="observe")]
                for one in produced:
                    await emit("video", item.pts, one)
                await advance("video", item.pts)
            self.stats.queue_dropped += video_in.stats.dropped
            await finish("video")

        async def audio_stage() -> None:
            async for chunk in audio_in:
                if self.audio is None:
                    continue
                self.stats.audio_seconds += chunk.duration
                for note in await asyncio.to_thread(self.audio.feed, chunk):
                    self.stats.notes += 1
                    await emit("audio", note.pts, note)
                await advance("audio", self.audio.watermark(chunk.pts + chunk.duration))
            if self.audio is not None:
                for note in self.audio.flush():
                    self.stats.notes += 1
                    await emit("audio", note.pts, note)
            await finish("audio")

        async def run_all() -> None:
            try:
                await asyncio.gather(video_stage(), audio_stage())
            finally:
                out.close()

        runner = asyncio.create_task(run_all())
        try:
            async for item in out:
                yield item
        finally:
            video_in.close()
            audio_in.close()
            out.close()
            await asyncio.gather(runner, return_exceptions=True)

    def _paced(self, items: Iterator, stop: threading.Event) -> Iterator:
        """In live mode, release items no earlier than their presentation time."""
        start = None
        for item in items:
            if stop.is_set():
                return
            pts = getattr(item, "pts", None)
            if self.config.live and pts is not None:
                start = start if start is not None else time.monotonic() - pts
                delay = start + pts - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
            yield item

    def _process_frame(self, frame: VideoFrame, embed_dedup: EmbeddingDedup) -> list:
        produced: list = []
        if self.observer is not None:
            note = self.observer.observe(frame)
            if note is not None:
                self.stats.notes += 1
                produced.append(note)
        if self.clip is not None and self.projector is not None:
            embedding = self.clip.encode([frame.image])[0]
            if embed_dedup.keep(embedding, frame.scene_cut):
                vectors = self.projector(embedding[None])[0]
                produced.append(FrameTokens(vectors, frame.pts, frame.index, embedding))
            else:
                self.stats.embedding_dropped += 1
        return produced


def describe(item: FrameTokens | Note | MediaError | Tick) -> str:
    """One printable line for an ingest item."""
    if isinstance(item, Tick):
        return f"[tick {item.pts:.1f}s]"
    if isinstance(item, Note):
        return item.stamped()
    if isinstance(item, FrameTokens):
        return f"[frame {item.index} @ {item.pts:.1f}s] {item.vectors.shape[0]} tokens"
    return f"[error] {item.stage}: {item.message}"


__all__ = ["Ingest", "IngestConfig", "IngestStats", "describe"]
