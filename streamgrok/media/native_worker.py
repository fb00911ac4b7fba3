"""The media worker process: image decoding and OpenCV detectors, away from the server.

Run as `python -m streamgrok.media.native_worker` by `NativeMediaPool`. It reads requests
from stdin and writes replies to stdout, one framed message each (see `wire`); a crash inside
a native library ends this process only. It imports no torch and nothing of the engine.
"""

from __future__ import annotations

import io
import sys
import warnings
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from streamgrok.media.wire import read_message, write_message

HOG_WINDOW = (64, 128)  # width, height of OpenCV's default people detector window


@dataclass(frozen=True)
class ImageLimits:
    """Sizes a pushed frame may have, checked from its header before any pixel is decoded."""

    min_side: int = 32
    max_side: int = 8192
    max_pixels: int = 16_777_216

    def check(self, width: int, height: int) -> None:
        """Raises ValueError naming the problem when the size is outside the limits."""
        if min(width, height) < self.min_side:
            raise ValueError(f"image of {width}x{height} is smaller than the minimum "
                             f"{self.min_side}x{self.min_side}")
        if max(width, height) > self.max_side or width * height > self.max_pixels:
            raise ValueError(f"image of {width}x{height} exceeds the limit of {self.max_side} "
                             f"pixels a side and {self.max_pixels} pixels in all")


def image_size(data: bytes) -> tuple[int, int, str]:
    """(width, height, format) read from a JPEG/PNG header without decoding pixels."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                fmt = image.format or ""
                width, height = image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ValueError(f"image header declares too many pixels: {exc}") from None
    except Exception as exc:  # PIL raises many kinds for garbage; all mean "not an image"
        raise ValueError(f"not a decodable JPEG/PNG image ({len(data)} bytes)") from exc
    if fmt not in ("JPEG", "PNG"):
        raise ValueError(f"frames must be JPEG or PNG, not {fmt or 'unknown'}")
    return width, height, fmt


def decode_frame(data: bytes, limits: ImageLimits) -> np.ndarray:
    """An RGB uint8 array [h, w, 3] of a JPEG/PNG whose header passes `limits`."""
    import cv2

    width, height, _ = image_size(data)
    limits.check(width, height)
    image = cv2.imdecode(np.frombuffer(data, dtype=np.uint8), cv2.IMREAD_COLOR)
    if image is None or image.shape[:2] != (height, width):
        raise ValueError(f"not a decodable JPEG/PNG image ({len(data)} bytes)")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB)


@dataclass(frozen=True)
class Detections:
    """How many of each thing the detectors found in one frame."""

    faces: int = 0
    people: int = 0
    cats: int = 0


class Detectors:
    """OpenCV's Haar face and cat-face cascades and HOG people detector, loaded once per
    worker."""

    def __init__(self) -> None:
        import cv2

        cv2.setNumThreads(1)
        self.cv2 = cv2
        self.faces = cv2.CascadeClassifier(
            cv2.data.haarcascades + "haarcascade_frontalface_default.xml")
        self.cat_faces = cv2.CascadeClassifier(
            cv2.data.haarcascades + "haarcascade_frontalcatface_extended.xml")
        self.hog = cv2.HOGDescriptor()
        self.hog.setSVMDetector(cv2.HOGDescriptor_getDefaultPeopleDetector())
        self.reader = None  # Tesseract, set up at the first text read

    def read_text(self, image: np.ndarray, timeout_s: float = 5.0) -> str:
        """The confident words on screen in an RGB image (`TextReader`), or "" (also when
        Tesseract takes longer than `timeout_s`)."""
        if self.reader is None:
            from streamgrok.media.text_reader import TextReader

            self.reader = TextReader()
        self.reader.timeout_s = timeout_s
        return self.reader.read(image)

    def detect(self, image: np.ndarray, faces: bool, people: bool,
               cats: bool = False) -> Detections:
        """What is in an RGB image; a detector whose window does not fit the image finds
        nothing (OpenCV's HOG corrupts memory on images smaller than its window)."""
        height, width = image.shape[:2]
        found_faces = found_people = found_cats = 0
        if (faces or cats) and min(width, height) >= 24:
            gray = self.cv2.cvtColor(image, self.cv2.COLOR_RGB2GRAY)
            if faces:
                found_faces = len(self.faces.detectMultiScale(
                    gray, scaleFactor=1.1, minNeighbors=5, minSize=(24, 24)))
            if cats:
                found_cats = len(self.cat_faces.detectMultiScale(
                    gray, scaleFactor=1.08, minNeighbors=3, minSize=(24, 24)))
        if people and width >= HOG_WINDOW[0] and height >= HOG_WINDOW[1]:
            _, weights = self.hog.detectMultiScale(image, winStride=(8, 8), padding=(8, 8),
                                                   scale=1.05)
            found_people = int(sum(1 for w in np.ravel(weights) if w > 0.5))
        return Detections(found_faces, found_people, found_cats)


def handle(request: dict, payload: bytes, detectors: Detectors) -> tuple[dict, bytes]:
    """One request -> (reply header, reply payload)."""
    op = request.get("op")
    if op == "decode":
        image = decode_frame(payload, ImageLimits(**request["limits"]))
        return {"shape": list(image.shape)}, image.tobytes()
    if op == "detect":
        image = np.frombuffer(payload, dtype=np.uint8).reshape(request["shape"])
        found = detectors.detect(image, request["faces"], request["people"],
                                 request.get("cats", False))
        return {"faces": found.faces, "people": found.people, "cats": found.cats}, b""
    if op == "read_text":
        image = np.frombuffer(payload, dtype=np.uint8).reshape(request["shape"])
        limit = request.get("timeout_s", 5.0)
        if not isinstance(limit, int | float) or not 0 < limit <= 600:
            raise ValueError("read_text's timeout_s must be in (0, 600] seconds")
        return {"text": detectors.read_text(image, float(limit))}, b""
    if op == "abort":  # fault injection for tests: die the way a native crash does
        import os

        os.abort()
    if op == "ping":
        return {}, b""
    raise ValueError(f"unknown worker operation {op!r}")


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    """Answer requests until stdin closes."""
    detectors = Detectors()
    while (message := read_message(inp)) is not None:
        request, payload = message
        try:
            header, body = handle(request, payload, detectors)
            header["ok"] = True
        except Exception as exc:  # a Python-level failure is a clean error reply
            header, body = {"ok": False, "error": str(exc) or type(exc).__name__}, b""
        write_message(out, header, body)


if __name__ == "__main__":
    serve(sys.stdin.buffer, sys.stdout.buffer)
