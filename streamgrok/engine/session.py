"""The asyncio side of the engine: sessions you append to and ask, answers you iterate."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import torch

from streamgrok.engine.events import AnswerDelta, AnswerDone, AnswerFailed
from streamgrok.engine.metrics import AnswerMetrics
from streamgrok.engine.pending import AppendItem
from streamgrok.engine.state import AnswerState, SessionState
from streamgrok.errors import RequestTooLarge, StreamgrokError
from streamgrok.model.sampling import SamplingParams
from streamgrok.stream_tokens import Modality, TokenInfo

if TYPE_CHECKING:
    from streamgrok.cache.parking import SequenceSnapshot
    from streamgrok.engine.engine import Engine


class Answer:
    """A streamed answer: `async for delta in answer` yields text; `cancel()` stops it."""

    def __init__(self, state: AnswerState, queue: asyncio.Queue, engine: Engine) -> None:
        self._state = state
        self._queue = queue
        self._engine = engine
        self.error: str | None = None
        self.finished = False

    @property
    def id(self) -> int:
        return self._state.answer_id

    @property
    def metrics(self) -> AnswerMetrics:
        return self._state.metrics

    @property
    def remaining_tokens(self) -> int:
        """At most how many tokens this answer may still generate (0 once finished)."""
        if self.finished:
            return 0
        return max(0, self._state.sampling.max_tokens - self._state.metrics.tokens)

    def cancel(self) -> None:
        """Stop generating at the next step; the iterator then ends."""
        self._state.cancel_requested.set()
        self._engine.wake()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._deltas()

    async def _deltas(self) -> AsyncIterator[str]:
        while not self.finished:
            match await self._queue.get():
                case AnswerDelta(text):
                    yield text
                case AnswerFailed(message):
                    self.error = message
                    self.finished = True
                    raise StreamgrokError(message)
                case AnswerDone():
                    self.finished = True

    async def text(self) -> str:
        """The whole answer."""
        return "".join([d async for d in self])


class Session:
    """A long-lived streaming context on an Engine."""

    def __init__(self, engine: Engine, state: SessionState, space: asyncio.Event) -> None:
        self._engine = engine
        self._state = state
        self._space = space
        self.closed = False

    @property
    def id(self) -> int:
        return self._state.session_id

    @property
    def dropped_frames(self) -> int:
        return self._state.pending.dropped_items

    @property
    def dropped(self) -> dict[str, int]:
        """Live items dropped so far, by reason ("full", "stale", "superseded")."""
        return dict(self._state.pending.dropped)

    def pending_tokens(self) -> int:
        return self._state.pending.pending_tokens()

    async def append_text(
        self,
        text: str,
        modality: Modality = Modality.TEXT,
        timestamp: float = 0.0,
        source: int = -1,
        protected: bool = False,
        state_key: str | None = None,
    ) -> None:
        """Queue text (notes, transcripts, messages); waits while the text queue is full.
        Text with a `state_key` (a live description of the picture now) replaces a waiting
        older text with the same key instead of queuing behind it."""
        ids = self._engine.tokenizer.encode(text)
        info = TokenInfo.uniform(len(ids), modality, timestamp, source, protected)
        await self.append_tokens(torch.tensor(ids, dtype=torch.long), info, state_key)

    async def append_message(
        self,
        content: str,
        role: str = "user",
        modality: Modality = Modality.NOTE,
        timestamp: float = 0.0,
        source: int = -1,
        protected: bool = False,
        state_key: str | None = None,
    ) -> None:
        """Queue text as one chat turn in the model's own template (how observations and
        transcripts should enter a chat model's context); see `append_text`."""
        turn = self._engine.render_turn(self._state, role, content, generation_prompt=False)
        await self.append_text(turn, modality, timestamp, source, protected, state_key)

    async def append_tokens(self, token_ids: torch.Tensor, info: TokenInfo,
                            state_key: str | None = None) -> None:
        """Queue token ids (dropped only when replaced through `state_key`); waits while the
        text queue is full."""
        self._check_open()
        n = token_ids.numel()
        limit = self._engine.config.max_append_tokens
        if n > limit:
            raise RequestTooLarge(f"an append of {n} tokens exceeds the limit of {limit}; "
                                  "send it in parts")
        await self.wait_for_room(n)
        self._state.pending.put(AppendItem(info, token_ids.long(), state_key=state_key))
        self._engine.wake()

    async def wait_for_room(self, tokens: int) -> None:
        """Wait until `tokens` more never-dropped tokens fit in the session's queue (the
        back-pressure of lossless sources: text, and frames of files)."""
        pending = self._state.pending
        while pending.text_room() < tokens and pending.pending_tokens() > 0:
            self._space.clear()
            if pending.text_room() >= tokens:
                break
            await self._space.wait()

    def append_embeddings(
        self,
        vectors: torch.Tensor,
        timestamp: float,
        source: int,
        modality: Modality = Modality.FRAME,
        droppable: bool = True,
        index_embedding: torch.Tensor | None = None,
    ) -> int:
        """Queue embedding vectors [k, hidden] (frame tokens). Live frames are droppable:
        when the session's frame queue is full the oldest waiting frame is dropped, and a frame
        not prefilled within the freshness bound is dropped. `index_embedding` (the frame's
        unit CLIP embedding) lets frame-aware eviction drop frames a newer one repeats first.
        Returns how many frames were dropped to make room."""
        self._check_open()
        hidden = self._engine.model_config.hidden_size
        if vectors.ndim != 2 or vectors.shape[1] != hidden:
            raise ValueError(f"frame tokens must be [k, {hidden}], got {tuple(vectors.shape)}")
        k = vectors.shape[0]
        info = TokenInfo.uniform(k, modality, timestamp, source, False)
        item = AppendItem(info, torch.zeros(k, dtype=torch.long), vectors.detach().cpu(),
                          droppable, index_embedding=index_embedding)
        dropped = self._state.pending.put(item)  # counted by the queue, shown in snapshots
        self._engine.wake()
        return len(dropped)

    def ask(
        self,
        question: str,
        sampling: SamplingParams | None = None,
        raw: bool = False,
        remember: bool = True,
        add_bos: bool | None = None,
        answer_prefix: str = "",
        own_context: bool = False,
    ) -> Answer:
        """Ask about everything appended so far; the answer streams as it is generated.

        With `raw` the question is used as a plain completion prompt (no chat turn). With
        `remember`, the question and answer join the session's context when done. `add_bos`
        overrides the tokenizer's own choice of a leading BOS (False when the question
        continues text already appended). `answer_prefix` is the answer's given start: it is
        the first delta, and the model continues from it. With `own_context` the question is
        answered over the system prompt and itself alone, not the stream (a question that
        carries what it must be answered from); it waits for nothing queued before it, and
        cannot be remembered.
        """
        self._check_open()
        return self._engine.submit_question(self._state, question, sampling, raw, remember,
                                            add_bos, answer_prefix, own_context)

    def set_context(self, target: int | None, trigger: int | None = None) -> None:
        """Bound this session's context (see `Engine.set_context`)."""
        self._check_open()
        self._engine.set_context(self._state, target, trigger)

    def context_policy(self) -> dict:
        """What this session's context keeps (see `Engine.context_policy`)."""
        return self._engine.context_policy(self._state)

    def question_room(self) -> int | None:
        """How many tokens a question's text may have before it is refused as too large
        (None: no bound)."""
        return self._engine.question_room(self._state)

    async def cache_info(self) -> dict:
        """What the KV cache holds of this session: `layer_tokens` (tokens per layer) and
        `retained` (the frames, notes and audio eviction kept), read on the engine thread."""
        return await self._engine.session_info(self._state)

    async def park(self) -> int:
        """Move this session's KV out of the page pool into host memory once it is idle
        (see `Engine.park_session`); returns the bytes parked."""
        self._check_open()
        return await self._engine.park_session(self._state)

    async def unpark(self) -> None:
        """Bring this session's KV back into pages (CacheFullError when there is no room)."""
        self._check_open()
        await self._engine.unpark_session(self._state)

    async def export(self) -> SequenceSnapshot:
        """This parked session's sequence as a snapshot (see `Engine.export_session`)."""
        self._check_open()
        return await self._engine.export_session(self._state)

    @property
    def parked(self) -> bool:
        """Whether the session's KV is parked in host memory now."""
        return self._state.parked

    async def close(self) -> None:
        """Cancel answers and free every page of the session."""
        if not self.closed:
            self.closed = True
            await self._engine.close_session(self._state)

    def _check_open(self) -> None:
        if self.closed:
            raise StreamgrokError(f"session {self.id} is closed")
        if self._state.error is not None:
            raise StreamgrokError(f"session {self.id} ended: {self._state.error}")

