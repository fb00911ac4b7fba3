"""Resume handles: a live session outlives its connection for a while, and a client that
comes back with the session's handle (and the API key that made it) carries on with it.

The shelf owns the handles of every resumable session and the bookkeeping of the detached
ones (when they left, when they expire); the connection objects own the sessions themselves.
A handle is opaque and unguessable (`secrets`), bound to a digest of the API key its session
was made with, valid for one attachment at a time, and replaced by a new one at each resume;
the server keeps only its SHA-256 (the key), also in saved state.
Handles of sessions that ended are remembered (a bounded number) so a late client hears
`resume_expired` rather than `resume_unknown`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

from streamgrok.server.protocol import ProtocolError

ENDED_REMEMBERED = 4096  # handles of ended sessions kept to say `resume_expired`


class Resumable(Protocol):
    """What the shelf needs of a session's connection."""

    async def expire(self, reason: str) -> None:
        """End the detached session for good."""


@dataclass
class ShelfEntry:
    """One resumable session: its connection, its owner and, while detached, since when."""

    connection: Resumable
    owner: bytes  # digest of the API key its session was made with
    detached_at: float | None = None  # monotonic seconds; None while attached
    detached_wall: float | None = None  # unix seconds, for the client's gap


@dataclass
class ShelfStats:
    """What the shelf has done, for `/metrics`."""

    resumed: int = 0
    expired: int = 0  # detached past the TTL
    evicted: int = 0  # ended early to bound detached sessions or make room for a new one
    refused: int = 0  # resume requests refused (unknown, expired, forbidden, in use)


class ResumeShelf:
    """Handles of resumable sessions; detached sessions wait here until they are resumed or
    expire (`ttl_s`), at most `max_detached` at a time (the oldest goes first)."""

    def __init__(self, ttl_s: float, max_detached: int) -> None:
        self.ttl_s = ttl_s
        self.max_detached = max_detached
        self.entries: dict[str, ShelfEntry] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # handle key -> why it ended
        self.stats = ShelfStats()

    @property
    def enabled(self) -> bool:
        """Sessions are kept after a disconnect (a TTL and room for at least one)."""
        return self.ttl_s > 0 and self.max_detached > 0

    def issue(self, connection: Resumable, principal: str,
              old_key: str | None = None) -> tuple[str, str]:
        """A new handle for `connection`'s session (replacing the one of `old_key`, which
        stops working): (the handle, its key; only the key is kept)."""
        if old_key is not None and self.entries.pop(old_key, None) is not None:
            self.retire(old_key)
        handle = secrets.token_urlsafe(24)
        key = handle_key(handle)
        self.entries[key] = ShelfEntry(connection, _digest(principal))
        return handle, key

    def adopt(self, key: str, owner: bytes, connection: Resumable,
              detached_wall: float) -> None:
        """A session restored from saved state: detached since `detached_wall` (unix
        seconds; its resume time counts from then), under its saved handle's key and
        owner."""
        since = time.monotonic() - max(0.0, time.time() - detached_wall)
        self.entries[key] = ShelfEntry(connection, owner, since, detached_wall)

    def owner(self, key: str) -> bytes:
        """The owner digest of a session's handle (saved with the session)."""
        return self.entries[key].owner

    def detach(self, key: str) -> list[Resumable]:
        """The session's client left: it waits here. Returns the detached sessions that must
        now end to keep at most `max_detached` (oldest first)."""
        entry = self.entries[key]
        entry.detached_at, entry.detached_wall = time.monotonic(), time.time()
        over = len(self.detached()) - self.max_detached
        victims = [e.connection for e in self.detached()[:max(over, 0)]]
        self.stats.evicted += len(victims)
        return victims

    def claim(self, handle: object, principal: str) -> tuple[Resumable, float, float]:
        """Take a detached session back for a client offering `handle` with `principal`:
        (its connection, when it detached in unix seconds, seconds away). Raises ProtocolError
        `resume_unknown`, `resume_expired`, `resume_forbidden` (another API key made it) or
        `resume_in_use` (it is attached); the session then stays as it was."""
        if not isinstance(handle, str):
            self.stats.refused += 1
            raise ProtocolError("bad_field", "session.resume.handle must be a string")
        key = handle_key(handle)
        entry = self.entries.get(key)
        if entry is None:
            self.stats.refused += 1
            if key in self.ended:
                raise ProtocolError("resume_expired", self.ended[key])
            raise ProtocolError("resume_unknown", "no session has this resume handle")
        if not hmac.compare_digest(entry.owner, _digest(principal)):
            self.stats.refused += 1
            raise ProtocolError("resume_forbidden", "this handle's session was made with "
                                "another API key")
        if entry.detached_at is None:
            self.stats.refused += 1
            raise ProtocolError("resume_in_use", "this session is attached to another "
                                "connection; a handle works for one connection at a time")
        away = time.monotonic() - entry.detached_at
        since = entry.detached_wall
        entry.detached_at = entry.detached_wall = None
        return entry.connection, since, away

    def give_back(self, key: str, since: float, away: float) -> None:
        """A claim that could not finish (no room to bring the session back): detached
        again, as it was."""
        entry = self.entries.get(key)
        if entry is not None:
            entry.detached_wall = since
            entry.detached_at = time.monotonic() - away
        self.stats.refused += 1

    def forget(self, key: str | None) -> None:
        """The session ended: its handle stops working (and is remembered as ended)."""
        if key is None or self.entries.pop(key, None) is None:
            return
        self.retire(key)

    def retire(self, key: str, reason: str = "the session of this handle has ended "
               "(expired, ended, or replaced by a newer handle)") -> None:
        """A handle that no longer works, remembered with why (bounded)."""
        self.ended[key] = reason
        while len(self.ended) > ENDED_REMEMBERED:
            self.ended.popitem(last=False)

    def detached(self) -> list[ShelfEntry]:
        """The detached sessions, oldest first."""
        return sorted((e for e in self.entries.values() if e.detached_at is not None),
                      key=lambda e: e.detached_at)

    def expired(self, now: float) -> list[Resumable]:
        """The detached sessions past their TTL."""
        return [e.connection for e in self.detached() if now - e.detached_at >= self.ttl_s]


def handle_key(handle: str) -> str:
    """What the server keeps of a handle (in memory and in saved state): its SHA-256."""
    return hashlib.sha256(handle.encode()).hexdigest()


def _digest(principal: str) -> bytes:
    return hashlib.sha256(principal.encode()).digest()
