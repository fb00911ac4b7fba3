"""What every websocket client of a live session shares, whatever protocol it speaks: the
socket's read loop, the bounded outbox and its writer, the `LiveSession` it composes, and
(through `SessionResumption`) detaching, resuming and saving.

Protocol v1 (`connection.ClientConnection`) and Realtime (`realtime.RealtimeConnection`) are
the two protocols; each turns its own messages into calls on its `LiveSession` and the
session's events into its own messages (`deliver`, `send`, `error`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from streamgrok.media.decode import AUDIO_RATE
from streamgrok.pipeline.events import PipelineEvent
from streamgrok.pipeline.pipeline import PipelineRunner
from streamgrok.server.asgi_socket import AsgiSocket, ClientGone
from streamgrok.server.live_session import LiveSession
from streamgrok.server.protocol import ProtocolError
from streamgrok.server.resumable import SessionResumption
from streamgrok.server.session_context import SessionContext
from streamgrok.server.session_store import SavedSession

log = logging.getLogger(__name__)
ESSENTIAL = {"response.done", "error", "session.started", "session.ended"}


class SessionConnection(SessionResumption):
    """One client's socket and the live session it drives; bad input gets an error
    message, never a crash.

    The session outlives a dropped socket when the server allows resumption: it waits,
    detached, until a resume with its handle attaches another socket, or its time runs out.
    """

    resumable = True  # whether its sessions may be resumed at all

    def __init__(self, context: SessionContext, ws: AsgiSocket | None) -> None:
        self.context = context  # what this connection may use of the server
        self.ws = ws
        self.config = context.config
        self.live: LiveSession | None = None
        self.audio_rate = AUDIO_RATE  # pushed PCM's rate for the next session
        self.outbox: deque[tuple[str, str]] = deque()
        self.outbox_ready = asyncio.Event()
        self.dropped_outbound = 0
        self.closed = False
        # resumption: the session's handle, whether its client is away, and the socket
        # that a resume hands over to the session it names
        self.resume_handle: str | None = None  # given to the client; the server keeps the key
        self.resume_key: str | None = None
        self.detached = False
        self.stream_time_at_detach = 0.0
        self.parking: asyncio.Future | None = None
        self.handover: SessionConnection | None = None
        self.frozen = False  # being saved for a restart: the client's messages are ignored

    # -- the session -----------------------------------------------------------------------

    @property
    def runner(self) -> PipelineRunner | None:
        """The running session's pipeline runner (None before it starts and after it ends)."""
        return self.live.runner if self.live is not None else None

    @property
    def options(self) -> dict | None:
        """The client's session options (saved with it)."""
        return self.live.options if self.live is not None else None

    @property
    def answers(self) -> dict[Any, Any]:
        """The session's questions in flight, by client query id."""
        return self.live.answers if self.live is not None else {}

    @property
    def listeners(self) -> dict[Any, Any]:
        """Who else hears each question's answer (an HTTP request about this session)."""
        return self.live.listeners if self.live is not None else {}

    def open_session(self, options: dict | None, message_id: Any = None,
                     saved: SavedSession | None = None) -> None:
        """Start this client's live session, new or restored from `saved` (`busy` when the
        server has no room; nothing is kept when the pipeline refuses to start)."""
        self.live = LiveSession.open(self.context, options, self.deliver, message_id, saved,
                                     self.audio_rate)
        self.live.pipeline_task.add_done_callback(self._pipeline_ended)
        log.info("session %s started (%s, pipeline %s)", self.runner.session.id,
                 type(self).__name__, self.runner.pipeline.name,
                 extra={"event": "session.started", "session": self.runner.session.id})

    def _pipeline_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("pipeline of a client session failed", exc_info=error)
        self.error("pipeline_failed", f"the session's pipeline stopped: "
                   f"{type(error).__name__}: {error}")

    def ask(self, text: str, query_id: Any = None, listener=None,
            max_tokens: int | None = None) -> Any:
        """Ask this session's pipeline (see `LiveSession.ask`); `ProtocolError` when there
        is no session or the question is refused."""
        if self.live is None:
            raise ProtocolError("no_session", "the session has ended", query_id)
        return self.live.ask(text, query_id, listener, max_tokens)

    def oldest_wait(self, now: float) -> float:
        """How long the oldest question of this client has waited for its first token."""
        return self.live.oldest_wait(now) if self.live is not None else 0.0

    def answers_in_flight(self) -> int:
        return self.live.answers_in_flight() if self.live is not None else 0

    def to_listener(self, item: PipelineEvent) -> None:
        """An answer's events also go to the listener that asked it (HTTP, Realtime)."""
        if self.live is not None:
            self.live.to_listener(item)

    def record_answer(self, metrics: dict) -> None:
        """A finished answer's latency and tokens go to the metrics and the load governor."""
        self.context.metrics.observe_answer(metrics)
        if metrics.get("ttft_ms") is not None:
            self.context.governor.record_ttft(metrics["ttft_ms"] / 1e3)

    def drops(self) -> dict[str, int]:
        """Everything this session and its connection dropped so far, by reason (see
        docs/PROTOCOL.md)."""
        session = self.live.drops() if self.live is not None else {}
        return {**session, **self.connection_drops()}

    def connection_drops(self) -> dict[str, int]:
        """What this connection (not its session) dropped, by reason."""
        return {"outbound": self.dropped_outbound}

    async def _end_session(self) -> None:
        """End the live session (once): what it and this connection dropped joins the
        server's totals, and this connection's counters start again at 0."""
        if self.live is None:
            return
        live, self.live = self.live, None
        self.context.shelf.forget(self.resume_key)
        self.resume_handle = self.resume_key = None
        if self.parking is not None:
            self.parking.cancel()
        drops = self.connection_drops()
        self.reset_counters()
        await live.end(drops)

    def reset_counters(self) -> None:
        """A next session on this connection counts its drops from 0."""
        self.dropped_outbound = 0

    def reset_rate_window(self) -> None:
        """A resumed session's new socket starts its per-second message limits afresh."""

    # -- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> None:
        """Serve this websocket until the client leaves. A session whose client drops is
        kept for resumption when the server allows it (`detached`); one resumed on this
        socket is served here from then on."""
        successor = await self._serve_socket()
        while successor is not None:  # a detached session resumed on this socket
            successor, resumed = None, successor
            self.context.connections.add(resumed)
            try:
                successor = await resumed._serve_socket()
            finally:
                if not resumed.detached:
                    self.context.connections.discard(resumed)

    async def _serve_socket(self) -> SessionConnection | None:
        """Read this socket's messages; returns the detached session a resume handed this
        socket to, if any."""
        writer = asyncio.create_task(self._writer())
        side = self._side_task()
        idle = False
        try:
            while self.handover is None:
                try:
                    raw = await asyncio.wait_for(self.ws.recv(), self.config.idle_timeout_s)
                except TimeoutError:
                    idle = True
                    await self.ws.close(1000, "idle timeout")
                    return None
                await self._handle_safely(raw)
        except ClientGone:
            pass
        finally:
            if side is not None:
                side.cancel()
            if self.handover is None and not idle and self._resumable():
                writer.cancel()
                await self._detach()
            elif self.handover is None:
                self.closed = True
                await self._end_session()
                writer.cancel()
            else:
                writer.cancel()
        successor, self.handover = self.handover, None
        return successor

    def _side_task(self) -> asyncio.Task | None:
        """A task that runs beside the socket's read loop while it lives (none here)."""
        return None

    async def _handle_safely(self, raw: str | bytes) -> None:
        """Handle one client message; a failure becomes the client's error message."""
        raise NotImplementedError

    async def deliver(self, item: PipelineEvent) -> None:
        """The session's sink: its events, as this protocol's messages."""
        raise NotImplementedError

    async def shutdown(self, reason: str, flush_s: float = 2.0, saved: bool = False) -> None:
        """End the session for a server shutdown: `session.ended`, then close 1001; a
        session `saved` for the next process closes 1012 (service restart) instead, without
        `session.ended`: its client resumes it there."""
        if self.detached or self.ws is None:
            await self.expire("shutdown")
            return
        await self._end_session()
        if not saved:
            self.send("session.ended", reason=reason)
        deadline = time.monotonic() + flush_s
        while self.outbox and time.monotonic() < deadline and not self.closed:
            await asyncio.sleep(0.01)
        if saved:
            await self.ws.close(1012, "server restarting: resume with your handle")
        else:
            await self.ws.close(1001, reason)

    # -- messages out ----------------------------------------------------------------------

    def send(self, message_type: str, /, **fields: Any) -> None:
        """Queue a server message for this client."""
        raise NotImplementedError

    def error(self, code: str, message: str, message_id: Any = None, **fields: Any) -> None:
        """Queue an error message for this client (counted by code)."""
        raise NotImplementedError

    def _queue(self, kind: str, text: str) -> None:
        """Put a message in the bounded outbox: when it is full the oldest message that is
        not essential goes (counted); a detached session keeps no superseded message."""
        if self.closed:
            return
        if self.detached and kind in self.SUPERSEDED_WHILE_AWAY:
            return  # not kept: response.done carries the whole text, stats come anew
        if len(self.outbox) >= self.config.outbound_queue:
            self.dropped_outbound += 1
            self.context.metrics.outbound_dropped.inc()
            victim = next((i for i, (k, _) in enumerate(self.outbox) if k not in ESSENTIAL),
                          None)
            if victim is None:  # every queued message is essential: drop this one
                return
            del self.outbox[victim]
        self.outbox.append((kind, text))
        self.outbox_ready.set()

    async def _writer(self) -> None:
        while True:
            while not self.outbox:
                self.outbox_ready.clear()
                await self.outbox_ready.wait()
            _, text = self.outbox.popleft()
            try:
                await self.ws.send(text)
            except ClientGone:
                return
