"""The shared speech recogniser: segments of several sessions recognised one after another (or
packed into one call and handed back by their words' times); a bounded queue; the real
Whisper on espeak-ng speech of several sessions, its encoder reading each segment and a few
seconds after it, not a 30-s window."""

from __future__ import annotations

import asyncio
import shutil
import threading

import numpy as np
import pytest

from streamgrok.media.speech_batcher import GAP_S, SpeechBatcher, split_words
from streamgrok.media.transcribers import RATE, Transcript, Word


class LoudRecogniser:
    """Hears one word per stretch of loud audio, named by its level (the segments are
    constant signals), timed where the stretch is; `gate` holds each call until set."""

    name = "whisper fake"

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.gate = threading.Event()

    def transcribe(self, samples: np.ndarray, rate: int) -> Transcript:
        self.gate.wait(10)
        self.calls.append(samples.shape[0] / rate)
        loud = np.concatenate([[False], np.abs(samples) > 0.05, [False]])
        edges = np.flatnonzero(loud[1:] != loud[:-1])
        words = tuple(Word(f" w{round(float(samples[a]) * 10)}", a / rate, b / rate)
                      for a, b in zip(edges[::2], edges[1::2]))
        return Transcript("".join(w.text for w in words).strip(), words)


def segment(level: float, seconds: int) -> np.ndarray:
    return np.full(seconds * RATE, level, dtype=np.float32)


async def test_waiting_segments_are_recognised_one_by_one_oldest_first():
    recogniser = LoudRecogniser()
    batcher = SpeechBatcher(recogniser)
    try:
        first = asyncio.create_task(batcher.transcribe_async(segment(0.3, 1)))
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(batcher.transcribe_async(segment(level, 2)))
                for level in (0.5, 0.7)]
        await asyncio.sleep(0.05)
        recogniser.gate.set()
        heard = await asyncio.wait_for(asyncio.gather(first, *rest), 10)
    finally:
        batcher.close()
    assert [t.text for t in heard] == ["w3", "w5", "w7"]
    assert recogniser.calls == [1.0, 2.0, 2.0]
    assert batcher.stats.calls == 3 and batcher.stats.segments == 3


async def test_packed_segments_share_one_call_and_get_their_own_words():
    recogniser = LoudRecogniser()
    batcher = SpeechBatcher(recogniser, packs=True)
    try:
        first = asyncio.create_task(batcher.transcribe_async(segment(0.3, 1)))
        await asyncio.sleep(0.05)  # the worker took it and waits at the gate
        rest = [asyncio.create_task(batcher.transcribe_async(segment(level, 2)))
                for level in (0.5, 0.7, 0.9)]
        await asyncio.sleep(0.05)
        recogniser.gate.set()
        alone, *packed = await asyncio.wait_for(asyncio.gather(first, *rest), 10)
    finally:
        batcher.close()
    assert alone.text == "w3" and len(recogniser.calls) == 2  # alone, then the three at once
    assert recogniser.calls[1] == pytest.approx(3 * 2 + 2 * GAP_S, abs=1e-3)
    assert [t.text for t in packed] == ["w5", "w7", "w9"]
    assert all(t.words[0].start == pytest.approx(0.0, abs=1e-3) for t in packed)
    assert all(t.words[0].end == pytest.approx(2.0, abs=1e-3) for t in packed)
    stats = batcher.stats.as_dict()
    assert stats["segments"] == 4 and stats["calls"] == 2 and stats["dropped"] == 0


async def test_a_full_queue_leaves_a_segment_unrecognised_and_counts_it():
    recogniser = LoudRecogniser()
    batcher = SpeechBatcher(recogniser, max_waiting_s=3.0)
    try:
        held = asyncio.create_task(batcher.transcribe_async(segment(0.3, 1)))
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(batcher.transcribe_async(segment(0.5, 2)))
        await asyncio.sleep(0.05)
        dropped = await batcher.transcribe_async(segment(0.7, 2))  # 2 + 2 > 3 s waiting
        assert dropped.text == "" and batcher.stats.dropped == 1
        recogniser.gate.set()
        assert [t.text for t in await asyncio.gather(held, waiting)] == ["w3", "w5"]
    finally:
        batcher.close()


def test_words_go_to_the_segment_their_middle_falls_in():
    words = (Word(" a", 0.2, 0.9), Word(" b", 1.3, 1.4), Word(" c", 2.0, 2.6))
    assert split_words(words, 0.0, 1.2).text == "a b"  # b's middle is within the gap's half
    later = split_words(words, 1.8, 1.0)
    assert later.text == "c" and later.words[0].start == pytest.approx(0.2)


@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed")
async def test_whisper_hears_the_sentences_of_several_sessions_apart():
    from streamgrok.media.samples import speak
    from streamgrok.media.transcribers import WhisperTranscriber

    sentences = ["A cat is resting on the table.", "Please move your car away from the dock.",
                 "Two people are waiting at the front door."]
    clips = [speak(text, voice=voice) for text, voice in zip(sentences, ("en", "en-us", "en+f3"))]
    whisper = WhisperTranscriber("base")
    encode = whisper.model.encode.encode
    frames: list[int] = []

    def recorded(features):
        frames.append(features.shape[-1])
        return encode(features)

    whisper.model.encode.encode = recorded
    batcher = SpeechBatcher(whisper)
    try:
        heard = await asyncio.wait_for(asyncio.gather(
            *(batcher.transcribe_async(c) for c in clips)), 120)
    finally:
        batcher.close()
    assert batcher.stats.calls == 3 and batcher.stats.segments == 3
    for text, transcript in zip(sentences, heard):
        words = {w.strip(".,").lower() for w in transcript.text.split()}
        expected = {w.strip(".,").lower() for w in text.split()}
        assert len(words & expected) >= len(expected) - 2, (text, transcript.text)
    # each encoder call read its segment and 5 s after it, not a 30-s window of 3000 frames
    assert frames and all(n <= len(c) / RATE * 100 + 500 + 2 for n, c in zip(frames, clips))


def test_the_padding_trim_keeps_the_speech_and_the_asked_silence():
    from streamgrok.media.transcribers import PaddingTrim

    seen = []
    trim = PaddingTrim(lambda features: seen.append(features.shape) or "encoded", frames=50)
    features = np.zeros((80, 3000), dtype=np.float32)
    features[:, :301] = -0.5  # 3 s of log-mel, then faster-whisper's zero padding
    assert trim(features) == "encoded" and seen[-1] == (80, 352)  # 301 + 50, made even
    trim(np.full((1, 80, 3000), -0.5, dtype=np.float32))
    assert seen[-1] == (1, 80, 3000)  # a full window stays whole


async def test_the_warm_up_call_is_not_counted_as_work():
    """The first call of a recogniser is slow; made at load, it stays out of the counters
    admission learns a session's speech cost from."""
    recogniser = LoudRecogniser()
    recogniser.gate.set()
    batcher = SpeechBatcher(recogniser)
    try:
        batcher.warm_up()
        assert recogniser.calls == [1.0]  # one second of quiet noise
        assert batcher.stats.calls == 0 and batcher.stats.busy_s == 0.0
        heard = await batcher.transcribe_async(segment(0.3, 1))
        assert heard.text == "w3" and batcher.stats.calls == 1
    finally:
        batcher.close()
