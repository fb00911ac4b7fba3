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
        """The text safe to emit after `delta` (the stop string and all after it never are).
        A stop found is final only when no other stop could still begin before it: 'aba'
        arriving as 'ab' + 'a' with stops 'b' and 'aba' stops at 0, not at 1."""
        if self.stopped:
            return ""
        text = self.held + delta
        if not self.stops:
            self.held = ""
            return text
        cut = self._first_stop(text)
        # where the earliest stop that may still complete begins (text's end is its prefix)
        keep = max((n for s in self.stops for n in range(1, len(s))
                    if text.endswith(s[:n])), default=0)
        open_from = len(text) - keep
        if cut >= 0 and cut <= open_from:
            self.stopped = True
            self.held = ""
            return text[:cut]
        self.held = text[open_from:]
        return text[:open_from]

    def flush(self) -> str:
        """What was held back, at the end of the answer (up to a stop string it holds)."""
        text, self.held = self.held, ""
        if self.stopped:
            return ""
        cut = self._first_stop(text)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        return text

    def _first_stop(self, text: str) -> int:
        """Where the earliest stop string in `text` begins, -1 where there is none."""
        return min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
