"""The sentences speaking benchmark clients say, in which voices, and how what was heard is
scored against them (word error rate, with the digits these sentences contain spelled out)."""

from __future__ import annotations

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
