"""Frame sampling at a target rate and a cheap pixel-difference pre-filter.

The pre-filter follows vllm-omni: compare a 64x64 grayscale thumbnail with that of the last
kept frame and skip frames that barely changed. A scene cut (a large change of the colour
histogram) is always kept and marked.
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


@dataclass
class DedupStats:
    seen: int = 0
    kept: int = 0
    cuts: int = 0

    @property
    def dropped(self) -> int:
        return self.seen - self.kept


class PixelDedup:
    """Drop frames whose 64x64 thumbnail differs from the last kept one by less than
    `threshold` (mean absolute difference, 0-255) overall and by less than `block_threshold`
    in every 8x8 block (so a small object appearing still counts); keep scene cuts always."""

    def __init__(self, threshold: float = 2.0, cut_threshold: float = 0.5, size: int = 64,
                 block_threshold: float = 20.0):
        self.threshold = threshold
        self.block_threshold = block_threshold
        self.cut_threshold = cut_threshold
        self.size = size
        self._last_thumb: np.ndarray | None = None
        self._last_hist: np.ndarray | None = None
        self.stats = DedupStats()

    def keep(self, frame: VideoFrame) -> bool:
        self.stats.seen += 1
        small = cv2.resize(frame.image, (self.size, self.size), interpolation=cv2.INTER_AREA)
        thumb = cv2.cvtColor(small, cv2.COLOR_RGB2GRAY).astype(np.float32)
        hist = cv2.calcHist([small], [0, 1, 2], None, [8, 8, 8], [0, 256] * 3).flatten()
        hist /= max(hist.sum(), 1.0)
        if self._last_thumb is None:
            keep = True
        else:
            delta = np.abs(thumb - self._last_thumb)
            blocks = delta.reshape(self.size // 8, 8, self.size // 8, 8).mean(axis=(1, 3))
            hist_change = 0.5 * float(np.abs(hist - self._last_hist).sum())  # 0..1
            frame.scene_cut = hist_change >= self.cut_threshold
            keep = (frame.scene_cut or float(delta.mean()) >= self.threshold
                    or float(blocks.max()) >= self.block_threshold)
        if keep:
            self._last_thumb, self._last_hist = thumb, hist
            self.stats.kept += 1
            self.stats.cuts += int(frame.scene_cut)
        return keep
