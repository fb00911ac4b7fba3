"""Audio: voice activity with silero-vad (its sequence ONNX model, shipped in the package),
speech segments, and the notes their transcripts become (recognisers: `transcribers`).
Input is 16 kHz mono float audio."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from streamgrok.media.items import AudioChunk, Note
from streamgrok.media.transcribers import RATE, Transcriber, Transcript
from streamgrok.stream_tokens import Modality

WINDOW = 512  # samples per silero-vad step at 16 kHz
CONTEXT = 64  # samples of the previous window each step also sees


@dataclass
class SpeechSegment:
    start: float
    end: float
    samples: np.ndarray
    continues: bool = False  # cut from longer speech that goes on after it


def silero_model_path() -> Path:
    """The sequence ONNX model the silero-vad package ships, found without importing the
    package: its `__init__` sets torch's threads to 1 for the whole process (the engine's
    steps would then run on one core)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("silero-vad is not installed (pip install silero-vad)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / \
        "silero_vad_16k_sequence.onnx"


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
        self.session = onnxruntime.InferenceSession(
            str(silero_model_path()), sess_options=options, providers=["CPUExecutionProvider"])

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
    windows scoring below `threshold - 0.15` (silero's own hysteresis). Speech going on past
    `max_segment_s` is cut at its quietest window of the last `cut_search_s` (most likely
    between words) and goes on as a new segment, so long speech gives partial transcripts.
    """

    def __init__(self, model: SpeechModel | None = None, threshold: float = 0.5,
                 min_silence_ms: int = 300, max_segment_s: float = 8.0,
                 cut_search_s: float = 1.5) -> None:
        self.model = model or SpeechModel()
        self.threshold = threshold
        self.min_silence = min_silence_ms * RATE // 1000
        self.max_segment = int(max_segment_s * RATE)
        self.cut_search = max(1, int(cut_search_s * RATE) // WINDOW)
        self._state = new_vad_state()
        self._context = np.zeros(CONTEXT, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._clock: float | None = None  # stream time of the first sample in _pending
        self._speech: list[np.ndarray] = []
        self._probs: list[float] = []
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
            self._probs = []
        self._speech.append(window)
        self._probs.append(prob)
        end = t + WINDOW / RATE
        if prob >= self.threshold:
            self._silent_since = None
        elif prob < self.threshold - 0.15 and self._silent_since is None:
            self._silent_since = t
        silent = self._silent_since is not None and \
            (end - self._silent_since) * RATE >= self.min_silence
        if silent:
            return self._close(end)
        if len(self._speech) * WINDOW >= self.max_segment:
            return self._cut_long_speech()
        return None

    def _cut_long_speech(self) -> SpeechSegment:
        search = self._probs[-self.cut_search:]
        keep = len(self._probs) - len(search) + int(np.argmin(search)) + 1
        start = self._speech_start
        cut_at = start + keep * WINDOW / RATE
        segment = SpeechSegment(start, cut_at, np.concatenate(self._speech[:keep]),
                                continues=True)
        self._speech, self._probs = self._speech[keep:], self._probs[keep:]
        self._speech_start = cut_at
        return segment

    @property
    def open_since(self) -> float | None:
        """Start of the speech segment still in progress (its note will carry this time)."""
        return self._speech_start

    def flush(self) -> list[SpeechSegment]:
        if self._speech_start is None:
            return []
        return [self._close(self._clock or 0.0)]

    def _close(self, end: float) -> SpeechSegment:
        samples = np.concatenate(self._speech) if self._speech else np.zeros(0, np.float32)
        segment = SpeechSegment(self._speech_start, end, samples)
        self._speech_start, self._speech, self._silent_since = None, [], None
        self._probs = []
        return segment


class AudioObserver:
    """Speech segments -> timestamped transcript notes (or "speech" when nothing decoded)."""

    def __init__(self, transcriber: Transcriber | None = None,
                 model: SpeechModel | None = None) -> None:
        self.detector = SpeechDetector(model)
        self.transcriber = transcriber

    def feed(self, chunk: AudioChunk) -> list[Note]:
        return [n for s in self.detector.feed(chunk) for n in self._notes(s)]

    def flush(self) -> list[Note]:
        return [n for s in self.detector.flush() for n in self._notes(s)]

    def _notes(self, segment: SpeechSegment) -> list[Note]:
        transcript = (self.transcriber.transcribe(segment.samples, RATE)
                      if self.transcriber else Transcript(""))
        return speech_notes(segment, transcript)


# a word heard with less probability than this is named as unsure in its note
UNSURE = 0.3


def speech_notes(segment: SpeechSegment, transcript: Transcript,
                 unsure_below: float = UNSURE) -> list[Note]:
    """The notes a speech segment becomes: one per sentence it said, each at the time its
    first word was heard, quoting it, with the words the recogniser was unsure of (word
    probability under `unsure_below`) named after the quote; "speech" alone when nothing
    was recognised."""
    sentences = transcript.sentences()
    if not sentences:
        return [Note(f"speech ({segment.end - segment.start:.1f} s)", segment.start,
                     modality=Modality.AUDIO, tags={"speech"})]
    words = transcript.sentence_words() or [[]]
    notes = []
    for index, (offset, text) in enumerate(sentences):
        last = index == len(sentences) - 1
        goes_on = " (continues)" if last and segment.continues else ""
        unsure = [w.text.strip(" .,!?") for w in words[index] if w.probability < unsure_below]
        doubt = f" (unsure of: {', '.join(u for u in unsure if u)})" if any(unsure) else ""
        at = segment.start + min(max(offset, 0.0), segment.end - segment.start)
        notes.append(Note(f'said: "{text}"{doubt}{goes_on}', at,
                          modality=Modality.AUDIO, tags={"speech", "transcript"}))
    return notes
