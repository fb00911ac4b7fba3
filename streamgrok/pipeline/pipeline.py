"""A pipeline definition and the runner that wires source, stages, engine session and sinks.

    source ─► Ingest (decode, sample/dedup, observers, CLIP, audio, interleave)
           ─► user stages (bounded edges) ─► session (append, triggers, answers) ─► sinks
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from streamgrok.engine import Engine
from streamgrok.engine.session import Answer, Session
from streamgrok.errors import StreamgrokError
from streamgrok.media.clip import ClipEncoder
from streamgrok.media.frame_index import FrameIndex, FrameMatch
from streamgrok.media.items import FrameTokens, MediaError, Note
from streamgrok.media.projector import Projector
from streamgrok.model.sampling import SamplingParams
from streamgrok.pipeline.events import (
    DeltaEvent,
    DoneEvent,
    ErrorEvent,
    NoteEvent,
    PipelineEvent,
    QuestionEvent,
)
from streamgrok.pipeline.grounding import (
    SELECTIONS,
    answer_stem,
    grounded_prompt,
    read_question,
)
from streamgrok.pipeline.ingest import Ingest, IngestConfig
from streamgrok.pipeline.note_log import NoteLog
from streamgrok.pipeline.options import DEFAULT_CLIENT_OPTIONS, ClientOption
from streamgrok.pipeline.resources import SharedResources
from streamgrok.pipeline.stage import Stage, start_chain
from streamgrok.pipeline.triggers import At, Trigger

DEFAULT_SYSTEM = (
    "You watch a live video through timestamped notes [mm:ss] of what was seen and said. "
    "Answer briefly, only from the notes; never invent names or events."
)
ANSWER_CONTEXTS = ("stream", "notes")
# the default when the model sees the frames themselves (its own vision tower)
DEFAULT_VISION_SYSTEM = (
    "You watch a live video: its frames, each after 'Frame from MM:SS:', and timestamped "
    "notes [mm:ss] of what was seen and said. Answer briefly, only from what the frames and "
    "notes show; never invent names or events."
)


class Sink(Protocol):
    async def send(self, event: PipelineEvent) -> None: ...


@dataclass
class Pipeline:
    """What a pipeline file builds: how to ingest, what stages and triggers to run."""

    name: str
    ingest: IngestConfig = field(default_factory=IngestConfig)
    system_prompt: str = DEFAULT_SYSTEM
    stages: list[Stage] = field(default_factory=list)  # after the merge: notes, tokens, errors
    video_stages: list[Stage] = field(default_factory=list)  # on the video branch: frames
    triggers: list[Trigger] = field(default_factory=list)
    sampling: SamplingParams = field(
        default_factory=lambda: SamplingParams(max_tokens=64, repetition_penalty=1.3)
    )
    clip: ClipEncoder | None = None
    projector: Projector | None = None
    # frame tokens from the loaded model's own vision tower, when it has one
    vision_tokens: bool = True
    # questions carry the notes that bear on them (see `grounding`); False asks them bare
    grounded: bool = True
    # what a grounded question is answered over: "stream" (the session's cache, then the
    # question) or "notes" (the system prompt and the question with its notes alone: a small
    # text model copies the latest similar note of a long stream over the one restated
    # beside the question); None: "notes" unless the model sees frames in the stream or
    # the cache recalls evicted KV from a host tier
    answer_context: str | None = None
    # how a grounded question's notes are chosen: "meaning" (the kinds of note its form and
    # words ask about, BM25, the latest of each kind; says what was not seen) or "words"
    # (shared word stems and topic words only: the old way)
    note_selection: str = "meaning"
    # what a remote client may set in session.start (everything else is server configuration)
    client_options: dict[str, ClientOption] = field(
        default_factory=lambda: dict(DEFAULT_CLIENT_OPTIONS))

    def __post_init__(self) -> None:
        if self.answer_context not in (None, *ANSWER_CONTEXTS):
            raise ValueError(f"answer_context must be one of {', '.join(ANSWER_CONTEXTS)} "
                             f"or None, got {self.answer_context!r}")
        if self.note_selection not in SELECTIONS:
            raise ValueError(f"note_selection must be one of {', '.join(SELECTIONS)}, "
                             f"got {self.note_selection!r}")


@dataclass
class RunStats:
    stream_time: float = 0.0
    notes: int = 0
    frame_tokens: int = 0
    errors: int = 0
    answers: list[dict[str, Any]] = field(default_factory=list)


class PipelineRunner:
    """Runs one pipeline on one source for one engine session."""

    def __init__(self, pipeline: Pipeline, engine: Engine, sinks: list[Sink],
                 progress: Callable[[dict], None] | None = None,
                 resources: SharedResources | None = None) -> None:
        self.pipeline = pipeline
        self.engine = engine
        self.resources = resources
        self.sinks = sinks
        self.progress = progress
        self.stats = RunStats()
        self.session: Session | None = None
        self.ingest: Ingest | None = None
        self._answers: list[asyncio.Task] = []
        self.notes = NoteLog()
        # whether notes are prefilled into the session's stream (set by `start`): only where
        # questions are answered over it; a grounded question answered over its notes
        # (`answer_context` "notes") reads the system prompt and its own prompt alone
        self.notes_in_stream = True
        self.instructions = ""  # a client's standing instructions, for answers over notes
        self.frame_index = FrameIndex()  # CLIP embeddings of the frames, when CLIP runs

    async def send(self, event: PipelineEvent) -> None:
        for sink in self.sinks:
            await sink.send(event)

    async def run(self, source: Any, asks: list[Trigger] | None = None) -> RunStats:
        """Stream a file, URL or byte stream through the pipeline; returns when it ends and
        the answers have finished."""
        self.start()
        return await self.run_items(self.ingest.run(source), asks)

    def system_prompt(self) -> str:
        """The system prompt the session starts with."""
        vision = self.engine.vision if self.pipeline.vision_tokens else None
        system = self.pipeline.system_prompt
        if vision is not None and system == DEFAULT_SYSTEM:
            return DEFAULT_VISION_SYSTEM
        return system

    def start(self, session: Session | None = None) -> None:
        """Open the engine session (or carry on with `session`, one restored from a saved
        state) and the ingest (before pushing media or asking)."""
        if self.session is None:
            vision = self.engine.vision if self.pipeline.vision_tokens else None
            self.session = session or self.engine.new_session(self.system_prompt())
            config = self.pipeline.ingest
            shared = self.resources
            transcriber = speech_model = None
            if shared is not None and config.audio:
                speech_model = shared.speech_model()
                if config.transcribe:
                    transcriber = shared.transcriber(config.speech_model)
            self.ingest = Ingest(config, self.pipeline.clip, self.pipeline.projector,
                                 transcriber, shared.media_pool if shared else None,
                                 self.pipeline.video_stages, speech_model,
                                 shared.degradation if shared else None, vision)
            self.notes_in_stream = not self.pipeline.grounded or \
                self.answer_context() == "stream"

    def export_state(self) -> dict:
        """What the session knows beside its KV cache, as JSON-able data: its notes, a
        client's standing instructions, and the stream clock (stages' own state is not
        kept: observers start afresh)."""
        return {"stream_time": self.stats.stream_time, "instructions": self.instructions,
                "notes": [note.saved() for note in self.notes.notes]}

    def restore_state(self, state: dict) -> None:
        """Carry on from `export_state`'s data."""
        self.stats.stream_time = float(state.get("stream_time", 0.0))
        self.instructions = str(state.get("instructions", ""))
        for saved in state.get("notes", []):
            self.notes.restore(saved)

    async def set_instructions(self, text: str) -> None:
        """A client's standing instructions (Realtime `session.update`): a protected system
        turn in the stream, or, where questions are answered over notes, a line every
        grounded question carries."""
        if self.notes_in_stream:
            if text:
                await self.session.append_message(text, role="system", protected=True)
        else:
            self.instructions = text

    async def add_text(self, text: str) -> None:
        """A client's text (`input.text`): a user turn in the stream, or, where questions
        are answered over notes, a note the questions can be grounded in."""
        if self.notes_in_stream:
            await self.session.append_message(text)
        else:
            self.notes.add(Note(f'the user wrote: "{text}"', self.stats.stream_time,
                                tags={"user"}))

    async def search_frames(self, text: str, top_k: int = 5) -> list[FrameMatch]:
        """The stream's frames that best match `text` through CLIP's text encoder (needs
        CLIP: `clip_weights`), best first."""
        clip = self.ingest.clip if self.ingest is not None else None
        if clip is None:
            raise StreamgrokError("frame search needs CLIP: the server sets clip_weights")
        query = await asyncio.to_thread(clip.encode_text, [text])
        return self.frame_index.search(query[0], top_k)

    def vision_path(self) -> dict:
        """Which frame tokens this session's model gets: `vlm` (the model's own vision
        tower), `clip` (CLIP + projector), or `notes` (none: observers' notes only); CLIP as
        the per-frame index is reported beside."""
        ingest = self.ingest
        index = ingest is not None and ingest.clip is not None
        if ingest is not None and ingest.vision is not None:
            return {**ingest.vision.encoder.describe(), "clip_index": index}
        if ingest is not None and ingest.clip is not None and ingest.projector is not None:
            return {"kind": "clip", "tokens_per_frame": ingest.projector.tokens,
                    "clip_index": True}
        return {"kind": "notes", "tokens_per_frame": 0, "clip_index": index}

    def answer_context(self) -> str:
        """What grounded questions are answered over: "stream" or "notes" (see Pipeline);
        by default the stream when the model sees frames in it, or when the server keeps
        evicted KV in a host tier to recall it."""
        if self.pipeline.answer_context is not None:
            return self.pipeline.answer_context
        recalls = getattr(self.engine.cache, "tier", None) is not None
        return "notes" if self.vision_path()["kind"] == "notes" and not recalls else "stream"

    def ask(self, question: str, kind: str = "answer", query_id: Any = None,
            max_tokens: int | None = None) -> Answer:
        """Ask the session now (a client's query); the answer streams to the sinks as
        typed events tagged with `query_id`. `max_tokens` caps this answer below the
        pipeline's own limit."""
        return self._ask(question, kind, query_id=query_id, max_tokens=max_tokens)

    def _fire(self, question: str, kind: str, pts: float | None = None) -> None:
        """A trigger's question: one the session refuses becomes an error event, and the
        pipeline goes on."""
        try:
            self._ask(question, kind, pts)
        except StreamgrokError as exc:
            self.stats.errors += 1
            self._answers.append(asyncio.create_task(self.send(ErrorEvent(
                f"{kind} question refused: {exc}", pts or self.stats.stream_time,
                stage="trigger"))))

    async def run_items(self, items: AsyncIterator[Any],
                        asks: list[Trigger] | None = None) -> RunStats:
        """Run stages, session and triggers on an ingest stream until it ends."""
        self.start()
        pipeline = self.pipeline
        triggers = list(pipeline.triggers) + list(asks or [])
        channels, tasks = start_chain(pipeline.stages, self.send, sink="session")

        async def produce() -> None:
            try:
                async for item in items:
                    await channels[0].put(item)
            finally:
                channels[0].close()

        producer = asyncio.create_task(produce())
        last_progress = 0.0
        try:
            async for item in channels[-1]:
                await self._consume(item, triggers)
                if self.progress and time.monotonic() - last_progress > 1.0:
                    last_progress = time.monotonic()
                    self.progress(self.progress_info())
            await asyncio.gather(producer, *tasks)
            self.stats.stream_time = max(self.stats.stream_time, self.ingest.stats.stream_time)
            self._check_time(triggers)
            for trigger in triggers:  # questions set for after the end of a short stream
                if isinstance(trigger, At) and not trigger.fired:
                    trigger.fired = True
                    self._fire(trigger.question, trigger.kind)
            await asyncio.gather(*self._answers)
        finally:
            producer.cancel()
            for task in tasks + self._answers:
                task.cancel()
            await self.session.close()
        if self.progress:
            self.progress(self.progress_info())
        return self.stats

    async def _consume(self, item: Any, triggers: list[Trigger]) -> None:
        session = self.session
        pts = getattr(item, "pts", None)
        if pts is not None:
            self.stats.stream_time = max(self.stats.stream_time, pts)
        live = self.pipeline.ingest.live
        if isinstance(item, FrameTokens):
            if item.vectors.shape[0]:  # none when CLIP only indexes the frame
                if not live:  # a file's frames are never dropped: wait for room instead
                    await session.wait_for_room(item.vectors.shape[0])
                session.append_embeddings(item.vectors, item.pts, item.index, droppable=live,
                                          index_embedding=item.embedding)
            if item.embedding is not None:
                self.frame_index.add(item.pts, item.index, item.embedding)
            self.stats.frame_tokens += item.vectors.shape[0]
        elif isinstance(item, Note):
            self.stats.notes += 1
            self.notes.add(item)
            if self.notes_in_stream:
                await session.append_message(item.stamped(), modality=item.modality,
                                             timestamp=item.pts, source=item.source,
                                             state_key=item.state_key if live else None)
            await self.send(NoteEvent(item.text, item.pts, sorted(item.tags)))
            for trigger in triggers:
                question = trigger.on_note(item)
                if question:
                    self._fire(question, trigger.kind, item.pts)
        elif isinstance(item, MediaError):
            self.stats.errors += 1
            await self.send(ErrorEvent(item.message, item.pts, stage=item.stage))
        elif isinstance(item, PipelineEvent):
            await self.send(item)
        self._check_time(triggers)

    def _check_time(self, triggers: list[Trigger]) -> None:
        for trigger in triggers:
            question = trigger.on_time(self.stats.stream_time)
            if question:
                self._fire(question, trigger.kind)

    def _ask(self, question: str, kind: str, pts: float | None = None,
             query_id: Any = None, max_tokens: int | None = None) -> Answer:
        sampling = self.pipeline.sampling
        if max_tokens is not None:
            sampling = replace(sampling, max_tokens=min(max_tokens, sampling.max_tokens))
        if self.pipeline.grounded:  # the notes travel with the question, not into the context
            one_line = replace(sampling, stop_token_ids=sampling.stop_token_ids
                               | self.engine.tokenizer.line_break_ids())
            tokenizer = self.engine.tokenizer
            selection = self.pipeline.note_selection
            reading = read_question(question, self.notes) if selection == "meaning" else None
            prompt = grounded_prompt(question, self.notes, self.session.question_room(),
                                     lambda text: len(tokenizer.encode(text)), selection,
                                     self.instructions, reading)
            answer = self.session.ask(prompt, one_line, remember=False,
                                      answer_prefix=answer_stem(question, self.notes,
                                                                selection, reading),
                                      own_context=self.answer_context() == "notes")
        else:
            answer = self.session.ask(question, sampling)
        when = self.stats.stream_time if pts is None else pts
        self._answers.append(asyncio.create_task(
            self._stream_answer(answer, question, kind, when, query_id)))
        return answer

    async def _stream_answer(self, answer: Answer, question: str, kind: str,
                             pts: float, query_id: Any) -> None:
        await self.send(QuestionEvent(kind, answer.id, question, pts, query_id))
        parts = []
        try:
            async for delta in answer:
                parts.append(delta)
                await self.send(DeltaEvent(kind, answer.id, delta, pts, query_id))
        except Exception as exc:
            await self.send(ErrorEvent(f"answer failed: {exc}", pts, stage="answer",
                                       answer_id=answer.id, query_id=query_id))
            return
        metrics = answer.metrics.as_dict()
        self.stats.answers.append({"question": question, "answer": "".join(parts), **metrics})
        await self.send(DoneEvent(kind, answer.id, "".join(parts), pts, query_id,
                                  question=question, metrics=metrics))

    def progress_info(self) -> dict:
        ingest = self.ingest.stats if self.ingest else None
        snap = self.engine.snapshot()
        return {
            "stream_time": self.stats.stream_time,
            "frames_sampled": ingest.sampled_frames if ingest else 0,
            "frames_kept": ingest.kept_frames if ingest else 0,
            "frames_dropped": ingest.dropped_frames if ingest else 0,
            "frame_drops": ingest.drops() if ingest else {},
            "notes": self.stats.notes,
            "kv_pages_used": snap.kv_pages_used,
            "kv_pages_total": snap.kv_pages_total,
            "evicted_tokens": snap.evicted_tokens,
        }

