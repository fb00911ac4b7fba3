"""Events a pipeline emits to its sinks (stdout, JSON lines, a websocket), one type each.

Sinks dispatch with `match`. Answer events carry the answer's id and the caller's
`query_id` (a websocket client's query id; None when a trigger asked). Every event has a
`kind` string ("note", "answer.delta", "alert.done", ...) and `as_dict()` for JSON output.
User stages report their own events with the generic `Event`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from streamgrok.media.items import format_time


class _Line:
    kind: str
    text: str
    pts: float | None

    def line(self) -> str:
        """A human-readable line with the stream time."""
        stamp = f"[{format_time(self.pts)}] " if self.pts is not None else ""
        return f"{stamp}{self.kind}: {self.text}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **asdict(self)}


@dataclass
class Event(_Line):
    """A generic event (user stages, progress): its own `kind`, text and data."""

    kind: str
    text: str = ""
    pts: float | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class NoteEvent(_Line):
    """An observation or transcript that joined the session's context."""

    text: str
    pts: float | None
    tags: list[str] = field(default_factory=list)
    kind = "note"


@dataclass
class _AnswerPart(_Line):
    """Common fields of the events of one answer; `purpose` is "answer" for a caller's
    query, or the trigger's kind ("alert", "commentary", ...)."""

    purpose: str
    answer_id: int
    text: str
    pts: float | None
    query_id: Any = None
    part = ""

    @property
    def kind(self) -> str:
        return f"{self.purpose}.{self.part}"


@dataclass
class QuestionEvent(_AnswerPart):
    """A question was asked (`text`)."""

    part = "question"


@dataclass
class DeltaEvent(_AnswerPart):
    """New text of an answer."""

    part = "delta"


@dataclass
class DoneEvent(_AnswerPart):
    """An answer finished: its whole text, its question and its metrics."""

    question: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    part = "done"


@dataclass
class ErrorEvent(_Line):
    """Something failed: media (`stage` decode/observe), a stage, a trigger, or one answer
    (`answer_id` set, then no DoneEvent follows for it)."""

    text: str
    pts: float | None
    stage: str = ""
    answer_id: int | None = None
    query_id: Any = None
    kind = "error"


PipelineEvent = NoteEvent | QuestionEvent | DeltaEvent | DoneEvent | ErrorEvent | Event
