"""Stop sequences on streamed text: deltas pass through until a stop string appears; text that
could be the start of one is held back until it is known not to be."""

from __future__ import annotations


class StopScanner:
    """Feed it deltas; it returns what may be shown and whether a stop string was reached."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """The text safe to emit after `delta` (the stop string and all after it never are)."""
        if self.stopped:
            return ""
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self.held = ""
            return text[:cut]
        keep = max((n for s in self.stops for n in range(1, len(s))
                    if text.endswith(s[:n])), default=0)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        """What was held back, at the end of the answer."""
        text, self.held = self.held, ""
        return "" if self.stopped else text
