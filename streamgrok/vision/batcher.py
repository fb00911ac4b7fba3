"""One thread encodes the frames of every session of an engine, batching what is waiting,
on the engine's device."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from streamgrok.errors import StreamgrokError
from streamgrok.vision.encoder import VisionEncoder

log = logging.getLogger(__name__)


class FrameEncodingError(StreamgrokError):
    """The vision tower failed on a frame (that frame is dropped, the session goes on)."""


@dataclass
class FrameBatcherStats:
    frames: int = 0
    batches: int = 0
    largest_batch: int = 0
    errors: int = 0
    waited: int = 0  # submissions that found the queue full and waited for room

    def as_dict(self) -> dict:
        mean = self.frames / self.batches if self.batches else 0.0
        return {"frames": self.frames, "batches": self.batches, "mean_batch": round(mean, 2),
                "largest_batch": self.largest_batch, "errors": self.errors,
                "waited": self.waited}


@dataclass
class _Request:
    image: np.ndarray
    pts: float | None
    done: concurrent.futures.Future


class FrameBatcher:
    """`await encode(image, pts)` gives the frame's rows for the stream (framing embeddings
    around the image tokens). Requests queue (bounded: a full queue makes the caller wait,
    counted in `stats.waited`); the worker takes everything waiting, up to `max_batch`, as
    one batch through the tower, so concurrent sessions share the forward passes."""

    def __init__(self, encoder: VisionEncoder, tokenizer, embedding: nn.Embedding,
                 max_batch: int = 16, queue_size: int = 64) -> None:
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.embedding = embedding
        self.max_batch = max_batch
        self.stats = FrameBatcherStats()
        self._queue: queue.Queue[_Request | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="streamgrok-vision",
                                            daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Finish what is queued, then end the worker."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    async def encode(self, image: np.ndarray, pts: float | None) -> torch.Tensor:
        """The frame's rows [framing + image tokens, text hidden] (requests made before
        `start` wait for it); `pts` None frames a still image of a chat turn."""
        request = _Request(image, pts, concurrent.futures.Future())
        try:
            self._queue.put_nowait(request)
        except queue.Full:
            self.stats.waited += 1
            await asyncio.to_thread(self._queue.put, request)
        return await asyncio.wrap_future(request.done)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, stopping = [first], False
            while len(batch) < self.max_batch:
                try:
                    request = self._queue.get_nowait()
                except queue.Empty:
                    break
                if request is None:
                    stopping = True
                    break
                batch.append(request)
            self._encode(batch)
            if stopping:
                return

    def _encode(self, batch: list[_Request]) -> None:
        pixels, ready = [], []
        for request in batch:  # a malformed frame fails alone, not its batch
            try:
                pixels.append(self.encoder.preprocessor.one(request.image))
                ready.append(request)
            except Exception as exc:
                self._fail([request], exc)
        if not ready:
            return
        try:
            vectors = self.encoder.encode_pixels(torch.stack(pixels))
            rows = [self.encoder.frame_rows(v, r.pts, self.tokenizer, self.embedding)
                    for v, r in zip(vectors, ready)]
        except Exception as exc:  # the tower's failure is the frames' error, not the server's
            self._fail(ready, exc)
            return
        self.stats.frames += len(ready)
        self.stats.batches += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(ready))
        for request, result in zip(ready, rows):
            request.done.set_result(result)

    def _fail(self, requests: list[_Request], exc: Exception) -> None:
        self.stats.errors += len(requests)
        log.warning("vision encoder failed on %d frames: %s", len(requests), exc)
        for request in requests:
            request.done.set_exception(FrameEncodingError(f"frame encoding failed: {exc}"))
