"""Commands the event loop sends the engine thread (on the engine's one command queue)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from streamgrok.cache.parking import SequenceSnapshot
from streamgrok.engine.state import SessionState


@dataclass(frozen=True)
class NewSession:
    """Start the session's sequence."""

    state: SessionState


@dataclass(frozen=True)
class CloseSession:
    """Free the session; `done` resolves when it is gone."""

    state: SessionState
    done: asyncio.Future


@dataclass(frozen=True)
class SessionInfo:
    """Resolve `done` with what the cache holds of the session."""

    state: SessionState
    done: asyncio.Future


@dataclass(frozen=True)
class ParkSession:
    """Move the session's KV out of the page pool once it is idle (no answer running, nothing
    queued); `done` resolves with the host bytes it then holds (0 when it cannot park)."""

    state: SessionState
    done: asyncio.Future


@dataclass(frozen=True)
class UnparkSession:
    """Put a parked session's KV back into pages; `done` resolves, or fails with
    CacheFullError (the session stays parked)."""

    state: SessionState
    done: asyncio.Future


@dataclass(frozen=True)
class SetContext:
    """Bound the session's context: (target, trigger) tokens per layer."""

    state: SessionState
    target: int
    trigger: int


@dataclass(frozen=True)
class RestoreSession:
    """Start the session's sequence from a snapshot, parked."""

    state: SessionState
    snapshot: SequenceSnapshot


@dataclass(frozen=True)
class ExportSession:
    """Resolve `done` with a snapshot of the (parked) session's sequence."""

    state: SessionState
    done: asyncio.Future
