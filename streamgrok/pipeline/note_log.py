"""A session's notes, kept for grounded questions: each note's events with their tags and
stemmed content words (stemmed once, when logged: snowballstemmer is tens of microseconds a
word, too slow to restem a long log per question)."""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import snowballstemmer

from streamgrok.media.items import Note

WORD = re.compile(r"[a-z0-9]+")
STOP = frozenset(
    "a an the is are was were be been to of in on at and or what who whom which when where "
    "why how did do does has have had it its this that there any anything someone somebody "
    "so far you i me my we us our your please tell about from with for as by now yet ever "
    "see seen saw hear heard can could would should".split())
SYNONYMS = {"vanish": "gone", "disappear": "gone", "came": "appear", "arriv": "appear"}  # stems


class Event(NamedTuple):
    """One thing a note says happened."""

    text: str
    tags: frozenset[str]  # what it is about
    words: frozenset[str] = frozenset()  # its content words, stemmed once when logged


@dataclass(frozen=True)
class LoggedNote:
    text: str
    pts: float
    tags: frozenset[str]
    events: tuple[Event, ...]  # the note's parts; a prompt may show only some

    @property
    def shown(self) -> str:
        """The text of the events it shows."""
        return "; ".join(event.text for event in self.events)

    def saved(self) -> dict:
        """The note as JSON-able data (`NoteLog.restore` reads it back)."""
        return {"text": self.text, "pts": self.pts, "tags": sorted(self.tags),
                "events": [[event.text, sorted(event.tags)] for event in self.events]}

    def line(self, timed: bool = True) -> str:
        """The note as a prompt line, with its time unless `timed` is False."""
        return f"- at {self.pts:.0f} seconds: {self.shown}" if timed else f"- {self.shown}"


class NoteLog:
    """A session's notes in stream order; the oldest leave past `capacity`."""

    def __init__(self, capacity: int = 2000) -> None:
        self.notes: deque[LoggedNote] = deque(maxlen=capacity)
        self._stemmer = snowballstemmer.stemmer("english")

    def add(self, note: Note) -> None:
        tags = frozenset(note.tags)
        events = tuple(note.events) or ((note.text, tags),)
        self.notes.append(LoggedNote(note.text, note.pts, tags, tuple(
            Event(text, frozenset(about), frozenset(self.words(text)))
            for text, about in events)))

    def restore(self, saved: dict) -> None:
        """Log a note `LoggedNote.saved` wrote."""
        events = tuple((str(text), frozenset(map(str, tags))) for text, tags in saved["events"])
        self.add(Note(str(saved["text"]), float(saved["pts"]), tags=set(map(str, saved["tags"])),
                      events=events))

    def words(self, text: str) -> set[str]:
        """The content words of `text`, stemmed ("moving" and "move" are one word)."""
        stems = self._stemmer.stemWords([w for w in WORD.findall(text.lower())
                                         if w not in STOP])
        return {SYNONYMS.get(stem, stem) for stem in stems}
