"""The model's side of the paged cache: a forward pass's new K/V and its attention."""

from __future__ import annotations

import torch

from streamgrok.cache.attention_plan import (
    AttentionPlan,
    SpanGroup,
    build_attention_plan,
    decode_view,
)
from streamgrok.cache.core import CacheCore
from streamgrok.cache.tiers.recaller import Recaller
from streamgrok.model.batch import BatchMetadata, PagedDecodeView
from streamgrok.stream_tokens import TokenInfo


class PagedAttention:
    """The `AttentionBackend` of a `PagedKVCache`: stores each layer's new K/V in the pages
    the step reserved and attends over each sequence's page table (decode rows in one paged
    decode call, prefill chunks in one paged prefill call, through the cache's kernels),
    feeding the attention mass eviction ranks by and the recall armed for a pass.

    Runs on the engine's thread, inside the forward passes of the steps the cache's manager
    reserves; every method runs in inference mode.
    """

    def __init__(self, core: CacheCore, recaller: Recaller) -> None:
        self.core = core
        self.recaller = recaller

    @torch.inference_mode()
    def prepare(self, batch: BatchMetadata) -> None:
        """Record metadata for the batch's new tokens, in pages reserved for them by
        the cache's `reserve` (or, without a reservation, allocated now: all or nothing)."""
        core = self.core
        spans = batch.spans()
        if len({s for s, _, _ in spans}) != len(spans):
            raise ValueError("a batch may hold each sequence once")
        counts = {s: n for s, _, n in spans}
        reservation = core.step
        if reservation is None:
            core.allocate(counts)
        else:
            unreserved = [s for s, n in counts.items() if reservation.counts.get(s, 0) < n]
            if unreserved:
                raise ValueError(f"sequences {unreserved} were not reserved for this step")
        info = batch.token_info or TokenInfo.text(batch.num_tokens)
        starts: dict[int, list[int]] = {}
        for seq_id, row, n in spans:
            seq = core.sequences[seq_id]
            starts[seq_id] = [layer.length for layer in seq.layers]
            core.append_records(seq, info.slice(row, row + n))
        core.stats.appended_tokens += batch.num_tokens
        if core.config.recall_in_stream:  # the config has a host tier then
            for seq_id, _, n in spans:
                if n >= 2:
                    self.recaller.arm_stream(seq_id)
        records = {s: core.sequences[s].layers for s, _, _ in spans}
        batch.backend_state = build_attention_plan(spans, records, starts,
                                                   core.config.page_size, core.device)

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
        call, through the cache's kernels (Triton on CUDA, the PyTorch reference elsewhere)."""
        core = self.core
        plan: AttentionPlan = batch.backend_state
        if self.recaller.active:
            plan = batch.backend_state = self.recaller.before_attention(layer, q, k, plan)
        elif self.recaller.rehearsal_due:
            self.recaller.rehearse(layer, q, plan)
        kv = core.pool.paged_kv()
        core.kernels.kv_append(kv, plan.new_slots[layer], k, v)
        out = torch.empty_like(q)
        for group in plan.groups:
            self._attend_group(layer, kv, q, out, group)
        return out

    def _attend_group(self, layer: int, kv, q, out, group: SpanGroup) -> None:
        core = self.core
        width = group.widths[layer]
        tables = group.tables[layer, :, :width]
        cos, sin = core.rotary.tables(width * core.config.page_size)
        q_rot = core.kernels.rotate(q[group.rows], group.positions[layer], cos, sin)
        accumulates = core.scorer.accumulates_attention
        if group.decode:
            result, mass = core.kernels.decode_attention(
                q_rot, kv, tables, group.lengths[layer], cos, sin, accumulates)
            observed = [1] * len(group.counts)
        else:
            window = (core.scorer.observation_window or group.max_q) if accumulates else None
            result, mass = core.kernels.prefill_attention(
                q_rot, kv, tables, group.cu_q, group.past[layer], cos, sin, group.max_q, window)
            observed = [min(n, window or n) for n in group.counts]
        out[group.rows] = result.to(out.dtype)
        if self.recaller.active:
            self.recaller.record_queries(layer, q, group)
        if mass is not None:  # scores stay on the device: no sync per layer
            for i, (seq_id, total) in enumerate(zip(group.seq_ids, group.totals[layer])):
                core.observe_mass(core.sequences[seq_id].layers[layer], mass[i, :total],
                                  observed[i])

    def paged_decode_view(self, batch: BatchMetadata) -> PagedDecodeView | None:
        """The prepared decode batch as one native step takes it (every layer in one call),
        or None where its layers must run one by one: a prefill chunk in the batch, a device
        other than the CPU, or recall capturing queries or rehearsing (they act between
        layers)."""
        core = self.core
        plan: AttentionPlan = batch.backend_state
        if (core.device.type != "cpu" or self.recaller.active or self.recaller.rehearsal_due
                or plan is None):
            return None
        return decode_view(plan, core.pool.paged_kv(), core.rotary.tables,
                           core.config.page_size, core.scorer.accumulates_attention)

    def observe_step_mass(self, batch: BatchMetadata, mass: torch.Tensor) -> None:
        """The attention mass [L, B, keys] a native decode step of `batch` (one query per
        row) gave each layer's tokens, as `attend` observes it layer by layer."""
        core = self.core
        group = batch.backend_state.groups[0]
        for layer, totals in enumerate(group.totals):
            for row, (seq_id, total) in enumerate(zip(group.seq_ids, totals)):
                core.observe_mass(core.sequences[seq_id].layers[layer],
                                  mass[layer, row, :total], 1)
