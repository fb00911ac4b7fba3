"""A token embedding table stored as int8 with one scale per group of 32 values (GGUF's
Q8_0 layout): a quarter of float32's bytes for a table that is only indexed, never
multiplied. A looked-up row is dequantized to the model's compute dtype."""

from __future__ import annotations

import torch
from torch import nn

EMBED_GROUP = 32
_BLOCK_ROWS = 4096  # rows quantized at a time (the float temporaries stay small)


class Int8Embedding(nn.Module):
    """`nn.Embedding`'s lookup over int8 rows: `forward(ids)` -> [*ids.shape, dim]."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("values", values)  # int8 [vocab, dim]
        self.register_buffer("scales", scales)  # float32 [vocab, dim / EMBED_GROUP]
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = values.shape

    @classmethod
    def of(cls, weight: torch.Tensor) -> Int8Embedding:
        """`weight` [vocab, dim] quantized symmetrically per group of 32 (a row dimension
        not divisible by 32 is refused: `fits` tells)."""
        vocab, dim = weight.shape
        if not fits(dim):
            raise ValueError(f"an int8 embedding needs a row size divisible by {EMBED_GROUP}, "
                             f"got {dim}")
        values = torch.empty(vocab, dim, dtype=torch.int8, device=weight.device)
        scales = torch.empty(vocab, dim // EMBED_GROUP, device=weight.device)
        for first in range(0, vocab, _BLOCK_ROWS):
            rows = weight[first:first + _BLOCK_ROWS].detach().float()
            groups = rows.view(len(rows), -1, EMBED_GROUP)
            scale = groups.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127.0
            values[first:first + len(rows)] = torch.round(groups / scale).clamp(-127, 127) \
                .view(len(rows), dim).to(torch.int8)
            scales[first:first + len(rows)] = scale[..., 0]
        return cls(values, scales, weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        groups = self.values[ids].float().view(*ids.shape, -1, EMBED_GROUP)
        rows = groups * self.scales[ids][..., None]
        return rows.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def dequantized(self) -> torch.Tensor:
        """The whole table in the compute dtype, [vocab, dim]."""
        return self(torch.arange(self.num_embeddings, device=self.values.device))


def fits(dim: int) -> bool:
    """Whether rows of `dim` values can be stored as an `Int8Embedding`."""
    return dim % EMBED_GROUP == 0
