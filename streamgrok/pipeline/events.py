"""Events a pipeline emits to its sinks (stdout, JSON lines, a websocket)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from streamgrok.media.items import format_time


@dataclass
class Event:
    """Something worth telling the user: a note, an answer delta, an alert, an error, stats.

    kinds: "note", "answer.delta", "answer.done", "alert", "error", "progress", "stats".
    """

    kind: str
    text: str = ""
    pts: float | None = None
    data: dict[str, Any] = field(default_factory=dict)

    def line(self) -> str:
        """A human-readable line with the stream time."""
        stamp = f"[{format_time(self.pts)}] " if self.pts is not None else ""
        return f"{stamp}{self.kind}: {self.text}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
