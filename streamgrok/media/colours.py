"""Colours in words: the nearest of a small named palette."""

from __future__ import annotations

import cv2
import numpy as np

PALETTE = {  # RGB
    "black": (20, 20, 20), "white": (235, 235, 235), "grey": (128, 128, 128),
    "dark grey": (75, 75, 75),
    "red": (200, 30, 30), "orange": (240, 140, 30), "yellow": (235, 215, 40),
    "green": (40, 160, 60), "blue": (40, 80, 200), "purple": (130, 50, 160),
    "pink": (235, 130, 170), "brown": (120, 75, 40), "beige": (215, 195, 160),
}
NAMES = list(PALETTE)
COLOURS = np.array(list(PALETTE.values()), dtype=np.float32)


def colour_name(rgb: np.ndarray) -> str:
    """The palette name nearest to one RGB colour."""
    distances = ((COLOURS - np.asarray(rgb, np.float32)) ** 2).sum(-1)
    return NAMES[int(distances.argmin())]


def dominant_colours(image: np.ndarray, count: int = 2) -> list[str]:
    """Names of the `count` most common palette colours of an RGB image."""
    return [name for name, _ in colour_shares(image)[:count]]


def colour_shares(image: np.ndarray) -> list[tuple[str, float]]:
    """(palette name, share of the image) for the colours present, most common first."""
    small = cv2.resize(image, (32, 32), interpolation=cv2.INTER_AREA).reshape(-1, 3)
    distances = ((small[:, None, :].astype(np.float32) - COLOURS[None]) ** 2).sum(-1)
    votes = np.bincount(distances.argmin(1), minlength=len(NAMES)) / len(small)
    return [(NAMES[i], float(votes[i])) for i in votes.argsort()[::-1] if votes[i] > 0]
