"""What a speaking live client says: espeak-ng sentences in several voices with pauses of room
noise between them (speech about half the time), as 16 kHz PCM, and what it was heard to say.

`SpeechTrack` lays a client's sentences on its audio timeline; `SpeechScore` matches the
server's transcript notes (`event` kind `note`, tagged `transcript`, at the time of their
first word) to the sentences spoken, and reports how many were transcribed, how soon after
they ended, and their word error rate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from streamgrok.bench.sentences import SENTENCES, VOICES
from streamgrok.bench.sentences import word_error_rate as sentences_wer
from streamgrok.bench.timing import milliseconds, percentile
from streamgrok.media.samples import speak

RATE = 16_000
QUOTE = re.compile(r'^said: "(.*?)"(?: \(unsure of: [^)]*\))?(?: \(continues\))?$')


@dataclass(frozen=True)
class Spoken:
    """One sentence on a client's timeline (seconds of its audio)."""

    start: float
    end: float
    text: str


def sentence_clips() -> list[tuple[str, np.ndarray]] | None:
    """Every bench sentence in every voice and speed, or None without espeak-ng."""
    clips = []
    for text in SENTENCES:
        for voice, speed in VOICES:
            samples = speak(text, voice=voice, speed=speed)
            if samples is None:
                return None
            clips.append((text, samples))
    return clips


class SpeechTrack:
    """A client's audio: from `offset` s of noise on, a sentence, then as long a pause of
    noise, and so on (clips taken in turn from `first`); `chunk(start, seconds)` is the PCM16
    of that stretch, and `spoken` the sentences laid so far."""

    def __init__(self, clips: list[tuple[str, np.ndarray]], first: int, seed: int,
                 offset: float = 1.0) -> None:
        self.clips, self.next_clip = clips, first
        self.noise = np.random.default_rng(seed)
        self.samples = self._noise(int(offset * RATE))
        self.spoken: list[Spoken] = []

    def chunk(self, start: float, seconds: float = 1.0) -> bytes:
        first, last = int(start * RATE), int((start + seconds) * RATE)
        while self.samples.shape[0] < last:
            self._lay_next()
        return (np.clip(self.samples[first:last], -1, 1) * 32767).astype("<i2").tobytes()

    def said_by(self, seconds: float) -> list[Spoken]:
        """The sentences that had ended by `seconds` of audio."""
        return [s for s in self.spoken if s.end <= seconds]

    def _lay_next(self) -> None:
        text, clip = self.clips[self.next_clip % len(self.clips)]
        self.next_clip += 7  # another sentence in another voice
        start = self.samples.shape[0] / RATE
        self.spoken.append(Spoken(start, start + clip.shape[0] / RATE, text))
        pause = self._noise(clip.shape[0])
        self.samples = np.concatenate([self.samples, clip + self._noise(clip.shape[0]), pause])

    def _noise(self, n: int) -> np.ndarray:
        return self.noise.normal(0, 300 / 32767, n).astype(np.float32)


@dataclass
class SpeechScore:
    """The server's transcripts of one client's sentences."""

    heard: list[tuple[float, float, str]] = field(default_factory=list)  # (arrived, t, text)

    def on_note(self, message: dict, arrived: float) -> None:
        """Keep a transcript note (`arrived`: seconds since the client's audio began)."""
        if "transcript" in message.get("tags", ()):
            match = QUOTE.match(message.get("text", ""))
            self.heard.append((arrived, float(message.get("t", 0.0)),
                               match.group(1) if match else message.get("text", "")))

    def matches(self, spoken: list[Spoken], slack: float = 0.75) -> list[tuple[Spoken, str,
                                                                               float | None]]:
        """Each sentence with the transcript heard within it (its notes' text, in order) and
        how long after its end the first of them arrived (None: never)."""
        out = []
        for sentence in spoken:
            notes = [(arrived, text) for arrived, t, text in self.heard
                     if sentence.start - slack <= t <= sentence.end + slack]
            late = min((a for a, _ in notes), default=None)
            out.append((sentence, " ".join(text for _, text in notes),
                        None if late is None else max(0.0, late - sentence.end)))
        return out


def word_error_rate(pairs: list[tuple[str, str]]) -> float:
    """WER of (reference, heard) pairs (see `speech.word_error_rate`); a sentence heard as
    nothing counts as wrong throughout."""
    if not pairs:
        return float("nan")
    return sentences_wer([r for r, _ in pairs],
                         [h if h.strip() else "<nothing>" for _, h in pairs])


def speech_summary(results: list, within_s: float = 3.0) -> dict | None:
    """Over the live clients' `results` (their `spoken` sentences and `speech` scores):
    sentences said, transcribed, transcribed within `within_s` of their end, the delay
    p50/p95 and the WER (None: nobody spoke)."""
    matched = [m for r in results for m in r.speech.matches(r.spoken)]
    if not matched:
        return None
    delays = [late for _, _, late in matched if late is not None]
    return {"said": len(matched), "transcribed": len(delays),
            "in_time": sum(1 for d in delays if d <= within_s),
            "delay_p50": percentile(delays, 50), "delay_p95": percentile(delays, 95),
            "wer": word_error_rate([(s.text, heard) for s, heard, _ in matched])}


def speech_line(summary: dict) -> str:
    """`speech_summary` as one report line."""
    return (f"{summary['said']} sentences said, {summary['transcribed']} transcribed, "
            f"{summary['in_time']} within 3 s of their end "
            f"({summary['in_time'] / summary['said']:.0%}); delay p50 "
            f"{milliseconds(summary['delay_p50'])} ms, "
            f"p95 {milliseconds(summary['delay_p95'])} ms; "
            f"WER {summary['wer']:.1%}")
