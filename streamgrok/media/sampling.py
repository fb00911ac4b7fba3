"""Frame sampling at a target rate and a cheap pixel-difference pre-filter.

The pre-filter follows vllm-omni: compare a 64x64 thumbnail with that of the last kept
frame and skip frames that barely changed. A scene cut is always kept and marked
(`SceneCutDetector`).
"""

from __future__ import annotations

from dataclasses import dataclass

import cv2
import numpy as np

from streamgrok.media.items import VideoFrame


class RateSampler:
    """Keep at most `fps` frames per second of presentation time."""

    def __init__(self, fps: float) -> None:
        if fps <= 0:
            raise ValueError(f"fps must be > 0, got {fps}")
        self.interval = 1.0 / fps
        self._next = None

    def keep(self, frame: VideoFrame) -> bool:
        if self._next is not None and frame.pts + 1e-6 < self._next:
            return False
        self._next = frame.pts + self.interval
        return True


@dataclass(frozen=True)
class Thumbnail:
    gray: np.ndarray  # 16x16, float32
    colour: np.ndarray  # 16x16x3, float32
    hue_saturation: np.ndarray  # normalised 12x4 histogram
    texture: np.ndarray  # normalised gradient-orientation histogram (8 bins) of 64x64
    energy: float  # mean gradient magnitude of 64x64


class SceneCutDetector:
    """A cut is a change of the picture's layout, not of its lighting: the correlation of
    brightness-normalised 16x16 thumbnails drops below `layout`, or below `changed` while
    the hue/saturation histogram or the mean brightness also changed a lot; and in any case
    at least `area` of the picture changed colour clearly. Pictures with almost no structure
    (flat colour) are compared by colour and brightness alone. An object moving or entering
    over a still background, a change of exposure or contrast, or noise is not a cut."""

    def __init__(self, layout: float = 0.35, changed: float = 0.7, colour: float = 0.5,
                 brightness: float = 30.0, flat_std: float = 4.0, area: float = 0.4,
                 cell: float = 20.0) -> None:
        self.layout, self.changed, self.area, self.cell = layout, changed, area, cell
        self.colour, self.brightness, self.flat_std = colour, brightness, flat_std

    @staticmethod
    def thumbnail(image: np.ndarray) -> Thumbnail:
        small = cv2.resize(image, (16, 16), interpolation=cv2.INTER_AREA)
        gray = cv2.cvtColor(small, cv2.COLOR_RGB2GRAY).astype(np.float32)
        hsv = cv2.cvtColor(small, cv2.COLOR_RGB2HSV)
        hist = cv2.calcHist([hsv], [0, 1], None, [12, 4], [0, 180, 0, 256]).flatten()
        fine = cv2.cvtColor(cv2.resize(image, (64, 64), interpolation=cv2.INTER_AREA),
                            cv2.COLOR_RGB2GRAY).astype(np.float32)
        magnitude, angle = cv2.cartToPolar(cv2.Sobel(fine, cv2.CV_32F, 1, 0),
                                           cv2.Sobel(fine, cv2.CV_32F, 0, 1))
        bins = (angle % np.pi / np.pi * 8).astype(int).clip(0, 7)  # orientation, not sign
        texture = np.bincount(bins.ravel(), magnitude.ravel(), minlength=8)
        return Thumbnail(gray, small.astype(np.float32), hist / max(float(hist.sum()), 1.0),
                         texture / max(float(texture.sum()), 1e-6), float(magnitude.mean()))

    def is_cut(self, before: Thumbnail, after: Thumbnail) -> bool:
        changed = float((np.abs(before.colour - after.colour).max(axis=2) > self.cell).mean())
        if changed >= self.area and self._looks_different(before, after):
            return True
        # two textures of the same colour (brick, grass) differ in their edges alone
        low, high = sorted((before.energy, after.energy))
        orientation = 0.5 * float(np.abs(before.texture - after.texture).sum())
        return high > 8.0 and (orientation >= 0.15 or high >= 1.6 * low) and \
            float(before.gray.std()) < self.flat_std * 4 and \
            float(after.gray.std()) < self.flat_std * 4

    def _looks_different(self, before: Thumbnail, after: Thumbnail) -> bool:
        colour = 0.5 * float(np.abs(before.hue_saturation - after.hue_saturation).sum())
        brightness = abs(float(before.gray.mean() - after.gray.mean()))
        spread_a, spread_b = float(before.gray.std()), float(after.gray.std())
        if min(spread_a, spread_b) < self.flat_std:
            return (colour >= self.colour or brightness >= self.brightness * 2 / 3
                    or abs(spread_a - spread_b) >= 15.0)
        correlation = float((((before.gray - before.gray.mean()) / spread_a)
                             * ((after.gray - after.gray.mean()) / spread_b)).mean())
        if correlation < self.layout:
            return True
        return correlation < self.changed and \
            (colour >= self.colour or brightness >= self.brightness)


@dataclass
class DedupStats:
    seen: int = 0
    kept: int = 0
    cuts: int = 0

    @property
    def dropped(self) -> int:
        return self.seen - self.kept


class PixelDedup:
    """Drop frames whose 64x64 colour thumbnail differs from the last kept one by less than
    `threshold` (mean absolute difference, 0-255) overall and by less than `block_threshold`
    in every 8x8 block (so a small object appearing still counts); keep scene cuts always."""

    def __init__(self, threshold: float = 2.0, size: int = 64, block_threshold: float = 20.0,
                 cuts: SceneCutDetector | None = None):
        self.threshold = threshold
        self.block_threshold = block_threshold
        self.cuts = cuts or SceneCutDetector()
        self.size = size
        self._last_thumb: np.ndarray | None = None
        self._last_layout: Thumbnail | None = None
        self.stats = DedupStats()

    def keep(self, frame: VideoFrame) -> bool:
        self.stats.seen += 1
        small = cv2.resize(frame.image, (self.size, self.size), interpolation=cv2.INTER_AREA)
        thumb = small.astype(np.float32)
        layout = self.cuts.thumbnail(small)
        if self._last_thumb is None:
            keep = True
        else:
            delta = np.abs(thumb - self._last_thumb).max(axis=2)  # colour counts, not only
            # brightness: a red ball on grey has about the grey's brightness
            blocks = delta.reshape(self.size // 8, 8, self.size // 8, 8).mean(axis=(1, 3))
            frame.scene_cut = self.cuts.is_cut(self._last_layout, layout)
            keep = (frame.scene_cut or float(delta.mean()) >= self.threshold
                    or float(blocks.max()) >= self.block_threshold)
        if keep:
            self._last_thumb, self._last_layout = thumb, layout
            self.stats.kept += 1
            self.stats.cuts += int(frame.scene_cut)
        return keep
