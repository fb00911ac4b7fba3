"""Moving objects from background subtraction (OpenCV MOG2) on sampled frames, tracked by
position and colour, reported as events: appeared, moving in a direction, left.

Works on the frames an observer sees (1-2 a second on live streams), so the background model
learns fast and a cut resets it. A foreground blob whose colour matches the ring of
background around it is the hole a moving object left behind (a "ghost"), not an object.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import cv2
import numpy as np

from streamgrok.media.colours import colour_name

WIDTH, HEIGHT = 160, 120  # analysis size
MIN_AREA = 0.003  # of the frame
GHOST_DISTANCE = 40.0  # RGB distance under which a blob looks like its surroundings
SAME_OBJECT_RGB = 90.0  # RGB distance past which a blob is another object, however close


@dataclass
class Blob:
    x: float  # centroid, 0..1 of the frame
    y: float
    area: float  # 0..1 of the frame
    colour: str
    rgb: np.ndarray | None = None  # the median colour the name came from


@dataclass
class Track:
    colour: str
    first_x: float
    first_y: float
    x: float
    y: float
    area: float
    seen: int = 1
    missed: int = 0
    reported: bool = False
    direction: str | None = None
    rgb: np.ndarray | None = None

    def describe(self) -> str:
        return f"a {size_word(self.area)} {self.colour} object"


@dataclass
class MotionTracker:
    """Turns frames into motion events; `events(frame, pts, cut)` -> lines of text."""

    history: int = 20
    confirm: int = 2  # frames a blob must be seen before it is reported
    forget: int = 2  # frames a track may be missed before it has left
    min_travel: float = 0.15  # of the frame, before a direction is reported
    tracks: list[Track] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._subtractor = self._new_subtractor()

    def _new_subtractor(self):
        return cv2.createBackgroundSubtractorMOG2(history=self.history, varThreshold=32,
                                                  detectShadows=False)

    def events(self, image: np.ndarray, cut: bool) -> list[str]:
        """What changed among the moving objects in this RGB frame."""
        small = cv2.resize(image, (WIDTH, HEIGHT), interpolation=cv2.INTER_AREA)
        if cut:  # a new scene: nothing tracked carries over, the background is relearned
            self.tracks = []
            self._subtractor = self._new_subtractor()
        mask = self._subtractor.apply(small)
        if cut:
            return []
        return self._update(self.blobs(small, mask))

    def blobs(self, small: np.ndarray, mask: np.ndarray) -> list[Blob]:
        mask = cv2.morphologyEx(mask, cv2.MORPH_OPEN, np.ones((3, 3), np.uint8))
        count, labels, stats, centroids = cv2.connectedComponentsWithStats(mask)
        found = []
        total = WIDTH * HEIGHT
        for label in range(1, count):
            area = stats[label, cv2.CC_STAT_AREA] / total
            if area < MIN_AREA or area > 0.6:  # specks, or the whole picture changing
                continue
            inside = labels == label
            ring = cv2.dilate(inside.astype(np.uint8), np.ones((7, 7), np.uint8)).astype(bool)
            ring &= mask == 0
            colour = np.median(small[inside], axis=0)
            if ring.any() and np.linalg.norm(colour - np.median(small[ring], axis=0)) \
                    < GHOST_DISTANCE:
                continue
            x, y = centroids[label]
            found.append(Blob(x / WIDTH, y / HEIGHT, area, colour_name(colour), colour))
        return found

    def _update(self, blobs: list[Blob]) -> list[str]:
        events: list[str] = []
        unmatched = list(blobs)
        for track in self.tracks:
            match = self._closest(track, unmatched)
            if match is None:
                track.missed += 1
                continue
            unmatched.remove(match)
            track.x, track.y, track.area, track.rgb = match.x, match.y, match.area, match.rgb
            track.seen += 1
            track.missed = 0
            events += self._progress(track)
        for track in [t for t in self.tracks if t.missed > self.forget]:
            self.tracks.remove(track)
            if track.reported:
                heading = f", {track.direction}" if track.direction else ""
                events.append(f"the {track.colour} object left{heading}")
        for blob in unmatched:
            self.tracks.append(Track(blob.colour, blob.x, blob.y, blob.x, blob.y, blob.area,
                                     rgb=blob.rgb))
        return events

    def _closest(self, track: Track, blobs: list[Blob]) -> Blob | None:
        def distance(blob: Blob) -> float:
            if track.rgb is not None and blob.rgb is not None and float(
                    np.linalg.norm(blob.rgb - track.rgb)) > SAME_OBJECT_RGB:
                return float("inf")  # another colour altogether: another object
            colour_penalty = 0.0 if blob.colour == track.colour else 0.1
            return float(np.hypot(blob.x - track.x, blob.y - track.y)) + colour_penalty

        near = [b for b in blobs if distance(b) < 0.5]
        return min(near, key=distance) if near else None

    def _progress(self, track: Track) -> list[str]:
        events = []
        if not track.reported and track.seen >= self.confirm:
            track.reported = True
            events.append(f"{track.describe()} appeared {place(track.x, track.y)}")
        direction = heading(track.x - track.first_x, track.y - track.first_y,
                            self.min_travel)
        if track.reported and direction and direction != track.direction:
            track.direction = direction
            track.first_x, track.first_y = track.x, track.y  # a turn is measured from here
            events.append(f"the {track.colour} object is moving {direction}")
        return events


def heading(dx: float, dy: float, min_travel: float) -> str | None:
    """'left to right', 'right to left', 'downwards', 'upwards' or None when it barely
    moved."""
    if max(abs(dx), abs(dy)) < min_travel:
        return None
    if abs(dx) >= abs(dy):
        return "left to right" if dx > 0 else "right to left"
    return "downwards" if dy > 0 else "upwards"


def place(x: float, y: float) -> str:
    across = "left" if x < 1 / 3 else "right" if x > 2 / 3 else "centre"
    down = "top" if y < 1 / 3 else "bottom" if y > 2 / 3 else ""
    if not down:
        return "at the centre" if across == "centre" else f"on the {across}"
    return f"at the {down}" if across == "centre" else f"at the {down} {across}"


def size_word(area: float) -> str:
    return "small" if area < 0.02 else "large" if area > 0.1 else "medium-sized"
