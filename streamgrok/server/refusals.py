"""Refusals made visible: every `busy` (and every answer shortened under load) counted by what
was refused and the rule that refused it (`/metrics`), and one log line per burst of them
rather than one per refusal."""

from __future__ import annotations

import logging

from prometheus_client import Counter

from streamgrok.server.load import Refusal

log = logging.getLogger(__name__)


class RefusalLog:
    """Counts refusals of one kind ("session" or "question") in `counter` (labelled by
    rule) and logs a burst of them as two lines: the first refusal, with its rule and
    values, and, when the next one of that kind is admitted, how many the burst refused.
    Event-loop only."""

    def __init__(self, kind: str, counter: Counter, action: str = "refused busy",
                 normal: str = "admitted") -> None:
        self.kind = kind
        self.counter = counter
        self.action = action  # what happened to a refused one ("refused busy", "shortened")
        self.normal = normal  # what happens to the others
        self.burst = 0  # refusals since the last admission

    def refused(self, refusal: Refusal) -> None:
        """One refusal: counted, and logged if it starts a burst."""
        self.counter.labels(refusal.rule).inc()
        if not self.burst:
            log.warning("%s %s: %s", self.kind, self.action, refusal,
                        extra={"event": f"{self.kind}.refused", "rule": refusal.rule})
        self.burst += 1

    def admitted(self) -> None:
        """One admitted: a burst of refusals before it ends (and is logged with its count)."""
        if self.burst:
            log.info("%s %s again after %d %s", self.kind, self.normal, self.burst, self.action,
                     extra={"event": f"{self.kind}.refusals_ended", "refused": self.burst})
            self.burst = 0
