"""Media ingest as stages joined by bounded channels (ingest_stages.py), one ordered stream out.

  decoder ─► video channel ─► sample ─► dedup ─► (user video stages) ─► observe ─► encode ─┐
  (PyAV)     (drop-oldest live, block for files)                                          ├─► merge
         └─► audio channel ─► detect speech ─► transcribe ──────────────────────────────┘

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

from streamgrok.channel import Channel, ChannelClosed, EdgePolicy
from streamgrok.media.audio import SpeechModel
from streamgrok.media.clip import ClipEncoder
from streamgrok.media.decode import RealTimePacer, decode_container
from streamgrok.media.interleave import Interleaver
from streamgrok.media.items import (
    AudioChunk,
    FrameTokens,
    MediaError,
    Note,
    Tick,
    VideoFrame,
    Watermark,
)
from streamgrok.media.observers import FrameDetectors, FrameObserver
from streamgrok.media.projector import Projector
from streamgrok.media.transcribers import Transcriber, load_transcriber
from streamgrok.pipeline.degradation import Degradation
from streamgrok.pipeline.events import PipelineEvent
from streamgrok.pipeline.ingest_stages import (
    DetectSpeech,
    DropDuplicateFrames,
    EncodeFrames,
    ObserveFrames,
    SampleFrames,
    Transcribe,
)
from streamgrok.pipeline.stage import Stage, start_chain
from streamgrok.vision.batcher import FrameBatcher


@dataclass
class IngestConfig:
    """What the ingest stages do."""

    fps: float = 1.0
    live: bool = False
    dedup_threshold: float = 2.0
    observers: bool = True
    audio: bool = True
    transcribe: bool = True
    # 'base' (Whisper base, packaged offline), another Whisper size or a local
    # faster-whisper folder, or 'pocketsphinx'
    speech_model: str = "base"
    frame_queue: int = 8
    embedding_dedup: float = 0.95
    freshness_s: float = 1.0  # live: a frame not yet observed/encoded this long is dropped

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
    stale_dropped: int = 0
    audio_seconds: float = 0.0
    notes: int = 0
    errors: int = 0
    started: float = field(default_factory=time.monotonic)
    stream_time: float = 0.0

    @property
    def dropped_frames(self) -> int:
        """Frames not turned into tokens: near-duplicates (pixels or embedding), frames
        dropped from a full live queue and live frames past their freshness bound."""
        return sum(self.drops().values())

    def drops(self) -> dict[str, int]:
        """Dropped frames by reason."""
        return {"duplicate": self.pixel_dropped + self.embedding_dropped,
                "queue": self.queue_dropped, "stale": self.stale_dropped}


class Ingest:
    """Turns one media source into an ordered stream of FrameTokens, Notes and MediaErrors."""

    def __init__(
        self,
        config: IngestConfig | None = None,
        clip: ClipEncoder | None = None,
        projector: Projector | None = None,
        transcriber: Transcriber | None = None,
        detectors: FrameDetectors | None = None,
        video_stages: list[Stage] | None = None,
        speech_model: SpeechModel | None = None,
        degradation: Degradation | None = None,
        vision: FrameBatcher | None = None,
    ) -> None:
        """`vision` (the engine's batcher over the model's own vision tower) makes frame
        tokens the model was trained on; CLIP + `projector` are the other way in, CLIP alone
        only the frames' index (dedup and text-to-frame search)."""
        self.config = config or IngestConfig()
        self.vision = vision
        self.clip = clip
        self.projector = projector
        self.detectors = detectors
        if self.config.audio and transcriber is None and self.config.transcribe:
            transcriber = load_transcriber(self.config.speech_model)
        self.transcriber = transcriber if self.config.transcribe else None
        self.video_stages = list(video_stages or [])
        self.speech_model = speech_model
        self.degradation = degradation or Degradation()
        self.stats = IngestStats()

    def stages(self) -> tuple[list[Stage], list[Stage]]:
        """Fresh (video, audio) branch stages for one run."""
        config, stats = self.config, self.stats
        max_age = config.freshness_s if config.live else None
        video: list[Stage] = [SampleFrames(config.fps, stats, self.degradation),
                              DropDuplicateFrames(config.dedup_threshold, stats),
                              *self.video_stages]
        encode = EncodeFrames(self.clip, self.projector, config.embedding_dedup, stats,
                              max_age, self.vision)
        observe = (ObserveFrames(FrameObserver(self.detectors), stats, max_age,
                                 self.degradation) if config.observers else None)
        if self.vision is not None and observe is not None:
            # the model's own frame tokens first: slow observers must not make them stale
            encode.pass_frames, observe.last = True, True
            video += [encode, observe]
        else:
            video += [s for s in (observe, encode) if s is not None]
        audio: list[Stage] = []
        if config.audio:
            audio = [DetectSpeech(stats, self.speech_model), Transcribe(self.transcriber, stats)]
        return video, audio

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
        policy = EdgePolicy.DROP_OLDEST if self.config.live else EdgePolicy.BLOCK
        return (Channel(self.config.frame_queue, policy, "video"),
                Channel(256, EdgePolicy.BLOCK, "audio"))

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
        video, audio = self.stages()
        report = _Reports()
        video_chain, video_tasks = start_chain(video, report, "video-out", source=video_in)
        audio_chain, audio_tasks = start_chain(audio, report, "audio-out", source=audio_in)
        out: Channel = Channel(64, EdgePolicy.BLOCK, "ingest-out")
        # live: an input silent for 2 s of stream time (no microphone) must not stall the rest;
        # files: strict order
        merger = Interleaver(["video", "audio"],
                             max_delay=2.0 if self.config.live else float("inf"))
        merging = asyncio.create_task(self._merge(merger, video_chain[-1], audio_chain[-1],
                                                  report, out, video_in))
        tasks = [*video_tasks, *audio_tasks, merging]
        try:
            async for item in out:
                yield item
        finally:
            video_in.close()
            audio_in.close()
            out.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.stats.queue_dropped = video_in.stats.dropped  # drops after the last item

    async def _merge(self, merger: Interleaver, video: Channel, audio: Channel,
                     report: _Reports, out: Channel, video_in: Channel) -> None:
        """Both branches into one stream in timestamp order (watermarks release items)."""
        async def release() -> None:
            for ready in [*report.take(), *merger.ready()]:
                await out.put(ready)

        async def branch(name: str, channel: Channel) -> None:
            async for item in channel:
                self.stats.queue_dropped = video_in.stats.dropped
                if isinstance(item, Watermark):
                    merger.advance(name, item.pts)
                elif isinstance(item, MediaError):
                    merger.push(name, item.pts or self.stats.stream_time, item)
                else:
                    merger.push(name, item.pts, item)
                await release()
            merger.close(name)
            await release()

        try:
            await asyncio.gather(branch("video", video), branch("audio", audio))
        finally:
            out.close()

    def _paced(self, items: Iterator, stop: threading.Event) -> Iterator:
        """In live mode, release items no earlier than their presentation time."""
        pacer = RealTimePacer()
        for item in items:
            if stop.is_set():
                return
            pts = getattr(item, "pts", None)
            if self.config.live and pts is not None:
                time.sleep(pacer.delay(pts))
                if isinstance(item, VideoFrame):
                    item.arrived = time.monotonic()
            yield item


class _Reports:
    """Errors the stages report (a stage that raised): they join the ingest stream."""

    def __init__(self) -> None:
        self.items: list[MediaError] = []

    async def __call__(self, event: PipelineEvent) -> None:
        self.items.append(MediaError(event.text, pts=event.pts,
                                     stage=getattr(event, "stage", "") or "stage"))

    def take(self) -> list[MediaError]:
        items, self.items = self.items, []
        return items


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
