"""Speech recognisers: Whisper through faster-whisper (the default, offline with the packaged
base model) and pocketsphinx, kept only as the measured baseline (`python -m benchmarks
media` compares them; docs/grounding.md has the numbers). Input is 16 kHz mono float."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from streamgrok.errors import StreamgrokError

RATE = 16_000
DEFAULT_PADDING_S = 5.0  # silence the encoder reads after a segment (`PaddingTrim`)
WHISPER_SIZES = ("tiny", "base", "small", "medium", "large-v3", "distil-large-v3",
                 "tiny.en", "base.en", "small.en", "medium.en")


class SpeechModelUnavailable(StreamgrokError):
    """The configured speech recogniser or its model files cannot be loaded."""


@dataclass(frozen=True)
class Word:
    """One recognised word with its time from the start of the audio it was heard in."""

    text: str
    start: float
    end: float
    probability: float = 1.0  # the recogniser's confidence in the word, 0-1


@dataclass(frozen=True)
class Transcript:
    text: str
    words: tuple[Word, ...] = field(default_factory=tuple)

    def sentences(self) -> list[tuple[float, str]]:
        """(start time, text) of each sentence, split where a word ends a sentence; the
        whole text at 0 when there are no word times."""
        if not self.words:
            return [(0.0, self.text)] if self.text else []
        return [(group[0].start, "".join(w.text for w in group).strip())
                for group in self.sentence_words()]

    def sentence_words(self) -> list[list[Word]]:
        """The words of each sentence (none without word times)."""
        sentences: list[list[Word]] = []
        current: list[Word] = []
        for word in self.words:
            current.append(word)
            if word.text.rstrip().endswith((".", "!", "?")):
                sentences.append(current)
                current = []
        if current:
            sentences.append(current)
        return sentences


class Transcriber(Protocol):
    """Turns one speech segment into text; thread-safe (sessions share one)."""

    name: str

    def transcribe(self, samples: np.ndarray, rate: int) -> Transcript: ...


class PaddingTrim:
    """A Whisper encoder call (`WhisperModel.encode`) that reads a segment and `frames` mel
    frames of the silence after it instead of the whole 30 s window faster-whisper pads every
    segment to: the encoder's cost grows with its input (CTranslate2 takes any length), and
    a few seconds of silence after the speech keep what the decoder hears as with the full
    window (`python -m benchmarks speech` measures both), where none at all makes it loop."""

    def __init__(self, encode: Any, frames: int) -> None:
        self.encode = encode
        self.frames = frames

    def __call__(self, features: np.ndarray) -> Any:
        # faster-whisper pads with exact zeros; a column of real audio's log-mel never is
        content = np.flatnonzero(np.any(features != 0.0, axis=tuple(range(features.ndim - 1))))
        end = min(features.shape[-1], (int(content[-1]) + 1 if content.size else 0)
                  + self.frames)
        end += end % 2  # the encoder's convolution halves the frames
        return self.encode(features[..., :end])


class WhisperTranscriber:
    """Whisper through faster-whisper (CTranslate2, int8 on CPU), beam search of 5, word
    timestamps; its own no-speech and log-probability checks drop non-speech. The encoder
    reads each segment and `padding_s` seconds of silence after it (`PaddingTrim`; None:
    the whole 30 s window)."""

    def __init__(self, model: str = "base", threads: int = 1, device: str = "cpu",
                 compute_type: str = "int8", beam_size: int = 5,
                 language: str | None = "en", initial_prompt: str | None = None,
                 options: dict[str, Any] | None = None,
                 padding_s: float | None = DEFAULT_PADDING_S) -> None:
        from faster_whisper import WhisperModel

        self.name = f"whisper {model}"
        path = self._resolve(model)
        try:
            self.model = WhisperModel(path, device=device, compute_type=compute_type,
                                      cpu_threads=threads, num_workers=1)
        except Exception as exc:  # huggingface_hub and CTranslate2 raise many kinds
            raise SpeechModelUnavailable(
                f"cannot load Whisper model {model!r}: {exc}. Offline, use 'base' (packaged) "
                "or a local faster-whisper folder") from exc
        if padding_s is not None:
            self.model.encode = PaddingTrim(self.model.encode, round(padding_s * 100))
        self.beam_size = beam_size
        self.language = language
        self.initial_prompt = initial_prompt
        self.options = dict(options or {})  # further faster-whisper transcribe() options
        self._lock = threading.Lock()  # one CTranslate2 worker: utterances take turns

    @staticmethod
    def _resolve(model: str) -> str:
        if model == "base":
            from streamgrok.media.whisper_files import packaged_whisper_base

            return str(packaged_whisper_base())
        if Path(model).expanduser().is_dir():
            return str(Path(model).expanduser())
        if model in WHISPER_SIZES or "/" in model:
            return model  # faster-whisper fetches it through huggingface_hub (or its cache)
        raise SpeechModelUnavailable(
            f"unknown speech model {model!r}: use one of {', '.join(WHISPER_SIZES)}, a "
            "Hugging Face repo id, a local faster-whisper folder, or 'pocketsphinx'")

    def transcribe(self, samples: np.ndarray, rate: int) -> Transcript:
        if rate != RATE:
            raise ValueError(f"Whisper expects {RATE} Hz audio, got {rate}")
        with self._lock:
            segments, _ = self.model.transcribe(
                np.ascontiguousarray(samples, dtype=np.float32), language=self.language,
                beam_size=self.beam_size, word_timestamps=True, vad_filter=False,
                condition_on_previous_text=False, without_timestamps=False,
                initial_prompt=self.initial_prompt, **self.options)
            segments = list(segments)
        words = tuple(Word(w.word, float(w.start), float(w.end), float(w.probability))
                      for s in segments for w in (s.words or ()))
        return Transcript("".join(s.text for s in segments).strip(), words)


class PocketSphinxTranscriber:
    """pocketsphinx's bundled en-us model: the old recogniser, kept as the benchmarks'
    baseline; far less accurate than Whisper on free-form speech and no word times."""

    name = "pocketsphinx"

    def __init__(self) -> None:
        from pocketsphinx import Decoder

        self.decoder = Decoder(samprate=RATE, loglevel="FATAL")
        self._lock = threading.Lock()  # one utterance at a time: sessions share a decoder

    def transcribe(self, samples: np.ndarray, rate: int) -> Transcript:
        if rate != RATE:
            raise ValueError(f"pocketsphinx expects {RATE} Hz audio, got {rate}")
        pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
        with self._lock:
            self.decoder.start_utt()
            self.decoder.process_raw(pcm, full_utt=True)
            self.decoder.end_utt()
            hypothesis = self.decoder.hyp()
        return Transcript(hypothesis.hypstr if hypothesis else "")


def load_transcriber(name: str, threads: int = 1) -> Transcriber:
    """'pocketsphinx', or a Whisper model: 'base' (packaged, offline), another size
    (downloaded when online, else from the Hugging Face cache), or a local folder."""
    if name == "pocketsphinx":
        return PocketSphinxTranscriber()
    return WhisperTranscriber(name, threads=threads)
