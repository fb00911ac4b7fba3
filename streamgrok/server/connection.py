"""One websocket client: a pipeline run on an engine session, fed by pushed media."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from streamgrok.errors import RequestTooLarge, StreamgrokError
from streamgrok.media.container_process import ContainerProcess
from streamgrok.media.decode import AUDIO_RATE, container_kind
from streamgrok.media.items import AudioChunk, VideoFrame
from streamgrok.media.native_pool import MediaWorkerError
from streamgrok.media.pcm_resampler import PcmResampler
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
from streamgrok.pipeline.pipeline import PipelineRunner
from streamgrok.server.asgi_socket import AsgiSocket, ClientGone
from streamgrok.server.media_lane import MediaLane
from streamgrok.server.protocol import ProtocolError, event, parse_binary, parse_text
from streamgrok.server.resumable import SessionResumption
from streamgrok.server.session_context import SessionContext
from streamgrok.server.session_store import SavedSession

log = logging.getLogger(__name__)
ESSENTIAL = {"response.done", "error", "session.started", "session.ended"}
BACKLOGGED_WAIT_S = 0.05  # an input.text's wait for room while its connection is backlogged
TEXT_RETRY_MS = 500  # what a `text_backlog` refusal suggests


class ClientConnection(SessionResumption):
    """Owns one client's session; bad input gets an `error` event, never a crash.

    The session outlives a dropped socket when the server allows resumption: it waits,
    detached, until a `session.resume` with its handle attaches another socket, or its time
    runs out."""

    resumable = True  # protocol v1 sessions can be resumed

    def __init__(self, context: SessionContext, ws: AsgiSocket | None) -> None:
        self.context = context  # what this connection may use of the server
        self.ws = ws
        self.config = context.config
        self.runner: PipelineRunner | None = None
        self.video_in = self.audio_in = None
        self.container: ContainerProcess | None = None  # a pushed video.chunk stream
        self.tasks: list[asyncio.Task] = []
        self.answers: dict[Any, Any] = {}  # client query id -> Answer, while in flight
        self.queries_asked = 0
        self.frame_index = 0
        self.media_times: deque[float] = deque()
        self.media_lane = MediaLane(self.config.media_lane)  # media apart from control
        self.audio_resampler = PcmResampler(AUDIO_RATE)  # `audio.format` sets another rate
        self.rate_limited = 0  # media messages dropped over the per-second limit
        self.text_backlogged = False  # the last input.text found no room in time
        self.rate_limit_reported = float("-inf")
        self.listeners: dict[Any, Callable[[PipelineEvent], None]] = {}  # query id -> HTTP
        self.outbox: deque[tuple[str, str]] = deque()
        self.outbox_ready = asyncio.Event()
        self.dropped_outbound = 0
        self.closed = False
        # resumption: the session's handle, whether its client is away, and the socket
        # that a `session.resume` hands over to the session it names
        self.resume_handle: str | None = None  # given to the client; the server keeps the key
        self.resume_key: str | None = None
        self.detached = False
        self.stream_time_at_detach = 0.0
        self.parking: asyncio.Future | None = None
        self.handover: ClientConnection | None = None
        self.options: dict | None = None  # the client's session options (saved with it)
        self.frozen = False  # being saved for a restart: the client's messages are ignored

    # -- lifecycle -------------------------------------------------------------------------

    async def serve(self) -> None:
        """Serve this websocket until the client leaves. A session whose client drops is
        kept for resumption when the server allows it (`detached`); one resumed on this
        socket by `session.resume` is served here from then on."""
        successor = await self._serve_socket()
        while successor is not None:  # a detached session resumed on this socket
            successor, resumed = None, successor
            self.context.connections.add(resumed)
            try:
                successor = await resumed._serve_socket()
            finally:
                if not resumed.detached:
                    self.context.connections.discard(resumed)

    async def _serve_socket(self) -> ClientConnection | None:
        """Read this socket's messages; returns the detached session a `session.resume`
        handed this socket to, if any."""
        writer = asyncio.create_task(self._writer())
        media = asyncio.create_task(self._media_loop())
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
            media.cancel()
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

    def session_description(self) -> dict:
        """What `session.started` and `session.resumed` say of the session."""
        return {"session_id": self.runner.session.id, "pipeline": self.runner.pipeline.name,
                "model": self.context.model_file, "vision": self.runner.vision_path(),
                "answers": self.runner.answer_context(), "replica": self.context.replica,
                "context": self.runner.session.context_policy(), "resume": self.resume_info()}

    def oldest_wait(self, now: float) -> float:
        """How long the oldest question of this client has waited for its first token."""
        waits = [now - a.metrics.asked_at for a in self.answers.values()
                 if not a.finished and a.metrics.first_token_at is None]
        return max(waits, default=0.0)

    def answers_in_flight(self) -> int:
        return sum(1 for answer in self.answers.values() if not answer.finished)

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
                self.audio_resampler = PcmResampler(message["rate"])
            except ValueError as exc:
                raise ProtocolError("bad_audio", str(exc), message.get("id")) from exc
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
        self.tasks.append(asyncio.create_task(self._stats_loop()))
        if self.resumable and self.context.shelf.enabled:
            self.resume_handle, self.resume_key = self.context.shelf.issue(self,
                                                                          self.ws.principal)
        self.send("session.started", id=message.get("id"), **self.session_description())

    def open_session(self, options: dict | None, message_id: Any = None,
                     saved: SavedSession | None = None) -> None:
        """Start this client's pipeline on a new engine session, or on one restored from
        `saved` (refused `busy` when the server has no room; nothing is kept when the
        pipeline refuses to start)."""
        if saved is None:
            refused = self.context.admission()
            if refused is not None:
                retry = {} if refused.retry_after_s is None else {
                    "retry_after_ms": round(refused.retry_after_s * 1000)}
                raise ProtocolError("busy", str(refused), message_id, **retry)
        pipeline = self.context.session_pipeline(options)
        runner = PipelineRunner(pipeline, self.context.engine, [_Sink(self.deliver)],
                                resources=self.context.resources)
        session = None
        if saved is not None:
            session = self.context.engine.restore_session(runner.system_prompt(),
                                                         saved.snapshot)
        runner.start(session)  # may refuse (a system prompt over the KV budget): nothing kept
        if saved is not None:
            runner.restore_state(saved.pipeline_state)
        self.runner, self.options = runner, options
        self.context.session_opened()
        self.video_in, self.audio_in = self.runner.ingest.open_inputs()
        items = self.runner.ingest.process(self.video_in, self.audio_in)
        running = asyncio.create_task(self.runner.run_items(items))
        running.add_done_callback(self._pipeline_ended)
        self.tasks.append(running)
        log.info("session %s started (%s, pipeline %s)", runner.session.id,
                 type(self).__name__, pipeline.name,
                 extra={"event": "session.started", "session": runner.session.id})

    def _pipeline_ended(self, task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error("pipeline of a client session failed", exc_info=error)
        self.error("pipeline_failed", f"the session's pipeline stopped: "
                   f"{type(error).__name__}: {error}")

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

    def ask(self, text: str, query_id: Any = None,
            listener: Callable[[PipelineEvent], None] | None = None,
            max_tokens: int | None = None) -> Any:
        """Ask this session's pipeline (grounded in what it saw and heard); the answer streams
        to the client and, when given, to `listener` too (an HTTP request about this live
        session). Returns the query id; raises `ProtocolError` when refused."""
        if self.runner is None:
            raise ProtocolError("no_session", "the session has ended", query_id)
        self.answers = {q: a for q, a in self.answers.items() if not a.finished}
        if len(self.answers) >= self.config.max_inflight_queries:
            raise ProtocolError("too_many_queries",
                                f"{len(self.answers)} queries in flight (max "
                                f"{self.config.max_inflight_queries})", query_id)
        limit = self.runner.pipeline.sampling.max_tokens
        max_tokens = self.context.answer_length(min(max_tokens or limit, limit))
        self.queries_asked += 1
        query_id = query_id or f"q{self.queries_asked}"
        if listener is not None:
            self.listeners[query_id] = listener
        try:
            self.answers[query_id] = self.runner.ask(text, query_id=query_id,
                                                     max_tokens=max_tokens)
        except Exception:
            self.listeners.pop(query_id, None)
            raise
        return query_id

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
        if self.runner is None:  # the session ended while the message waited
            return
        if media.kind == "video.frame":
            pool = self.context.resources.media_pool
            try:
                image = await asyncio.to_thread(pool.decode_image, media.payload)
            except ValueError as exc:
                raise ProtocolError("bad_image", str(exc)) from exc
            except MediaWorkerError as exc:
                raise ProtocolError("bad_media", str(exc)) from exc
            if self.runner is None:  # the session ended while the frame was decoded
                return
            frame = VideoFrame(image, media.timestamp, self.frame_index)
            self.frame_index += 1
            await self.video_in.put(frame)  # live: drops the oldest (counted by the ingest)
        elif media.kind == "audio.pcm16":
            try:
                chunk: AudioChunk = self.audio_resampler.push(media.payload, media.timestamp)
            except ValueError as exc:
                raise ProtocolError("bad_audio", str(exc)) from exc
            await self.audio_in.put(chunk)
        else:
            await self._feed_container(media.payload)

    async def _feed_container(self, payload: bytes) -> None:
        """Pushed container bytes go to this session's decoder process (started by the
        stream's first chunk, which must carry an MP4 or WebM header)."""
        if self.container is None:
            if container_kind(payload) is None:
                raise ProtocolError("bad_media", "a video.chunk stream must start with a "
                                    "fragmented MP4 (ftyp/styp/moof box) or WebM header; "
                                    "this chunk was dropped")
            container = self.container = ContainerProcess(live=self.runner.pipeline.ingest.live)
            await container.start()
            decoding = asyncio.create_task(container.run_into(self.video_in, self.audio_in))
            decoding.add_done_callback(lambda _: self._container_ended(container))
            self.tasks.append(decoding)
        try:
            await self.container.feed(payload)
        except ValueError as exc:
            raise ProtocolError("bad_media", str(exc)) from exc

    def _container_ended(self, container: ContainerProcess) -> None:
        """A pushed stream ended (or its decoder died): the next chunk starts a new one."""
        if self.container is container:
            self.container = None
            asyncio.ensure_future(container.stop())

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
                self.send("response.delta", query_id=_query_id(item), delta=item.text)
            case DoneEvent():
                self.record_answer(item)
                self.send("response.done", query_id=_query_id(item), text=item.text,
                          **item.metrics)
            case ErrorEvent(answer_id=int()):  # that answer failed, nothing else
                query_id = _query_id(item)
                self.error("answer_failed", item.text, query_id, query_id=query_id)
                self.send("response.done", query_id=query_id, text="", finish_reason="error")
            case ErrorEvent():
                media = item.stage in ("decode", "observe")
                self.error("bad_media" if media else "pipeline", item.text)
            case NoteEvent():
                self.send("event", kind="note", text=item.text, t=item.pts, tags=item.tags)
            case Event():
                self.send("event", kind=item.kind, text=item.text, t=item.pts, **item.data)

    def to_listener(self, item: PipelineEvent) -> None:
        """An answer's events also go to the listener that asked it (HTTP, Realtime)."""
        if isinstance(item, DeltaEvent | DoneEvent | ErrorEvent) and item.answer_id is not None:
            listener = self.listeners.get(_query_id(item))
            if listener is not None:
                if not isinstance(item, DeltaEvent):
                    del self.listeners[_query_id(item)]
                listener(item)

    def record_answer(self, item: DoneEvent) -> None:
        """A finished answer's latency and tokens go to the metrics and the load governor."""
        self.context.metrics.observe_answer(item.metrics)
        if item.metrics.get("ttft_ms") is not None:
            self.context.governor.record_ttft(item.metrics["ttft_ms"] / 1e3)

    def _queue(self, kind: str, text: str) -> None:
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
        runner = self.runner
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
            "frames": self.frame_counts(),
            "load": self.load_info(),
            "speech": self.context.resources.speech_stats(),
            "stream_time": runner.stats.stream_time if runner else 0.0,
            "latency": {"step_ms_p50": snap.step_ms_p50, "step_ms_p95": snap.step_ms_p95},
            "resume": self.resume_info(),
        }

    def drops(self, runner: PipelineRunner | None = None) -> dict[str, int]:
        """Everything this session (or `runner`'s) dropped so far, by reason (see
        docs/PROTOCOL.md)."""
        runner = runner or self.runner
        ingest = runner.ingest.stats if runner and runner.ingest else None
        engine = runner.session.dropped if runner and runner.session else {}
        return {
            "frames_duplicate": ingest.drops()["duplicate"] if ingest else 0,
            "frames_queue": ingest.queue_dropped if ingest else 0,
            "frames_stale": (ingest.stale_dropped if ingest else 0) + engine.get("stale", 0),
            "frames_full": engine.get("full", 0),
            "rate_limited": self.rate_limited,
            "frames_backlog": self.media_lane.dropped_frames,
            "notes_superseded": engine.get("superseded", 0),
            "outbound": self.dropped_outbound,
        }

    def frame_counts(self) -> dict[str, int]:
        """Frames received from the client, sampled, and processed (observed / encoded)."""
        runner = self.runner
        ingest = runner.ingest.stats if runner and runner.ingest else None
        if ingest is None:
            return {"received": self.frame_index, "sampled": 0, "processed": 0}
        return {"received": self.frame_index, "sampled": ingest.sampled_frames,
                "processed": max(0, ingest.kept_frames - ingest.stale_dropped)}

    def load_info(self) -> dict:
        """The sampling rate this session gets now, and whether the server degraded it."""
        degradation = self.context.resources.degradation
        runner = self.runner
        requested = runner.pipeline.ingest.fps if runner else 0.0
        return {"requested_fps": requested, "fps": requested * degradation.fps_scale,
                "degraded": degradation.degraded, "reason": degradation.reason}

    async def _end_session(self) -> None:
        if self.runner is None:
            return
        runner, self.runner = self.runner, None
        self.context.shelf.forget(self.resume_key)
        self.resume_handle = self.resume_key = None
        if self.parking is not None:
            self.parking.cancel()
        drops = self.drops(runner)
        log.info("session %s ended: %d frames received, %d answers, drops %s",
                 runner.session.id, self.frame_index, self.queries_asked,
                 {k: v for k, v in drops.items() if v},
                 extra={"event": "session.ended", "session": runner.session.id})
        for query_id, listener in list(self.listeners.items()):
            listener(ErrorEvent("the live session ended", runner.stats.stream_time,
                                stage="answer", answer_id=0, query_id=query_id))
        self.listeners.clear()
        # its drops and frames move to the server's totals at once; a next session starts at 0
        self.context.session_closed(drops, self.frame_index)
        self.rate_limited = self.dropped_outbound = self.frame_index = 0
        if self.container is not None:
            await self.container.stop()
        self.video_in.close()
        self.audio_in.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.tasks.clear()
        if runner.session is not None and not runner.session.closed:
            await runner.session.close()


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


def _query_id(event: DeltaEvent | DoneEvent | ErrorEvent) -> Any:
    return event.query_id if event.query_id is not None else f"auto-{event.answer_id}"


class _Sink:
    """Adapts ClientConnection.deliver to the pipeline's sink interface."""

    def __init__(self, deliver) -> None:
        self.send = deliver
