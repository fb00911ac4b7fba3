"""Each session's CLIP index of its frames: text-to-frame search over the stream ("when did a
red car appear?"), whatever produced the model's frame tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FrameMatch:
    pts: float
    frame: int
    score: float  # cosine similarity of the frame's and the text's CLIP embeddings

    def as_dict(self) -> dict:
        return {"t": round(self.pts, 3), "frame": self.frame, "score": round(self.score, 4)}


class FrameIndex:
    """Unit CLIP embeddings of the kept frames, stored float16, at most `capacity` (the
    oldest dropped first, counted in `dropped`; 7200 frames are two hours at 1 fps, 7 MiB at
    512 dims)."""

    def __init__(self, capacity: int = 7200) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, not {capacity}")
        self.capacity = capacity
        self._vectors: torch.Tensor | None = None
        self._pts = torch.zeros(capacity, dtype=torch.float64)
        self._frames = torch.zeros(capacity, dtype=torch.int64)
        self._next = 0  # frames ever added; slot = count % capacity
        self.dropped = 0

    def __len__(self) -> int:
        return min(self._next, self.capacity)

    def add(self, pts: float, frame: int, embedding: torch.Tensor) -> None:
        if self._vectors is None:
            self._vectors = torch.zeros(self.capacity, embedding.shape[-1],
                                        dtype=torch.float16)
        slot = self._next % self.capacity
        if self._next >= self.capacity:
            self.dropped += 1
        self._vectors[slot] = embedding.to(torch.float16)
        self._pts[slot], self._frames[slot] = pts, frame
        self._next += 1

    def search(self, query: torch.Tensor, top_k: int = 5) -> list[FrameMatch]:
        """The `top_k` frames most like `query` (a unit embedding), best first."""
        n = len(self)
        if n == 0 or self._vectors is None:
            return []
        scores = self._vectors[:n].float() @ query.float().flatten()
        best = torch.topk(scores, min(top_k, n))
        return [FrameMatch(float(self._pts[i]), int(self._frames[i]), float(s))
                for s, i in zip(best.values.tolist(), best.indices.tolist())]
