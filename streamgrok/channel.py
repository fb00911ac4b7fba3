"""A bounded async channel with an explicit policy for when it is full (Holoscan style).

- `EdgePolicy.DROP_OLDEST` ("drop_oldest"): the oldest waiting item is dropped (live video
  frames);
- `EdgePolicy.BLOCK` ("block"): the producer waits (file sources in non-live mode, text,
  control);
- `EdgePolicy.REJECT_NEW` ("reject_new"): the new item is dropped.
A policy may be given by its name. Every drop is counted. `close()` ends the stream for the
consumer after the queued items.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Generic, TypeVar

T = TypeVar("T")


class EdgePolicy(StrEnum):
    """What a full channel does with the next item."""

    DROP_OLDEST = "drop_oldest"
    BLOCK = "block"
    REJECT_NEW = "reject_new"


POLICIES = tuple(p.value for p in EdgePolicy)


class ChannelClosed(Exception):
    """Put on a closed channel."""


@dataclass
class ChannelStats:
    put: int = 0
    taken: int = 0
    dropped: int = 0
    high_water: int = 0


class Channel(Generic[T]):
    """A bounded FIFO between two async stages."""

    def __init__(self, capacity: int, policy: EdgePolicy | str = EdgePolicy.BLOCK,
                 name: str = "") -> None:
        if capacity < 1:
            raise ValueError("channel capacity must be >= 1")
        if policy not in POLICIES:
            raise ValueError(f"unknown channel policy {policy!r} (choose from {POLICIES})")
        self.capacity, self.policy, self.name = capacity, EdgePolicy(policy), name
        self._items: deque[T] = deque()
        self._closed = False
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self.stats = ChannelStats()

    def __len__(self) -> int:
        return len(self._items)

    async def put(self, item: T) -> bool:
        """Queue an item; returns False when the policy dropped something (new or oldest)."""
        if self._closed:
            raise ChannelClosed(f"channel {self.name!r} is closed")
        delivered = True
        if len(self._items) >= self.capacity:
            if self.policy is EdgePolicy.REJECT_NEW:
                self.stats.dropped += 1
                return False
            if self.policy is EdgePolicy.DROP_OLDEST:
                self._items.popleft()
                self.stats.dropped += 1
                delivered = False
            else:
                while len(self._items) >= self.capacity and not self._closed:
                    self._writable.clear()
                    await self._writable.wait()
                if self._closed:
                    raise ChannelClosed(f"channel {self.name!r} is closed")
        self._items.append(item)
        self.stats.put += 1
        self.stats.high_water = max(self.stats.high_water, len(self._items))
        self._readable.set()
        return delivered

    async def get(self) -> T:
        """The next item; raises StopAsyncIteration once closed and empty."""
        while not self._items:
            if self._closed:
                raise StopAsyncIteration
            self._readable.clear()
            await self._readable.wait()
        item = self._items.popleft()
        self.stats.taken += 1
        self._writable.set()
        return item

    def close(self) -> None:
        self._closed = True
        self._readable.set()
        self._writable.set()

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        return await self.get()
