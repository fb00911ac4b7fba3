"""A client's pushed media, queued apart from its control messages.

A websocket client's messages arrive on one socket, but they are not all the same work: a
`query` or `response.cancel` needs the engine within milliseconds, while a `video.frame`
waits for a media worker to decode it (behind other sessions' frames and detectors). Handled
in arrival order, a question waited behind its own client's frames; so the connection puts
binary media on this lane, which one task per connection drains, and handles control
messages at once.

The lane is bounded. When it is full, the oldest still-queued `video.frame` is dropped
(counted: a live frame that waited that long would be stale anyway); audio and container
bytes are never dropped (a gap in either corrupts what follows), so when the lane holds
nothing but them, the receiving side waits for room, which slows that client's socket and no
other client's.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

DROPPABLE = "video.frame"


class MediaLane:
    """A bounded FIFO of one client's parsed media messages (objects with a `kind`)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a media lane needs room for at least one message")
        self.capacity = capacity
        self.dropped_frames = 0  # video frames dropped because the lane was full
        self._items: deque[Any] = deque()
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, media: Any) -> None:
        """Queue `media`; when the lane is full, drop its oldest video frame, or wait for
        room when it holds none."""
        while len(self._items) >= self.capacity:
            if self._drop_oldest_frame():
                break
            self._writable.clear()
            await self._writable.wait()
        self._items.append(media)
        self._readable.set()

    async def get(self) -> Any:
        """The oldest queued message (waits for one)."""
        while not self._items:
            self._readable.clear()
            await self._readable.wait()
        media = self._items.popleft()
        self._writable.set()
        return media

    def _drop_oldest_frame(self) -> bool:
        for i, media in enumerate(self._items):
            if media.kind == DROPPABLE:
                del self._items[i]
                self.dropped_frames += 1
                return True
        return False
