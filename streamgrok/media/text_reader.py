"""Text in frames, read by Tesseract (Debian's `tesseract-ocr`, through pytesseract).

Each call runs the `tesseract` program in its own process, so a crash in it fails one read,
never the server. The server reads through its media worker processes
(`NativeMediaPool.read_text`), whose environment limits Tesseract to one thread; the program
runs at a lower priority (`nice`) than the engine, and gets an uncompressed BMP (PNG's
compression cost more than the reading on small frames). Only confident words are kept, and
only when one has three characters.
"""

from __future__ import annotations

import re
import shutil

import cv2
import numpy as np

WORD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9'&:.,!?%$#-]*$")


class TextReader:
    """Reads the words shown in an RGB frame (slow: a few hundred ms a frame)."""

    def __init__(self, min_confidence: float = 85.0, timeout_s: float = 5.0,
                 width: int = 800, nice: int = 10) -> None:
        self.min_confidence = min_confidence
        self.timeout_s = timeout_s
        self.width = width
        self.nice = nice  # Tesseract's priority below the caller's (the engine's)

    @staticmethod
    def available() -> bool:
        return shutil.which("tesseract") is not None

    def read(self, image: np.ndarray) -> str:
        """The confident words on screen, in reading order, or "" (also when Tesseract
        fails or takes longer than `timeout_s`)."""
        import pytesseract
        from PIL import Image

        gray = cv2.cvtColor(image, cv2.COLOR_RGB2GRAY)
        h, w = gray.shape
        if w < self.width:  # Tesseract reads small text far better when it is larger
            gray = cv2.resize(gray, (self.width, round(h * self.width / w)),
                              interpolation=cv2.INTER_CUBIC)
        picture = Image.fromarray(gray)
        picture.format = "BMP"  # pytesseract writes the file in the image's format
        try:
            data = pytesseract.image_to_data(picture, config="--psm 6", timeout=self.timeout_s,
                                             nice=self.nice,
                                             output_type=pytesseract.Output.DICT)
        except (RuntimeError, pytesseract.TesseractError, OSError):
            return ""
        words = []
        for text, confidence in zip(data["text"], data["conf"]):
            text = text.strip()
            if float(confidence) < self.min_confidence or not WORD.match(text):
                continue
            words.append(text)
        # a lone short token is usually texture read as a letter; beside a real word it
        # is text ("GATE 7")
        if not any(len(w) >= 3 for w in words):
            return ""
        return " ".join(words)
