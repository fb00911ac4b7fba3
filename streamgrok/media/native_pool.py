"""A small pool of media worker processes for native-code work on untrusted media.

Image decoding and OpenCV's detectors run in `native_worker` processes: a segfault, abort or
hang inside a native library costs that one request (`MediaWorkerError`), the worker is
replaced, and the server and every other session carry on. The pool is thread-safe and
blocking: call it from worker threads (`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import os
import queue
import select
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from streamgrok.errors import StreamgrokError
from streamgrok.media.native_worker import Detections, ImageLimits
from streamgrok.media.wire import read_message, write_message

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


class MediaWorkerError(StreamgrokError):
    """A media worker died or hung on an input; the input is dropped, the worker replaced."""


@dataclass
class PoolStats:
    """What the pool has done (crashes and timeouts are the inputs it dropped)."""

    requests: int = 0
    crashes: int = 0
    timeouts: int = 0
    started_workers: int = 0


def worker_env() -> dict[str, str]:
    """The environment of a media worker process, and of the Tesseract runs it starts: this
    streamgrok importable, one thread each (the cores belong to the engine)."""
    path = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "OMP_THREAD_LIMIT": "1", "PYTHONPATH": path}


class _Worker:
    """One worker process and its pipes; used by one thread at a time."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "streamgrok.media.native_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=worker_env(),
        )

    def call(self, header: dict, payload: bytes, timeout_s: float) -> tuple[dict, bytes]:
        write_message(self.process.stdin, header, payload)
        reply = read_message(_DeadlineReader(self.process.stdout, time.monotonic() + timeout_s))
        if reply is None:
            raise EOFError("the worker closed its output")
        return reply

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> int | None:
        """Stop the process; returns its exit code (negative: the signal that ended it)."""
        if self.alive():
            self.process.kill()
        try:
            return self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None
        finally:
            for pipe in (self.process.stdin, self.process.stdout):
                pipe.close()


class _DeadlineReader:
    """Reads from a raw pipe, raising TimeoutError once the deadline has passed."""

    def __init__(self, raw, deadline: float) -> None:
        self.raw = raw
        self.deadline = deadline

    def read(self, n: int) -> bytes:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0 or not select.select([self.raw], [], [], remaining)[0]:
            raise TimeoutError("the media worker did not answer in time")
        return self.raw.read(n)


class NativeMediaPool:
    """Up to `workers` media processes, started on first use and replaced when they die."""

    def __init__(self, workers: int = 2, timeout_s: float = 10.0,
                 limits: ImageLimits | None = None, ocr_timeout_s: float = 5.0) -> None:
        if workers < 1:
            raise ValueError("a media pool needs at least one worker")
        if not 0 < ocr_timeout_s < timeout_s:
            raise ValueError("a text read's time limit must be positive and under the "
                             "pool's call time limit")
        self.size = workers
        self.timeout_s = timeout_s
        self.ocr_timeout_s = ocr_timeout_s  # Tesseract's limit for one read (then "")
        self.limits = limits or ImageLimits()
        self.stats = PoolStats()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = []
        self._closed = False

    def decode_image(self, data: bytes) -> np.ndarray:
        """RGB uint8 [h, w, 3] of a JPEG/PNG; ValueError if it is not one or its header is
        outside the size limits (checked before decoding), MediaWorkerError on a crash."""
        header, body = self._call({"op": "decode", "limits": asdict(self.limits)}, data)
        return np.frombuffer(body, dtype=np.uint8).reshape(header["shape"])

    def detect(self, image: np.ndarray, faces: bool, people: bool,
               cats: bool = False) -> Detections:
        """What OpenCV's detectors find in an RGB image."""
        image = np.ascontiguousarray(image, dtype=np.uint8)
        header, _ = self._call({"op": "detect", "shape": list(image.shape), "faces": faces,
                                "people": people, "cats": cats}, image.tobytes())
        return Detections(int(header["faces"]), int(header["people"]), int(header["cats"]))

    def read_text(self, image: np.ndarray) -> str:
        """The confident words on screen in an RGB image (Tesseract, one thread, run by a
        worker), or ""."""
        image = np.ascontiguousarray(image, dtype=np.uint8)
        header, _ = self._call({"op": "read_text", "shape": list(image.shape),
                                "timeout_s": self.ocr_timeout_s}, image.tobytes())
        return str(header["text"])

    def crash_one_worker(self) -> None:
        """Fault injection: make a worker abort as a native crash would (tests, soak)."""
        self._call({"op": "abort"}, b"")

    def close(self) -> None:
        """Stop every worker; later calls raise."""
        with self._lock:
            self._closed = True
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.kill()

    def _call(self, header: dict, payload: bytes) -> tuple[dict, bytes]:
        worker = self._acquire()
        self.stats.requests += 1
        try:
            reply, body = worker.call(header, payload, self.timeout_s)
        except TimeoutError as exc:
            self.stats.timeouts += 1
            self._discard(worker)
            raise MediaWorkerError(f"the media worker hung on this input "
                                   f"(over {self.timeout_s:g} s); the input was dropped") from exc
        except (EOFError, OSError, ValueError) as exc:
            self.stats.crashes += 1
            code = self._discard(worker)
            raise MediaWorkerError(f"the media worker crashed on this input (exit code "
                                   f"{code}); the input was dropped") from exc
        self._idle.put(worker)
        if not reply.get("ok"):
            raise ValueError(reply.get("error", "the media worker refused the input"))
        return reply, body

    def _acquire(self) -> _Worker:
        while True:
            with self._lock:
                if self._closed:
                    raise MediaWorkerError("the media pool is closed")
                if self._idle.empty() and len(self._workers) < self.size:
                    worker = _Worker()
                    self._workers.append(worker)
                    self.stats.started_workers += 1
                    return worker
            try:
                worker = self._idle.get(timeout=0.1)
            except queue.Empty:
                continue  # the workers may all have died meanwhile: look again
            if worker.alive():
                return worker
            self._discard(worker)

    def _discard(self, worker: _Worker) -> int | None:
        with self._lock:
            if worker in self._workers:
                self._workers.remove(worker)
        return worker.kill()
