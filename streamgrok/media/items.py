"""What flows between media stages: frames, audio chunks, notes, frame tokens, errors."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from streamgrok.modality import Modality

if TYPE_CHECKING:
    import torch


@dataclass(eq=False)
class VideoFrame:
    """An RGB frame [H, W, 3] uint8 at presentation time `pts` seconds."""

    image: np.ndarray
    pts: float
    index: int
    scene_cut: bool = False
    arrived: float = field(default_factory=time.monotonic)  # when it entered the pipeline


@dataclass(eq=False)
class AudioChunk:
    """Mono float32 samples at `rate` Hz starting at `pts` seconds."""

    samples: np.ndarray
    pts: float
    rate: int = 16_000

    @property
    def duration(self) -> float:
        return self.samples.shape[0] / self.rate


@dataclass(eq=False)
class Note:
    """Timestamped text about the stream (observer notes, transcripts). A note with a
    `state_key` describes the picture now: on a live stream a newer note with the same key
    replaces it while it still waits for the model."""

    text: str
    pts: float
    modality: Modality = Modality.NOTE
    source: int = -1
    tags: set[str] = field(default_factory=set)
    state_key: str | None = None
    # when the text joins several events ("; "): each with the tags of what it is about
    events: tuple[tuple[str, frozenset[str]], ...] = ()

    def stamped(self) -> str:
        """The text with its time as [mm:ss]."""
        return f"[{format_time(self.pts)}] {self.text}"


@dataclass(eq=False)
class FrameTokens:
    """Vectors in the language model's hidden size standing for one frame."""

    vectors: torch.Tensor  # [k, hidden]
    pts: float
    index: int
    embedding: torch.Tensor | None = None  # the CLIP embedding [512] it came from


@dataclass(eq=False)
class Watermark:
    """Nothing earlier than `pts` will come on this branch any more (a frame was dropped,
    audio was heard up to `pts`): lets the merge release what other branches produced."""

    pts: float


@dataclass(eq=False)
class Tick:
    """Stream time passing: emitted while frames are skipped or static, so time triggers
    downstream follow the stream even when nothing else is produced."""

    pts: float


@dataclass(eq=False)
class MediaError:
    """A decode or processing failure; the stream goes on with the next decodable data."""

    message: str
    pts: float | None = None
    stage: str = ""


def format_time(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"
