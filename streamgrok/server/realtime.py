"""`/v1/realtime`: the OpenAI Realtime event protocol mapped onto a streamgrok live session.

Supported client events: `session.update` (instructions, input audio rate, max output tokens;
text output only), `input_audio_buffer.append` (base64 PCM16, 24 kHz unless the session says
otherwise; resampled), `input_audio_buffer.commit` / `.clear`, `conversation.item.create`
(user `input_text`, `input_image` as a data URL, `input_audio`; system and assistant text),
`response.create` and `response.cancel`. Server events: `session.created`, `session.updated`,
`conversation.item.added` / `.done`, `input_audio_buffer.committed` / `.cleared`,
`conversation.item.input_audio_transcription.completed` (Whisper, per sentence),
`response.created`, `response.output_item.added` / `.done`, `response.content_part.added` /
`.done`, `response.output_text.delta` / `.done`, `response.done`, `error`. Audio output,
tools and server turn detection are not supported (see docs/REALTIME.md)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from streamgrok.errors import RequestTooLarge, StreamgrokError
from streamgrok.media.native_pool import MediaWorkerError
from streamgrok.pipeline.events import ErrorEvent, NoteEvent, PipelineEvent
from streamgrok.server.answer_stream import LiveAnswer
from streamgrok.server.image_notes import ImageError, image_bytes
from streamgrok.server.openai_schema import ApiError, usage
from streamgrok.server.protocol import ProtocolError, strict_json_object
from streamgrok.server.realtime_events import (
    DEFAULT_INPUT_RATE,
    assistant_item,
    response_object,
    session_object,
    status_of,
    user_item,
)
from streamgrok.server.session_connection import SessionConnection

if TYPE_CHECKING:
    from streamgrok.server.asgi_socket import AsgiSocket
    from streamgrok.server.session_context import SessionContext

log = logging.getLogger(__name__)
HANDLERS = {
    "session.update": "_session_update",
    "input_audio_buffer.append": "_audio_append",
    "input_audio_buffer.commit": "_audio_commit",
    "input_audio_buffer.clear": "_audio_clear",
    "conversation.item.create": "_item_create",
    "response.create": "_response_create",
    "response.cancel": "_response_cancel",
}
SPEECH_WAIT_S = 15.0  # response.create after audio: how long to wait for its transcript


class RealtimeConnection(SessionConnection):
    """One Realtime client: a live pipeline session (observers, speech, the KV cache) that
    speaks the Realtime events instead of protocol v1.

    A client that asks for it (`?resumable=true` or `X-Streamgrok-Resumable: true` on the
    upgrade request; like Gemini Live, where resumption is asked for in the setup) gets a
    resume handle in `session.created`, and its session outlives a dropped connection: a
    client reconnecting with `?resume=HANDLE` or `X-Streamgrok-Resume: HANDLE` gets
    `session.resumed` and carries on (the same conversation items, instructions and context).
    Otherwise the session ends with its connection, as OpenAI's does. Not saved across a
    restart (`--state-dir`)."""

    SUPERSEDED_WHILE_AWAY = ("response.output_text.delta", "response.output_audio_transcript"
                             ".delta", "response.content_part.added")

    def __init__(self, context: SessionContext, ws: AsgiSocket) -> None:
        super().__init__(context, ws)
        self.audio_rate = DEFAULT_INPUT_RATE
        self._event_ids = itertools.count(1)
        self._item_ids = itertools.count(1)
        self._response_ids = itertools.count(1)
        self.session_name = f"sess_{id(self):x}"
        self.instructions = ""
        self.max_output_tokens = 0
        self.pending_text: list[str] = []  # user text since the last response
        self.heard: list[str] = []  # sentences transcribed since the last response
        self.heard_new = asyncio.Event()
        self.audio_item: str | None = None  # the user audio item being filled
        self.audio_waiting = False  # audio committed, its transcript not yet asked
        self.last_item: str | None = None
        self.response: asyncio.Task | None = None
        self.answer: LiveAnswer | None = None
        self.started_at = time.monotonic()

    async def serve(self) -> None:
        if self.ws.resume is not None and self.context.shelf.enabled:
            try:
                await self._resume({"handle": self.ws.resume, "id": None})
            except ProtocolError as exc:
                if exc.code not in ("resume_unknown", "resume_expired"):
                    await self._refuse(exc.code, str(exc), 1008, "resume refused")
                    return
                self.error(exc.code, f"{exc}; a new session starts")
            else:
                await super().serve()  # the resumed session, on this socket
                return
        try:
            await self.context.media_models()
            self.open_session(None)
        except (ProtocolError, StreamgrokError) as exc:
            code = exc.code if isinstance(exc, ProtocolError) else "session_refused"
            await self._refuse(code, str(exc), 1013, "no room for a session")
            return
        self.max_output_tokens = self.runner.pipeline.sampling.max_tokens
        if self.context.shelf.enabled and self.ws.resumable:
            self.resume_handle, self.resume_key = self.context.shelf.issue(self,
                                                                          self.ws.principal)
        self.send("session.created", session=self._session(), resume=self.resume_info())
        await super().serve()

    async def _refuse(self, code: str, message: str, close_code: int, reason: str) -> None:
        self.error(code, message)
        writer = asyncio.create_task(self._writer())
        await asyncio.sleep(0.1)
        writer.cancel()
        await self.ws.close(close_code, reason)

    def resumed_message(self, message_id: Any, gap: dict, held: int) -> str:
        """`session.resumed` as a Realtime event: the session object, the new resume
        handle, the gap and how many held events follow."""
        body = {"type": "session.resumed", "event_id": f"event_{next(self._event_ids)}",
                "session": self._session(), "resume": self.resume_info(), "gap": gap,
                "delivered": held}
        return json.dumps(body, allow_nan=False, default=str)

    async def save(self, store, wait_s: float = 30.0) -> bool:
        """Realtime sessions are not saved for the next process (their conversation items
        live in this one); they end with the server."""
        return False

    def _session(self) -> dict:
        return session_object(self.session_name, self.context.model_name, self.instructions,
                              self.audio_rate, self.max_output_tokens)

    # -- events out ------------------------------------------------------------------------

    def send(self, message_type: str, /, **fields: Any) -> None:
        """Queue a Realtime server event."""
        body = {"type": message_type, "event_id": f"event_{next(self._event_ids)}", **fields}
        self._queue(message_type, json.dumps(body, allow_nan=False, default=str))

    def error(self, code: str, message: str, message_id: Any = None, **fields: Any) -> None:
        self.context.metrics.errors.labels(code).inc()
        kind = "server_error" if code in ("internal", "pipeline_failed", "answer_failed") \
            else "invalid_request_error"
        body = {"type": "error", "event_id": f"event_{next(self._event_ids)}",
                "error": {"type": kind, "code": code, "message": message,
                          "param": fields.get("param"), "event_id": message_id}}
        self._queue("error", json.dumps(body, default=str))

    async def deliver(self, item: PipelineEvent) -> None:
        """Answers go to the response that asked them; speech transcripts become
        transcription events; media errors become `error` events; other notes stay in the
        session's context only."""
        self.to_listener(item)
        if isinstance(item, NoteEvent) and "speech" in item.tags:
            transcript = item.text.removeprefix('said: "').removesuffix('"')
            self.heard.append(transcript)
            self.heard_new.set()
            self.send("conversation.item.input_audio_transcription.completed",
                      item_id=self.audio_item or self.last_item or "item_none",
                      content_index=0, transcript=transcript,
                      usage={"type": "duration", "seconds": 0.0})
        elif isinstance(item, ErrorEvent) and item.answer_id is None:
            self.error("bad_media" if item.stage in ("decode", "observe") else "pipeline",
                       item.text)

    # -- events in -------------------------------------------------------------------------

    async def _handle_safely(self, raw: str | bytes) -> None:
        event_id = None
        try:
            if len(raw) > self.config.max_message_bytes:
                raise ProtocolError("too_large", f"an event of {len(raw)} bytes exceeds "
                                    f"{self.config.max_message_bytes}")
            if isinstance(raw, bytes):
                raise ProtocolError("bad_message", "Realtime events are JSON text messages")
            message = strict_json_object(raw)
            event_id = message.get("event_id")
            kind = message.get("type")
            if not isinstance(kind, str) or kind not in HANDLERS:
                raise ProtocolError("unknown_type", f"unsupported event type {str(kind)[:60]!r}"
                                    f" (supported: {', '.join(HANDLERS)})")
            if self.runner is None:
                raise ProtocolError("no_session", "the session has ended")
            await getattr(self, HANDLERS[kind])(message)
        except ProtocolError as exc:
            self.error(exc.code, str(exc), event_id)
        except ApiError as exc:
            self.error(exc.code or "bad_request", str(exc), event_id, param=exc.param)
        except (RequestTooLarge, StreamgrokError, ValueError) as exc:
            self.error("bad_request", str(exc), event_id)
        except Exception as exc:  # a bug must not take the connection down
            log.exception("handling a Realtime event failed")
            self.error("internal", f"internal error: {type(exc).__name__}", event_id)

    async def _session_update(self, message: dict) -> None:
        session = _field(message, "session", dict)
        modalities = session.get("output_modalities")
        if modalities is not None and modalities != ["text"]:
            raise ProtocolError("unsupported", "only text output is supported "
                                "(output_modalities: [\"text\"])")
        if session.get("tools"):
            raise ProtocolError("unsupported", "tools are not supported")
        audio_format = ((session.get("audio") or {}).get("input") or {}).get("format")
        if audio_format is not None:
            if not isinstance(audio_format, dict) or audio_format.get("type") != "audio/pcm":
                raise ProtocolError("unsupported", "input audio must be audio/pcm (PCM16 mono)")
            self.live.set_audio_rate(audio_format.get("rate", DEFAULT_INPUT_RATE))
            self.audio_rate = self.live.audio_resampler.rate
        if "max_output_tokens" in session:
            limit = session["max_output_tokens"]
            ceiling = self.runner.pipeline.sampling.max_tokens
            if limit == "inf":
                limit = ceiling
            if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
                raise ProtocolError("bad_field", "max_output_tokens must be a positive integer "
                                    "or \"inf\"")
            self.max_output_tokens = min(limit, ceiling)
        instructions = session.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str) or len(instructions) > self.config.max_text_chars:
                raise ProtocolError("bad_field", "instructions must be a string of at most "
                                    f"{self.config.max_text_chars} characters")
            self.instructions = instructions
            await self.runner.set_instructions(instructions)
        self.send("session.updated", session=self._session())

    async def _audio_append(self, message: dict) -> None:
        data = _base64(_field(message, "audio", str), "audio")
        chunk = self.live.audio_resampler.push(data)
        if self.audio_item is None:
            self.audio_item = self._new_item_id()
        await self.live.audio_in.put(chunk)

    async def _audio_commit(self, message: dict) -> None:
        if self.audio_item is None:
            raise ProtocolError("input_audio_buffer_commit_empty", "the audio buffer is empty")
        item_id, self.audio_item = self.audio_item, None
        self.send("input_audio_buffer.committed", item_id=item_id,
                  previous_item_id=self.last_item)
        self._added(user_item(item_id, [{"type": "input_audio", "transcript": None}]))
        self.audio_waiting = True

    async def _audio_clear(self, message: dict) -> None:
        self.audio_item = None
        self.send("input_audio_buffer.cleared")

    async def _item_create(self, message: dict) -> None:
        item = _field(message, "item", dict)
        role = item.get("role")
        if item.get("type", "message") != "message" or role not in ("user", "system",
                                                                     "assistant"):
            raise ProtocolError("unsupported", "only message items (user, system, assistant) "
                                "are supported")
        content = item.get("content")
        if not isinstance(content, list) or not content:
            raise ProtocolError("bad_field", "item.content must be a non-empty list")
        texts: list[str] = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("input_text", "text", "output_text") and isinstance(part.get("text"),
                                                                             str):
                texts.append(part["text"])
            elif kind == "input_image" and role == "user":
                await self._push_image(part.get("image_url"), index)
            elif kind == "input_audio" and role == "user":
                await self.live.audio_in.put(self.live.audio_resampler.push(
                    _base64(part.get("audio"), "audio")))
                self.audio_waiting = True
            else:
                raise ProtocolError("bad_field", f"item.content[{index}] is not a part this "
                                    f"server takes for a {role} message")
        text = "\n".join(texts)
        if len(text) > self.config.max_text_chars:
            raise ProtocolError("too_large", f"message text of {len(text)} characters exceeds "
                                f"{self.config.max_text_chars}")
        if role == "user" and (text or any(p.get("type") == "input_image" for p in content)):
            self.pending_text.append(text or "What is in the picture I just sent?")
        elif role != "user" and text:
            await self.runner.session.append_message(text, role=role)
        item_id = item.get("id") if isinstance(item.get("id"), str) else self._new_item_id()
        created = {"id": item_id[:64], "object": "realtime.item", "type": "message",
                   "role": role, "status": "completed", "content": content}
        self._added(created)

    async def _push_image(self, url: Any, index: int) -> None:
        """An image joins the live stream as a frame (observers, frame tokens)."""
        if not isinstance(url, str):
            raise ProtocolError("bad_field", f"item.content[{index}].image_url must be a "
                                "data URL")
        try:
            data = image_bytes(url)
            image = await asyncio.to_thread(self.context.resources.media_pool.decode_image,
                                            data)
        except (ImageError, ValueError, MediaWorkerError) as exc:
            raise ProtocolError("bad_image", str(exc)) from None
        await self.live.push_image(image, time.monotonic() - self.started_at, scene_cut=True)

    async def _response_create(self, message: dict) -> None:
        if self.response is not None and not self.response.done():
            raise ProtocolError("conversation_already_has_active_response",
                                "a response is in progress (response.cancel stops it)")
        response_id = f"resp_{next(self._response_ids)}"
        self.response = asyncio.create_task(self._respond(response_id))

    async def _response_cancel(self, message: dict) -> None:
        if self.response is None or self.response.done():
            raise ProtocolError("response_cancel_not_active", "no response is in progress")
        if self.answer is not None:
            self.answer.cancel()
        else:
            self.response.cancel()  # still waiting for a transcript: nothing generated

    # -- responses -------------------------------------------------------------------------

    async def _question(self) -> str:
        """What the user asked since the last response: their text, else their speech (a
        committed buffer's transcript may still be on its way)."""
        if self.pending_text:
            question = "\n".join(self.pending_text)
        else:
            if not self.heard and self.audio_waiting:
                self.heard_new.clear()
                try:
                    await asyncio.wait_for(self.heard_new.wait(), SPEECH_WAIT_S)
                    await asyncio.sleep(0.5)  # the rest of the sentence's notes
                except TimeoutError:
                    pass
            if not self.heard:
                raise ProtocolError("nothing_to_respond_to", "no user text or transcribed "
                                    "speech since the last response")
            question = " ".join(self.heard)
        self.pending_text.clear()
        self.heard.clear()
        self.audio_waiting = False
        return question

    async def _respond(self, response_id: str) -> None:
        limit = self.max_output_tokens
        try:
            question = await self._question()
            self.answer = LiveAnswer(self, question, response_id, limit, stops=[])
        except (ProtocolError, ApiError) as exc:
            self.error(getattr(exc, "code", None) or "bad_request", str(exc))
            return
        except asyncio.CancelledError:
            self.send("response.done", response=response_object(
                response_id, "cancelled", [], limit, reason="client_cancelled"))
            return
        item_id = self._new_item_id()
        where = {"response_id": response_id, "item_id": item_id, "output_index": 0}
        self.send("response.created", response=response_object(response_id, "in_progress",
                                                                [], limit))
        self.send("response.output_item.added", response_id=response_id, output_index=0,
                  item=assistant_item(item_id, None, "in_progress"))
        self._added(assistant_item(item_id, None, "in_progress"), done=False)
        self.send("response.content_part.added", **where, content_index=0,
                  part={"type": "text", "text": ""})
        parts: list[str] = []
        failed = None
        try:
            async for delta in self.answer:
                parts.append(delta)
                self.send("response.output_text.delta", **where, content_index=0, delta=delta)
        except ApiError as exc:
            failed = str(exc)
        text = "".join(parts)
        status, reason = ("failed", "error") if failed else status_of(self.answer.finish_reason)
        item = assistant_item(item_id, text, "completed" if status == "completed"
                              else "incomplete")
        self.send("response.output_text.done", **where, content_index=0, text=text)
        self.send("response.content_part.done", **where, content_index=0,
                  part={"type": "text", "text": text})
        self.send("response.output_item.done", response_id=response_id, output_index=0,
                  item=item)
        self.send("conversation.item.done", item=item, previous_item_id=None)
        used = usage(self.answer.prompt_tokens, self.answer.completion_tokens)
        self.send("response.done", response=response_object(response_id, status, [item],
                                                             limit, used, reason))
        if failed:
            self.error("answer_failed", failed)
        self.answer = None

    def _added(self, item: dict, done: bool = True) -> None:
        self.send("conversation.item.added", item=item, previous_item_id=self.last_item)
        if done:
            self.send("conversation.item.done", item=item, previous_item_id=self.last_item)
        self.last_item = item["id"]

    def _new_item_id(self) -> str:
        return f"item_{next(self._item_ids)}"

    async def _end_session(self) -> None:
        if self.response is not None and not self.response.done():
            self.response.cancel()
        await super()._end_session()


def _field(message: dict, name: str, kind: type) -> Any:
    value = message.get(name)
    if not isinstance(value, kind):
        raise ProtocolError("missing_field" if value is None else "bad_field",
                            f"{message.get('type')} needs {name!r} ({kind.__name__})")
    return value


def _base64(value: Any, name: str) -> bytes:
    if not isinstance(value, str):
        raise ProtocolError("bad_field", f"{name} must be base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError("bad_audio", f"{name} is not valid base64: {exc}") from None
