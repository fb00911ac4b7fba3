"""What lets a client's session outlive its connection: detaching when the socket drops,
resuming on another socket, expiring, and saving for and restoring from the next process.

`SessionResumption` is a part of `ClientConnection` (the session's one owner), kept in its own
file; it uses the connection's session, outbox and server context.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from streamgrok.errors import CacheFullError, StreamgrokError
from streamgrok.server.asgi_socket import AsgiSocket
from streamgrok.server.protocol import ProtocolError, event
from streamgrok.server.session_store import SavedSession, SessionStore

if TYPE_CHECKING:
    from streamgrok.server.connection import ClientConnection
    from streamgrok.server.session_context import SessionContext

log = logging.getLogger(__name__)


class SessionResumption:
    """Detach, resume, expire, save and restore: the resumable side of a client session."""

    # messages not kept for a detached session's client: what `response.done` (or its
    # Realtime equivalent) and the next stats carry again
    SUPERSEDED_WHILE_AWAY: tuple[str, ...] = ("response.delta", "stats")

    def _resumable(self) -> bool:
        return (self.resumable and self.runner is not None and self.resume_key is not None
                and self.context.shelf.enabled and self.context.accepting())

    async def _detach(self) -> None:
        """The client dropped: keep the session for `--resume-ttl` seconds, its KV parked
        in host memory once its running answers end (answers finishing meanwhile wait for
        the client in the outbox; their deltas and stats are not kept)."""
        self.detached = True
        self.ws = None
        self.stream_time_at_detach = self.runner.stats.stream_time
        log.info("session %s detached; resumable for %g s", self.runner.session.id,
                 self.context.shelf.ttl_s,
                 extra={"event": "session.detached", "session": self.runner.session.id})
        for victim in self.context.shelf.detach(self.resume_key):
            await victim.expire("evicted")
        if self.detached and self.runner is not None:
            self.parking = asyncio.ensure_future(self._park())

    async def _park(self) -> None:
        try:
            await self.runner.session.park()
        except StreamgrokError:  # the session ended meanwhile
            pass

    async def expire(self, reason: str) -> None:
        """End a detached session for good (its TTL passed, or it made room)."""
        if not self.detached:
            return
        log.info("detached session %s ended (%s)",
                 self.runner.session.id if self.runner else "?", reason,
                 extra={"event": "session.expired"})
        if reason == "expired":
            self.context.shelf.stats.expired += 1
        self.closed = True
        await self._end_session()
        self.detached = False
        self.context.connections.discard(self)

    async def _resume(self, message: dict) -> None:
        """`session.resume`: take a detached session back onto this socket (or, with
        `or_start`, start a new session when its handle is unknown or expired)."""
        if self.runner is not None:
            raise ProtocolError("session_exists", "session.resume while a session runs",
                                message.get("id"))
        shelf = self.context.shelf
        await self.context.restore_saved(message["handle"])  # saved by a previous process
        try:
            target, since, away = shelf.claim(message["handle"], self.ws.principal)
        except ProtocolError as exc:
            exc.message_id = message.get("id")
            if exc.code in ("resume_unknown", "resume_expired") and message.get("or_start"):
                self.error(exc.code, f"{exc}; starting a new session", message.get("id"))
                await self._start(message)
                return
            raise
        if type(target) is not type(self):
            shelf.give_back(target.resume_key, since, away)
            raise ProtocolError("bad_request", "this handle's session speaks another protocol "
                                "(Realtime sessions resume at /v1/realtime, protocol v1 ones "
                                "at /ws)", message.get("id"))
        try:
            await target.runner.session.unpark()
        except CacheFullError as exc:
            shelf.give_back(target.resume_key, since, away)
            raise ProtocolError("busy", f"no room to bring the session back now ({exc}); "
                                "retry soon", message.get("id")) from None
        target.attach(self.ws, since, away, message.get("id"))
        shelf.stats.resumed += 1
        self.handover = target

    def attach(self, ws: AsgiSocket, since: float, away: float, message_id: Any) -> None:
        """Serve this (detached) session on `ws` again: `session.resumed` first, then what
        finished while it was away, with a new resume handle."""
        self.ws, self.detached, self.closed = ws, False, False
        self.reset_rate_window()
        self.resume_handle, self.resume_key = self.context.shelf.issue(self, ws.principal,
                                                                      self.resume_key)
        held = len(self.outbox)
        gap = {"start": since, "end": since + away, "seconds": away,
               "stream_time": self.stream_time_at_detach}
        self.outbox.appendleft(("session.resumed", self.resumed_message(message_id, gap, held)))
        self.outbox_ready.set()
        log.info("session %s resumed after %.1f s (%d messages held)", self.runner.session.id,
                 away, held, extra={"event": "session.resumed", "session": self.runner.session.id})

    def resumed_message(self, message_id: Any, gap: dict, held: int) -> str:
        """The `session.resumed` message (protocol v1's shape)."""
        return event("session.resumed", id=message_id, **self.session_description(), gap=gap,
                     delivered=held)

    @classmethod
    def restored(cls, context: SessionContext, saved: SavedSession) -> ClientConnection:
        """A session saved by the previous server process, detached and resumable under its
        saved handle."""
        connection = cls(context, None)
        connection.open_session(saved.options, saved=saved)
        connection.live.tasks.append(asyncio.create_task(connection._stats_loop()))
        connection.detached = True
        connection.resume_key = saved.key
        connection.stream_time_at_detach = saved.stream_time
        connection.outbox.extend(saved.held)
        context.shelf.adopt(saved.key, saved.owner, connection, saved.detached_wall)
        context.connections.add(connection)
        return connection

    async def save(self, store: SessionStore, wait_s: float = 30.0) -> bool:
        """Write this session to the state directory for the next server process (its KV
        parked first; the client's further messages are ignored). False when it cannot
        be parked in `wait_s` seconds."""
        if self.runner is None or self.resume_key is None:
            return False
        self.frozen = True
        shelf = self.context.shelf
        detached_wall = next((e.detached_wall for e in shelf.detached()
                              if e.connection is self), None)
        try:
            if not await asyncio.wait_for(self.runner.session.park(), wait_s):
                return False
            snapshot = await self.runner.session.export()
        except (TimeoutError, StreamgrokError, RuntimeError) as exc:
            log.warning("session %s not saved: %s", self.runner.session.id, exc)
            return False
        held = [(k, t) for k, t in self.outbox if k not in self.SUPERSEDED_WHILE_AWAY] \
            if self.detached else []
        saved = SavedSession(
            self.resume_key, shelf.owner(self.resume_key), detached_wall or time.time(),
            self.options, self.runner.export_state(), snapshot,
            self.stream_time_at_detach if self.detached else self.runner.stats.stream_time,
            held)
        await asyncio.to_thread(store.save, saved)
        log.info("session %s saved for a resume after the restart", self.runner.session.id,
                 extra={"event": "session.saved", "session": self.runner.session.id})
        return True

    def resume_info(self) -> dict | None:
        """The session's resume handle and how long it outlives a dropped connection (None
        when the server keeps no session after a disconnect)."""
        if self.resume_handle is None:
            return None
        return {"handle": self.resume_handle, "ttl_s": self.context.shelf.ttl_s}
