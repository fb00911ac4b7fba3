"""The vocabulary every stage shares about streamed tokens: modality and per-token info."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamgrok.modality import Modality

__all__ = ["Modality", "TokenInfo"]


@dataclass(eq=False)
class TokenInfo:
    """Metadata of new tokens appended in one batch: tensors of [tokens] each."""

    modality: torch.Tensor
    timestamp: torch.Tensor
    source: torch.Tensor
    protected: torch.Tensor

    @classmethod
    def text(cls, count: int, protected: bool = False, timestamp: float = 0.0) -> TokenInfo:
        """`count` text tokens."""
        return cls.uniform(count, Modality.TEXT, timestamp, -1, protected)

    @classmethod
    def uniform(
        cls, count: int, modality: Modality, timestamp: float, source: int, protected: bool
    ) -> TokenInfo:
        """`count` tokens that share one modality, timestamp and source."""
        return cls(
            torch.full((count,), int(modality), dtype=torch.int64),
            torch.full((count,), float(timestamp), dtype=torch.float64),
            torch.full((count,), int(source), dtype=torch.int64),
            torch.full((count,), bool(protected), dtype=torch.bool),
        )

    @classmethod
    def concat(cls, parts: list[TokenInfo]) -> TokenInfo:
        return cls(
            torch.cat([p.modality for p in parts]),
            torch.cat([p.timestamp for p in parts]),
            torch.cat([p.source for p in parts]),
            torch.cat([p.protected for p in parts]),
        )

    def __len__(self) -> int:
        return self.modality.shape[0]

    def slice(self, start: int, stop: int) -> TokenInfo:
        return TokenInfo(
            self.modality[start:stop],
            self.timestamp[start:stop],
            self.source[start:stop],
            self.protected[start:stop],
        )
