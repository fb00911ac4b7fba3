"""The paged streaming KV cache: an AttentionBackend with eviction and prefix sharing."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from streamgrok.cache.attention_plan import (
    AttentionPlan,
    SpanGroup,
    build_attention_plan,
    decode_view,
)
from streamgrok.cache.config import CPU_DEFAULT_GIB, KV_DTYPES, CacheConfig
from streamgrok.cache.host_tier import HostTier
from streamgrok.cache.parking import (
    ParkedKV,
    SequenceSnapshot,
    check_entries,
    pages_to_unpark,
    park_layers,
    snapshot_layers,
    unpark_layers,
)
from streamgrok.cache.policies import LayerView, make_scorer, select_keep
from streamgrok.cache.pool import PagePool
from streamgrok.cache.prefix import PrefixIndex
from streamgrok.cache.recall import QueryCapture, RecallResult
from streamgrok.cache.recaller import Recaller
from streamgrok.cache.tokens import (
    META_COLUMNS,
    MODALITY,
    PROTECTED,
    SOURCE,
    STREAM,
    TIME,
    LayerTokens,
)
from streamgrok.errors import CacheFullError
from streamgrok.model.batch import BatchMetadata, PagedDecodeView
from streamgrok.model.config import ModelConfig
from streamgrok.model.rotary import Rotary
from streamgrok.stream_tokens import Modality, TokenInfo
from streamgrok_kernels.ops import KernelOps


@dataclass
class SequenceState:
    """One sequence's per-layer token records and stream counters."""

    seq_id: int
    layers: list[LayerTokens]
    stream_pos: int = 0  # tokens ever appended (the next stream index)
    next_group: int = 0
    last_frame_source: int | None = None
    pinned: int = 0  # leading stream tokens never unprotected (the system prompt)
    tier_source: int | None = None  # the sequence whose host tier recall reads (a fork's
    # parent session)
    budget_bonus: list[int] = field(default_factory=list)  # recalled tokens a layer may hold
    # beyond its budget
    # unit CLIP embeddings of the frames still cached, by source: frame-aware eviction
    # drops a frame a newer one repeats first (see policies.frame_novelty)
    frame_embeddings: dict[int, torch.Tensor] = field(default_factory=dict)
    # a client's own context bounds (see `PagedKVCache.set_context`): each layer kept to at
    # most `context_target` tokens, evicted once past it by `context_slack`
    context_target: int | None = None
    context_slack: int | None = None

    def index_frame(self, source: int, embedding: torch.Tensor) -> None:
        """Keep a cached frame's CLIP embedding (its index) for frame-aware eviction."""
        self.frame_embeddings[int(source)] = embedding.detach().float().cpu()


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


