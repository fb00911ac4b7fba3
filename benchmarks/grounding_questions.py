"""The questions of `python -m benchmarks grounding` and how an answer is scored.

An answer scores when it contains every expected fact (any of each fact's spellings, as whole
words; a fact spelled "#430" is a number, matched however it is written: "4:30", "430",
"four thirty"). For a question about something that never happened the answer must say so
("No", "I did not see ..."); one that does not, and names something found in no note and
not in the question, is counted as invented.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from streamgrok.media.samples import Scene

DENIALS = ("did not see", "didn't see", "did not hear", "didn't hear", "not seen", "was not",
           "wasn't", "were not", "weren't", "there was no", "there were no", "no person",
           "no one was", "nobody", "no cat", "no text", "no face", "not shown", "none",
           "not observed", "no speech", "no animal", "no moving", "not noted", "nothing",
           "no one")
COMMON = frozenset("i the a an no yes there it this that he she they we you in on at "
                   "not none nobody".split())
FILLER = frozenset("a an the is was were are be been to of in on at and or it its this that "
                   "there what who which when where why how did do does i you he she they "
                   "we screen video seen saw see shown show at seconds second s".split())


@dataclass(frozen=True)
class Question:
    text: str
    category: str
    facts: tuple[tuple[str, ...], ...] = ()  # every fact must appear, in any spelling
    absent: bool = False  # the right answer is that it was not there
    set: str = "existing"  # existing, direct, paraphrase or absent
    source: str = ""  # what the note that answers it says (generated clips)

    def in_set(self, name: str, source: str = "") -> Question:
        return replace(self, set=name, source=source or self.source)

    def score(self, answer: str) -> bool:
        """Every fact is in the answer as whole words ("no" is not in "know"); for what was
        absent the answer must deny it (start with "No", or say it was not seen)."""
        if self.absent:
            return says_absent(answer)
        if self.set != "existing" and says_absent(answer):  # "the person was not seen"
            return False
        said = f" {normalise(answer)} ".replace(" no one ", " nobody ")  # not the number one
        numbers = set(digits(answer))
        return all(any("".join(digits(s[1:])) in numbers if s.startswith("#")
                       else f" {normalise(s)} " in said for s in fact) for fact in self.facts)


@dataclass(frozen=True)
class Clip:
    name: str
    scenes: list[Scene]
    questions: list[Question]


def normalise(text: str) -> str:
    """Lower case, words and times only, single spaces ("didn't" stays one word, "00:03"
    one time, "seconds:" a word)."""
    text = re.sub(r"[^a-z0-9:']+", " ", text.lower().replace("\u2019", "'"))
    return " ".join(re.sub(r"(?<!\d):|:(?!\d)", " ", text).split())


def digits(text: str) -> list[str]:
    """The numbers in `text` as digit strings, however written: "four thirty", "4:30" and
    "430" are all "430"; "two hundred and five" and "200 and 5" are "205"."""
    from text_to_num import alpha2digit

    text = alpha2digit(text.lower().replace(",", " "), "en")
    text = re.sub(r"\b(\d+)00 and (\d{1,2})\b",
                  lambda m: str(int(m.group(1)) * 100 + int(m.group(2))), text)
    text = re.sub(r"\b(\d{1,2})[:. ](\d{2})\b", r"\1\2", text)  # a time
    return re.findall(r"\d+", text)


def says_absent(answer: str) -> bool:
    """Whether the answer says the thing asked about was not there."""
    said = f" {normalise(answer)} "
    return said.split()[:1] == ["no"] or any(f" {d} " in said for d in DENIALS)


def invented(answer: str, question: str, notes: list[str]) -> bool:
    """An answer that does not say the thing was absent and names a content word found in
    no note and not in the question."""
    if says_absent(answer):
        return False
    known = set(normalise(question + " " + " ".join(notes)).split())
    words = [w for w in normalise(answer).split() if w not in FILLER]
    return any(w not in known for w in words)


def invented_names(answer: str, question: str, notes: list[str]) -> list[str]:
    """Capitalised words of the answer found in neither the question nor the notes (the
    first word of a sentence is not a name by its capital alone)."""
    known = set(normalise(question + " " + " ".join(notes)).split())
    names = []
    for sentence in re.split(r"(?<=[.!?])\s+", answer):
        for word in re.findall(r"[A-Za-z][A-Za-z'-]+", sentence)[1:]:
            if word[0].isupper() and word.lower() not in known and word.lower() not in COMMON:
                names.append(word)
    return names
