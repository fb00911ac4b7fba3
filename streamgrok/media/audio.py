"""Audio: voice activity with silero-vad (ships its model) and a pluggable transcriber
(pocketsphinx's en-us model by default). Input is 16 kHz mono float audio."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from streamgrok.media.items import AudioChunk, Note
from streamgrok.stream_tokens import Modality

RATE = 16_000
WINDOW = 512  # samples per silero-vad step at 16 kHz


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


class SpeechDetector:
    """Streaming voice activity detection; yields finished speech segments."""

    def __init__(self, threshold: float = 0.5, min_silence_ms: int = 300,
                 max_segment_s: float = 15.0) -> None:
        threads = torch.get_num_threads()
        from silero_vad import VADIterator, load_silero_vad  # importing it sets 1 thread

        torch.set_num_threads(threads)
        self.model = load_silero_vad()
        self.iterator = VADIterator(self.model, threshold=threshold, sampling_rate=RATE,
                                    min_silence_duration_ms=min_silence_ms)
        self.max_segment = int(max_segment_s * RATE)
        self._pending = np.zeros(0, dtype=np.float32)
        self._clock = None  # stream time of the first sample in _pending
        self._speech: list[np.ndarray] = []
        self._speech_start: float | None = None

    def feed(self, chunk: AudioChunk) -> list[SpeechSegment]:
        if self._clock is None:
            self._clock = chunk.pts
        self._pending = np.concatenate([self._pending, chunk.samples.astype(np.float32)])
        segments = []
        while self._pending.shape[0] >= WINDOW:
            window, self._pending = self._pending[:WINDOW], self._pending[WINDOW:]
            t = self._clock
            self._clock += WINDOW / RATE
            with torch.inference_mode():
                event = self.iterator(torch.from_numpy(window.copy()), return_seconds=False)
            if event and "start" in event:
                self._speech_start = t
                self._speech = []
            if self._speech_start is not None:
                self._speech.append(window)
                too_long = sum(w.shape[0] for w in self._speech) >= self.max_segment
                if (event and "end" in event) or too_long:
                    segments.append(self._close(t + WINDOW / RATE))
        return segments

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
        self._speech_start, self._speech = None, []
        return segment


class AudioObserver:
    """Speech segments -> timestamped transcript notes (or "speech" when nothing decoded)."""

    def __init__(self, transcriber: Transcriber | None = None) -> None:
        self.detector = SpeechDetector()
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