class PagedKVCache:
    """Paged K/V for many sequences, each layer with its own page table and budget.

    Every method that touches cache tensors runs in inference mode, so the bookkeeping tensors
    are consistent whether callers use inference mode or not.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        config: CacheConfig | None = None,
        compute_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        num_pages: int | None = None,
        kernels: KernelOps | None = None,
    ) -> None:
        self.model_config = model_config
        self.kernels = kernels or KernelOps()
        self.config = (config or CacheConfig()).for_model(compute_dtype)
        self.device = torch.device(device)
        page_bytes = self.config.page_bytes(model_config)
        if num_pages is None:
            num_pages = int(self.memory_budget_bytes() // page_bytes)
        self.pool = PagePool(
            num_pages,
            self.config.page_size,
            model_config.num_kv_heads,
            model_config.head_dim,
            self.config.torch_kv_dtype,
            compute_dtype,
            self.device,
        )
        self.page_bytes = page_bytes
        self.budgets = self.config.layer_budget_list(model_config.num_layers)
        self.scorer = make_scorer(self.config)
        self.prefix = PrefixIndex(self.config.page_size)
        self.rotary = Rotary(model_config, self.device)
        self.sequences: dict[int, SequenceState] = {}
        self.parked: dict[int, ParkedKV] = {}  # sequences whose KV waits in host memory
        self.stats = CacheStats(evicted_by_layer=[0] * model_config.num_layers)
        self._reservation: Reservation | None = None
        self.tier = self._host_tier(compute_dtype)
        self.recaller = Recaller(self)

    def _host_tier(self, compute_dtype: torch.dtype) -> HostTier | None:
        if not self.config.recalls:
            return None
        store = (torch.int8 if self.config.host_tier_dtype == "int8"
                 else KV_DTYPES[self.config.kv_dtype])
        disk = self.config.disk_tier_gib
        return HostTier(self.config.host_tier_gib * 2**30, self.config.page_size,
                        self.model_config.num_kv_heads, self.model_config.head_dim, store,
                        compute_dtype, self.device,
                        disk_bytes=None if disk is None else disk * 2**30,
                        disk_folder=None if self.config.disk_tier_dir is None
                        else Path(self.config.disk_tier_dir))

    def memory_budget_bytes(self) -> float:
        """Bytes the page pool may use: a fixed size, or by default a share of free GPU memory
        (on CUDA) or `CPU_DEFAULT_GIB` (on CPU)."""
        if self.config.memory_gib is not None:
            return self.config.memory_gib * 2**30
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free * self.config.gpu_memory_fraction
        return CPU_DEFAULT_GIB * 2**30

    # -- sequences -------------------------------------------------------------------------

    @torch.inference_mode()
    def add_sequence(
        self,
        seq_id: int,
        prefix_tokens: Sequence[int] | None = None,
        prefix_info: TokenInfo | None = None,
        pinned: int = 0,
    ) -> int:
        """Register a sequence. When `prefix_tokens` (the text it will start with) begin with
        full pages another sequence published, those pages are shared; returns how many leading
        tokens are therefore already cached and must not be prefilled again.

        The first `pinned` stream tokens (a system prompt) stay protected whatever else is
        protected; they must fit every layer's budget."""
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id} already exists")
        budget = self.min_budget()
        if budget is not None and max(pinned, self.config.sink_tokens) > budget:
            raise CacheFullError(
                f"a pinned prefix of {pinned} tokens does not fit the layer budget ({budget})"
            )
        layers = [LayerTokens(self.config.page_size, self.device) for _ in self.budgets]
        seq = SequenceState(seq_id, layers, pinned=pinned, budget_bonus=[0] * len(layers))
        self.sequences[seq_id] = seq
        if self.tier is not None:
            self.tier.add_sequence(seq_id, len(layers))
            seq.tier_source = seq_id
        if not prefix_tokens:
            return 0
        entries = self.prefix.lookup(prefix_tokens, self.pool.generation)
        if not entries:
            return 0
        for layer, tokens in enumerate(seq.layers):
            pages = [entry.pages[layer] for entry in entries]
            for page in pages:
                self.pool.share(page)
            tokens.add_pages(pages)
        reused = len(entries) * self.config.page_size
        info = prefix_info or TokenInfo.text(len(prefix_tokens), protected=True)
        self._append_records(seq, info.slice(0, reused))
        self.stats.prefix_hit_tokens += reused
        return reused

    @torch.inference_mode()
    def fork(self, src_id: int, dst_id: int) -> None:
        """Start sequence `dst_id` as a copy of `src_id` that shares its full pages.

        Partly filled last pages are copied at once, so both sequences can append; later
        compaction of either copies shared pages on write.
        """
        if dst_id in self.sequences:
            raise ValueError(f"sequence {dst_id} already exists")
        src = self.sequences[src_id]
        partial = [rec for rec in src.layers if rec.length % self.config.page_size]
        if len(partial) > self.pool.free_pages:
            raise CacheFullError(
                f"KV cache out of pages: forking needs {len(partial)}, "
                f"{self.pool.free_pages} free of {self.pool.num_pages}"
            )
        layers = []
        for rec in src.layers:
            pages = list(rec.pages)
            for page in pages:
                self.pool.share(page)
            if rec.length % self.config.page_size:
                pages[-1] = self.pool.copy_on_write(pages[-1])
            copy = rec.copy_records()
            copy.set_pages(pages)
            layers.append(copy)
        self.sequences[dst_id] = replace(src, seq_id=dst_id, layers=layers,
                                         budget_bonus=list(src.budget_bonus))

    @torch.inference_mode()
    def limit_protected(self, seq_id: int, max_protected: int) -> int:
        """Unprotect the oldest protected tokens beyond `max_protected` per layer, never the
        sequence's pinned prefix (the system prompt); returns tokens unprotected."""
        seq = self.sequences[seq_id]
        return sum(limit_layer_protection(rec, max_protected, seq.pinned) for rec in seq.layers)

    def retained(self, seq_id: int, layer: int = 0) -> list[dict]:
        """What a layer still holds of frames, notes and audio: one entry per source/time,
        for the server's timeline of what eviction kept."""
        return retained_media(self.sequences[seq_id].layers[layer])

    @torch.inference_mode()
    def publish_prefix(self, seq_id: int, tokens: Sequence[int]) -> int:
        """Offer the sequence's leading full pages of `tokens` for sharing; returns pages
        published (none once eviction has touched the prefix)."""
        seq = self.sequences[seq_id]
        full = len(tokens) // self.config.page_size * self.config.page_size
        expected = torch.arange(full, dtype=torch.float64)
        for layer in seq.layers:
            if layer.length < full or not torch.equal(layer.column(STREAM)[:full], expected):
                return 0
        pages = [layer.pages[: full // self.config.page_size] for layer in seq.layers]
        return self.prefix.publish(list(tokens[:full]), pages, self.pool.generation)

    @torch.inference_mode()
    def remove_sequence(self, seq_id: int) -> None:
        """Free every page of a sequence (and what it has parked)."""
        seq = self.sequences.pop(seq_id)
        self.parked.pop(seq_id, None)
        for layer in seq.layers:
            self.pool.release(layer.pages)
            layer.set_pages([])
        self.recaller.forget(seq_id)
        if self.tier is not None:
            self.tier.remove_sequence(seq_id)

    @torch.inference_mode()
    def park(self, seq_id: int) -> int:
        """Move a sequence's KV out of the pool into host memory, freeing its pages; its
        records stay, so `unpark` brings it back exactly. Returns the host bytes it holds.
        A parked sequence must not be stepped, forked or recalled until it is unparked."""
        if seq_id in self.parked:
            return self.parked[seq_id].nbytes
        if self._reservation is not None and seq_id in self._reservation.counts:
            raise RuntimeError(f"sequence {seq_id} has pages reserved for a step")
        parked = self.parked[seq_id] = park_layers(self.pool, self.sequences[seq_id].layers)
        return parked.nbytes

    @torch.inference_mode()
    def unpark(self, seq_id: int) -> None:
        """Put a parked sequence's KV back into pages (CacheFullError, and it stays parked,
        when the pool lacks them)."""
        parked = self.parked.get(seq_id)
        if parked is None:
            return
        unpark_layers(self.pool, self.sequences[seq_id].layers, parked)
        del self.parked[seq_id]

    def export_sequence(self, seq_id: int) -> SequenceSnapshot:
        """A parked sequence as a snapshot another process can `import_sequence` (its host
        tier's evicted KV is not part of it)."""
        seq = self.sequences[seq_id]
        if seq_id not in self.parked:
            raise RuntimeError(f"sequence {seq_id} must be parked to be exported")
        return SequenceSnapshot(
            snapshot_layers(seq.layers, self.parked[seq_id]), seq.stream_pos, seq.next_group,
            seq.last_frame_source, seq.pinned, list(seq.budget_bonus),
            dict(seq.frame_embeddings), seq.context_target, seq.context_slack)

    @torch.inference_mode()
    def import_sequence(self, seq_id: int, snapshot: SequenceSnapshot) -> None:
        """Register a sequence from a snapshot, parked (`unpark` brings it into pages);
        ValueError when the snapshot does not fit this cache's model or KV format."""
        if seq_id in self.sequences:
            raise ValueError(f"sequence {seq_id} already exists")
        check_entries(self.pool, snapshot, len(self.budgets))
        layers = []
        for layer in snapshot.layers:
            rec = LayerTokens(self.config.page_size, self.device)
            rec.replace_records(layer.meta.clone(), layer.score.to(self.device, copy=True))
            layers.append(rec)
        seq = SequenceState(seq_id, layers, snapshot.stream_pos, snapshot.next_group,
                            snapshot.last_frame_source, snapshot.pinned,
                            budget_bonus=list(snapshot.budget_bonus),
                            frame_embeddings=dict(snapshot.frame_embeddings),
                            context_target=snapshot.context_target,
                            context_slack=snapshot.context_slack)
        self.sequences[seq_id] = seq
        if self.tier is not None:
            self.tier.add_sequence(seq_id, len(layers))
            seq.tier_source = seq_id
        self.parked[seq_id] = ParkedKV([layer.entries for layer in snapshot.layers])

    def set_context(self, seq_id: int, target: int, trigger: int) -> None:
        """Keep a sequence's layers to at most `target` tokens (within their budgets),
        evicting once one holds more than `trigger` (see `context_bounds`)."""
        seq = self.sequences[seq_id]
        seq.context_target, seq.context_slack = target, trigger - target

    def context_bounds(self, target: int | None, trigger: int | None,
                       pinned: int) -> tuple[int, int]:
        """A client's (target, trigger) checked against this cache: target within
        [pinned prefix + 4 pages, smallest layer budget], trigger within [target, target +
        the budget]; a missing one takes the server's. ValueError says what is wrong."""
        budget = self.min_budget()
        if budget is None:
            raise ValueError("this server's KV cache never evicts (--kv-policy full): its "
                             "context has no target to set")
        floor = max(pinned, self.config.sink_tokens) + 4 * self.config.page_size
        target = budget if target is None else target
        if not floor <= target <= budget:
            raise ValueError(f"context.target_tokens must be in [{floor}, {budget}] (the "
                             "system prompt and a few pages, up to the server's budget)")
        trigger = target + self.config.slack if trigger is None else trigger
        if not target <= trigger <= target + budget:
            raise ValueError(f"context.trigger_tokens must be in [{target}, {target + budget}]")
        return target, trigger

    def pages_to_unpark(self, seq_id: int) -> int:
        """Pages `unpark(seq_id)` would take (0 when it is not parked)."""
        if seq_id not in self.parked:
            return 0
        return pages_to_unpark(self.sequences[seq_id].layers, self.config.page_size)

    @property
    def parked_bytes(self) -> int:
        """Host bytes every parked sequence holds."""
        return sum(parked.nbytes for parked in self.parked.values())

    def min_budget(self) -> int | None:
        """The smallest per-layer token budget (None when the cache never evicts)."""
        budgets = [b for b in self.budgets if b is not None]
        return min(budgets) if budgets else None

    def layer_lengths(self, seq_id: int) -> list[int]:
        """Cached tokens per layer."""
        return [layer.length for layer in self.sequences[seq_id].layers]

    def can_append(self, seq_id: int, count: int) -> bool:
        """Whether `count` more tokens fit in the pool right now."""
        return self.pages_needed({seq_id: count}) <= self.pool.free_pages

    # -- reservation: a step's pages before its forward pass ------------------------------

    @torch.inference_mode()
    def reserve(self, counts: dict[int, int]) -> None:
        """Allocate pages for `counts[seq]` new tokens of each sequence in every layer, all or
        none (CacheFullError), before the forward pass that writes them. Until `commit` (the
        step succeeded) or `rollback` (it failed) the cache can be put back exactly as it was:
        lengths, page tables, refcounts, stream counters and attention-mass scores."""
        if self._reservation is not None:
            raise RuntimeError("a reservation is already open: commit or roll it back first")
        self._check_known(counts)
        saved = {}
        for seq_id in counts:
            seq = self.sequences[seq_id]
            saved[seq_id] = ([(layer.length, len(layer.pages)) for layer in seq.layers],
                             seq.stream_pos, seq.next_group, seq.last_frame_source)
        self._allocate(counts)
        self._reservation = Reservation(dict(counts), saved)

    @torch.inference_mode()
    def commit(self) -> None:
        """The step succeeded: keep its tokens and apply the attention mass it observed."""
        reservation, self._reservation = self._reservation, None
        self.recaller.end_step(committed=True)
        if reservation is None:
            return
        for rec, mass, queries in reservation.masses:
            self._accumulate(rec, mass, queries)

    @torch.inference_mode()
    def rollback(self) -> None:
        """The step failed: drop its tokens and pages; the cache is as before `reserve`."""
        reservation, self._reservation = self._reservation, None
        self.recaller.end_step(committed=False)  # first: the layers as the step found them
        if reservation is None:
            return
        for seq_id, (layers, stream_pos, next_group, last_source) in reservation.saved.items():
            seq = self.sequences.get(seq_id)
            if seq is None:
                continue
            for rec, (length, pages) in zip(seq.layers, layers):
                self.pool.release(rec.pages[pages:])
                rec.set_pages(rec.pages[:pages])
                rec.length = length
            seq.stream_pos, seq.next_group, seq.last_frame_source = (
                stream_pos, next_group, last_source)

    def _check_known(self, counts: dict[int, int]) -> None:
        for seq_id in counts:
            if seq_id not in self.sequences:
                raise KeyError(f"unknown sequence {seq_id}; call add_sequence first")

    def _allocate(self, counts: dict[int, int]) -> None:
        self._check_known(counts)
        needed = self.pages_needed(counts)
        if needed > self.pool.free_pages:
            raise CacheFullError(
                f"KV cache out of pages: this step needs {needed}, {self.pool.free_pages} free "
                f"of {self.pool.num_pages}"
            )
        growing = [(layer, extra) for seq_id, n in counts.items()
                   for layer in self.sequences[seq_id].layers
                   if (extra := math.ceil((layer.length + n) / self.config.page_size)
                       - len(layer.pages)) > 0]
        if growing:
            for (layer, _), pages in zip(growing, self.pool.allocate_each(
                    [extra for _, extra in growing])):
                layer.add_pages(pages)

    # -- AttentionBackend ------------------------------------------------------------------

    @torch.inference_mode()
    def prepare(self, batch: BatchMetadata) -> None:
        """Record metadata for the batch's new tokens, in pages reserved for them by
        `reserve` (or, without a reservation, allocated now: all or nothing)."""
        spans = batch.spans()
        if len({s for s, _, _ in spans}) != len(spans):
            raise ValueError("a batch may hold each sequence once")
        counts = {s: n for s, _, n in spans}
        reservation = self._reservation
        if reservation is None:
            self._allocate(counts)
        else:
            unreserved = [s for s, n in counts.items() if reservation.counts.get(s, 0) < n]
            if unreserved:
                raise ValueError(f"sequences {unreserved} were not reserved for this step")
        info = batch.token_info or TokenInfo.text(batch.num_tokens)
        starts: dict[int, list[int]] = {}
        for seq_id, row, n in spans:
            seq = self.sequences[seq_id]
            starts[seq_id] = [layer.length for layer in seq.layers]
            self._append_records(seq, info.slice(row, row + n))
        self.stats.appended_tokens += batch.num_tokens
        if self.config.recall_in_stream:  # the config has a host tier then
            for seq_id, _, n in spans:
                if n >= 2:
                    self.recaller.arm_stream(seq_id)
        records = {s: self.sequences[s].layers for s, _, _ in spans}
        batch.backend_state = build_attention_plan(spans, records, starts, self.config.page_size,
                                              self.device)

    @torch.inference_mode()
    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: BatchMetadata,
    ) -> torch.Tensor:
        """Store the new K/V of `layer`, then attend over each sequence's cached tokens:
        decode rows (one token) in one paged decode call, prefill chunks in one paged prefill
        call, through `self.kernels` (Triton on CUDA, the PyTorch reference elsewhere)."""
        plan: AttentionPlan = batch.backend_state
        if self.recaller.active:
            plan = batch.backend_state = self.recaller.before_attention(layer, q, k, plan)
        elif self.recaller.rehearsal_due:
            self.recaller.rehearse(layer, q, plan)
        kv = self.pool.paged_kv()
        self.kernels.kv_append(kv, plan.new_slots[layer], k, v)
        out = torch.empty_like(q)
        for group in plan.groups:
            self._attend_group(layer, kv, q, out, group)
        return out

    def _attend_group(self, layer: int, kv, q, out, group: SpanGroup) -> None:
        width = group.widths[layer]
        tables = group.tables[layer, :, :width]
        cos, sin = self.rotary.tables(width * self.config.page_size)
        q_rot = self.kernels.rotate(q[group.rows], group.positions[layer], cos, sin)
        accumulates = self.scorer.accumulates_attention
        if group.decode:
            result, mass = self.kernels.decode_attention(
                q_rot, kv, tables, group.lengths[layer], cos, sin, accumulates)
            observed = [1] * len(group.counts)
        else:
            window = (self.scorer.observation_window or group.max_q) if accumulates else None
            result, mass = self.kernels.prefill_attention(
                q_rot, kv, tables, group.cu_q, group.past[layer], cos, sin, group.max_q, window)
            observed = [min(n, window or n) for n in group.counts]
        out[group.rows] = result.to(out.dtype)
        if self.recaller.active:
            self.recaller.record_queries(layer, q, group)
        if mass is not None:  # scores stay on the device: no sync per layer
            for i, (seq_id, total) in enumerate(zip(group.seq_ids, group.totals[layer])):
                self.observe_mass(self.sequences[seq_id].layers[layer], mass[i, :total],
                                  observed[i])

    def paged_decode_view(self, batch: BatchMetadata) -> PagedDecodeView | None:
        """The prepared decode batch as one native step takes it (every layer in one call),
        or None where its layers must run one by one: a prefill chunk in the batch, a device
        other than the CPU, or recall capturing queries or rehearsing (they act between
        layers)."""
        plan: AttentionPlan = batch.backend_state
        if (self.device.type != "cpu" or self.recaller.active or self.recaller.rehearsal_due
                or plan is None):
            return None
        return decode_view(plan, self.pool.paged_kv(), self.rotary.tables,
                           self.config.page_size, self.scorer.accumulates_attention)

    def observe_step_mass(self, batch: BatchMetadata, mass: torch.Tensor) -> None:
        """The attention mass [L, B, keys] a native decode step of `batch` (one query per
        row) gave each layer's tokens, as `attend` observes it layer by layer."""
        group = batch.backend_state.groups[0]
        for layer, totals in enumerate(group.totals):
            for row, (seq_id, total) in enumerate(zip(group.seq_ids, totals)):
                self.observe_mass(self.sequences[seq_id].layers[layer], mass[layer, row, :total],
                                  1)

    @property
    def reserved(self) -> bool:
        """Whether a step's reservation is open (between `reserve` and commit/rollback)."""
        return self._reservation is not None

    def observe_mass(self, rec: LayerTokens, mass: torch.Tensor, queries: int) -> None:
        """Attention mass `queries` queries gave the layer's tokens: added to their scores
        now, or by `commit` when a reservation is open (so a failed step leaves the scores
        as they were)."""
        if self._reservation is None:
            self._accumulate(rec, mass, queries)
        else:
            self._reservation.masses.append((rec, mass, queries))

    def _accumulate(self, rec: LayerTokens, mass: torch.Tensor, queries: int) -> None:
        n = mass.shape[0]
        rec.score[:n] = rec.score[:n] * (self.config.h2o_decay**queries) + mass

    # -- eviction --------------------------------------------------------------------------

    @torch.inference_mode()
    def evict(
        self,
        seq_ids: Sequence[int] | None = None,
        force: bool = False,
        failed: dict[int, Exception] | None = None,
    ) -> int:
        """Bring every layer over budget + slack back to its budget; returns tokens evicted.

        Run between engine steps. With `force`, layers are cut to budget even within slack.
        Protected text never makes a budget impossible: when protected tokens and sinks
        outnumber it, the oldest protected tokens after the pinned prefix lose their
        protection (counted in `stats.demoted_tokens`) and compete like the rest.
        With `failed`, a sequence that cannot be evicted is recorded there (seq id -> error)
        and the others are still evicted; without it the error is raised.
        """
        if not self.config.evicts:
            return 0
        candidates = seq_ids if seq_ids is not None else list(self.sequences)
        return evict_each([s for s in candidates if s not in self.parked],
                          lambda seq_id: self._evict_sequence(self.sequences[seq_id], force),
                          self.stats, failed)

    def _evict_sequence(self, seq: SequenceState, force: bool) -> int:
        evicted = 0
        slack = self.config.slack if seq.context_slack is None else seq.context_slack
        for index, (rec, budget) in enumerate(zip(seq.layers, self.budgets)):
            if seq.context_target is not None:
                budget = min(budget, seq.context_target)
            budget += seq.budget_bonus[index]
            limit = budget if force else budget + slack
            if rec.length <= limit:
                continue
            self.stats.demoted_tokens += demote_protected(rec, budget, seq.pinned,
                                                           self.config.sink_tokens)
            view = LayerView(rec, lambda rec=rec: self.pool.read(rec.slots().to(self.device)),
                             seq.frame_embeddings)
            keep = select_keep(view, budget, self.scorer, self.config)
            removed = rec.length - keep.numel()
            if self.tier is not None and seq.seq_id in self.tier.sequences:
                self._store_evicted(seq.seq_id, index, rec, keep)
            self.compact_layer(rec, keep)
            self.stats.evicted_by_layer[index] += removed
            evicted += removed
        if evicted:
            forget_evicted_frames(seq)
        return evicted

    def index_frame(self, seq_id: int, source: int, embedding: torch.Tensor) -> None:
        """Record a cached frame's CLIP embedding (its index) for frame-aware eviction."""
        if (seq := self.sequences.get(seq_id)) is not None:
            seq.index_frame(source, embedding)

    def compact_layer(self, rec: LayerTokens, keep: torch.Tensor) -> None:
        """Move kept tokens to the front of the layer's pages on the device; free the emptied
        tail pages and copy shared pages on write.

        The moves run in place (`kernels.kv_compact`): copy-on-write pages are allocated while
        the tail is still held, so no source is overwritten before it is read. Only when the
        pool has no page left for that are the moved entries staged in a scratch copy first."""
        page_size = self.config.page_size
        kept = keep.numel()
        moved = torch.nonzero(keep != torch.arange(kept)).flatten()
        first = int(moved[0]) if moved.numel() else kept
        src = rec.slot_table()[keep[first:]].to(self.device)
        new_count = math.ceil(kept / page_size)
        pages = list(rec.pages)
        shared = [i for i in range(first // page_size, new_count)
                  if self.pool.refcount[pages[i]] > 1]
        staged = None
        if len(shared) > self.pool.free_pages:
            staged = self.pool.gather_raw(src)
            self.pool.release(pages[new_count:])
        for i in shared:
            pages[i] = self.pool.copy_on_write(pages[i])
        self.pool.touch([pages[i] for i in range(first // page_size, new_count)
                         if i not in shared])
        tail = pages[new_count:]
        rec.set_pages(pages[:new_count])
        dst = rec.slot_table()[first:kept].to(self.device)
        if staged is None:
            self.kernels.kv_compact(self.pool.paged_kv(), src, dst)
            self.pool.release(tail)
        else:
            self.pool.scatter_raw(dst, staged)
        rec.keep_only(keep)

    # -- host tier and recall --------------------------------------------------------------

    def capture_queries(self, seq_id: int, keep: int | None = None) -> None:
        """Keep the last `keep` (default `recall_queries`) queries of every layer the
        sequence (an answer's fork) attends with from now on, for `recall`."""
        if seq_id not in self.sequences:
            raise KeyError(f"unknown sequence {seq_id}")
        self.recaller.capture(seq_id, keep or self.config.recall_queries)

    def captured_queries(self, seq_id: int) -> QueryCapture | None:
        """What `capture_queries` has kept for the sequence so far (recall consumes it)."""
        return self.recaller.captured(seq_id)

    @torch.inference_mode()
    def recall(self, seq_id: int, room: int = 0) -> RecallResult:
        """Bring back into the sequence (an answer's fork, after `capture_queries` and a
        forward pass) the host-tier pages its captured queries score highest, per layer, in
        stream order; keep every layer, with `room` tokens still to come, within the model's
        trained context. The fork may hold the recalled tokens beyond its budget. Without a
        host tier or captured queries, nothing happens."""
        return self.recaller.recall(seq_id, room)

    def recall_next_pass(self, seq_id: int, room: int = 0,
                         min_hit_rate: float | None = None) -> None:
        """Recall inside the sequence's next forward pass (the engine's way): at each layer,
        before that pass's tokens (an answer's question) attend, their own queries choose
        what comes back, so they attend over it; `take_recall` tells what happened.
        `min_hit_rate` overrides the guard's threshold (`recall_min_hit_rate`) for this one."""
        if seq_id not in self.sequences:
            raise KeyError(f"unknown sequence {seq_id}")
        threshold = self.config.recall_min_hit_rate if min_hit_rate is None else min_hit_rate
        self.recaller.arm(seq_id, room, threshold)

    def take_recall(self, seq_id: int) -> RecallResult | None:
        """What the sequence's in-pass recall did, once its pass has run (else None)."""
        return self.recaller.take(seq_id)

    def _store_evicted(self, seq_id: int, layer: int, rec: LayerTokens,
                       keep: torch.Tensor) -> None:
        gone = torch.ones(rec.length, dtype=torch.bool)
        gone[keep] = False
        index = torch.nonzero(gone).flatten()
        k, v = self.pool.read(rec.slots()[index].to(self.device))
        self.tier.store(seq_id, layer, k, v, rec.meta[index])

    # -- helpers ---------------------------------------------------------------------------

    def pages_needed(self, counts: dict[int, int]) -> int:
        """Pages that appending counts[seq] tokens to each sequence would allocate."""
        page_size = self.config.page_size
        needed = 0
        for seq_id, n in counts.items():
            for layer in self.sequences[seq_id].layers:
                needed += max(0, math.ceil((layer.length + n) / page_size) - len(layer.pages))
        return needed

    def _append_records(self, seq: SequenceState, info: TokenInfo) -> None:
        rows = next_stream_rows(seq, info)
        for layer in seq.layers:
            layer.append_meta(rows)


def evict_each(seq_ids: Sequence[int], evict_one: Callable[[int], int], stats: CacheStats,
               failed: dict[int, Exception] | None) -> int:
    """`evict_one(seq_id)` for each sequence, counted as one pass in `stats`; a sequence
    that cannot be evicted goes to `failed` (seq id -> error) when given, else raises."""
    evicted = 0
    started = time.perf_counter()
    for seq_id in seq_ids:
        try:
            evicted += evict_one(seq_id)
        except CacheFullError as exc:
            if failed is None:
                raise
            failed[seq_id] = exc
    if evicted:
        stats.eviction_passes += 1
        stats.evicted_tokens += evicted
        stats.eviction_seconds += time.perf_counter() - started
    return evicted


def next_stream_rows(seq: SequenceState, info: TokenInfo) -> torch.Tensor:
    """Metadata rows [len(info), META_COLUMNS] of the sequence's next stream tokens (stream
    index, frame group, modality, time, source, protected); advances its stream counters."""
    n = len(info)
    if n == 1:  # a decode step's token: the same rows without a dozen small tensor ops
        return _next_stream_row(seq, info)
    is_frame = info.modality == int(Modality.FRAME)
    prev_frame = torch.cat([
        torch.tensor([seq.last_frame_source is not None]), is_frame[:-1]
    ])
    prev_source = torch.cat([
        torch.tensor([-1 if seq.last_frame_source is None else seq.last_frame_source]),
        info.source[:-1],
    ])
    continues = is_frame & prev_frame & (info.source == prev_source)
    group = seq.next_group + torch.cumsum((~continues).long(), 0) - 1
    rows = torch.empty(n, META_COLUMNS, dtype=torch.float64)
    rows[:, 0] = torch.arange(seq.stream_pos, seq.stream_pos + n, dtype=torch.float64)
    rows[:, 1] = group.double()
    rows[:, 2] = info.modality.double()
    rows[:, 3] = info.timestamp.double()
    rows[:, 4] = info.source.double()
    rows[:, 5] = info.protected.double()
    seq.stream_pos += n
    seq.next_group = int(group[-1]) + 1 if n else seq.next_group
    seq.last_frame_source = int(info.source[-1]) if n and bool(is_frame[-1]) else None
    return rows


def _next_stream_row(seq: SequenceState, info: TokenInfo) -> torch.Tensor:
    """`next_stream_rows` of one token."""
    modality, source = int(info.modality[0]), int(info.source[0])
    is_frame = modality == int(Modality.FRAME)
    continues = is_frame and seq.last_frame_source is not None and \
        source == seq.last_frame_source
    group = seq.next_group - 1 if continues else seq.next_group
    row = torch.tensor([[seq.stream_pos, group, modality, float(info.timestamp[0]), source,
                         float(bool(info.protected[0]))]], dtype=torch.float64)
    seq.stream_pos += 1
    seq.next_group = group + 1
    seq.last_frame_source = source if is_frame else None
    return row


def forget_evicted_frames(seq: SequenceState) -> None:
    """Drop the CLIP embeddings of frames no layer holds any more."""
    if not seq.frame_embeddings:
        return
    held: set[int] = set()
    for rec in seq.layers:
        frames = rec.column(MODALITY) == int(Modality.FRAME)
        held.update(rec.column(SOURCE)[frames].long().tolist())
    for source in [s for s in seq.frame_embeddings if s not in held]:
        del seq.frame_embeddings[source]


def retained_media(rec: LayerTokens) -> list[dict]:
    """What a layer's records hold of frames, notes and audio: one entry per source/time."""
    meta = rec.meta[: rec.length]
    media = meta[meta[:, MODALITY] != int(Modality.TEXT)]
    if media.numel() == 0:
        return []
    keys, counts = torch.unique(media[:, [MODALITY, SOURCE, TIME]], dim=0, return_counts=True)
    names = {int(m): m.name.lower() for m in Modality}
    return [{"modality": names[int(k[0])], "source": int(k[1]), "t": float(k[2]),
             "tokens": int(c)} for k, c in zip(keys, counts)]


def limit_layer_protection(rec: LayerTokens, max_protected: int, pinned: int) -> int:
    """Unprotect the layer's oldest protected tokens beyond `max_protected`, never the first
    `pinned` stream tokens; returns how many were unprotected."""
    protected = (rec.column(PROTECTED) > 0) & (rec.column(STREAM) >= pinned)
    return unprotect_oldest(rec, int(protected.sum()) - max_protected, pinned)


def demote_protected(rec: LayerTokens, budget: int, pinned: int, sinks: int) -> int:
    """Unprotect the oldest protected tokens after the pinned prefix until protected tokens
    and attention sinks fit `budget`; returns how many were unprotected."""
    mandatory = (rec.column(PROTECTED) > 0) | (rec.column(STREAM) < sinks)
    return unprotect_oldest(rec, int(mandatory.sum()) - budget, max(pinned, sinks))


def unprotect_oldest(rec: LayerTokens, count: int, first: int) -> int:
    """Unprotect up to `count` of the oldest protected tokens at stream index >= `first`."""
    if count <= 0:
        return 0
    candidates = (rec.column(PROTECTED) > 0) & (rec.column(STREAM) >= first)
    chosen = torch.nonzero(candidates).flatten()[:count]
    rec.meta[chosen, PROTECTED] = 0.0
    return chosen.numel()
