"""Images sent with a request (data URLs): decoded safely, and for a model without a vision
tower turned into text it reads, the offline observers' description of each picture."""

from __future__ import annotations

import asyncio
import base64
import binascii
import re

from streamgrok.media.items import VideoFrame
from streamgrok.media.native_pool import MediaWorkerError
from streamgrok.media.observers import FrameObserver
from streamgrok.pipeline.resources import SharedResources

DATA_URL = re.compile(r"data:(image/[a-z0-9.+-]+)?(;[a-z0-9=-]+)*;base64,(.*)", re.S | re.I)


class ImageError(ValueError):
    """An image the server cannot take; the message says why."""


def image_bytes(url: str) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL (remote URLs are never fetched)."""
    match = DATA_URL.fullmatch(url.strip())
    if match is None:
        raise ImageError("an image must be a data URL (data:image/jpeg;base64,...); the server "
                         "does not fetch URLs or open files")
    try:
        return base64.b64decode(match.group(3), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the image's base64 does not decode: {exc}") from None


async def decode_image(resources: SharedResources, data: bytes, index: int):
    """One JPEG/PNG as RGB uint8 [H, W, 3], decoded in a media worker process (a decoder
    crash cannot take the server down)."""
    try:
        return await asyncio.to_thread(resources.media_pool.decode_image, data)
    except (ValueError, MediaWorkerError) as exc:
        raise ImageError(f"image {index + 1} is not a JPEG/PNG the server can decode: "
                         f"{exc}") from None


async def describe_image(resources: SharedResources, data: bytes, index: int) -> str:
    """What the observers see in one JPEG/PNG."""
    image = await decode_image(resources, data, index)
    observer = FrameObserver(resources.media_pool)
    note = await asyncio.to_thread(observer.observe, VideoFrame(image, 0.0, index))
    text = note.text.removeprefix("first view; ") if note else ""
    height, width = image.shape[:2]
    return f"image {index + 1} ({width}x{height}): {text or 'nothing the observers recognise'}"
