"""The paged streaming KV cache's manager: sequences, steps, eviction, prefixes, parking."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from streamgrok.cache.config import CPU_DEFAULT_GIB, KV_DTYPES, CacheConfig
from streamgrok.cache.core import CacheCore, CacheStats, Reservation
from streamgrok.cache.eviction import compact_layer, evict_each
from streamgrok.cache.page_ledger import PageLedger
from streamgrok.cache.paged_attention import PagedAttention
from streamgrok.cache.parking import (
    ParkedKV,
    SequenceSnapshot,
    check_entries,
    pages_to_unpark,
    park_layers,
    snapshot_layers,
    unpark_layers,
)
from streamgrok.cache.policies import LayerView, Scorer, make_scorer, select_keep
from streamgrok.cache.pool import PagePool
from streamgrok.cache.prefix import PrefixIndex
from streamgrok.cache.records import (
    SequenceState,
    demote_protected,
    forget_evicted_frames,
    limit_layer_protection,
    retained_media,
)
from streamgrok.cache.tiers.host_tier import HostTier
from streamgrok.cache.tiers.recall import QueryCapture, RecallResult
from streamgrok.cache.tiers.recaller import Recaller
from streamgrok.cache.tokens import STREAM, LayerTokens
from streamgrok.errors import CacheFullError
from streamgrok.model.config import ModelConfig
from streamgrok.model.rotary import Rotary
from streamgrok.stream_tokens import TokenInfo
from streamgrok_kernels.ops import KernelOps


class PagedKVCache:
    """Paged K/V for many sequences, each layer with its own page table and budget: the
    scheduler's side (sequences, fork, a step's reserve/commit/rollback, eviction, prefix
    sharing, parking, recall), with the model's side in `attention` (a `PagedAttention` over
    the same pages).

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
        config = (config or CacheConfig()).for_model(compute_dtype)
        device = torch.device(device)
        page_bytes = config.page_bytes(model_config)
        if num_pages is None:
            num_pages = int(memory_budget_bytes(config, device) // page_bytes)
        pool = PagePool(num_pages, config.page_size, model_config.num_kv_heads,
                        model_config.head_dim, config.torch_kv_dtype, compute_dtype, device)
        self.core = CacheCore(
            model_config, config, device, kernels or KernelOps(), pool,
            Rotary(model_config, device), make_scorer(config),
            config.layer_budget_list(model_config.num_layers),
            host_tier(config, model_config, compute_dtype, device),
            stats=CacheStats(evicted_by_layer=[0] * model_config.num_layers))
        self.page_bytes = page_bytes
        self.prefix = PrefixIndex(config.page_size)
        self.parked: dict[int, ParkedKV] = {}  # sequences whose KV waits in host memory
        self.recaller = Recaller(self.core)
        self.attention = PagedAttention(self.core, self.recaller)

    # the core's parts, read by the engine, the server and the tests

    @property
    def model_config(self) -> ModelConfig:
        return self.core.model_config

    @property
    def config(self) -> CacheConfig:
        return self.core.config

    @property
    def device(self) -> torch.device:
        return self.core.device

    @property
    def kernels(self) -> KernelOps:
        return self.core.kernels

    @kernels.setter
    def kernels(self, kernels: KernelOps) -> None:
        self.core.kernels = kernels

    @property
    def pool(self) -> PagePool:
        return self.core.pool

    @property
    def rotary(self) -> Rotary:
        return self.core.rotary

    @property
    def scorer(self) -> Scorer:
        return self.core.scorer

    @property
    def budgets(self) -> list[int | None]:
        return self.core.budgets

    @property
    def tier(self) -> HostTier | None:
        return self.core.tier

    @property
    def sequences(self) -> dict[int, SequenceState]:
        return self.core.sequences

    @property
    def stats(self) -> CacheStats:
        return self.core.stats

    def memory_budget_bytes(self) -> float:
        """Bytes the page pool may use (see `memory_budget_bytes`)."""
        return memory_budget_bytes(self.config, self.device)

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
        self.core.append_records(seq, info.slice(0, reused))
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
        if self.core.step is not None and seq_id in self.core.step.counts:
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
        if self.core.step is not None:
            raise RuntimeError("a reservation is already open: commit or roll it back first")
        self.core.check_known(counts)
        saved = {}
        for seq_id in counts:
            seq = self.sequences[seq_id]
            saved[seq_id] = ([(layer.length, len(layer.pages)) for layer in seq.layers],
                             seq.stream_pos, seq.next_group, seq.last_frame_source)
        self.core.allocate(counts)
        self.core.step = Reservation(dict(counts), saved)

    @torch.inference_mode()
    def commit(self) -> None:
        """The step succeeded: keep its tokens and apply the attention mass it observed."""
        reservation, self.core.step = self.core.step, None
        self.recaller.end_step(committed=True)
        if reservation is None:
            return
        for rec, mass, queries in reservation.masses:
            self.core.accumulate(rec, mass, queries)

    @torch.inference_mode()
    def rollback(self) -> None:
        """The step failed: drop its tokens and pages; the cache is as before `reserve`."""
        reservation, self.core.step = self.core.step, None
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
            compact_layer(self.pool, self.kernels, rec, keep, self.device)
            self.stats.evicted_by_layer[index] += removed
            evicted += removed
        if evicted:
            forget_evicted_frames(seq)
        return evicted

    def index_frame(self, seq_id: int, source: int, embedding: torch.Tensor) -> None:
        """Record a cached frame's CLIP embedding (its index) for frame-aware eviction."""
        if (seq := self.sequences.get(seq_id)) is not None:
            seq.index_frame(source, embedding)

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
        ledger = self.core.ledger()
        for seq_id, tokens in counts.items():
            ledger.count(seq_id, tokens)
        return ledger.needed

    def page_ledger(self) -> PageLedger:
        """A ledger the planner takes a step's spans through, against the pages free now."""
        return self.core.ledger()



def memory_budget_bytes(config: CacheConfig, device: torch.device) -> float:
    """Bytes a page pool may use: a fixed size, or by default a share of free GPU memory
    (on CUDA) or `CPU_DEFAULT_GIB` (on CPU)."""
    if config.memory_gib is not None:
        return config.memory_gib * 2**30
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free * config.gpu_memory_fraction
    return CPU_DEFAULT_GIB * 2**30


def host_tier(config: CacheConfig, model_config: ModelConfig, compute_dtype: torch.dtype,
              device: torch.device) -> HostTier | None:
    """The host tier evicted KV goes to, when the config recalls (else None)."""
    if not config.recalls:
        return None
    store = torch.int8 if config.host_tier_dtype == "int8" else KV_DTYPES[config.kv_dtype]
    disk = config.disk_tier_gib
    return HostTier(config.host_tier_gib * 2**30, config.page_size, model_config.num_kv_heads,
                    model_config.head_dim, store, compute_dtype, device,
                    disk_bytes=None if disk is None else disk * 2**30,
                    disk_folder=None if config.disk_tier_dir is None
                    else Path(config.disk_tier_dir))
