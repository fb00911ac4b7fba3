"""Word error rate and real-time factor of the speech recognisers on espeak-ng sentences in
several voices and speeds (part of `python -m benchmarks media`), and `python -m benchmarks
speech`: how well Whisper hears numbers, times and names under each decoding option."""

from __future__ import annotations

import argparse
import time

from streamgrok.bench.sentences import SENTENCES, VOICES, word_error_rate
from streamgrok.cli.options import DEFAULTS
from streamgrok.media.samples import speak
from streamgrok.media.transcribers import load_transcriber


def spoken(sentences: list[str], voices: list[tuple[str, int]]) -> list | None:
    """(sentence, 16 kHz samples) for every sentence in every (voice, words a minute);
    None without espeak-ng."""
    clips = [(text, speak(text, voice=voice, speed=speed))
             for text in sentences for voice, speed in voices]
    return None if clips[0][1] is None else clips


def timed_transcripts(recogniser, clips: list) -> tuple[list, float]:
    """What `recogniser` heard in each clip, and the seconds it took (after one warm-up)."""
    recogniser.transcribe(clips[0][1], 16_000)
    started = time.perf_counter()
    heard = [recogniser.transcribe(samples, 16_000) for _, samples in clips]
    return heard, time.perf_counter() - started


def speech_bench(recognisers: tuple[str, ...] = ("pocketsphinx", "base")) -> dict:
    """WER and RTF per recogniser on the same audio, one thread each."""
    clips = spoken(SENTENCES, VOICES)
    if clips is None:
        print("speech     espeak-ng is not installed: recogniser part skipped")
        return {}
    audio_s = sum(len(samples) for _, samples in clips) / 16_000
    results = {}
    for name in recognisers:
        recogniser = load_transcriber(name)
        transcripts, seconds = timed_transcripts(recogniser, clips)
        heard = [t.text for t in transcripts]
        wer = word_error_rate([t for t, _ in clips], heard)
        results[f"wer_{name}"], results[f"rtf_{name}"] = wer, seconds / audio_s
        print(f"speech     {recogniser.name:<14} WER {wer:6.1%} on {len(clips)} sentences "
              f"({len(VOICES)} voices/speeds), real-time factor {seconds / audio_s:.3f} "
              f"({audio_s:.0f} s of audio in {seconds:.1f} s, one thread)")
    return results


NUMBER_SENTENCES = [  # spoken in words, as a person reads them
    "The meeting starts at four thirty in room twelve.",
    "The delivery truck arrives at gate seven.",
    "Flight two hundred and five now boards at gate fourteen.",
    "Please call Maria at extension three four one.",
    "The train to Leeds leaves from platform nine at six fifteen.",
    "Doctor Patel will see you in room eighteen at ten o'clock.",
    "The store closes at nine tonight.",
    "Bus number forty two is running twenty minutes late.",
    "Take the stairs to floor three and ask for Daniel.",
    "The package weighs eleven kilos and costs sixty dollars.",
]
NUMBER_VOICES = [("en-us", 150), ("en+m3", 140), ("en-gb", 175), ("en+f3", 165)]
NAMES = ("maria", "leeds", "patel", "daniel")
# the decoding options measured (WhisperTranscriber keyword arguments); the first is the
# recogniser's default
DECODINGS = {
    "beam 5 (default)": {},
    "beam 5, 30-s window": {"padding_s": None},
    "beam 1": {"beam_size": 1},
    "beam 5, no temperature fallback": {"options": {"temperature": 0.0}},
    "beam 5, patience 2": {"options": {"patience": 2.0}},
    "beam 5, digits prompt": {"initial_prompt": "Gate 7 at 4:30, room 12, flight 205."},
    "beam 5, schedule prompt": {"initial_prompt": "Announcements of times, rooms, gates and "
                                                  "names."},
}


def numbers_heard(reference: str, heard: str) -> bool:
    """Whether `heard` has the reference's numbers, in order, however written ("4:30",
    "430", "four thirty"; "341" or "3 4 1")."""
    from benchmarks.grounding_questions import digits

    return "".join(digits(reference.replace("o'clock", ""))) == "".join(digits(heard))


