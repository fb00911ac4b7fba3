"""Merge timestamped items from several inputs into one stream in timestamp order."""

from __future__ import annotations

import heapq
import itertools
from typing import Any


class Interleaver:
    """Items are released once every still-open input has reached their timestamp (a
    watermark), so a slow encoder cannot make a later note overtake an earlier frame.

    An input that falls more than `max_delay` seconds of stream time behind the most advanced
    one (a camera without a microphone) no longer holds the others back.
    """

    def __init__(self, inputs: list[str], max_delay: float = 2.0) -> None:
        self.max_delay = max_delay
        self._latest = {name: float("-inf") for name in inputs}
        self._open = set(inputs)
        self._heap: list[tuple[float, int, Any]] = []
        self._order = itertools.count()

    def push(self, name: str, pts: float, item: Any) -> None:
        self._latest[name] = max(self._latest[name], pts)
        heapq.heappush(self._heap, (pts, next(self._order), item))

    def advance(self, name: str, pts: float) -> None:
        """Say that input `name` has nothing earlier than `pts` left to send."""
        self._latest[name] = max(self._latest[name], pts)

    def close(self, name: str) -> None:
        self._open.discard(name)

    def ready(self) -> list[Any]:
        """Items every open input has moved past, oldest first (all of them once all closed)."""
        watermark = min((self._latest[n] for n in self._open), default=float("inf"))
        newest = max(self._latest.values(), default=float("-inf"))
        watermark = max(watermark, newest - self.max_delay)
        out = []
        while self._heap and self._heap[0][0] <= watermark:
            out.append(heapq.heappop(self._heap)[2])
        return out
