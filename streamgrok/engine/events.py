"""What the engine thread tells the event loop: typed answer events, gathered per step.

The scheduler records events as it changes state; the engine hands each step's batch to the
event loop in one call (`StepOutputs.deliver` runs there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from streamgrok.engine.metrics import AnswerMetrics


@dataclass(frozen=True)
class AnswerDelta:
    """New text of an answer (never splits a character)."""

    text: str


@dataclass(frozen=True)
class AnswerDone:
    """The answer ended: stop, length or cancelled (see metrics.finish_reason)."""

    metrics: AnswerMetrics


@dataclass(frozen=True)
class AnswerFailed:
    """The answer failed; nothing more comes."""

    message: str


AnswerEvent = AnswerDelta | AnswerDone | AnswerFailed
Deliver = Callable[[AnswerEvent], None]  # runs on the event loop


@dataclass
class StepOutputs:
    """Events, wake-ups and command replies produced on the engine thread since the last
    hand-off (callbacks run on the event loop after the events)."""

    events: list[tuple[Deliver, AnswerEvent]] = field(default_factory=list)
    wakeups: list[Callable[[], None]] = field(default_factory=list)

    def emit(self, deliver: Deliver, event: AnswerEvent) -> None:
        self.events.append((deliver, event))

    def wake(self, callback: Callable[[], None]) -> None:
        if callback not in self.wakeups:
            self.wakeups.append(callback)

    def __bool__(self) -> bool:
        return bool(self.events or self.wakeups)

    def deliver(self) -> None:
        """On the event loop: pass every event to its consumer, then wake writers."""
        for deliver, event in self.events:
            deliver(event)
        for callback in self.wakeups:
            callback()
