"""The offline frame observer: an event log of what changed in the picture.

Scene cuts, people, faces and cat faces appearing and leaving (OpenCV Haar and HOG detectors,
counts), moving objects with colour and direction (`tracking`), the scene's colours when they
change, and text on screen (`text_reader`). A frame where nothing changed gives no note, so
the model's context holds what happened, each event with its time, not the same line again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import cv2
import numpy as np

from streamgrok.media.colours import dominant_colours
from streamgrok.media.items import Note, VideoFrame
from streamgrok.media.native_worker import Detections, Detectors
from streamgrok.media.text_reader import TextReader
from streamgrok.media.tracking import MotionTracker


class FrameDetectors(Protocol):
    """Counts faces, people and cat faces and reads text in an RGB frame:
    `native_worker.Detectors` in this process, or a `NativeMediaPool` that runs them in
    worker processes."""

    def detect(self, image: np.ndarray, faces: bool, people: bool,
               cats: bool = False) -> Detections: ...

    def read_text(self, image: np.ndarray) -> str: ...


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
    other_seconds: float = 0.0  # motion, tracking, colours, text reading, resizing

    @property
    def skipped(self) -> int:
        return self.frames - self.detections


# Detections field, one, many, the tag of a note that sees one
COUNTED = (("people", "person", "people", "person"), ("faces", "face", "faces", "face"),
           ("cats", "cat face", "cat faces", "cat"))


class FrameObserver:
    """Describes what changed since the last sampled frame in one short note, or None."""

    def __init__(self, detectors: FrameDetectors | None = None, faces: bool = True,
                 people: bool = True, cats: bool = True, colours: bool = True,
                 text: bool | None = None, analysis_width: int = 400,
                 schedule: DetectionSchedule | None = None,
                 text_schedule: DetectionSchedule | None = None) -> None:
        self.detectors = detectors or Detectors()
        self.find = {"faces": faces, "people": people, "cats": cats}
        self.colours = colours
        self.reads_text = TextReader.available() if text is None else text
        self.width = analysis_width
        self.schedule = schedule or DetectionSchedule()
        self.text_schedule = text_schedule or DetectionSchedule(3.0, 15.0, motion=0.02)
        self.tracker = MotionTracker()
        self.stats = ObserverStats()
        self._previous_gray: np.ndarray | None = None
        self._last_detection: float | None = None
        self._last_text_read: float | None = None
        self._counts = Detections()
        self._colours: tuple[str, ...] = ()
        self._colour_candidate: tuple[str, ...] = ()
        self._text = ""

    def observe(self, frame: VideoFrame) -> Note | None:
        """A note of the events in this frame, or None when nothing changed."""
        started = time.perf_counter()
        image = _resize_to_width(frame.image, self.width)
        gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
        first = self._previous_gray is None
        motion = self.motion(gray)
        cut = frame.scene_cut and not first
        new_scene = cut or first
        self.stats.frames += 1
        events: list[tuple[str, str]] = []  # (what happened, the tag of what it is about)
        tags: set[str] = set()
        if cut:
            events.append(("scene cut: a different scene", "cut"))
            tags.add("cut")
        detect_s = self._detect(image, frame.pts, motion, new_scene, events, tags)
        if self.colours:
            self._colour_events(image, new_scene, events, tags)
        moved = self.tracker.events(image, new_scene)
        if moved:
            events += [(line, "motion") for line in moved]
            tags.add("motion")
        self.text_schedule.stretch = self.schedule.stretch
        if self.reads_text and \
                self.text_schedule.due(frame.pts, self._last_text_read, motion, cut):
            self._last_text_read = frame.pts
            self._text_events(image, events, tags)
        self.stats.other_seconds += time.perf_counter() - started - detect_s
        if not events:
            return None
        if first:
            events.insert(0, ("first view", ""))
        return Note("; ".join(text for text, _ in events), frame.pts, source=frame.index,
                    tags=tags, events=tuple((text, frozenset({tag}) if tag else frozenset())
                                            for text, tag in events))

    def _detect(self, image: np.ndarray, pts: float, motion: float, cut: bool,
                events: list[tuple[str, str]], tags: set[str]) -> float:
        if not any(self.find.values()) or \
                not self.schedule.due(pts, self._last_detection, motion, cut):
            return 0.0
        started = time.perf_counter()
        counts = self.detectors.detect(image, self.find["faces"], self.find["people"],
                                       self.find["cats"])
        seconds = time.perf_counter() - started
        self._last_detection = pts
        self.stats.detections += 1
        self.stats.detect_seconds += seconds
        for field_name, one, many, tag in COUNTED:
            before, now = getattr(self._counts, field_name), getattr(counts, field_name)
            if now != before:
                events.append((count_change(now - before, now, one, many), tag))
            if now:
                tags.add(tag)
        self._counts = counts
        return seconds

    def _colour_events(self, image: np.ndarray, new_scene: bool,
                       events: list[tuple[str, str]], tags: set[str]) -> None:
        named = dominant_colours(image)  # most common first
        colours = tuple(sorted(named))
        # a change must hold for two frames, so colours near a boundary do not flip
        stable = colours == self._colour_candidate
        self._colour_candidate = colours
        if colours and (new_scene or (stable and colours != self._colours)):
            self._colours = colours
            events.append(("colours " + ", ".join(named), "colour"))
            tags.add("colour")

    def _text_events(self, image: np.ndarray, events: list[tuple[str, str]],
                     tags: set[str]) -> None:
        text = self.detectors.read_text(image)
        if same_words(text, self._text):
            return
        if text:
            events.append((f'text on screen: "{text}"', "text"))
            tags.add("text")
        elif self._text:
            events.append(("the text on screen is gone", "text"))
        self._text = text

    def motion(self, gray: np.ndarray) -> float:
        """Fraction of pixels that changed clearly since the previous observed frame."""
        small = cv2.resize(gray, (160, 120))
        previous, self._previous_gray = self._previous_gray, small
        if previous is None:
            return 0.0
        return float((cv2.absdiff(small, previous) > 25).mean())


def count_change(delta: int, now: int, one: str, many: str) -> str:
    """'1 person appeared (2 in view)', '2 faces left (none in view)'."""
    word = one if abs(delta) == 1 else many
    verb = "appeared" if delta > 0 else "left"
    return f"{abs(delta)} {word} {verb} ({now or 'none'} in view)"


def same_words(a: str, b: str) -> bool:
    """Two OCR reads show the same text (most words shared; OCR varies a little)."""
    left, right = set(a.lower().split()), set(b.lower().split())
    if not left and not right:
        return True
    return len(left & right) / max(1, len(left | right)) >= 0.5


def _resize_to_width(image: np.ndarray, width: int) -> np.ndarray:
    h, w = image.shape[:2]
    if w <= width:
        return image
    return cv2.resize(image, (width, round(h * width / w)), interpolation=cv2.INTER_AREA)
