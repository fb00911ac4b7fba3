"""Word error rate and real-time factor of the speech recognisers on espeak-ng sentences in
several voices and speeds (part of `streamgrok bench media`)."""

from __future__ import annotations

import time

from streamgrok.media.samples import speak
from streamgrok.media.transcribers import load_transcriber

SENTENCES = [
    "Attention please. The delivery truck arrives at gate seven.",
    "A cat is resting on the table.",
    "The store closes at nine tonight.",
    "Please move your car away from the loading dock.",
    "The meeting starts in ten minutes in room four.",
    "Two people are waiting at the front door.",
]
VOICES = [("en", 150), ("en-us", 175), ("en+f3", 160), ("en-gb", 190)]
NUMBERS = {"7": "seven", "9": "nine", "10": "ten", "4": "four", "2": "two"}  # as Whisper writes


def word_error_rate(references: list[str], heard: list[str]) -> float:
    """WER of what was `heard` against the `references`, case, punctuation and the digits of
    these sentences normalised."""
    import jiwer

    transform = jiwer.Compose([jiwer.ToLowerCase(), jiwer.RemovePunctuation(),
                               jiwer.SubstituteWords(NUMBERS), jiwer.RemoveMultipleSpaces(),
                               jiwer.Strip(), jiwer.ReduceToListOfListOfWords()])
    return jiwer.wer(references, heard, reference_transform=transform,
                     hypothesis_transform=transform)


def speech_bench(recognisers: tuple[str, ...] = ("pocketsphinx", "base")) -> dict:
    """WER and RTF per recogniser on the same audio, one thread each."""
    clips = [(text, speak(text, voice=voice, speed=speed))
             for text in SENTENCES for voice, speed in VOICES]
    if clips[0][1] is None:
        print("speech     espeak-ng is not installed: recogniser part skipped")
        return {}
    audio_s = sum(len(samples) for _, samples in clips) / 16_000
    results = {}
    for name in recognisers:
        recogniser = load_transcriber(name)
        recogniser.transcribe(clips[0][1], 16_000)  # warm up
        started = time.perf_counter()
        heard = [recogniser.transcribe(samples, 16_000).text for _, samples in clips]
        seconds = time.perf_counter() - started
        wer = word_error_rate([t for t, _ in clips], heard)
        results[f"wer_{name}"], results[f"rtf_{name}"] = wer, seconds / audio_s
        print(f"speech     {recogniser.name:<14} WER {wer:6.1%} on {len(clips)} sentences "
              f"({len(VOICES)} voices/speeds), real-time factor {seconds / audio_s:.3f} "
              f"({audio_s:.0f} s of audio in {seconds:.1f} s, one thread)")
    return results
