"""Offline observers with OpenCV (<5): faces (Haar), people (HOG), motion, scene cuts, colours.

They give a pipeline real, honest notes about the video when no CLIP weights are configured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import cv2
import numpy as np

from streamgrok.media.items import Note, VideoFrame
from streamgrok.media.native_worker import Detectors

# Named colours for describing dominant colours in words (RGB).
PALETTE = {
    "black": (20, 20, 20), "white": (235, 235, 235), "grey": (128, 128, 128),
    "red": (200, 30, 30), "orange": (240, 140, 30), "yellow": (235, 215, 40),
    "green": (40, 160, 60), "blue": (40, 80, 200), "purple": (130, 50, 160),
    "pink": (235, 130, 170), "brown": (120, 75, 40), "beige": (215, 195, 160),
}


class FrameDetectors(Protocol):
    """Counts faces and people in an RGB frame: `native_worker.Detectors` in this process, or
    a `NativeMediaPool` that runs them in worker processes."""

    def detect(self, image: np.ndarray, faces: bool, people: bool) -> tuple[int, int]: ...


@dataclass
class DetectionSchedule:
    """When the costly detectors (Haar faces, HOG people: tens of ms a frame) run.

    At a scene cut, or on motion over `motion` at most every `min_interval_s` of stream time,
    and at least every `max_interval_s`; in between, the last counts stand. `stretch`
    multiplies both intervals (the server raises it under load)."""

    min_interval_s: float = 2.0
    max_interval_s: float = 10.0
    motion: float = 0.05
    stretch: float = 1.0

    def due(self, pts: float, last: float | None, motion: float, cut: bool) -> bool:
        if last is None or cut:
            return True
        since = pts - last
        if since < 0:  # the stream's clock went back (a new pushed stream): start over
            return True
        if since >= self.max_interval_s * self.stretch:
            return True
        return motion >= self.motion and since >= self.min_interval_s * self.stretch


@dataclass
class ObserverStats:
    """How often the detectors ran and what they cost (seconds of wall time, this thread)."""

    frames: int = 0
    detections: int = 0
    detect_seconds: float = 0.0
    other_seconds: float = 0.0  # motion, colours, resizing

    @property
    def skipped(self) -> int:
        return self.frames - self.detections


class FrameObserver:
    """Describes a sampled frame in a short note; repeats nothing that did not change."""

    def __init__(self, detectors: FrameDetectors | None = None, faces: bool = True,
                 people: bool = True, colours: bool = True, analysis_width: int = 400,
                 schedule: DetectionSchedule | None = None) -> None:
        self.detectors = detectors or Detectors()
        self.find_faces = faces
        self.find_people = people
        self.colours = colours
        self.width = analysis_width
        self.schedule = schedule or DetectionSchedule()
        self.stats = ObserverStats()
        self._previous_gray: np.ndarray | None = None
        self._last_summary = ""
        self._last_detection: float | None = None
        self._counts = (0, 0)

    def observe(self, frame: VideoFrame) -> Note | None:
        """A note when the description changed (or at a scene cut), else None."""
        started = time.perf_counter()
        image = _resize_to_width(frame.image, self.width)
        gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
        motion = self.motion(gray)
        cut = frame.scene_cut
        self.stats.frames += 1
        detect_s = 0.0
        if (self.find_faces or self.find_people) and \
                self.schedule.due(frame.pts, self._last_detection, motion, cut):
            detect_started = time.perf_counter()
            self._counts = self.detectors.detect(image, self.find_faces, self.find_people)
            detect_s = time.perf_counter() - detect_started
            self._last_detection = frame.pts
            self.stats.detections += 1
            self.stats.detect_seconds += detect_s
        faces, people = self._counts
        parts, tags = [], set()
        if people:
            parts.append(f"{people} {'person' if people == 1 else 'people'}")
            tags.add("person")
        if faces:
            parts.append(f"{faces} face{'s' if faces > 1 else ''}")
            tags.add("face")
        if motion >= 0.05:
            parts.append(f"motion {motion:.0%}")
            tags.add("motion")
        if self.colours:
            parts.append("colours " + ", ".join(dominant_colours(image)))
        summary = "; ".join(parts) if parts else "no people"
        self.stats.other_seconds += time.perf_counter() - started - detect_s
        if cut:
            tags.add("cut")
        if summary == self._last_summary and not cut:
            return None
        self._last_summary = summary
        text = ("scene cut; " if cut else "") + summary
        return Note(text, frame.pts, source=frame.index, tags=tags, state_key="observer")

    def motion(self, gray: np.ndarray) -> float:
        """Fraction of pixels that changed clearly since the previous observed frame."""
        small = cv2.resize(gray, (160, 120))
        previous, self._previous_gray = self._previous_gray, small
        if previous is None:
            return 0.0
        return float((cv2.absdiff(small, previous) > 25).mean())


def dominant_colours(image: np.ndarray, count: int = 2) -> list[str]:
    """Names of the `count` most common palette colours of the image."""
    small = cv2.resize(image, (32, 32), interpolation=cv2.INTER_AREA).reshape(-1, 3)
    palette = np.array(list(PALETTE.values()), dtype=np.float32)
    distances = ((small[:, None, :].astype(np.float32) - palette[None]) ** 2).sum(-1)
    votes = np.bincount(distances.argmin(1), minlength=len(PALETTE))
    names = list(PALETTE)
    return [names[i] for i in votes.argsort()[::-1][:count] if votes[i] > 0]


def _resize_to_width(image: np.ndarray, width: int) -> np.ndarray:
    h, w = image.shape[:2]
    if w <= width:
        return image
    return cv2.resize(image, (width, round(h * width / w)), interpolation=cv2.INTER_AREA)
