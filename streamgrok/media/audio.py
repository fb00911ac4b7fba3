"""Audio: voice activity with silero-vad (its sequence ONNX model, shipped in the package)
and a pluggable transcriber (pocketsphinx's en-us model by default). Input is 16 kHz mono
float audio."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from importlib import resources
from typing import Protocol

import numpy as np

from streamgrok.media.items import AudioChunk, Note
from streamgrok.stream_tokens import Modality

RATE = 16_000
WINDOW = 512  # samples per silero-vad step at 16 kHz
CONTEXT = 64  # samples of the previous window each step also sees


class Transcriber(Protocol):
    """Turns one speech segment into text."""

    def transcribe(self, samples: np.ndarray, rate: int) -> str: ...


class PocketSphinxTranscriber:
    """Offline transcription with pocketsphinx's bundled en-us model (free-form accuracy on
    synthetic speech is modest; replace it with a better engine through `Transcriber`)."""

    def __init__(self) -> None:
        from pocketsphinx import Decoder

        self.decoder = Decoder(samprate=RATE, loglevel="FATAL")
        self._lock = threading.Lock()  # one utterance at a time: sessions share a decoder

    def transcribe(self, samples: np.ndarray, rate: int) -> str:
        if rate != RATE:
            raise ValueError(f"pocketsphinx expects {RATE} Hz audio, got {rate}")
        pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
        with self._lock:
            self.decoder.start_utt()
            self.decoder.process_raw(pcm, full_utt=True)
            self.decoder.end_utt()
            hypothesis = self.decoder.hyp()
        return hypothesis.hypstr if hypothesis else ""


@dataclass
class SpeechSegment:
    start: float
    end: float
    samples: np.ndarray


class SpeechModel:
    """silero-vad's sequence ONNX model: one call scores a whole block of 32 ms windows (the
    LSTM state goes in and out), and ONNX Runtime releases the GIL while it runs, so many
    sessions' detectors share the cores instead of queuing on the interpreter. Thread-safe:
    one instance serves every session of a process."""

    def __init__(self) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = 1
        path = resources.files("silero_vad") / "data" / "silero_vad_16k_sequence.onnx"
        self.session = onnxruntime.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"])

    def score(self, windows: np.ndarray, state: tuple[np.ndarray, np.ndarray]
              ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Speech probability of each row of `windows` [n, CONTEXT + WINDOW] (each window
        prefixed by the last CONTEXT samples before it), and the state after the last."""
        probs, hidden, cell = self.session.run(
            ["speech_probs", "hn", "cn"], {"input": windows, "h": state[0], "c": state[1]})
        return probs.reshape(-1), (hidden, cell)


def new_vad_state() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((1, 1, 128), np.float32), np.zeros((1, 1, 128), np.float32)


class SpeechDetector:
    """Streaming voice activity detection; yields finished speech segments.

    Speech starts at a window scoring >= `threshold` and ends after `min_silence_ms` of
    windows scoring below `threshold - 0.15` (silero's own hysteresis); a segment longer than
    `max_segment_s` is cut there.
    """

    def __init__(self, model: SpeechModel | None = None, threshold: float = 0.5,
                 min_silence_ms: int = 300, max_segment_s: float = 15.0) -> None:
        self.model = model or SpeechModel()
        self.threshold = threshold
        self.min_silence = min_silence_ms * RATE // 1000
        self.max_segment = int(max_segment_s * RATE)
        self._state = new_vad_state()
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._clock: float | None = None  # stream time of the first sample in _pending
        self._speech: list[np.ndarray] = []
        self._speech_start: float | None = None
        self._silent_since: float | None = None

    def feed(self, chunk: AudioChunk) -> list[SpeechSegment]:
        if self._clock is None:
            self._clock = chunk.pts
        self._pending = np.concatenate([self._pending, chunk.samples.astype(np.float32)])
        count = self._pending.shape[0] // WINDOW
        if not count:
            return []
        frames = self._pending[: count * WINDOW].reshape(count, WINDOW)
        self._pending = self._pending[count * WINDOW :]
        contexts = np.concatenate([self._context[None], frames[:-1, -CONTEXT:]])
        self._context = frames[-1, -CONTEXT:].copy()
        probs, self._state = self.model.score(
            np.ascontiguousarray(np.concatenate([contexts, frames], axis=1)), self._state)
        segments = []
        for window, prob in zip(frames, probs):
            t = self._clock
            self._clock += WINDOW / RATE
            segment = self._step(window, float(prob), t)
            if segment is not None:
                segments.append(segment)
        return segments

    def _step(self, window: np.ndarray, prob: float, t: float) -> SpeechSegment | None:
        if self._speech_start is None:
            if prob < self.threshold:
                return None
            self._speech_start, self._speech, self._silent_since = t, [], None
        self._speech.append(window)
        end = t + WINDOW / RATE
        if prob >= self.threshold:
            self._silent_since = None
        elif prob < self.threshold - 0.15 and self._silent_since is None:
            self._silent_since = t
        silent = self._silent_since is not None and \
            (end - self._silent_since) * RATE >= self.min_silence
        if silent or len(self._speech) * WINDOW >= self.max_segment:
            return self._close(end)
        return None

    @property
    def open_since(self) -> float | None:
        """Start of the speech segment still in progress (its note will carry this time)."""
        return self._speech_start

    def flush(self) -> list[SpeechSegment]:
        if self._speech_start is None:
            return []
        return [self._close(self._clock or 0.0)]

    def _close(self, end: float) -> SpeechSegment:
        segment = SpeechSegment(self._speech_start, end, np.concatenate(self._speech))
        self._speech_start, self._speech, self._silent_since = None, [], None
        return segment


class AudioObserver:
    """Speech segments -> timestamped transcript notes (or "speech" when nothing decoded)."""

    def __init__(self, transcriber: Transcriber | None = None,
                 model: SpeechModel | None = None) -> None:
        self.detector = SpeechDetector(model)
        self.transcriber = transcriber

    def feed(self, chunk: AudioChunk) -> list[Note]:
        return [self._note(s) for s in self.detector.feed(chunk)]

    def flush(self) -> list[Note]:
        return [self._note(s) for s in self.detector.flush()]

    def watermark(self, heard_until: float) -> float:
        """The time before which no more notes can come."""
        open_since = self.detector.open_since
        return heard_until if open_since is None else min(heard_until, open_since)

    def _note(self, segment: SpeechSegment) -> Note:
        text = self.transcriber.transcribe(segment.samples, RATE) if self.transcriber else ""
        return speech_note(segment, text)


def speech_note(segment: SpeechSegment, text: str) -> Note:
    """The note a speech segment becomes: its transcript, or "speech" when none."""
    words = f'speech: "{text}"' if text else "speech"
    return Note(f"{words} ({segment.end - segment.start:.1f} s)", segment.start,
                modality=Modality.AUDIO, tags={"speech"})
