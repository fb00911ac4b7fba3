"""Offline observers with OpenCV (<5): faces (Haar), people (HOG), motion, scene cuts, colours.

They give a pipeline real, honest notes about the video when no CLIP weights are configured.
"""

from __future__ import annotations

import cv2
import numpy as np

from streamgrok.media.items import Note, VideoFrame

# Named colours for describing dominant colours in words (RGB).
PALETTE = {
    "black": (20, 20, 20), "white": (235, 235, 235), "grey": (128, 128, 128),
    "red": (200, 30, 30), "orange": (240, 140, 30), "yellow": (235, 215, 40),
    "green": (40, 160, 60), "blue": (40, 80, 200), "purple": (130, 50, 160),
    "pink": (235, 130, 170), "brown": (120, 75, 40), "beige": (215, 195, 160),
}


class FrameObserver:
    """Describes a sampled frame in a short note; repeats nothing that did not change."""

    def __init__(self, faces: bool = True, people: bool = True, colours: bool = True,
                 analysis_width: int = 400) -> None:
        self.faces = cv2.CascadeClassifier(
            cv2.data.haarcascades + "haarcascade_frontalface_default.xml"
        ) if faces else None
        self.hog = None
        if people:
            self.hog = cv2.HOGDescriptor()
            self.hog.setSVMDetector(cv2.HOGDescriptor_getDefaultPeopleDetector())
        self.colours = colours
        self.width = analysis_width
        self._previous_gray: np.ndarray | None = None
        self._last_summary = ""

    def observe(self, frame: VideoFrame) -> Note | None:
        """A note when the description changed (or at a scene cut), else None."""
        image = _resize_to_width(frame.image, self.width)
        gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
        parts, tags = [], set()
        faces = self.count_faces(gray)
        people = self.count_people(image)
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

    def count_faces(self, gray: np.ndarray) -> int:
        if self.faces is None:
            return 0
        found = self.faces.detectMultiScale(gray, scaleFactor=1.1, minNeighbors=5,
                                            minSize=(24, 24))
        return len(found)

    def count_people(self, image: np.ndarray) -> int:
        if self.hog is None:
            return 0
        rects, weights = self.hog.detectMultiScale(image, winStride=(8, 8), padding=(8, 8),
                                                   scale=1.05)
        return int(sum(1 for w in np.ravel(weights) if w > 0.5))

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
