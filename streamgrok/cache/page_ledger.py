"""Counting the pages a step's tokens take: the one rule the planner and `reserve` share."""

from __future__ import annotations

import math
from collections.abc import Callable

from streamgrok.cache.tokens import LayerTokens


class PageLedger:
    """The pages appending tokens to sequences takes, counted against the pages free.

    The planner takes each span it adds through one ledger (`take` refuses a span that does
    not fit what is left); `reserve` counts its step with a ledger too and allocates exactly
    the `growth` it counted. A sequence counted twice needs the pages of all its tokens.
    """

    def __init__(self, free: int, page_size: int,
                 layers_of: Callable[[int], list[LayerTokens]]) -> None:
        self.free = free
        self.page_size = page_size
        self._layers_of = layers_of
        self.counts: dict[int, int] = {}  # seq id -> tokens taken
        self._pages: dict[int, list[int]] = {}  # seq id -> new pages per layer

    @property
    def needed(self) -> int:
        """Pages everything taken so far needs."""
        return sum(sum(pages) for pages in self._pages.values())

    @property
    def over(self) -> bool:
        """Whether what was taken needs more pages than were free."""
        return self.needed > self.free

    @property
    def growth(self) -> list[tuple[LayerTokens, int]]:
        """(layer records, new pages) for every layer that grows."""
        return [(rec, extra) for seq_id, pages in self._pages.items()
                for rec, extra in zip(self._layers_of(seq_id), pages) if extra > 0]

    def pages_for(self, seq_id: int, tokens: int) -> list[int]:
        """New pages per layer that `tokens` more tokens of `seq_id` (beyond those taken)
        would need."""
        total = self.counts.get(seq_id, 0) + tokens
        return [max(0, math.ceil((rec.length + total) / self.page_size) - len(rec.pages))
                for rec in self._layers_of(seq_id)]

    def count(self, seq_id: int, tokens: int) -> None:
        """Count `tokens` more tokens of `seq_id`, whether or not they fit (`over` says)."""
        self._record(seq_id, tokens, self.pages_for(seq_id, tokens))

    def take(self, seq_id: int, tokens: int) -> bool:
        """Count `tokens` more tokens of `seq_id` only when they fit the pages left; returns
        whether they did."""
        pages = self.pages_for(seq_id, tokens)
        if self.needed - sum(self._pages.get(seq_id, [])) + sum(pages) > self.free:
            return False
        self._record(seq_id, tokens, pages)
        return True

    def _record(self, seq_id: int, tokens: int, pages: list[int]) -> None:
        self.counts[seq_id] = self.counts.get(seq_id, 0) + tokens
        self._pages[seq_id] = pages
