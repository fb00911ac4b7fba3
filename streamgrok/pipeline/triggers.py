"""Triggers: ask the session a question on a schedule or when an observation matches."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from streamgrok.media.items import Note, format_time


@dataclass
class Trigger:
    """Base: `check` returns the question to ask now, or None."""

    question: str
    kind: str = "answer"  # the event kind of the answer: "answer" or "alert"

    def on_time(self, stream_time: float) -> str | None:
        return None

    def on_note(self, note: Note) -> str | None:
        return None


@dataclass
class At(Trigger):
    """Once, when the stream reaches `seconds`."""

    seconds: float = 0.0
    fired: bool = False

    def on_time(self, stream_time: float) -> str | None:
        if not self.fired and stream_time >= self.seconds:
            self.fired = True
            return self.question
        return None


@dataclass
class Every(Trigger):
    """Every `seconds` of stream time (first at `seconds`)."""

    seconds: float = 10.0
    _next: float | None = None

    def on_time(self, stream_time: float) -> str | None:
        if self._next is None:
            self._next = self.seconds
        if stream_time >= self._next:
            self._next = stream_time + self.seconds
            return self.question
        return None


@dataclass
class OnNote(Trigger):
    """When a note has one of `tags` (person, face, speech, cut, motion) or matches `pattern`;
    at most once per `cooldown` seconds of stream time."""

    tags: set[str] = field(default_factory=set)
    pattern: str | None = None
    cooldown: float = 10.0
    kind: str = "alert"
    _last: float = float("-inf")

    def on_note(self, note: Note) -> str | None:
        hit = bool(self.tags & note.tags) or bool(
            self.pattern and re.search(self.pattern, note.text, re.IGNORECASE)
        )
        if hit and note.pts - self._last >= self.cooldown:
            self._last = note.pts
            return self.question.format(note=note.text, time=f"[{format_time(note.pts)}]")
        return None
