"""Offline observers with OpenCV (<5): faces (Haar), people (HOG), motion, scene cuts, colours.

They give a pipeline real, honest notes about the video when no CLIP weights are configured.
"""

from __future__ import annotations

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


class FrameObserver:
    """Describes a sampled frame in a short note; repeats nothing that did not change."""

    def __init__(self, detectors: FrameDetectors | None = None, faces: bool = True,
                 people: bool = True, colours: bool = True, analysis_width: int = 400) -> None:
        self.detectors = detectors or Detectors()
        self.find_faces = faces
        self.find_people = people
        self.colours = colours
        self.width = analysis_width
        self._previous_gray: np.ndarray | None = None
        self._last_summary = ""

    def observe(self, frame: VideoFrame) -> Note | None:
        """A note when the description changed (or at a scene cut), else None."""
        image = _resize_to_width(frame.image, self.width)
        gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
        parts, tags = [], set()
        faces, people = 0, 0
        if self.find_faces or self.find_people:
            faces, people = self.detectors.detect(image, self.find_faces, self.find_people)
        if people:
            parts.append(f"{people} {'person' if people == 1 else 'people'}")
            tags.add("person")
        if faces:
            parts.append(f"{faces} face{'s' if faces > 1 else ''}")
            tags.add("face")
        motion = self.motion(gray)
        if motion >= 0.05:
            parts.append(f"motion {motion:.0%}")
            tags.add("motion")
        if self.colours:
            parts.append("colours " + ", ".join(dominant_colours(image)))
        summary = "; ".join(parts) if parts else "no people"
        cut = frame.scene_cut
        if cut:
            tags.add("cut")
        if summary == self._last_summary and not cut:
            return None
        self._last_summary = summary
        text = ("scene cut; " if cut else "") + summary
        return Note(text, frame.pts, source=frame.index, tags=tags)

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