def speech_numbers_bench(decodings: dict[str, dict], threads: int = 1) -> dict:
    """Numbers (and names) heard right, WER and real-time factor of Whisper base under each
    decoding option (faster-whisper keyword arguments), on the same espeak-ng audio."""
    from streamgrok.media.audio import UNSURE
    from streamgrok.media.transcribers import WhisperTranscriber

    clips = spoken(NUMBER_SENTENCES, NUMBER_VOICES)
    if clips is None:
        print("speech     espeak-ng is not installed: nothing to measure")
        return {}
    audio_s = sum(len(samples) for _, samples in clips) / 16_000
    results = {}
    print(f"speech numbers: {len(NUMBER_SENTENCES)} sentences x {len(NUMBER_VOICES)} voices "
          f"({', '.join(f'{v} {s} wpm' for v, s in NUMBER_VOICES)}), {audio_s:.0f} s of audio, "
          f"Whisper base int8, {threads} thread(s)")
    for label, options in decodings.items():
        heard, seconds = timed_transcripts(
            WhisperTranscriber("base", threads=threads, **options), clips)
        right = [numbers_heard(text, said.text) for (text, _), said in zip(clips, heard)]
        named = [(name, said.text) for (text, _), said in zip(clips, heard)
                 for name in NAMES if name in text.lower()]
        names = sum(name in said.lower() for name, said in named)
        wer = word_error_rate([_digits_spelled(t) for t, _ in clips],
                              [_digits_spelled(said.text) for said in heard])
        flagged = [any(w.probability < UNSURE for w in said.words) for said in heard]
        wrong_flagged = sum(f for f, ok in zip(flagged, right) if not ok)
        right_flagged = sum(f for f, ok in zip(flagged, right) if ok)
        n_right = sum(right)
        results[label] = {"numbers": n_right / len(clips), "names": names / max(1, len(named)),
                          "wer": wer, "rtf": seconds / audio_s}
        print(f"  {label:<28} numbers {n_right}/{len(clips)} ({n_right / len(clips):.0%}), "
              f"names {names}/{len(named)}, WER {wer:.1%}, real-time factor "
              f"{seconds / audio_s:.3f}; a word noted unsure (p < {UNSURE}) in "
              f"{wrong_flagged}/{len(clips) - n_right} sentences with a number misheard, "
              f"{right_flagged}/{n_right} heard right")
        for (text, _), said, ok in zip(clips, heard, right):
            if not ok:
                print(f"      {text!r} -> {said.text!r}")
        if label == next(iter(decodings)):  # the default
            _unsure_sweep(heard, right)
    return results


def _unsure_sweep(heard: list, right: list[bool]) -> None:
    """How often a word is noted unsure at each probability threshold, in sentences whose
    numbers were misheard and in those heard right (the note's threshold is chosen here)."""
    wrong = len(right) - sum(right)
    words = sum(len(t.words) for t in heard)
    for threshold in (0.1, 0.2, 0.3, 0.4, 0.5):
        flagged = [any(w.probability < threshold for w in t.words) for t in heard]
        print(f"      unsure below {threshold}: {sum(f for f, ok in zip(flagged, right) if not ok)}"
              f"/{wrong} misheard sentences, {sum(f for f, ok in zip(flagged, right) if ok)}"
              f"/{sum(right)} right ones, "
              f"{sum(w.probability < threshold for t in heard for w in t.words)}/{words} words")


def _digits_spelled(text: str) -> str:
    """Numbers as digits, so WER counts words misheard, not "four thirty" against "4:30"."""
    from text_to_num import alpha2digit

    return alpha2digit(text.replace(":", " "), "en")


def register(benches: argparse._SubParsersAction) -> None:
    """Add `speech` and its arguments to the `python -m benchmarks` commands."""
    speech = benches.add_parser(
        "speech", formatter_class=DEFAULTS,
        help="numbers, times and names heard right by Whisper base under each decoding option")
    speech.add_argument("--threads", type=int, default=1, help="recogniser threads")
    speech.set_defaults(run=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the bench with the parsed command-line arguments."""
    speech_numbers_bench(DECODINGS, args.threads)
    return 0
