"""The OpenAI-compatible HTTP API: /v1/models, /v1/chat/completions, /v1/completions.

A request runs on its own short-lived engine session, unless it names a live websocket
session (`metadata.session`, or the `X-Streamgrok-Session` header): then its last user
message is asked of that session's pipeline, grounded in what the stream showed and said."""

from __future__ import annotations

import itertools
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import torch
from jinja2 import TemplateError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from streamgrok.errors import StreamgrokError
from streamgrok.server.answer_stream import AnswerStream, EngineAnswer, LiveAnswer
from streamgrok.server.image_notes import ImageError, decode_image, describe_image, image_bytes
from streamgrok.server.openai_schema import (
    ApiError,
    ChatMessage,
    GenerationRequest,
    chat_chunk,
    chat_completion,
    new_id,
    parse_chat,
    parse_completion,
    text_completion,
    usage,
)
from streamgrok.server.protocol import ProtocolError, strict_json_object
from streamgrok.stream_tokens import Modality
from streamgrok.vision.encoder import token_rows

if TYPE_CHECKING:
    from streamgrok.server.app import StreamgrokServer

log = logging.getLogger(__name__)
SESSION_HEADER = "x-streamgrok-session"
# where an image goes in a rendered chat prompt (control characters no client text holds
# after parsing, so the split is exact)
IMAGE_MARKER = "\x1e{}\x1f"
IMAGE_SPLIT = re.compile("\x1e(\\d+)\x1f")
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class OpenAIApi:
    """The /v1 endpoints of one server."""

    def __init__(self, server: StreamgrokServer) -> None:
        self.server = server
        self.created = int(time.time())
        self._ids = itertools.count(1)

    def error(self, status: int, message: str, kind: str = "invalid_request_error",
              param: str | None = None, code: str | None = None) -> JSONResponse:
        return JSONResponse(ApiError(status, message, kind, param, code).body(), status)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": self.server.model_name, "object": "model", "created": self.created,
             "owned_by": "streamgrok"}]})

    async def chat_completions(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            chat = parse_chat(body, self.server.config.max_completion_tokens,
                              self.server.config.max_images)
            self._check_ready(chat.model)
            stream = await self._chat_answer(chat, request)
        except ApiError as exc:
            return _refused(exc)
        return await self._respond(new_id("chatcmpl"), chat, stream, self._chat_events,
                                   chat_completion)

    async def completions(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            completion = parse_completion(body, self.server.config.max_completion_tokens)
            self._check_ready(completion.model)
            stream = self.answer(completion, completion.prompt, request, raw=True)
        except ApiError as exc:
            return _refused(exc)
        return await self._respond(new_id("cmpl"), completion, stream,
                                   self._completion_events, text_completion)

    async def _respond(self, request_id: str, request: GenerationRequest,
                       stream: AnswerStream, events, whole) -> Response:
        """SSE events when the request streams, else the whole answer as one object."""
        if request.stream:
            return StreamingResponse(events(request_id, request, stream),
                                     media_type="text/event-stream", headers=SSE_HEADERS)
        try:
            text = await stream.text()
        except ApiError as exc:
            return _refused(exc)
        self._observe(stream)
        return JSONResponse(whole(request_id, self.server.model_name, text, _finish(stream),
                                  _usage(stream)))

    # -- requests ----------------------------------------------------------------------

    async def _body(self, request: Request) -> dict:
        limit = self.server.config.max_request_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the request body of {declared} bytes exceeds {limit}")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"the request body exceeds {limit} bytes")
                chunks.append(chunk)
        except ClientDisconnect:
            raise ApiError(400, "the client left before sending the body") from None
        try:
            return strict_json_object(b"".join(chunks))
        except ProtocolError as exc:
            raise ApiError(400, f"the body must be a JSON object: {exc}") from None

    def _check_ready(self, model: str) -> None:
        server = self.server
        if not server.ready:
            raise ApiError(503, "the model is still loading (GET /health says when it is "
                           "ready)", "server_error", code="model_loading")
        if not server.accepting:
            raise ApiError(503, "the server is shutting down", "server_error")
        if model != server.model_name:
            raise ApiError(404, f"the model {model[:80]!r} is not served here (this server "
                           f"serves {server.model_name!r})", param="model",
                           code="model_not_found")

    async def _chat_answer(self, chat: GenerationRequest, request: Request) -> AnswerStream:
        engine = self.server.engine
        live = self._live_session_id(chat, request) is not None
        if engine.vision is not None and not live and any(
                p.image_url is not None for m in chat.messages for p in m.parts):
            return await self._seen_chat_answer(chat)
        messages = [await self._render_message(m, i) for i, m in enumerate(chat.messages)]
        if live:
            return self.answer(chat, messages[-1]["content"], request)
        return self.answer(chat, self._render_chat(messages), request, raw=True)

    def _render_chat(self, messages: list[dict]) -> str:
        """The model's chat template over `messages`; its refusal is the client's 400."""
        try:
            return self.server.engine.tokenizer.render_chat(messages)
        except TemplateError as exc:
            raise ApiError(400, f"the model's chat template refused the messages: {exc}",
                           param="messages") from exc

    async def _seen_chat_answer(self, chat: GenerationRequest) -> AnswerStream:
        """A chat with images for a model with a vision tower: the template rendered with a
        marker where each image goes, the text between the markers as token embeddings and
        each image as the tower's tokens in the model's own image framing."""
        engine = self.server.engine
        self._admit(chat)  # before the tower does any work for a request that cannot run
        images: list[tuple[int, str]] = []
        messages = []
        for index, message in enumerate(chat.messages):
            texts = []
            for part in message.parts:
                if part.image_url is None:  # the marker's characters never come from a client
                    texts.append(part.text.replace("\x1e", " ").replace("\x1f", " "))
                else:
                    texts.append(IMAGE_MARKER.format(len(images)))
                    images.append((index, part.image_url))
            messages.append({"role": message.role, "content": "\n".join(texts)})
        pieces = IMAGE_SPLIT.split(self._render_chat(messages))  # text, image no., ..., text
        if len(pieces) != 2 * len(images) + 1:
            raise ApiError(400, "the model's chat template dropped or repeated an image",
                           param="messages")
        rows = []
        for (index, url), number in zip(images, pieces[1::2]):
            if int(number) != len(rows):
                raise ApiError(400, "the chat template reordered the images",
                               param="messages")
            try:
                image = await decode_image(self.server.resources, image_bytes(url), index)
                rows.append(await engine.vision.encode(image, None))
            except ImageError as exc:
                raise ApiError(400, str(exc), param=f"messages[{index}].content") from None
            except StreamgrokError as exc:
                raise ApiError(400, f"image {len(rows) + 1}: {exc}",
                               param=f"messages[{index}].content") from None
        preamble: list[tuple[Modality, torch.Tensor]] = []
        for number, (text, image) in enumerate(zip(pieces[0:-1:2], rows)):
            ids = engine.tokenizer.encode(text, add_bos=None if number == 0 else False)
            if ids:
                preamble.append((Modality.TEXT, token_rows(ids, engine.loaded.model.embed)))
            preamble.append((Modality.FRAME, image))
        return EngineAnswer(engine, pieces[-1], chat.sampling, chat.stops, preamble)

    async def _render_message(self, message: ChatMessage, index: int) -> dict:
        """A chat message as text: images become what the observers see in them."""
        texts = []
        for part in message.parts:
            if part.image_url is None:
                texts.append(part.text)
                continue
            try:
                data = image_bytes(part.image_url)
                texts.append(f"[{await describe_image(self.server.resources, data, index)}]")
            except ImageError as exc:
                raise ApiError(400, str(exc), param=f"messages[{index}].content") from None
        return {"role": message.role, "content": "\n".join(texts)}

    def _admit(self, request: GenerationRequest) -> None:
        """Refuse (429) a new engine answer the server has no room for now."""
        refused = self.server.question_admission(request.sampling.max_tokens)
        if refused is not None:
            raise ApiError(429, str(refused), "rate_limit_error", code="busy")

    def _live_session_id(self, request: GenerationRequest, http: Request | None) -> str | None:
        if request.session is not None:
            return request.session
        return http.headers.get(SESSION_HEADER) if http is not None else None

    def answer(self, request: GenerationRequest, prompt: str, http: Request | None,
               raw: bool = False) -> AnswerStream:
        """Start the answer: on a live session when the request names one, else on a new
        engine session (`raw`: `prompt` is the whole rendered prompt)."""
        session_id = self._live_session_id(request, http)
        if session_id is not None:
            connection = self.server.live_session(session_id)
            if connection is None:
                raise ApiError(404, f"no live session {session_id[:40]!r} (its id is in the "
                               "websocket's session.started)", param="metadata.session",
                               code="session_not_found")
            return LiveAnswer(connection, prompt, f"http-{next(self._ids)}",
                              request.sampling.max_tokens, request.stops)
        self._admit(request)
        if not raw:
            prompt = self.server.engine.tokenizer.render_chat(
                [{"role": "user", "content": prompt}])
        return EngineAnswer(self.server.engine, prompt, request.sampling, request.stops)

    # -- streamed responses ------------------------------------------------------------

    async def _chat_events(self, request_id: str, chat: GenerationRequest,
                           stream: AnswerStream) -> AsyncIterator[str]:
        model = self.server.model_name
        try:
            yield _sse(chat_chunk(request_id, model, {"role": "assistant", "content": ""}))
            async for delta in stream:
                yield _sse(chat_chunk(request_id, model, {"content": delta}))
            yield _sse(chat_chunk(request_id, model, {}, _finish(stream)))
            if chat.include_usage:
                yield _sse(chat_chunk(request_id, model, {}, used=_usage(stream)))
            self._observe(stream)
        except ApiError as exc:
            yield _sse(exc.body())
        finally:
            await stream.close()
        yield "data: [DONE]\n\n"

    async def _completion_events(self, request_id: str, completion: GenerationRequest,
                                 stream: AnswerStream) -> AsyncIterator[str]:
        model = self.server.model_name
        try:
            async for delta in stream:
                yield _sse(text_completion(request_id, model, delta, None, None, chunk=True))
            yield _sse(text_completion(request_id, model, "", _finish(stream), None, True))
            if completion.include_usage:
                yield _sse(text_completion(request_id, model, "", None, _usage(stream), True))
            self._observe(stream)
        except ApiError as exc:
            yield _sse(exc.body())
        finally:
            await stream.close()
        yield "data: [DONE]\n\n"

    def _observe(self, stream: AnswerStream) -> None:
        if isinstance(stream, EngineAnswer) and stream.metrics:  # live ones are counted there
            self.server.metrics.observe_answer(stream.metrics)
        log.info("HTTP answer: %d prompt + %d completion tokens, %s, TTFT %s ms%s",
                 stream.prompt_tokens, stream.completion_tokens, stream.finish_reason,
                 stream.metrics.get("ttft_ms"),
                 " (live session)" if isinstance(stream, LiveAnswer) else "",
                 extra={"event": "http.answer", "prompt_tokens": stream.prompt_tokens,
                        "completion_tokens": stream.completion_tokens})


def _refused(exc: ApiError) -> JSONResponse:
    """The error response, logged once (warning for refusals under load, info otherwise)."""
    level = logging.WARNING if exc.status in (429, 503) else logging.INFO
    log.log(level, "HTTP %d %s: %s", exc.status, exc.code or exc.kind, exc,
            extra={"event": "http.refused", "status": exc.status})
    return JSONResponse(exc.body(), exc.status)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, allow_nan=False)}\n\n"


def _finish(stream: AnswerStream) -> str:
    return "length" if stream.finish_reason == "length" else "stop"


def _usage(stream: AnswerStream) -> dict:
    return usage(stream.prompt_tokens, stream.completion_tokens)
