"""What the parts of one paged cache share: its pages, its sequences' records and the step
that is open.

`PagedKVCache` (the scheduler's side: sequences, the step's transaction, eviction) creates
one `CacheCore` and hands it to the parts that act on the same pages: `PagedAttention` (the
model's side: a forward pass's new K/V and attention) and the host tier's `Recaller`. They
take the core as an argument; none of them holds the cache that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.page_ledger import PageLedger
from streamgrok.cache.policies import Scorer
from streamgrok.cache.pool import PagePool
from streamgrok.cache.records import SequenceState, next_stream_rows
from streamgrok.cache.tiers.host_tier import HostTier
from streamgrok.cache.tokens import LayerTokens
from streamgrok.errors import CacheFullError
from streamgrok.model.config import ModelConfig
from streamgrok.model.rotary import Rotary
from streamgrok.stream_tokens import TokenInfo
from streamgrok_kernels.ops import KernelOps


@dataclass
class Reservation:
    """Pages allocated before a step's forward pass, and what to restore if it fails."""

    counts: dict[int, int]  # seq id -> tokens reserved
    saved: dict[int, tuple[list[tuple[int, int]], int, int, int | None]]  # see reserve()
    masses: list[tuple[LayerTokens, torch.Tensor, int]] = field(default_factory=list)


@dataclass
class CacheStats:
    """Counters of what the cache has done."""

    appended_tokens: int = 0
    prefix_hit_tokens: int = 0
    eviction_passes: int = 0
    evicted_tokens: int = 0
    demoted_tokens: int = 0  # protected tokens unprotected so eviction could meet a budget
    eviction_seconds: float = 0.0
    evicted_by_layer: list[int] = field(default_factory=list)


@dataclass
class CacheCore:
    """The pages, records and open step of one paged cache, shared by its parts.

    `sequences` and `step` are changed only on the engine's thread: by the cache's manager,
    by its attention backend inside a forward pass and by its recaller.
    """

    model_config: ModelConfig
    config: CacheConfig
    device: torch.device
    kernels: KernelOps
    pool: PagePool
    rotary: Rotary
    scorer: Scorer  # what eviction ranks by, and whether attention feeds it
    budgets: list[int | None]  # tokens each layer keeps per sequence (None: no limit)
    tier: HostTier | None  # evicted KV recall reads, None without one
    sequences: dict[int, SequenceState] = field(default_factory=dict)
    stats: CacheStats = field(default_factory=CacheStats)
    step: Reservation | None = None  # the step between `reserve` and commit/rollback

    @property
    def reserved(self) -> bool:
        """Whether a step's reservation is open (between `reserve` and commit/rollback)."""
        return self.step is not None

    def ledger(self) -> PageLedger:
        """A count of the pages appending tokens to these sequences takes, against the
        pages free now."""
        return PageLedger(self.pool.free_pages, self.config.page_size,
                          lambda seq_id: self.sequences[seq_id].layers)

    def check_known(self, counts: dict[int, int]) -> None:
        """KeyError for a sequence of `counts` this cache does not hold."""
        for seq_id in counts:
            if seq_id not in self.sequences:
                raise KeyError(f"unknown sequence {seq_id}; call add_sequence first")

    def allocate(self, counts: dict[int, int]) -> None:
        """Give each layer of each sequence the pages `counts[seq]` more tokens need, all or
        none (CacheFullError)."""
        self.check_known(counts)
        ledger = self.ledger()
        for seq_id, tokens in counts.items():
            ledger.count(seq_id, tokens)
        if ledger.over:
            raise CacheFullError(
                f"KV cache out of pages: this step needs {ledger.needed}, "
                f"{self.pool.free_pages} free of {self.pool.num_pages}"
            )
        growing = ledger.growth
        if growing:
            for (layer, _), pages in zip(growing, self.pool.allocate_each(
                    [extra for _, extra in growing])):
                layer.add_pages(pages)

    def append_records(self, seq: SequenceState, info: TokenInfo) -> None:
        """The records of the sequence's next stream tokens, in every layer."""
        rows = next_stream_rows(seq, info)
        for layer in seq.layers:
            layer.append_meta(rows)

    def observe_mass(self, rec: LayerTokens, mass: torch.Tensor, queries: int) -> None:
        """Attention mass `queries` queries gave the layer's tokens: added to their scores
        now, or at commit when a step is open (so a failed step leaves the scores as they
        were)."""
        if self.step is None:
            self.accumulate(rec, mass, queries)
        else:
            self.step.masses.append((rec, mass, queries))

    def accumulate(self, rec: LayerTokens, mass: torch.Tensor, queries: int) -> None:
        """Decay the layer's scores by `queries` steps and add `mass`."""
        n = mass.shape[0]
        rec.score[:n] = rec.score[:n] * (self.config.h2o_decay**queries) + mass
