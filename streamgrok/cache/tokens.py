"""Per-token records of one (sequence, layer): where each token lives and what it is."""

from __future__ import annotations

import torch

# Columns of LayerTokens.meta (float64 holds integers exactly below 2**53).
STREAM, GROUP, MODALITY, TIME, SOURCE, PROTECTED = range(6)
META_COLUMNS = 6


class LayerTokens:
    """The cached tokens of one sequence in one layer: page table, metadata, scores.

    Token i of this layer sits at slot pages[i // page_size] * page_size + i % page_size and
    has cache-relative position i. Scores live on `device` (where the attention that
    accumulates them runs), metadata on the host.
    """

    def __init__(self, page_size: int, device: torch.device | str = "cpu") -> None:
        self.page_size = page_size
        self.pages: list[int] = []
        self.length = 0
        self._slot_table: torch.Tensor | None = None
        self.meta = torch.zeros(0, META_COLUMNS, dtype=torch.float64)
        self.score = torch.zeros(0, dtype=torch.float32, device=device)

    def add_pages(self, pages: list[int]) -> None:
        self.pages.extend(pages)
        self._slot_table = None

    def set_pages(self, pages: list[int]) -> None:
        self.pages = pages
        self._slot_table = None

    def copy_records(self) -> LayerTokens:
        """A copy of the records (metadata, scores, length) that holds no pages."""
        copy = LayerTokens(self.page_size, self.score.device)
        copy.meta, copy.score, copy.length = self.meta.clone(), self.score.clone(), self.length
        return copy

    def slot_table(self) -> torch.Tensor:
        """Slot index of every position the layer's pages can hold."""
        if self._slot_table is None:
            pages = torch.tensor(self.pages, dtype=torch.int64)
            offsets = torch.arange(self.page_size)
            self._slot_table = (pages[:, None] * self.page_size + offsets).flatten()
        return self._slot_table

    def slots(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Slot indices of tokens [start, stop)."""
        return self.slot_table()[start : self.length if stop is None else stop]

    def append_meta(self, rows: torch.Tensor) -> None:
        """Add metadata rows [n, META_COLUMNS] (scores start at zero)."""
        n = rows.shape[0]
        if self.meta.shape[0] < self.length + n:
            grow = max(self.length + n, 2 * self.meta.shape[0], 64)
            self.meta = _grow(self.meta, grow)
            self.score = _grow(self.score, grow)
        self.meta[self.length : self.length + n] = rows
        self.score[self.length : self.length + n] = 0
        self.length += n

    def scores(self) -> torch.Tensor:
        """A host copy of the live tokens' scores (what eviction policies rank)."""
        return self.score[: self.length].to("cpu", copy=True)

    def column(self, col: int) -> torch.Tensor:
        return self.meta[: self.length, col]

    def replace_records(self, meta: torch.Tensor, score: torch.Tensor) -> None:
        """New metadata [n, META_COLUMNS] and scores [n] for all n tokens of the layer."""
        self.meta, self.score, self.length = meta, score, meta.shape[0]

    def put_back(self, pages: list[int], meta: torch.Tensor, score: torch.Tensor,
                 length: int) -> None:
        """Pages and records as they were before a change that replaced them."""
        self.set_pages(pages)
        self.meta, self.score, self.length = meta, score, length

    def keep_only(self, keep: torch.Tensor) -> None:
        """Reorder metadata and scores to the kept token indices (ascending)."""
        m = keep.shape[0]
        self.meta[:m] = self.meta[keep]
        self.score[:m] = self.score[keep.to(self.score.device)]
        self.length = m


def _grow(t: torch.Tensor, rows: int) -> torch.Tensor:
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out
