"""A simple contiguous KV cache: one fixed-capacity slot per sequence, never evicts.

It stores rotated keys at absolute positions. It is the reference the paged streaming cache
is checked against, and the cache of plain one-shot generation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from streamgrok.errors import CacheFullError
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.config import ModelConfig
from streamgrok.model.rotary import Rotary


class ContiguousKVCache:
    """`max_seqs` slots of `capacity` tokens per layer; sequence ids are slot indices."""

    def __init__(
        self,
        config: ModelConfig,
        max_seqs: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (config.num_layers, max_seqs, config.num_kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * max_seqs
        self.capacity = capacity
        self.rotary = Rotary(config, device)

    def reset(self, seq_id: int) -> None:
        """Forget a sequence's tokens so its slot can be reused."""
        self.lengths[seq_id] = 0

    def length(self, seq_id: int) -> int:
        """Tokens cached for a sequence."""
        return self.lengths[seq_id]

    def prepare(self, batch: BatchMetadata) -> None:
        """Check capacity and advance each sequence's length by its new tokens."""
        starts = [self.lengths[s] for s in batch.seq_ids]
        for seq, start, n in zip(batch.seq_ids, starts, batch.query_lens):
            if start + n > self.capacity:
                raise CacheFullError(
                    f"sequence {seq} needs {start + n} tokens but the contiguous cache holds "
                    f"{self.capacity}"
                )
        for seq, start, n in zip(batch.seq_ids, starts, batch.query_lens):
            self.lengths[seq] = start + n
        positions = torch.cat(
            [torch.arange(st, st + n) for st, n in zip(starts, batch.query_lens)]
        ).to(self.k.device)
        batch.backend_state = (starts, positions)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: BatchMetadata,
    ) -> torch.Tensor:
        """Store this layer's new K/V for each sequence, then attend (causal within chunks)."""
        starts, positions = batch.backend_state
        q = self.rotary.rotate(q, positions)
        k = self.rotary.rotate(k, positions)
        spans = batch.spans()
        for (seq, row, n), start in zip(spans, starts):
            self.k[layer, seq, :, start : start + n] = k[row : row + n].transpose(0, 1)
            self.v[layer, seq, :, start : start + n] = v[row : row + n].transpose(0, 1)
        if batch.is_decode:
            return self._decode(layer, q, batch.seq_ids, starts)
        out = torch.empty_like(q)
        for (seq, row, n), start in zip(spans, starts):
            out[row : row + n] = self._prefill(layer, q[row : row + n], seq, start, n)
        return out

    def _prefill(
        self, layer: int, q: torch.Tensor, seq: int, start: int, n: int
    ) -> torch.Tensor:
        total = start + n
        keys = self.k[layer, seq, :, :total]
        values = self.v[layer, seq, :, :total]
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).to(keys.dtype), keys, values, attn_mask=mask, enable_gqa=True
        )
        return out.transpose(0, 1).to(q.dtype)

    def _decode(
        self, layer: int, q: torch.Tensor, seq_ids: list[int], starts: list[int]
    ) -> torch.Tensor:
        total = max(starts) + 1
        slots = torch.tensor(seq_ids, device=q.device)
        keys = self.k[layer, slots, :, :total]
        values = self.v[layer, slots, :, :total]
        lengths = torch.tensor(starts, device=q.device) + 1
        mask = torch.arange(total, device=q.device)[None, :] < lengths[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :].to(keys.dtype),
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            enable_gqa=True,
        )
        return out[:, :, 0, :].to(q.dtype)
