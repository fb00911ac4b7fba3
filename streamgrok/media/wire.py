"""Framing of the media workers' pipes: a JSON header and raw bytes, never pickle.

    uint32 header length | header (UTF-8 JSON, with "size": payload length) | payload
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO

_LENGTH = struct.Struct("<I")
MAX_HEADER = 1 << 16


def write_message(out: BinaryIO, header: dict, payload: bytes = b"") -> None:
    """Send one message and flush."""
    data = json.dumps({**header, "size": len(payload)}).encode()
    out.write(_LENGTH.pack(len(data)) + data)
    out.write(payload)
    out.flush()


def read_message(inp: BinaryIO) -> tuple[dict, bytes] | None:
    """The next message, or None at a clean end of stream; raises EOFError if it is cut."""
    first = inp.read(_LENGTH.size)
    if not first:
        return None
    header = json.loads(_read_exact(inp, _header_length(_read_exact(inp, _LENGTH.size, first))))
    return header, _read_exact(inp, int(header.get("size", 0)))


def _header_length(raw: bytes) -> int:
    length = _LENGTH.unpack(raw)[0]
    if length > MAX_HEADER:
        raise ValueError(f"message header of {length} bytes is over {MAX_HEADER}")
    return length


def _read_exact(inp: BinaryIO, n: int, start: bytes = b"") -> bytes:
    data = bytearray(start)
    while len(data) < n:
        chunk = inp.read(n - len(data))
        if not chunk:
            raise EOFError(f"stream ended {n - len(data)} bytes short of a message")
        data.extend(chunk)
    return bytes(data)


async def read_message_async(reader) -> tuple[dict, bytes] | None:
    """`read_message` for an asyncio StreamReader; None at a clean end of stream."""
    import asyncio

    try:
        first = await reader.readexactly(_LENGTH.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise EOFError("stream ended inside a message header") from exc
    try:
        header = json.loads(await reader.readexactly(_header_length(first)))
        payload = await reader.readexactly(int(header.get("size", 0)))
    except asyncio.IncompleteReadError as exc:
        raise EOFError("stream ended inside a message") from exc
    return header, payload
