"""KV parallelism (Mnemosyne's KVP): one sequence's KV cache sharded across ranks, exact.

Every rank runs the same model steps on the same inputs (the dense layers are replicated) and
holds the K/V of the stream pages it owns: stream page p (tokens p*16 .. p*16+15) belongs to
rank p % world, so any stream, evicting or not, spreads evenly. Attention runs on every rank
over its own keys and returns a partial output and log-sum-exp per query head; one all-gather
per layer merges them exactly (`shard_attention`). Token records (stream index, frame group,
modality, time, protection) are small and replicated on every rank, so cache-relative
positions and eviction decisions are computed identically everywhere: eviction gathers only
the per-shard scores it ranks (attention mass for h2o/snapkv/pyramid, the keys for
redundancy), selects over the whole sequence with the same `select_keep` as one process, and
each rank compacts its own pages.

Each rank's pages live in its own `PagedKVCache` (pool, page tables, reservation,
copy-on-write compaction). Prefix sharing is not used under KVP (`add_sequence` returns 0).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.core import CacheStats
from streamgrok.cache.eviction import compact_layer, evict_each
from streamgrok.cache.kv_group import KVGroup
from streamgrok.cache.page_ledger import PageLedger
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.cache.policies import LayerView, select_keep
from streamgrok.cache.records import (
    SequenceState,
    demote_protected,
    forget_evicted_frames,
    limit_layer_protection,
    next_stream_rows,
    retained_media,
)
from streamgrok.cache.shard_attention import (
    ShardPartial,
    empty_partial,
    merge_partials,
    shard_attention,
    shard_mass,
)
from streamgrok.cache.tokens import PROTECTED, STREAM, LayerTokens
from streamgrok.errors import CacheFullError
from streamgrok.model.batch import BatchMetadata
from streamgrok.model.config import ModelConfig
from streamgrok.stream_tokens import TokenInfo
from streamgrok_kernels.ops import KernelOps


@dataclass
class ShardSpan:
    """One sequence's queries in one layer, and this rank's keys for them."""

    seq_id: int
    rows: slice  # packed batch rows of its new tokens
    query_positions: torch.Tensor  # [n] cache-relative positions over the whole sequence
    key_slots: torch.Tensor  # [m] this rank's slots of the sequence's keys (new ones included)
    key_positions: torch.Tensor  # [m]


@dataclass
class ShardPlan:
    """Per layer: where this rank stores the step's new K/V (-1: another rank's) and what
    it attends."""

    new_slots: torch.Tensor  # [L, tokens] int64
    spans: list[list[ShardSpan]]  # [layer][sequence]
    reach: int  # one past the largest position any query or key has


@dataclass
class _Saved:
    """What a failed step restores of the replicated records."""

    lengths: dict[int, list[int]]
    counters: dict[int, tuple[int, int, int | None]]


class ShardLedger:
    """The planner's page ledger under KV parallelism: this rank's pages, a sequence's
    tokens counted as the ones this rank holds."""

    def __init__(self, ledger: PageLedger, owned_count: Callable[[int, int, int], int]) -> None:
        self.ledger = ledger
        self._owned_count = owned_count
        self._taken: dict[int, int] = {}  # seq id -> tokens taken (over all ranks)

    def take(self, seq_id: int, tokens: int) -> bool:
        """Count `tokens` more tokens of `seq_id` when this rank's share fits; returns
        whether it did."""
        taken = self._taken.get(seq_id, 0)
        if not self.ledger.take(seq_id, self._owned_count(seq_id, tokens, taken)):
            return False
        self._taken[seq_id] = taken + tokens
        return True


class KVParallelCache:
    """An AttentionBackend whose sequences are sharded over the ranks of `group`; the same
    interface as `PagedKVCache` for the engine. Every rank must make the same calls in the
    same order (the engine's leader broadcasts them; tests call them directly)."""

    def __init__(
        self,
        model_config: ModelConfig,
        group: KVGroup,
        config: CacheConfig | None = None,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_pages: int | None = None,
        kernels: KernelOps | None = None,
    ) -> None:
        if config is not None and config.recalls:
            raise ValueError("the host tier and recall are not available with KV parallelism "
                             "yet: leave host_tier_gib unset (--kv-host-gib) with --kv-parallel")
        self.group = group
        self.tier = None  # no host tier under KV parallelism
        self.local = PagedKVCache(model_config, config, compute_dtype, device, num_pages,
                                  kernels)
        self.model_config = model_config
        self.config = self.local.config
        self.kernels = self.local.kernels
        self.device = self.local.device
        self.budgets = self.local.budgets
        self.scorer = self.local.scorer
        self.rotary = self.local.rotary
        self.pool = self.local.pool
        self.page_bytes = self.local.page_bytes
        self.attention = self  # the model's side: every rank attends over its shard
        self.sequences: dict[int, SequenceState] = {}  # the whole sequence's records
        self.stats = CacheStats(evicted_by_layer=[0] * model_config.num_layers)
        self.exchanged_bytes = 0  # sent by this rank in collectives
        self._saved: _Saved | None = None

    # -- ownership ---------------------------------------------------------------------------

    def owned(self, stream: torch.Tensor) -> torch.Tensor:
        """Which of these stream indices (float64, as records hold them) this rank holds."""
        pages = torch.div(stream, self.config.page_size, rounding_mode="floor").long()
        return pages % self.group.world == self.group.rank

    def _owned_count(self, seq_id: int, count: int, after: int = 0) -> int:
        """How many of `seq_id`'s next `count` tokens (past `after` already counted) this
        rank holds."""
        start = self.sequences[seq_id].stream_pos + after
        stream = torch.arange(start, start + count, dtype=torch.float64)
        return int(self.owned(stream).sum())

    def _key_positions(self, seq_id: int, layer: int) -> torch.Tensor:
        """Cache-relative positions (over all ranks) of this rank's keys in `layer`."""
        whole = self.sequences[seq_id].layers[layer]
        mine = self.local.sequences[seq_id].layers[layer]
        return torch.searchsorted(whole.column(STREAM).contiguous(),
                                  mine.column(STREAM).contiguous())

    # -- sequences -------------------------------------------------------------------------

    @torch.inference_mode()
    def add_sequence(
        self,
        seq_id: int,
        prefix_tokens: Sequence[int] | None = None,
        prefix_info: TokenInfo | None = None,
        pinned: int = 0,
    ) -> int:
        """Register a sequence on every rank; returns 0 (no prefix sharing under KVP)."""
        self.local.add_sequence(seq_id, pinned=pinned)
        layers = [LayerTokens(self.config.page_size, self.device) for _ in self.budgets]
        self.sequences[seq_id] = SequenceState(seq_id, layers, pinned=pinned)
        return 0

    @torch.inference_mode()
    def fork(self, src_id: int, dst_id: int) -> None:
        """Start `dst_id` as a copy of `src_id` on every rank (pages shared copy-on-write)."""
        self._on_every_rank(lambda: self.local.fork(src_id, dst_id),
                            lambda: self.local.remove_sequence(dst_id), "a fork")
        src = self.sequences[src_id]
        self.sequences[dst_id] = replace(src, seq_id=dst_id,
                                         layers=[rec.copy_records() for rec in src.layers])

    @torch.inference_mode()
    def remove_sequence(self, seq_id: int) -> None:
        """Free the sequence's pages on every rank."""
        self.local.remove_sequence(seq_id)
        del self.sequences[seq_id]

    @torch.inference_mode()
    def limit_protected(self, seq_id: int, max_protected: int) -> int:
        """As `PagedKVCache.limit_protected`, over the whole sequence."""
        seq = self.sequences[seq_id]
        released = 0
        for layer, rec in enumerate(seq.layers):
            released += limit_layer_protection(rec, max_protected, seq.pinned)
            self._mirror_protection(seq_id, layer)
        return released

    def retained(self, seq_id: int, layer: int = 0) -> list[dict]:
        """What a layer of the whole sequence still holds of frames, notes and audio."""
        return retained_media(self.sequences[seq_id].layers[layer])

    def publish_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Prefix sharing is not used under KVP: nothing is published."""
        return 0

    def min_budget(self) -> int | None:
        return self.local.min_budget()

    def layer_lengths(self, seq_id: int) -> list[int]:
        """Cached tokens per layer, over all ranks."""
        return [rec.length for rec in self.sequences[seq_id].layers]

    def pages_needed(self, counts: dict[int, int]) -> int:
        """Pages this rank would allocate for counts[seq] more tokens of each sequence."""
        return self.local.pages_needed(
            {s: self._owned_count(s, n) for s, n in counts.items()})

    def can_append(self, seq_id: int, count: int) -> bool:
        return self.pages_needed({seq_id: count}) <= self.pool.free_pages

    def page_ledger(self) -> ShardLedger:
        """A ledger of this rank's pages for the planner: a sequence's tokens count as the
        ones this rank holds (every rank takes the same spans; `reserve` checks them all)."""
        return ShardLedger(self.local.page_ledger(), self._owned_count)

    # -- reservation -----------------------------------------------------------------------

    @torch.inference_mode()
    def reserve(self, counts: dict[int, int]) -> None:
        """Allocate every rank's pages for the step, all or none: when any rank is out of
        pages, all roll back and raise CacheFullError naming it."""
        owned = {s: self._owned_count(s, n) for s, n in counts.items()}
        self._on_every_rank(lambda: self.local.reserve(owned), self.local.rollback, "a step")
        self._saved = _Saved(
            {s: [rec.length for rec in self.sequences[s].layers] for s in counts},
            {s: (q.stream_pos, q.next_group, q.last_frame_source)
             for s, q in ((s, self.sequences[s]) for s in counts)},
        )

    @torch.inference_mode()
    def commit(self) -> None:
        """The step succeeded on every rank: keep its tokens and attention mass."""
        self._saved = None
        self.local.commit()

    @torch.inference_mode()
    def rollback(self) -> None:
        """The step failed: every rank restores its pages and the replicated records."""
        saved, self._saved = self._saved, None
        self.local.rollback()
        if saved is None:
            return
        for seq_id, lengths in saved.lengths.items():
            seq = self.sequences.get(seq_id)
            if seq is None:
                continue
            for rec, length in zip(seq.layers, lengths):
                rec.length = length
            seq.stream_pos, seq.next_group, seq.last_frame_source = saved.counters[seq_id]

    def _on_every_rank(self, action: Callable[[], object], undo: Callable[[], object],
                       what: str) -> None:
        """Run `action` here; when any rank ran out of pages for it, undo it where it
        succeeded, so all ranks stay alike, and raise CacheFullError naming those ranks."""
        error = None
        try:
            action()
        except CacheFullError as exc:
            error = exc
        failed = self.group.failed_ranks(error is None)
        if failed:
            if error is None:
                undo()
            raise CacheFullError(
                f"KV cache out of pages on rank(s) {failed} of {self.group.world} for {what}"
                + (f": {error}" if error else ""))

    # -- AttentionBackend ------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, batch: BatchMetadata) -> None:
        """Record the batch's new tokens in the replicated records and in this rank's pages
        (reserved by `reserve`; without a reservation, reserved now and committed after the
        step by the caller's `commit`)."""
        spans = batch.spans()
        if len({s for s, _, _ in spans}) != len(spans):
            raise ValueError("a batch may hold each sequence once")
        if not self.local.core.reserved:
            self.reserve({s: n for s, _, n in spans})
        info = batch.token_info or TokenInfo.text(batch.num_tokens)
        layers = len(self.budgets)
        new_slots = torch.full((layers, batch.num_tokens), -1, dtype=torch.int64)
        plan_spans: list[list[ShardSpan]] = [[] for _ in range(layers)]
        for seq_id, row, n in spans:
            seq = self.sequences[seq_id]
            rows = next_stream_rows(seq, info.slice(row, row + n))
            mine = self.owned(rows[:, STREAM])
            mine_rows = torch.nonzero(mine).flatten() + row
            for layer in range(layers):
                whole, local = seq.layers[layer], self.local.sequences[seq_id].layers[layer]
                past, local_past = whole.length, local.length
                whole.append_meta(rows)
                local.append_meta(rows[mine])
                new_slots[layer, mine_rows] = local.slots(local_past, local.length)
                plan_spans[layer].append(ShardSpan(
                    seq_id, slice(row, row + n),
                    torch.arange(past, past + n, device=self.device),
                    local.slots().to(self.device),
                    self._key_positions(seq_id, layer).to(self.device),
                ))
        self.local.stats.appended_tokens += batch.num_tokens
        self.stats.appended_tokens += batch.num_tokens
        # layers evict apart (frame groups, pyramid budgets): the longest one bounds positions
        reach = max(rec.length for s, _, _ in spans for rec in self.sequences[s].layers)
        batch.backend_state = ShardPlan(new_slots.to(self.device), plan_spans, reach)

    @torch.inference_mode()
    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: BatchMetadata,
    ) -> torch.Tensor:
        """Store this rank's share of the new K/V, attend over this rank's keys, and merge
        every rank's partials into the exact attention output."""
        plan: ShardPlan = batch.backend_state
        kv = self.pool.paged_kv()
        self.kernels.kv_append(kv, plan.new_slots[layer], k, v)
        spans = plan.spans[layer]
        cos, sin = self.rotary.tables(plan.reach)
        tokens, heads, dim = q.shape
        accumulates = self.scorer.accumulates_attention
        packed = torch.empty(tokens, heads, dim + 1, dtype=torch.float32, device=q.device)
        partials: list[ShardPartial] = []
        for span in spans:
            queries = self.kernels.rotate(q[span.rows], span.query_positions, cos, sin)
            if span.key_slots.numel() == 0:
                part = empty_partial(queries.shape[0], heads, dim, q.device)
            else:
                keys, values = kv.read(span.key_slots, q.dtype)
                keys = self.kernels.rotate(keys, span.key_positions, cos, sin)
                part = shard_attention(queries, keys, values, span.query_positions,
                                       span.key_positions, accumulates)
            packed[span.rows, :, :dim] = part.out
            packed[span.rows, :, dim] = part.lse
            partials.append(part)
        gathered = torch.stack(self.group.all_gather(packed))
        self.exchanged_bytes += packed.numel() * packed.element_size() * (self.group.world - 1)
        out, lse = merge_partials(gathered[..., :dim], gathered[..., dim])
        if accumulates:
            self._record_mass(layer, spans, partials, lse)
        return out.to(q.dtype)

    def _record_mass(self, layer: int, spans: list[ShardSpan], partials: list[ShardPartial],
                     lse: torch.Tensor) -> None:
        window = self.scorer.observation_window
        for span, part in zip(spans, partials):
            if span.key_slots.numel() == 0:
                continue
            queries = span.rows.stop - span.rows.start
            observed = 1 if queries == 1 else min(queries, window or queries)
            mass = shard_mass(part.scores, lse[span.rows], observed)
            self.local.core.observe_mass(self.local.sequences[span.seq_id].layers[layer], mass,
                                    observed)

    # -- eviction --------------------------------------------------------------------------

    @torch.inference_mode()
    def evict(
        self,
        seq_ids: Sequence[int] | None = None,
        force: bool = False,
        failed: dict[int, Exception] | None = None,
    ) -> int:
        """As `PagedKVCache.evict`, with each budget over the whole sequence: every rank
        selects the same tokens and compacts its own pages."""
        if not self.config.evicts:
            return 0
        return evict_each(seq_ids if seq_ids is not None else list(self.sequences),
                          lambda seq_id: self._evict_sequence(seq_id, force), self.stats, failed)

    def _evict_sequence(self, seq_id: int, force: bool) -> int:
        seq = self.sequences[seq_id]
        evicted = 0
        for layer, (whole, budget) in enumerate(zip(seq.layers, self.budgets)):
            limit = budget if force else budget + self.config.slack
            if whole.length <= limit:
                continue
            self.stats.demoted_tokens += demote_protected(whole, budget, seq.pinned,
                                                          self.config.sink_tokens)
            self._mirror_protection(seq_id, layer)
            positions = self._key_positions(seq_id, layer)
            if self.scorer.accumulates_attention:
                self._gather_scores(seq_id, layer, positions)
            view = LayerView(whole, functools.partial(self._gather_kv, seq_id, layer, positions),
                             seq.frame_embeddings)
            keep = select_keep(view, budget, self.scorer, self.config)
            kept = torch.zeros(whole.length, dtype=torch.bool)
            kept[keep] = True
            local = self.local.sequences[seq_id].layers[layer]
            compact_layer(self.pool, self.kernels, local,
                          torch.nonzero(kept[positions]).flatten(), self.device)
            removed = whole.length - keep.numel()
            whole.keep_only(keep)
            self.stats.evicted_by_layer[layer] += removed
            evicted += removed
        if evicted:
            forget_evicted_frames(seq)
        return evicted

    def index_frame(self, seq_id: int, source: int, embedding: torch.Tensor) -> None:
        """As `PagedKVCache.index_frame` (mirrored, so every rank chooses the same)."""
        if (seq := self.sequences.get(seq_id)) is not None:
            seq.index_frame(source, embedding)

    def _mirror_protection(self, seq_id: int, layer: int) -> None:
        whole = self.sequences[seq_id].layers[layer]
        local = self.local.sequences[seq_id].layers[layer]
        positions = self._key_positions(seq_id, layer)
        local.meta[: local.length, PROTECTED] = whole.column(PROTECTED)[positions]

    def _gather_scores(self, seq_id: int, layer: int, positions: torch.Tensor) -> None:
        """Every rank's accumulated mass, put in stream order in the replicated records."""
        local = self.local.sequences[seq_id].layers[layer]
        mine = torch.stack([positions.double(), local.scores().double()], dim=1)
        whole = self.sequences[seq_id].layers[layer]
        for part in self.group.all_gather_rows(mine.to(self.device)):
            whole.score[part[:, 0].long()] = part[:, 1].float().to(whole.score.device)
        self.exchanged_bytes += mine.numel() * 8 * (self.group.world - 1)

    def _gather_kv(self, seq_id: int, layer: int, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole layer's K and V in stream order (for scorers that read keys)."""
        local = self.local.sequences[seq_id].layers[layer]
        keys, values = self.pool.read(local.slots().to(self.device))
        total = self.sequences[seq_id].layers[layer].length
        out = []
        for mine in (keys, values):
            whole = mine.new_empty((total, *mine.shape[1:]))
            parts = self.group.all_gather_rows(mine)
            where = self.group.all_gather_rows(positions.to(self.device))
            for part, index in zip(parts, where):
                whole[index] = part
            self.exchanged_bytes += mine.numel() * mine.element_size() * (self.group.world - 1)
            out.append(whole)
        return out[0], out[1]
