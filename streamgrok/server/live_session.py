"""One client's live session, whatever protocol it speaks: the pipeline run on an engine
session, its pushed media inputs and decoders, its questions in flight, and its counters."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from streamgrok.media.container_process import ContainerProcess
from streamgrok.media.decode import AUDIO_RATE, container_kind
from streamgrok.media.items import AudioChunk, VideoFrame
from streamgrok.media.native_pool import MediaWorkerError
from streamgrok.media.pcm_resampler import PcmResampler
from streamgrok.pipeline.events import DeltaEvent, DoneEvent, ErrorEvent, PipelineEvent
from streamgrok.pipeline.pipeline import PipelineRunner
from streamgrok.server.protocol import ProtocolError
from streamgrok.server.session_context import SessionContext
from streamgrok.server.session_store import SavedSession

log = logging.getLogger(__name__)
Deliver = Callable[[PipelineEvent], Awaitable[None]]


class LiveSession:
    """A running pipeline session fed by a client's pushed media.

    Created by `open` (refused `busy` when the server has no room); both protocol v1 and
    Realtime connections compose one. It owns the pipeline runner, the video and audio
    inputs, the pushed-container decoder process, the audio resampler, the questions in
    flight (client query id -> answer) and the listeners their events also go to, and the
    count of frames received; `end` releases all of them once.
    """

    def __init__(self, context: SessionContext, runner: PipelineRunner, options: dict | None,
                 audio_rate: int = AUDIO_RATE) -> None:
        self.context = context
        self.runner = runner
        self.options = options  # the client's session options (saved with it)
        self.video_in, self.audio_in = runner.ingest.open_inputs()
        self.audio_resampler = PcmResampler(audio_rate)
        self.container: ContainerProcess | None = None  # a pushed video.chunk stream
        self.tasks: list[asyncio.Task] = []
        self.answers: dict[Any, Any] = {}  # client query id -> Answer, while in flight
        self.listeners: dict[Any, Callable[[PipelineEvent], None]] = {}  # query id -> HTTP
        self.queries_asked = 0
        self.frame_index = 0  # frames received
        self.ended = False

    @classmethod
    def open(cls, context: SessionContext, options: dict | None, deliver: Deliver,
             message_id: Any = None, saved: SavedSession | None = None,
             audio_rate: int = AUDIO_RATE) -> LiveSession:
        """Start a pipeline on a new engine session, or on one restored from `saved`; its
        events go to `deliver`. Refused with `busy` when the server has no room for a new
        session; nothing is kept when the pipeline refuses to start."""
        if saved is None:
            refused = context.admission()
            if refused is not None:
                retry = {} if refused.retry_after_s is None else {
                    "retry_after_ms": round(refused.retry_after_s * 1000)}
                raise ProtocolError("busy", str(refused), message_id, **retry)
        pipeline = context.session_pipeline(options)
        runner = PipelineRunner(pipeline, context.engine, [_Sink(deliver)],
                                resources=context.resources)
        session = None
        if saved is not None:
            session = context.engine.restore_session(runner.system_prompt(), saved.snapshot)
        runner.start(session)  # may refuse (a system prompt over the KV budget): nothing kept
        if saved is not None:
            runner.restore_state(saved.pipeline_state)
        live = cls(context, runner, options, audio_rate)
        context.session_opened()
        items = runner.ingest.process(live.video_in, live.audio_in)
        live.tasks.append(asyncio.create_task(runner.run_items(items)))
        return live

    def set_audio_rate(self, rate: int) -> None:
        """Pushed PCM from now on has `rate` Hz (ValueError for a rate it cannot have)."""
        self.audio_resampler = PcmResampler(rate)

    @property
    def pipeline_task(self) -> asyncio.Task:
        """The task that runs the pipeline over the session's inputs."""
        return self.tasks[0]

    # -- questions -------------------------------------------------------------------------

    def ask(self, text: str, query_id: Any = None,
            listener: Callable[[PipelineEvent], None] | None = None,
            max_tokens: int | None = None) -> Any:
        """Ask the pipeline (grounded in what it saw and heard); the answer's events go to
        the session's sink and, when given, to `listener` too. Returns the query id; raises
        `ProtocolError` when refused (too many questions in flight)."""
        config = self.context.config
        self.answers = {q: a for q, a in self.answers.items() if not a.finished}
        if len(self.answers) >= config.max_inflight_queries:
            raise ProtocolError("too_many_queries",
                                f"{len(self.answers)} queries in flight (max "
                                f"{config.max_inflight_queries})", query_id)
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

    def to_listener(self, item: PipelineEvent) -> None:
        """An answer's events also go to the listener that asked it (HTTP, Realtime)."""
        if isinstance(item, DeltaEvent | DoneEvent | ErrorEvent) and item.answer_id is not None:
            listener = self.listeners.get(answer_query_id(item))
            if listener is not None:
                if not isinstance(item, DeltaEvent):
                    del self.listeners[answer_query_id(item)]
                listener(item)

    def oldest_wait(self, now: float) -> float:
        """How long the oldest question still without a first token has waited."""
        waits = [now - a.metrics.asked_at for a in self.answers.values()
                 if not a.finished and a.metrics.first_token_at is None]
        return max(waits, default=0.0)

    def answers_in_flight(self) -> int:
        return sum(1 for answer in self.answers.values() if not answer.finished)

    # -- media -----------------------------------------------------------------------------

    async def push_jpeg(self, payload: bytes, timestamp: float) -> None:
        """A pushed image, decoded in the media workers, joins the stream as a frame."""
        pool = self.context.resources.media_pool
        try:
            image = await asyncio.to_thread(pool.decode_image, payload)
        except ValueError as exc:
            raise ProtocolError("bad_image", str(exc)) from exc
        except MediaWorkerError as exc:
            raise ProtocolError("bad_media", str(exc)) from exc
        await self.push_image(image, timestamp)

    async def push_image(self, image, timestamp: float, scene_cut: bool = False) -> None:
        """A decoded image joins the stream as the next frame (live: the input drops its
        oldest when full, counted by the ingest)."""
        if self.ended:  # the session ended while the image was decoded
            return
        frame = VideoFrame(image, timestamp, self.frame_index, scene_cut=scene_cut)
        self.frame_index += 1
        await self.video_in.put(frame)

    async def push_pcm(self, payload: bytes, timestamp: float | None = None) -> None:
        """Pushed PCM16 audio, resampled to the pipeline's rate, joins the stream."""
        try:
            chunk: AudioChunk = self.audio_resampler.push(payload, timestamp)
        except ValueError as exc:
            raise ProtocolError("bad_audio", str(exc)) from exc
        await self.audio_in.put(chunk)

    async def push_container(self, payload: bytes) -> None:
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

    # -- counters --------------------------------------------------------------------------

    def drops(self) -> dict[str, int]:
        """What the session's ingest and engine session dropped so far, by reason."""
        runner = self.runner
        ingest = runner.ingest.stats if runner.ingest else None
        engine = runner.session.dropped if runner.session else {}
        return {
            "frames_duplicate": ingest.drops()["duplicate"] if ingest else 0,
            "frames_queue": ingest.queue_dropped if ingest else 0,
            "frames_stale": (ingest.stale_dropped if ingest else 0) + engine.get("stale", 0),
            "frames_full": engine.get("full", 0),
            "notes_superseded": engine.get("superseded", 0),
        }

    def frame_counts(self) -> dict[str, int]:
        """Frames received from the client, sampled, and processed (observed / encoded)."""
        ingest = self.runner.ingest.stats if self.runner.ingest else None
        if ingest is None:
            return {"received": self.frame_index, "sampled": 0, "processed": 0}
        return {"received": self.frame_index, "sampled": ingest.sampled_frames,
                "processed": max(0, ingest.kept_frames - ingest.stale_dropped)}

    def load_info(self) -> dict:
        """The sampling rate this session gets now, and whether the server degraded it."""
        degradation = self.context.resources.degradation
        requested = self.runner.pipeline.ingest.fps
        return {"requested_fps": requested, "fps": requested * degradation.fps_scale,
                "degraded": degradation.degraded, "reason": degradation.reason}

    # -- the end ---------------------------------------------------------------------------

    async def end(self, connection_drops: dict[str, int]) -> None:
        """End the session once: its listeners hear that it ended, its drops (with the
        connection's, `connection_drops`) and frames join the server's totals, its inputs
        close, its tasks stop and its engine session closes."""
        if self.ended:
            return
        self.ended = True
        runner = self.runner
        drops = {**self.drops(), **connection_drops}
        log.info("session %s ended: %d frames received, %d answers, drops %s",
                 runner.session.id, self.frame_index, self.queries_asked,
                 {k: v for k, v in drops.items() if v},
                 extra={"event": "session.ended", "session": runner.session.id})
        for query_id, listener in list(self.listeners.items()):
            listener(ErrorEvent("the live session ended", runner.stats.stream_time,
                                stage="answer", answer_id=0, query_id=query_id))
        self.listeners.clear()
        try:
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
        finally:
            self.context.session_closed(drops, self.frame_index)


def answer_query_id(event: DeltaEvent | DoneEvent | ErrorEvent) -> Any:
    """The client's query id of an answer's event (`auto-N` for a trigger's answer)."""
    return event.query_id if event.query_id is not None else f"auto-{event.answer_id}"


class _Sink:
    """Adapts a connection's `deliver` to the pipeline's sink interface."""

    def __init__(self, deliver: Deliver) -> None:
        self.send = deliver

