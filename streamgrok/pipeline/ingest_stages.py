"""The built-in ingest stages, on the same `Stage` contract user stages use.

Video branch: SampleFrames -> DropDuplicateFrames -> (user video stages) -> ObserveFrames ->
EncodeFrames. Audio branch: DetectSpeech -> Transcribe. A frame a stage drops becomes a
`Watermark` (nothing earlier follows on this branch), so the merge never waits for it; the
last video stage turns every remaining frame into frame tokens or a watermark.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import cv2
import torch

from streamgrok.channel import EdgePolicy
from streamgrok.errors import StreamgrokError
from streamgrok.media.audio import (
    RATE,
    SpeechDetector,
    SpeechModel,
    SpeechSegment,
    speech_notes,
)
from streamgrok.media.clip import ClipEncoder, EmbeddingDedup
from streamgrok.media.items import (
    AudioChunk,
    FrameTokens,
    MediaError,
    Tick,
    VideoFrame,
    Watermark,
)
from streamgrok.media.observers import FrameObserver
from streamgrok.media.projector import Projector
from streamgrok.media.sampling import PixelDedup, RateSampler
from streamgrok.media.speech_batcher import SpeechBatcher
from streamgrok.media.transcribers import Transcriber, Transcript
from streamgrok.pipeline.degradation import Degradation
from streamgrok.pipeline.stage import Edge, Stage
from streamgrok.vision.batcher import FrameBatcher, FrameEncodingError

if TYPE_CHECKING:
    from streamgrok.pipeline.ingest import IngestStats

TICK_SECONDS = 0.5
INNER_EDGE = Edge(capacity=4, policy=EdgePolicy.BLOCK)  # between built-in stages: the input drops


def drop_if_stale(frame: VideoFrame, max_age_s: float | None,
                  stats: IngestStats) -> list[Watermark] | None:
    """A live frame that waited past its freshness bound since it came in is dropped (and
    counted): its watermark, else None."""
    if max_age_s is None or time.monotonic() - frame.arrived <= max_age_s:
        return None
    stats.stale_dropped += 1
    return [Watermark(frame.pts)]


@dataclass
class SampleFrames(Stage):
    """Keeps at most `fps` frames a second of stream time (times the degradation's scale
    under load); a Tick every half second."""

    fps: float
    stats: IngestStats
    degradation: Degradation = field(default_factory=Degradation)
    name = "sample"
    edge = INNER_EDGE

    def __post_init__(self) -> None:
        self.sampler = RateSampler(self.fps)
        self.last_tick = float("-inf")

    @property
    def effective_fps(self) -> float:
        return self.fps * self.degradation.fps_scale

    async def process(self, item: Any) -> list[Any] | None:
        if isinstance(item, MediaError):
            self.stats.errors += 1
            return None
        if not isinstance(item, VideoFrame):
            return None
        out: list[Any] = []
        if item.pts - self.last_tick >= TICK_SECONDS:
            self.last_tick = item.pts
            out.append(Tick(item.pts))
        self.stats.decoded_frames += 1
        self.stats.stream_time = max(self.stats.stream_time, item.pts)
        self.sampler.interval = 1.0 / self.effective_fps
        if not self.sampler.keep(item):
            return [*out, Watermark(item.pts)]
        self.stats.sampled_frames += 1
        return [*out, item]


@dataclass
class DropDuplicateFrames(Stage):
    """Drops frames that barely differ from the last kept one (64x64 pixel difference); marks
    scene cuts."""

    threshold: float
    stats: IngestStats
    name = "dedup"
    edge = INNER_EDGE

    def __post_init__(self) -> None:
        self.dedup = PixelDedup(self.threshold)

    async def process(self, item: Any) -> list[Any] | None:
        if not isinstance(item, VideoFrame):
            return None
        if not self.dedup.keep(item):
            self.stats.pixel_dropped += 1
            return [Watermark(item.pts)]
        self.stats.kept_frames += 1
        return None


@dataclass
class ObserveFrames(Stage):
    """Notes from the offline observers (faces, people, motion, cuts, colours); the
    detectors run where the observer's `detectors` put them (media worker processes). A live
    frame older than `max_age_s` is dropped (stale) before any work."""

    observer: FrameObserver
    stats: IngestStats
    max_age_s: float | None = None
    degradation: Degradation = field(default_factory=Degradation)
    last: bool = False  # the branch's last stage: a frame ends here (its watermark goes on)
    name = "observe"
    edge = INNER_EDGE

    async def process(self, item: Any) -> list[Any] | None:
        if not isinstance(item, VideoFrame):
            return None
        if dropped := drop_if_stale(item, self.max_age_s, self.stats):
            return dropped
        self.observer.schedule.stretch = 1.0 / self.degradation.fps_scale
        try:
            note = await asyncio.to_thread(self.observer.observe, item)
        except (StreamgrokError, ValueError, cv2.error) as exc:  # that frame only
            self.stats.errors += 1
            return [MediaError(f"frame at {item.pts:.2f}s dropped: {exc}", pts=item.pts,
                               stage="observe"), Watermark(item.pts)]
        onward = Watermark(item.pts) if self.last else item
        if note is None:
            return [onward] if self.last else None
        self.stats.notes += 1
        return [note, onward]


@dataclass
class EncodeFrames(Stage):
    """The video stage that makes frame tokens: from the model's own vision tower (`vision`, shared
    by the engine's sessions), else from CLIP + a projector, else none. CLIP, when
    configured, is also each frame's index (text-to-frame search; with neither a tower nor a
    projector the index is all it gives): a near-duplicate CLIP embedding drops the frame.
    Last on the branch (a frame never leaves it) unless `pass_frames` hands it on to the
    observers; a frame the encoder fails on becomes an error."""

    clip: ClipEncoder | None
    projector: Projector | None
    embedding_dedup: float
    stats: IngestStats
    max_age_s: float | None = None
    vision: FrameBatcher | None = None
    pass_frames: bool = False  # the observers come after: the frame goes on to them
    name = "encode"
    edge = INNER_EDGE

    def __post_init__(self) -> None:
        self.dedup = EmbeddingDedup(self.embedding_dedup)

    async def process(self, item: Any) -> list[Any] | None:
        if not isinstance(item, VideoFrame):
            return None
        onward = item if self.pass_frames else Watermark(item.pts)
        if self.vision is None and self.clip is None:
            return [onward]
        if dropped := drop_if_stale(item, self.max_age_s, self.stats):
            return dropped
        embedding = None
        if self.clip is not None:
            embedding = await asyncio.to_thread(lambda: self.clip.encode([item.image])[0])
            if not self.dedup.keep(embedding, item.scene_cut):
                self.stats.embedding_dropped += 1
                return [Watermark(item.pts)]
        if self.vision is not None:
            try:
                rows = await self.vision.encode(item.image, item.pts)
            except FrameEncodingError as exc:
                self.stats.errors += 1
                return [MediaError(f"frame at {item.pts:.2f}s dropped: {exc}", pts=item.pts,
                                   stage="encode"), onward]
            return [FrameTokens(rows, item.pts, item.index, embedding), onward]
        if self.projector is None:  # CLIP as the frames' index only: no tokens for the model
            return [FrameTokens(torch.empty(0, 0), item.pts, item.index, embedding), onward]
        vectors = await asyncio.to_thread(lambda: self.projector(embedding[None])[0])
        return [FrameTokens(vectors, item.pts, item.index, embedding), onward]


@dataclass
class DetectSpeech(Stage):
    """Voice activity (silero-vad): audio chunks in, finished speech segments out, and a
    watermark up to where no segment can start any more."""

    stats: IngestStats
    model: SpeechModel | None = None  # shared by the sessions of a process
    name = "vad"
    edge = INNER_EDGE

    def __post_init__(self) -> None:
        self.detector = SpeechDetector(self.model)

    async def process(self, item: Any) -> list[Any] | None:
        if not isinstance(item, AudioChunk):
            return None
        self.stats.audio_seconds += item.duration
        segments = await asyncio.to_thread(self.detector.feed, item)
        heard = item.pts + item.duration
        open_since = self.detector.open_since
        return [*segments, Watermark(heard if open_since is None else min(heard, open_since))]

    async def flush(self) -> list[Any]:
        return self.detector.flush()


@dataclass
class Transcribe(Stage):
    """Speech segments -> timestamped transcript notes ("speech" when nothing decoded)."""

    transcriber: Transcriber | None
    stats: IngestStats
    name = "transcribe"
    edge = INNER_EDGE

    async def process(self, item: Any) -> list[Any] | None:
        if not isinstance(item, SpeechSegment):
            return None
        transcript = Transcript("")
        if isinstance(self.transcriber, SpeechBatcher):  # shared: waits without a thread
            transcript = await self.transcriber.transcribe_async(item.samples)
        elif self.transcriber is not None:
            transcript = await asyncio.to_thread(self.transcriber.transcribe, item.samples,
                                                 RATE)
        notes = speech_notes(item, transcript)
        self.stats.notes += len(notes)
        return notes
