"""Protocol v1: JSON text messages for control and events, binary messages for media.

Binary media message = 11-byte little-endian header + payload:
    kind (uint8): 1 = video frame (JPEG/PNG), 2 = video container chunk (fragmented MP4/WebM),
                  3 = audio (PCM16 mono, 16 kHz unless an `audio.format` message set another rate)
    stream (uint16): the client's stream id
    timestamp (float64): seconds on the client's stream clock
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("<BHd")
MAX_TIMESTAMP = 1e7  # seconds (about 115 days of stream clock)
MAX_ID_CHARS = 128
MEDIA_KINDS = {1: "video.frame", 2: "video.chunk", 3: "audio.pcm16"}
CLIENT_TYPES = {
    "session.start": (),
    "session.resume": ("handle",),
    "input.text": ("text",),
    "query": ("text",),
    "response.cancel": ("query_id",),
    "session.end": (),
    "audio.format": ("rate",),
    "frames.search": ("text",),
}


# Every error code the server sends, and what it means (docs/PROTOCOL.md lists the same).
ERROR_CODES = {
    "bad_json": "not strict JSON (NaN/Infinity, huge integers, too deeply nested, malformed)",
    "bad_message": "JSON that is not an object",
    "missing_field": "a required field (type, text, query_id) is absent",
    "bad_field": "a field of the wrong type, or text that is not valid Unicode",
    "unknown_type": "a message type the protocol does not have",
    "no_session": "anything but session.start before session.start",
    "session_exists": "session.start sent twice",
    "bad_option": "a session option the pipeline does not let clients set, or a bad value",
    "unknown_query": "response.cancel for a query that is not in flight",
    "too_many_queries": "more queries in flight than allowed",
    "too_large": "a message, text or question over its limit (bytes, characters, tokens, or "
                 "the session's KV budget)",
    "bad_media": "a bad binary header, a container stream that is not fragmented MP4/WebM, or "
                 "media the decoder or a media worker could not process",
    "bad_image": "a frame that is not a JPEG/PNG within the size limits",
    "bad_audio": "audio that is not PCM16 mono, or an audio.format rate outside 8-192 kHz",
    "rate_limited": "media over the per-second limit: dropped (one error a second at most)",
    "busy": "the server has no room for another session (or, for session.resume, no KV "
            "room to bring the session back now)",
    "resume_unknown": "session.resume with a handle no session has",
    "resume_expired": "session.resume for a session that has ended (its resume time ran out, "
                      "it ended, a newer handle replaced this one, or it was saved by a server "
                      "of another model or KV format)",
    "resume_forbidden": "session.resume with a handle made with another API key",
    "resume_in_use": "session.resume for a session attached to another connection",
    "bad_request": "a well-formed request the session cannot serve as asked (the message "
                   "says why)",
    "answer_failed": "an answer failed after it started (its query_id and a response.done "
                     "with finish_reason error follow)",
    "pipeline": "the session's pipeline reported a problem; the session goes on",
    "pipeline_failed": "the session's pipeline stopped",
    "internal": "a bug in the server; the connection stays usable",
}


class ProtocolError(Exception):
    """A message the server cannot accept; `code` goes into the error event, and `fields`
    (such as `retry_after_ms`) beside it."""

    def __init__(self, code: str, message: str, message_id: Any = None, **fields: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message_id = message_id
        self.fields = fields


@dataclass
class MediaMessage:
    kind: str
    stream: int
    timestamp: float
    payload: bytes


def parse_text(raw: str) -> dict[str, Any]:
    """A client JSON message, checked for type and required fields.

    Strict JSON only: NaN/Infinity, integers of more than 4300 digits and nesting deeper than
    Python's recursion limit are `bad_json`; ids must be strings or safe integers; text must be
    valid Unicode (no lone surrogates)."""
    message = strict_json_object(raw)
    message_id = message.get("id")
    if not _valid_id(message_id):
        raise ProtocolError("bad_field", "id must be a string of at most "
                            f"{MAX_ID_CHARS} characters or an integer", None)
    if "type" not in message:
        raise ProtocolError("missing_field", "a message needs the field 'type'", message_id)
    kind = message["type"]
    if not isinstance(kind, str):
        raise ProtocolError("bad_field", "type must be a string", message_id)
    if kind not in CLIENT_TYPES:
        raise ProtocolError("unknown_type", f"unknown message type {kind[:40]!r}", message_id)
    for name in CLIENT_TYPES[kind]:
        if name not in message:
            raise ProtocolError("missing_field", f"{kind} needs the field {name!r}", message_id)
    if "text" in CLIENT_TYPES[kind]:
        text = message["text"]
        if not isinstance(text, str):
            raise ProtocolError("bad_field", f"{kind}.text must be a string", message_id)
        if not _is_unicode(text):
            raise ProtocolError("bad_field", f"{kind}.text is not valid Unicode (lone "
                                "surrogates)", message_id)
    if "query_id" in CLIENT_TYPES[kind] and not _valid_id(message["query_id"]):
        raise ProtocolError("bad_field", f"{kind}.query_id must be a string or an integer",
                            message_id)
    if "options" in message and not isinstance(message["options"], dict | None):
        raise ProtocolError("bad_field", "options must be a JSON object", message_id)
    return message


def strict_json_object(raw: str | bytes) -> dict[str, Any]:
    """A JSON object, strictly: NaN/Infinity, huge integers, over-deep nesting and
    non-objects raise `ProtocolError` (bad_json / bad_message)."""
    try:
        message = json.loads(raw, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ProtocolError("bad_json", f"malformed JSON: {exc.msg} at {exc.pos}") from exc
    except RecursionError:
        raise ProtocolError("bad_json", "JSON nested too deeply") from None
    except ValueError as exc:  # non-finite constants, integers past the digit limit, UTF-8
        raise ProtocolError("bad_json", f"malformed JSON: {exc}") from None
    if not isinstance(message, dict):
        raise ProtocolError("bad_message", "a message must be a JSON object")
    return message


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed (strict JSON)")


def _valid_id(value: Any) -> bool:
    if value is None:
        return True
    if isinstance(value, str):
        return len(value) <= MAX_ID_CHARS and _is_unicode(value)
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**53


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def parse_binary(raw: bytes) -> MediaMessage:
    """A binary media message (header + payload)."""
    if len(raw) < HEADER.size:
        raise ProtocolError("bad_media", f"binary message shorter than its {HEADER.size}-byte "
                            "header")
    kind, stream, timestamp = HEADER.unpack_from(raw)
    if kind not in MEDIA_KINDS:
        raise ProtocolError("bad_media", f"unknown media kind {kind}")
    if not math.isfinite(timestamp) or not 0 <= timestamp <= MAX_TIMESTAMP:
        raise ProtocolError("bad_media", f"media timestamp {timestamp} is not within "
                            f"[0, {MAX_TIMESTAMP:g}] seconds")
    return MediaMessage(MEDIA_KINDS[kind], stream, timestamp, raw[HEADER.size :])


def pack_media(kind: str, stream: int, timestamp: float, payload: bytes) -> bytes:
    """Client side: build a binary media message."""
    code = {v: k for k, v in MEDIA_KINDS.items()}[kind]
    return HEADER.pack(code, stream, timestamp) + payload


def event(message_type: str, /, **fields: Any) -> str:
    """A server message as strict JSON text (fields may include their own "kind"); a
    non-finite number becomes null."""
    message = {"type": message_type, **fields}
    try:
        return json.dumps(message, default=_jsonable, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(message), default=_jsonable, allow_nan=False)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    if isinstance(value, Mapping):  # read-only views, such as the engine snapshot's
        return dict(value)
    return str(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
