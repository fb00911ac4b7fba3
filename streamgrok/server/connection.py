"""One websocket client: a pipeline run on an engine session, fed by pushed media."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from streamgrok.errors import RequestTooLarge, StreamgrokError
from streamgrok.media.pcm_resampler import checked_rate
from streamgrok.pipeline.events import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    Event,
    NoteEvent,
    PipelineEvent,
    QuestionEvent,
)
from streamgrok.pipeline.options import OptionError
from streamgrok.server.asgi_socket import AsgiSocket
from streamgrok.server.live_session import answer_query_id
from streamgrok.server.media_lane import MediaLane
from streamgrok.server.protocol import ProtocolError, event, parse_binary, parse_text
from streamgrok.server.session_connection import SessionConnection
from streamgrok.server.session_context import SessionContext

log = logging.getLogger(__name__)
BACKLOGGED_WAIT_S = 0.05  # an input.text's wait for room while its connection is backlogged
TEXT_RETRY_MS = 500  # what a `text_backlog` refusal suggests


class ClientConnection(SessionConnection):
    """A protocol v1 client (docs/PROTOCOL.md): JSON control messages and binary media
    messages drive its live session; the session's events come back as v1 messages. Its
    media messages wait in their own lane (`MediaLane`), so control is handled at once, under
    a per-second limit."""

    def __init__(self, context: SessionContext, ws: AsgiSocket | None) -> None:
        super().__init__(context, ws)
        self.media_times: deque[float] = deque()
        self.media_lane = MediaLane(self.config.media_lane)  # media apart from control
        self.rate_limited = 0  # media messages dropped over the per-second limit
        self.text_backlogged = False  # the last input.text found no room in time
        self.rate_limit_reported = float("-inf")

    # -- lifecycle -------------------------------------------------------------------------

    def _side_task(self) -> asyncio.Task:
        """The media lane's loop, while the socket lives."""
        return asyncio.create_task(self._media_loop())

    def session_description(self) -> dict:
        """What `session.started` and `session.resumed` say of the session."""
        return {"session_id": self.runner.session.id, "pipeline": self.runner.pipeline.name,
                "model": self.context.model_file, "vision": self.runner.vision_path(),
                "answers": self.runner.answer_context(), "replica": self.context.replica,
                "context": self.runner.session.context_policy(), "resume": self.resume_info()}

    async def _handle_safely(self, raw: str | bytes) -> None:
        message_id = None
        if self.frozen:  # being saved for a restart: `session.going_away` said so
            return
        try:
            if len(raw) > self.config.max_message_bytes:
                unit = "bytes" if isinstance(raw, bytes) else "characters"
                raise ProtocolError("too_large", f"message of {len(raw)} {unit} exceeds "
                                    f"{self.config.max_message_bytes}")
            if isinstance(raw, bytes):
                await self._accept_media(parse_binary(raw))
            else:
                message = parse_text(raw)
                message_id = message.get("id")
                await self._handle_control(message)
        except Exception as exc:
            self._report(exc, message_id)

    def _report(self, exc: Exception, message_id: Any) -> None:
        """A message's failure as the client's `error` event (a bug is logged, and the
        connection carries on)."""
        match exc:
            case ProtocolError():
                self.error(exc.code, str(exc), exc.message_id or message_id, **exc.fields)
            case OptionError():
                self.error("bad_option", str(exc), message_id)
            case RequestTooLarge():
                self.error("too_large", str(exc), message_id)
            case StreamgrokError() | ValueError():
                self.error("bad_request", str(exc), message_id)
            case _:
                log.error("handling a client message failed", exc_info=exc)
                self.error("internal", f"internal error: {type(exc).__name__}", message_id)

    # -- control ---------------------------------------------------------------------------

    async def _handle_control(self, message: dict) -> None:
        kind = message["type"]
        if kind == "session.start":
            await self._start(message)
            return
        if kind == "session.resume":
            await self._resume(message)
            return
        if kind == "audio.format":  # the rate of the audio.pcm16 messages that follow
            try:
                self.audio_rate = checked_rate(message["rate"])
            except ValueError as exc:
                raise ProtocolError("bad_audio", str(exc), message.get("id")) from exc
            if self.live is not None:
                self.live.set_audio_rate(self.audio_rate)
            return
        if self.runner is None:
            raise ProtocolError("no_session", f"{kind} before session.start", message.get("id"))
        if kind == "input.text":
            self._check_text_size(message)
            await self._add_text(message)
        elif kind == "query":
            await self._query(message)
        elif kind == "frames.search":
            await self._search_frames(message)
        elif kind == "response.cancel":
            answer = self.answers.get(message["query_id"])
            if answer is None:
                raise ProtocolError("unknown_query", f"no query {message['query_id']!r} in "
                                    "flight", message.get("id"))
            answer.cancel()
        elif kind == "session.end":
            await self._end_session()
            self.send("session.ended")

    async def _start(self, message: dict) -> None:
        if self.runner is not None:
            raise ProtocolError("session_exists", "session.start sent twice", message.get("id"))
        context = _context_field(message)
        await self.context.media_models()
        await self.context.make_room()
        self.open_session(message.get("options"), message.get("id"))
        if context is not None:
            try:
                self.runner.session.set_context(context.get("target_tokens"),
                                                context.get("trigger_tokens"))
            except ValueError as exc:
                await self._end_session()
                raise ProtocolError("bad_field", str(exc), message.get("id")) from None
        self.live.tasks.append(asyncio.create_task(self._stats_loop()))
        if self.resumable and self.context.shelf.enabled:
            self.resume_handle, self.resume_key = self.context.shelf.issue(self,
                                                                          self.ws.principal)
        self.send("session.started", id=message.get("id"), **self.session_description())

    async def _search_frames(self, message: dict) -> None:
        self._check_text_size(message)
        top_k = message.get("top_k", 5)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 50:
            raise ProtocolError("bad_field", "top_k must be an integer in [1, 50]",
                                message.get("id"))
        matches = await self.runner.search_frames(message["text"], top_k)
        self.send("frames.found", id=message.get("id"), indexed=len(self.runner.frame_index),
                  matches=[m.as_dict() for m in matches])

    async def _query(self, message: dict) -> None:
        self._check_text_size(message)
        self.ask(message["text"], message.get("id"))

    async def _add_text(self, message: dict) -> None:
        """Queue a client's text, waiting for room in the session's text queue at most
        `text_wait_s` (once the connection is backlogged, a moment): past that it is refused
        with `text_backlog`, not accepted, so the socket keeps being read (a client flooding
        text would otherwise stall its own keepalive pings until the connection dropped)."""
        wait = BACKLOGGED_WAIT_S if self.text_backlogged else self.config.text_wait_s
        try:
            await asyncio.wait_for(self.runner.add_text(message["text"]), wait)
        except TimeoutError:
            self.text_backlogged = True
            raise ProtocolError(
                "text_backlog", "the session's text queue is full (the model is behind the "
                "text sent): this input.text was not accepted; send it again after "
                f"{TEXT_RETRY_MS} ms", message.get("id"), retry_after_ms=TEXT_RETRY_MS) from None
        self.text_backlogged = False

    def _check_text_size(self, message: dict) -> None:
        text = message["text"]
        if len(text) > self.config.max_text_chars:
            raise ProtocolError("too_large", f"{message['type']}.text of {len(text)} characters "
                                f"exceeds {self.config.max_text_chars}", message.get("id"))

    # -- media -----------------------------------------------------------------------------

    async def _accept_media(self, media) -> None:
        """A media message joins this client's media lane (after the per-second limit),
        so the control messages behind it are handled at once."""
        if self.runner is None:
            raise ProtocolError("no_session", "media before session.start")
        now = time.monotonic()
        while self.media_times and now - self.media_times[0] > 1.0:
            self.media_times.popleft()
        if len(self.media_times) >= self.config.max_media_per_second:
            self.rate_limited += 1
            if now - self.rate_limit_reported < 1.0:
                return  # dropped and counted; one error a second says so
            self.rate_limit_reported = now
            raise ProtocolError("rate_limited", f"more than {self.config.max_media_per_second} "
                                "media messages per second: messages are dropped "
                                f"({self.rate_limited} so far)")
        self.media_times.append(now)
        await self.media_lane.put(media)

    async def _media_loop(self) -> None:
        """Decode and feed the lane's media in order, for as long as the connection lives."""
        while True:
            media = await self.media_lane.get()
            try:
                await self._handle_media(media)
            except Exception as exc:
                self._report(exc, None)

    async def _handle_media(self, media) -> None:
        live = self.live
        if live is None:  # the session ended while the message waited
            return
        if media.kind == "video.frame":
            await live.push_jpeg(media.payload, media.timestamp)
        elif media.kind == "audio.pcm16":
            await live.push_pcm(media.payload, media.timestamp)
        else:
            await live.push_container(media.payload)

    # -- events out ------------------------------------------------------------------------

    def send(self, message_type: str, /, **fields: Any) -> None:
        """Queue a server message for this client."""
        self._queue(message_type, event(message_type, **fields))

    async def deliver(self, item: PipelineEvent) -> None:
        """The pipeline's sink: typed pipeline events become protocol messages. A trigger's
        answer streams with query_id `auto-N`."""
        self.to_listener(item)
        match item:
            case QuestionEvent(query_id=None):  # a trigger asked: tell the client
                self.send("event", kind=item.purpose, text=item.text, t=item.pts,
                          query_id=f"auto-{item.answer_id}")
            case QuestionEvent():
                pass  # the client knows what it asked
            case DeltaEvent():
                self.send("response.delta", query_id=answer_query_id(item), delta=item.text)
            case DoneEvent():
                self.record_answer(item.metrics)
                self.send("response.done", query_id=answer_query_id(item), text=item.text,
                          **item.metrics)
            case ErrorEvent(answer_id=int()):  # that answer failed, nothing else
                query_id = answer_query_id(item)
                self.error("answer_failed", item.text, query_id, query_id=query_id)
                self.send("response.done", query_id=query_id, text="", finish_reason="error")
            case ErrorEvent():
                media = item.stage in ("decode", "observe")
                self.error("bad_media" if media else "pipeline", item.text)
            case NoteEvent():
                self.send("event", kind="note", text=item.text, t=item.pts, tags=item.tags)
            case Event():
                self.send("event", kind=item.kind, text=item.text, t=item.pts, **item.data)

    def error(self, code: str, message: str, message_id: Any = None, **fields: Any) -> None:
        self.context.metrics.errors.labels(code).inc()
        self._queue("error", event("error", code=code, message=message, message_id=message_id,
                                   **fields))

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_interval_s)
            self._queue("stats", event("stats", **await self.stats()))

    async def stats(self) -> dict:
        """The `stats` message: engine snapshot, this session's cache contents, drops."""
        engine = self.context.engine
        snap = engine.snapshot()
        runner, live = self.runner, self.live
        info = await runner.session.cache_info() if runner else {}
        drops = self.drops()
        return {
            "kv": {"pages_used": snap.kv_pages_used, "pages_total": snap.kv_pages_total,
                   "layer_tokens": info.get("layer_tokens", []),
                   "layer_budget": engine.cache.budgets},
            "evicted_tokens": snap.evicted_tokens,
            "host_tier": snap.host_tier,
            "vision": snap.vision,
            "retained": info.get("retained", []),
            "drops": {"frames": sum(v for k, v in drops.items() if k.startswith("frames_")),
                      **drops},
            "frames": live.frame_counts() if live else {},
            "load": live.load_info() if live else {},
            "speech": self.context.resources.speech_stats(),
            "stream_time": runner.stats.stream_time if runner else 0.0,
            "latency": {"step_ms_p50": snap.step_ms_p50, "step_ms_p95": snap.step_ms_p95},
            "resume": self.resume_info(),
        }

    def connection_drops(self) -> dict[str, int]:
        """What this connection dropped: media over the per-second limit, media its lane had
        no room for, messages its outbox had no room for."""
        return {"rate_limited": self.rate_limited,
                "frames_backlog": self.media_lane.dropped_frames,
                "outbound": self.dropped_outbound}

    def reset_counters(self) -> None:
        self.rate_limited = self.dropped_outbound = 0

    def reset_rate_window(self) -> None:
        self.media_times.clear()

def _context_field(message: dict) -> dict | None:
    """`session.start`'s optional `context` ({target_tokens, trigger_tokens}, integers)."""
    context = message.get("context")
    if context is None:
        return None
    if not isinstance(context, dict) or set(context) - {"target_tokens", "trigger_tokens"}:
        raise ProtocolError("bad_field", "context must be an object with target_tokens and/or "
                            "trigger_tokens", message.get("id"))
    for name, value in context.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ProtocolError("bad_field", f"context.{name} must be an integer",
                                message.get("id"))
    return context

