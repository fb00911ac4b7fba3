"""One speech recogniser shared by every session: one worker thread recognises the waiting
speech segments of all sessions one after another, oldest first.

Whisper's encoder reads each segment with a few seconds of silence after it
(`transcribers.PaddingTrim`), so a short segment costs little, and segments are recognised
apart. They can instead be packed (`packs=True`): laid end to end with short silences into
one window of up to `window_s` seconds, recognised in one call, each segment's words handed
back by their times. That shares the encoder's fixed 30-s window, but on espeak-ng sentences
of several voices it made Whisper loop and drop segments, and it is no cheaper once the window
is trimmed (docs/grounding.md has the measurements); it stays for recognisers with a fixed
window.

The queue is bounded by the seconds of audio waiting (`max_waiting_s`); a segment past it is
not recognised (its note says only that speech was heard) and is counted in `stats.dropped`.
Sessions wait on asyncio futures, not on threads: the recogniser's one worker thread is the
only thread it takes.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from streamgrok.engine.metrics import percentile
from streamgrok.media.transcribers import RATE, Transcriber, Transcript, Word

GAP_S = 0.6  # silence between packed segments


@dataclass
class BatcherStats:
    """What the shared recogniser did (seconds are wall time of its worker)."""

    segments: int = 0
    calls: int = 0
    audio_s: float = 0.0
    busy_s: float = 0.0
    dropped: int = 0  # segments not recognised: the queue held `max_waiting_s` already
    waits: deque = field(default_factory=lambda: deque(maxlen=512))  # queue wait, seconds

    def as_dict(self) -> dict:
        p95 = percentile(list(self.waits), 95) if self.waits else None
        return {"segments": self.segments, "calls": self.calls,
                "audio_s": round(self.audio_s, 1), "busy_s": round(self.busy_s, 1),
                "dropped": self.dropped, "wait_p95_s": p95}


@dataclass(eq=False)
class _Waiting:
    samples: np.ndarray
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued_at: float

    @property
    def seconds(self) -> float:
        return self.samples.shape[0] / RATE


class SpeechBatcher:
    """A shared `Transcriber` behind a queue and one worker thread (see the module doc)."""

    def __init__(self, transcriber: Transcriber, window_s: float = 28.0,
                 max_waiting_s: float = 90.0, packs: bool = False) -> None:
        self.transcriber = transcriber
        self.name = transcriber.name
        self.window_s = window_s
        self.max_waiting_s = max_waiting_s
        # packing needs word times to hand each segment its words back (Whisper's)
        self.packs = packs
        self.stats = BatcherStats()
        self._queue: deque[_Waiting] = deque()
        self._waiting_s = 0.0
        self._ready = threading.Condition()
        self._closed = False
        self._worker = threading.Thread(target=self._run, name="speech recogniser",
                                        daemon=True)
        self._worker.start()

    async def transcribe_async(self, samples: np.ndarray) -> Transcript:
        """The transcript of one 16 kHz mono segment, its words timed from its start (an
        empty one when the queue is full or the recogniser is closed)."""
        loop = asyncio.get_running_loop()
        item = _Waiting(np.ascontiguousarray(samples, dtype=np.float32), loop.create_future(),
                        loop, time.monotonic())
        with self._ready:
            if self._closed or self._waiting_s + item.seconds > self.max_waiting_s:
                self.stats.dropped += 1
                return Transcript("")
            self._queue.append(item)
            self._waiting_s += item.seconds
            self._ready.notify()
        return await item.future

    def oldest_wait(self, now: float | None = None) -> float:
        """How long the oldest segment still queued has waited (0 when none is)."""
        with self._ready:
            if not self._queue:
                return 0.0
            return (time.monotonic() if now is None else now) - self._queue[0].queued_at

    def warm_up(self) -> None:
        """Recognise a second of quiet noise once, outside `stats`: a recogniser's first
        call (allocations, first kernels) is much slower than the rest, and counted it would
        make the first sessions' speech look dear to the server's admission. Call it before
        any segment is queued."""
        noise = np.random.default_rng(0).normal(0.0, 1e-3, RATE).astype(np.float32)
        self.transcriber.transcribe(noise, RATE)

    def transcribe(self, samples: np.ndarray, rate: int) -> Transcript:
        """The `Transcriber` call, for callers on a worker thread: recognised alone."""
        return self.transcriber.transcribe(samples, rate)

    def close(self) -> None:
        """Stop the worker; segments still queued get empty transcripts."""
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._worker.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if self._closed:
                    batch, self._queue = list(self._queue), deque()
                    for item in batch:
                        _resolve(item, Transcript(""))
                    return
                batch = self._take()
            self._recognise(batch)

    def _take(self) -> list[_Waiting]:
        """The oldest segment, and those after it that fit in the window (lock held)."""
        batch = [self._queue.popleft()]
        length = batch[0].seconds
        while self.packs and self._queue and \
                length + GAP_S + self._queue[0].seconds <= self.window_s:
            item = self._queue.popleft()
            batch.append(item)
            length += GAP_S + item.seconds
        self._waiting_s -= sum(item.seconds for item in batch)
        return batch

    def _recognise(self, batch: list[_Waiting]) -> None:
        started = time.monotonic()
        for item in batch:
            self.stats.waits.append(started - item.queued_at)
        try:
            if len(batch) == 1:
                results = [self.transcriber.transcribe(batch[0].samples, RATE)]
            else:
                results = self._packed(batch)
        except Exception:  # a recogniser failure costs these segments their text only
            results = [Transcript("") for _ in batch]
        self.stats.calls += 1
        self.stats.segments += len(batch)
        self.stats.audio_s += sum(item.seconds for item in batch)
        self.stats.busy_s += time.monotonic() - started
        for item, transcript in zip(batch, results):
            _resolve(item, transcript)

    def _packed(self, batch: list[_Waiting]) -> list[Transcript]:
        gap = np.zeros(int(GAP_S * RATE), dtype=np.float32)
        parts, starts, at = [], [], 0.0
        for item in batch:
            starts.append(at)
            parts += [item.samples, gap]
            at += item.seconds + GAP_S
        heard = self.transcriber.transcribe(np.concatenate(parts[:-1]), RATE)
        return [split_words(heard.words, start, item.seconds)
                for item, start in zip(batch, starts)]


def split_words(words: tuple[Word, ...], start: float, seconds: float) -> Transcript:
    """The words whose middle falls within [start - gap/2, start + seconds + gap/2) of a
    packed window, timed from `start`."""
    half = GAP_S / 2
    mine = tuple(Word(w.text, max(0.0, w.start - start), max(0.0, w.end - start), w.probability)
                 for w in words if start - half <= (w.start + w.end) / 2 < start + seconds + half)
    return Transcript("".join(w.text for w in mine).strip(), mine)


def _resolve(item: _Waiting, transcript: Transcript) -> None:
    def deliver() -> None:
        if not item.future.done():
            item.future.set_result(transcript)

    try:
        item.loop.call_soon_threadsafe(deliver)
    except RuntimeError:  # the session's loop closed: nobody is waiting
        pass
