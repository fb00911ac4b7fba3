"""What the engine and the server may use of a KV cache, as protocols.

Three caches implement them: `PagedKVCache` (one process), `KVParallelCache` (one rank's
shard; the same calls on every rank) and the engine's `LeaderCache` (rank 0, which sends each
mutating call to the followers first). The model's side, the attention a forward pass runs,
is a cache's `attention` (a `streamgrok.model.batch.AttentionBackend`: `PagedAttention` for
the paged cache); this module is the scheduler's side:

- `SequenceCache`: sequences (add, fork, remove), their records and budgets, the pages a
  step needs (`page_ledger`, the one count the planner and `reserve` share), the step's
  transaction (`reserve`, then `commit` or `rollback`), eviction and the frame index, and
  the cache's `attention` for the model. Every cache has these.
- `ResumableCache`: a session's KV parked in host memory while its client is away, exported
  to and imported from a snapshot. `PagedKVCache` only.
- `ContextCache`: a client's own context bounds (target and trigger) for its session.
  `PagedKVCache` only.
- `RecallingCache`: recall from the host tier into an answer's pass. `PagedKVCache` with a
  host tier (`tier` is not None) only.

`tests/test_cache_contract.py` checks that each cache has the members its protocols name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.pool import PagePool
from streamgrok.cache.tiers.host_tier import HostTier
from streamgrok.model.batch import AttentionBackend
from streamgrok.stream_tokens import TokenInfo

if TYPE_CHECKING:
    from streamgrok.cache.core import CacheStats
    from streamgrok.cache.parking import SequenceSnapshot
    from streamgrok.cache.records import SequenceState
    from streamgrok.cache.tiers.recall import RecallResult


class PlannerLedger(Protocol):
    """What the planner asks of a page ledger."""

    def take(self, seq_id: int, tokens: int) -> bool:
        """Count `tokens` more tokens of `seq_id` when they fit the pages left; returns
        whether they did."""
        ...


@runtime_checkable
class SequenceCache(Protocol):
    """The scheduler's side of every KV cache."""

    config: CacheConfig
    pool: PagePool  # the pages (free, used) this process holds
    page_bytes: int
    budgets: list[int | None]  # tokens each layer keeps per sequence (None: no limit)
    sequences: Mapping[int, SequenceState]
    stats: CacheStats
    tier: HostTier | None  # the host tier recall reads, None without one
    attention: AttentionBackend  # the model's side: what a forward pass stores and attends

    def add_sequence(self, seq_id: int, prefix_tokens: Sequence[int] | None = None,
                     prefix_info: TokenInfo | None = None, pinned: int = 0) -> int:
        """Start sequence `seq_id`, its first tokens shared from a published prefix where
        one matches `prefix_tokens`; returns the tokens reused."""
        ...

    def fork(self, src_id: int, dst_id: int) -> None:
        """`dst_id` starts as a copy of `src_id`'s cached tokens, sharing their pages."""
        ...

    def remove_sequence(self, seq_id: int) -> None:
        """Forget `seq_id` and free the pages only it held."""
        ...

    def limit_protected(self, seq_id: int, max_protected: int) -> int:
        """Unprotect the oldest protected tokens past `max_protected`; returns how many."""
        ...

    def retained(self, seq_id: int, layer: int = 0) -> list[dict]:
        """The media still cached in `layer` of `seq_id`, one entry per item."""
        ...

    def publish_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Offer `seq_id`'s first `tokens` for later sequences to share; returns pages."""
        ...

    def min_budget(self) -> int | None:
        """The smallest per-layer token budget, None when unbounded."""
        ...

    def layer_lengths(self, seq_id: int) -> list[int]:
        """Tokens cached in each layer of `seq_id`."""
        ...

    def pages_needed(self, counts: dict[int, int]) -> int:
        """Free pages appending `counts` (seq id -> tokens) would take."""
        ...

    def page_ledger(self) -> PlannerLedger:
        """A count of the pages the spans of one step take, against the pages free now."""
        ...

    def reserve(self, counts: dict[int, int]) -> None:
        """Open a step: allocate its pages now (all or nothing, `CacheFullError`)."""
        ...

    def commit(self) -> None:
        """Close the step that ran: its tokens and attention scores stay."""
        ...

    def rollback(self) -> None:
        """Close the step that failed: the cache is as it was before `reserve`."""
        ...

    def evict(self, seq_ids: Sequence[int] | None = None, force: bool = False,
              failed: dict[int, Exception] | None = None) -> int:
        """Bring sequences back within their budgets; returns the tokens evicted."""
        ...

    def index_frame(self, seq_id: int, source: int, embedding: torch.Tensor) -> None:
        """Keep a cached frame's CLIP embedding for frame-aware eviction."""
        ...


@runtime_checkable
class ResumableCache(SequenceCache, Protocol):
    """A cache whose sequences can wait in host memory and move between processes."""

    @property
    def parked_bytes(self) -> int:
        """Host bytes every parked sequence holds."""
        ...

    def park(self, seq_id: int) -> int:
        """Move `seq_id`'s KV to host memory and free its pages; returns the bytes kept."""
        ...

    def unpark(self, seq_id: int) -> None:
        """Bring a parked sequence's KV back into pages (`CacheFullError` without room)."""
        ...

    def export_sequence(self, seq_id: int) -> SequenceSnapshot:
        """`seq_id`'s records and KV, detached from this cache."""
        ...

    def import_sequence(self, seq_id: int, snapshot: SequenceSnapshot) -> None:
        """Start `seq_id` from an exported snapshot."""
        ...


@runtime_checkable
class ContextCache(SequenceCache, Protocol):
    """A cache that keeps a session within a client's own context bounds."""

    def set_context(self, seq_id: int, target: int, trigger: int) -> None:
        """Keep each layer of `seq_id` at most `target` tokens once past `trigger`."""
        ...

    def context_bounds(self, target: int | None, trigger: int | None,
                       pinned: int) -> tuple[int, int]:
        """A client's context target and trigger, checked and filled in from the budget."""
        ...


@runtime_checkable
class RecallingCache(SequenceCache, Protocol):
    """A cache with a host tier that recalls evicted tokens into an answer's pass."""

    def recall_next_pass(self, seq_id: int, room: int = 0,
                         min_hit_rate: float | None = None) -> None:
        """Recall for `seq_id` in its next forward pass, with `room` tokens to spare."""
        ...

    def take_recall(self, seq_id: int) -> RecallResult | None:
        """What the last recall for `seq_id` did, once."""
        ...
