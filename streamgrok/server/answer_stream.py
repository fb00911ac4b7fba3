"""One answer for an HTTP or Realtime request, from a short-lived engine session or from a
live websocket session, as text deltas (cut at stop strings) and then its usage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import torch

from streamgrok.engine import Engine
from streamgrok.engine.session import Answer, Session
from streamgrok.errors import RequestTooLarge, StreamgrokError
from streamgrok.model.sampling import SamplingParams
from streamgrok.pipeline.events import DeltaEvent, DoneEvent, ErrorEvent, PipelineEvent
from streamgrok.server.openai_schema import ApiError
from streamgrok.server.protocol import ProtocolError
from streamgrok.server.stop_strings import StopScanner
from streamgrok.stream_tokens import Modality

if TYPE_CHECKING:
    from streamgrok.server.connection import ClientConnection

REFUSALS = {"busy": 429, "too_many_queries": 429, "too_large": 400, "no_session": 404}


class AnswerStream:
    """`async for delta in stream` yields text; then `finish_reason` ("stop", "length",
    "cancelled"), `prompt_tokens` and `completion_tokens` are set. `cancel()` stops it."""

    def __init__(self, stops: list[str]) -> None:
        self.scanner = StopScanner(stops)
        self.finish_reason = "stop"
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.metrics: dict[str, Any] = {}

    def __aiter__(self) -> AsyncIterator[str]:
        return self._stream()

    async def _stream(self) -> AsyncIterator[str]:
        try:
            async for delta in self._deltas():
                shown = self.scanner.feed(delta)
                if shown:
                    yield shown
                if self.scanner.stopped:
                    self.cancel()
                    self.finish_reason = "stop"
                    return
            tail = self.scanner.flush()
            if tail:
                yield tail
        finally:
            await self.close()

    async def text(self) -> str:
        return "".join([delta async for delta in self])

    def _deltas(self) -> AsyncIterator[str]:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        """Release what the answer holds (idempotent)."""


class EngineAnswer(AnswerStream):
    """A prompt (already in the chat template, or plain text) on its own engine session."""

    def __init__(self, engine: Engine, prompt: str, sampling: SamplingParams,
                 stops: list[str], preamble: list[tuple[Modality, torch.Tensor]] = ()) -> None:
        """`preamble`: embedding rows [n, hidden] that come before `prompt` (the text and
        image parts of a chat with images, for a model with a vision tower)."""
        super().__init__(stops)
        try:
            self.session: Session | None = engine.new_session()
        except StreamgrokError as exc:
            raise ApiError(429, f"the server is busy: {exc}", "rate_limit_error") from exc
        try:
            for source, (modality, rows) in enumerate(preamble):
                self.session.append_embeddings(rows, 0.0, source, modality, droppable=False)
            self.answer: Answer = self.session.ask(prompt, sampling, raw=True, remember=False,
                                                   add_bos=False if preamble else None)
        except RequestTooLarge as exc:
            session, self.session = self.session, None
            asyncio.ensure_future(session.close())
            raise ApiError(400, str(exc), code="context_length_exceeded") from exc
        self.prompt_tokens = (self.answer.metrics.prompt_tokens
                              + sum(rows.shape[0] for _, rows in preamble))

    async def _deltas(self) -> AsyncIterator[str]:
        try:
            async for delta in self.answer:
                yield delta
        except StreamgrokError as exc:
            raise ApiError(500, f"the answer failed: {exc}", "server_error") from exc
        self._finished()

    def _finished(self) -> None:
        metrics = self.answer.metrics
        self.finish_reason = metrics.finish_reason or "stop"
        self.completion_tokens = metrics.tokens
        self.metrics = metrics.as_dict()

    def cancel(self) -> None:
        self.answer.cancel()

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            self.completion_tokens = self.answer.metrics.tokens
            self.metrics = self.answer.metrics.as_dict()
            await session.close()


class LiveAnswer(AnswerStream):
    """A question to a live websocket session's pipeline: grounded in what that stream showed
    and said; the streaming client sees the question and answer too."""

    def __init__(self, connection: ClientConnection, question: str, query_id: str,
                 max_tokens: int, stops: list[str]) -> None:
        super().__init__(stops)
        self.connection = connection
        # one event per token at most, plus the last: bounded by the answer's length
        self.events: asyncio.Queue[PipelineEvent] = asyncio.Queue(maxsize=max_tokens + 8)
        try:
            self.query_id = connection.ask(question, query_id, self.events.put_nowait,
                                           max_tokens)
        except ProtocolError as exc:
            raise ApiError(REFUSALS.get(exc.code, 400), str(exc),
                           "rate_limit_error" if exc.code in ("busy", "too_many_queries")
                           else "invalid_request_error", code=exc.code) from exc
        except RequestTooLarge as exc:
            raise ApiError(400, str(exc), code="context_length_exceeded") from exc

    async def _deltas(self) -> AsyncIterator[str]:
        while True:
            event = await self.events.get()
            if isinstance(event, DeltaEvent):
                yield event.text
            elif isinstance(event, DoneEvent):
                self.metrics = event.metrics
                self.finish_reason = event.metrics.get("finish_reason") or "stop"
                self.prompt_tokens = event.metrics.get("prompt_tokens") or 0
                self.completion_tokens = event.metrics.get("tokens") or 0
                return
            elif isinstance(event, ErrorEvent):
                raise ApiError(500, event.text, "server_error")

    def cancel(self) -> None:
        answer = self.connection.answers.get(self.query_id)
        if answer is not None:
            answer.cancel()

    async def close(self) -> None:
        self.connection.listeners.pop(self.query_id, None)
