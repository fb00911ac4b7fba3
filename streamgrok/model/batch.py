"""The batch description that travels from the scheduler to the attention backend.

This is the only interface between whoever builds a batch and the cache/kernels: the model
itself never looks inside it, it only hands it to the attention backend of each layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from streamgrok.stream_tokens import TokenInfo
from streamgrok_kernels.paged_kv import PagedKV


@dataclass
class BatchMetadata:
    """A packed (varlen) batch: the new tokens of several sequences laid end to end.

    `seq_ids` name cache sequences; `query_lens[i]` new tokens belong to `seq_ids[i]`, in order.
    `embed_rows`/`embed_values` replace the token embedding of those packed rows with given
    vectors (frame tokens). `logit_rows` selects which packed rows produce logits (by default the
    last token of each sequence).
    """

    seq_ids: list[int]
    query_lens: list[int]
    embed_rows: torch.Tensor | None = None
    embed_values: torch.Tensor | None = None
    logit_rows: torch.Tensor | None = None
    token_info: TokenInfo | None = None
    backend_state: Any = None  # filled by AttentionBackend.prepare, read by attend

    @classmethod
    def build(
        cls,
        seq_ids: Sequence[int],
        query_lens: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> BatchMetadata:
        """Metadata for `query_lens` new tokens per sequence, logits at each last token."""
        ends = torch.tensor(query_lens, dtype=torch.long).cumsum(0) - 1
        return cls(list(seq_ids), list(query_lens), logit_rows=ends.to(device))

    @property
    def num_tokens(self) -> int:
        """Number of packed rows."""
        return sum(self.query_lens)

    def spans(self) -> list[tuple[int, int, int]]:
        """(sequence id, first packed row, row count) for each sequence."""
        out, start = [], 0
        for seq_id, n in zip(self.seq_ids, self.query_lens):
            out.append((seq_id, start, n))
            start += n
        return out

    @property
    def is_decode(self) -> bool:
        """True when every sequence adds exactly one token."""
        return all(n == 1 for n in self.query_lens)


class AttentionBackend(Protocol):
    """Stores new K/V and computes attention for one layer of a packed batch.

    q is [tokens, heads, head_dim]; k and v are [tokens, kv_heads, head_dim]; none of them is
    rotated yet: the backend owns positions (absolute or cache-relative) and applies rotary.
    """

    def prepare(self, batch: BatchMetadata) -> None:
        """Reserve room and positions for the batch's new tokens, once per forward pass;
        whatever attend needs later goes into `batch.backend_state`."""
        ...

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: BatchMetadata,
    ) -> torch.Tensor:
        """Attention output [tokens, heads, head_dim] for the packed batch."""
        ...


@dataclass
class PagedDecodeView:
    """A prepared decode step as one native call over the page pool takes it
    (`streamgrok.model.native_decode.NativeDecodeStep.paged`): the pool, where each row's new
    K/V go, each layer's page tables and lengths (the new token included), the rotary tables
    covering them, and whether the cache wants the step's attention mass."""

    kv: PagedKV
    new_slots: torch.Tensor  # [L, B] int64
    tables: torch.Tensor  # [L, B, P] int32
    lengths: torch.Tensor  # [L, B] int32
    cos: torch.Tensor  # [>= P * page_size, head_dim / 2] float32
    sin: torch.Tensor
    page_size: int
    wants_mass: bool
