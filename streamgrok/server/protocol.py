"""Protocol v1: JSON text messages for control and events, binary messages for media.

Binary media message = 11-byte little-endian header + payload:
    kind (uint8): 1 = video frame (JPEG/PNG), 2 = video container chunk (fragmented MP4/WebM),
                  3 = audio (PCM16 mono 16 kHz)
    stream (uint16): the client's stream id
    timestamp (float64): seconds on the client's stream clock
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any

HEADER = struct.Struct("<BHd")
MEDIA_KINDS = {1: "video.frame", 2: "video.chunk", 3: "audio.pcm16"}
CLIENT_TYPES = {
    "session.start": (),
    "input.text": ("text",),
    "query": ("text",),
    "response.cancel": ("query_id",),
    "session.end": (),
}


class ProtocolError(Exception):
    """A message the server cannot accept; `code` goes into the error event."""

    def __init__(self, code: str, message: str, message_id: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message_id = message_id


@dataclass
class MediaMessage:
    kind: str
    stream: int
    timestamp: float
    payload: bytes


def parse_text(raw: str) -> dict[str, Any]:
    """A client JSON message, checked for type and required fields."""
    try:
        message = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ProtocolError("bad_json", f"malformed JSON: {exc.msg} at {exc.pos}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("bad_message", "a message must be a JSON object")
    kind = message.get("type")
    message_id = message.get("id")
    if kind not in CLIENT_TYPES:
        raise ProtocolError("unknown_type", f"unknown message type {kind!r}", message_id)
    for name in CLIENT_TYPES[kind]:
        if name not in message:
            raise ProtocolError("missing_field", f"{kind} needs the field {name!r}", message_id)
    if "text" in CLIENT_TYPES[kind] and not isinstance(message["text"], str):
        raise ProtocolError("bad_field", f"{kind}.text must be a string", message_id)
    return message


def parse_binary(raw: bytes) -> MediaMessage:
    """A binary media message (header + payload)."""
    if len(raw) < HEADER.size:
        raise ProtocolError("bad_media", f"binary message shorter than its {HEADER.size}-byte "
                            "header")
    kind, stream, timestamp = HEADER.unpack_from(raw)
    if kind not in MEDIA_KINDS:
        raise ProtocolError("bad_media", f"unknown media kind {kind}")
    if timestamp != timestamp or timestamp < 0:
        raise ProtocolError("bad_media", f"bad media timestamp {timestamp}")
    return MediaMessage(MEDIA_KINDS[kind], stream, timestamp, raw[HEADER.size :])


def pack_media(kind: str, stream: int, timestamp: float, payload: bytes) -> bytes:
    """Client side: build a binary media message."""
    code = {v: k for k, v in MEDIA_KINDS.items()}[kind]
    return HEADER.pack(code, stream, timestamp) + payload


def event(message_type: str, /, **fields: Any) -> str:
    """A server message as JSON text (fields may include their own "kind")."""
    return json.dumps({"type": message_type, **fields}, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)
