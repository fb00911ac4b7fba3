"""Per-step attention metadata for every layer, built once in `prepare` and moved to the
device in a few copies, so `attend` does no host work or host-to-device copy per layer.

Each sequence has its own page table and length in every layer (per-layer budgets and
eviction), so tables, lengths and query positions carry a layer dimension.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from streamgrok.cache.tokens import LayerTokens
from streamgrok.model.batch import PagedDecodeView
from streamgrok_kernels.paged_kv import PagedKV


@dataclass
class SpanGroup:
    """The batch's decode tokens, or its prefill chunks: everything one attention call needs.

    Host lists are indexed [layer][sequence]; device tensors lead with the layer."""

    seq_ids: list[int]
    decode: bool
    counts: list[int]
    totals: list[list[int]]  # tokens cached after this step, per layer and sequence
    widths: list[int]  # pages the longest sequence needs, per layer
    rows: torch.Tensor  # [T] rows of q/out (int64)
    positions: torch.Tensor  # [L, T] cache position of each query (int64)
    tables: torch.Tensor  # [L, B, P] page tables (int32, unused entries 0)
    lengths: torch.Tensor  # [L, B] totals (int32)
    past: torch.Tensor  # [L, B] tokens cached before this step (int32)
    cu_q: torch.Tensor  # [B + 1] query row offsets within the group (int32)

    @property
    def max_q(self) -> int:
        return max(self.counts)


@dataclass
class AttentionPlan:
    """Where this step's new K/V go in every layer, and the span groups to attend."""

    new_slots: torch.Tensor  # [L, tokens] (int64), in batch row order
    groups: list[SpanGroup]
    spans: list[tuple[int, int, int]]  # what it was built from, to rebuild it
    starts: dict[int, list[int]]


def build_attention_plan(
    spans: list[tuple[int, int, int]],
    records: dict[int, list[LayerTokens]],
    starts: dict[int, list[int]],
    page_size: int,
    device: torch.device,
) -> AttentionPlan:
    """`spans` are (seq_id, first row, tokens); `records[seq]` its layers (pages already
    allocated for the new tokens); `starts[seq][layer]` its length before this step."""
    layers = len(next(iter(records.values())))
    if all(n == 1 for _, _, n in spans):  # decode: each new slot from its page, in Python
        new_slots = torch.tensor([
            [_slot(records[s][layer].pages, starts[s][layer], page_size) for s, _, _ in spans]
            for layer in range(layers)], dtype=torch.int64)
    else:
        new_slots = torch.stack([
            torch.cat([records[s][layer].slots(starts[s][layer], starts[s][layer] + n)
                       for s, _, n in spans])
            for layer in range(layers)
        ])
    groups = []
    for decode in (True, False):
        chosen = [span for span in spans if (span[2] == 1) == decode]
        if chosen:
            groups.append(_group(chosen, records, starts, page_size, layers, decode))
    return AttentionPlan(new_slots.to(device), [_to(g, device) for g in groups], spans, starts)


def _slot(pages: list[int], position: int, page_size: int) -> int:
    """The slot of cache position `position` in a layer with `pages`."""
    return pages[position // page_size] * page_size + position % page_size


def _group(spans, records, starts, page_size, layers, decode) -> SpanGroup:
    seq_ids = [s for s, _, _ in spans]
    counts = [n for _, _, n in spans]
    past = np.array([[starts[s][layer] for s in seq_ids] for layer in range(layers)],
                    dtype=np.int64)
    totals = past + np.array(counts)[None, :]
    widths = [-(-int(row.max()) // page_size) for row in totals]
    tables = np.zeros((layers, len(spans), max(widths)), dtype=np.int32)
    for layer in range(layers):
        for i, s in enumerate(seq_ids):
            used = -(-int(totals[layer, i]) // page_size)
            tables[layer, i, :used] = records[s][layer].pages[:used]
    offsets = np.concatenate([np.arange(n) for n in counts])
    first = np.repeat(past, counts, axis=1)
    rows = np.concatenate([np.arange(row, row + n) for _, row, n in spans])
    return SpanGroup(
        seq_ids=seq_ids, decode=decode, counts=counts, totals=totals.tolist(), widths=widths,
        rows=torch.from_numpy(rows),
        positions=torch.from_numpy(first + offsets[None, :]),
        tables=torch.from_numpy(tables),
        lengths=torch.from_numpy(totals.astype(np.int32)),
        past=torch.from_numpy(past.astype(np.int32)),
        cu_q=torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)),
    )


def _to(group: SpanGroup, device: torch.device) -> SpanGroup:
    if device.type == "cpu":
        return group
    for name in ("rows", "positions", "tables", "lengths", "past", "cu_q"):
        setattr(group, name, getattr(group, name).to(device, non_blocking=True))
    return group


def refresh_layer(plan: AttentionPlan, layer: int, records: dict[int, list[LayerTokens]],
                  page_size: int) -> None:
    """Bring one layer of `plan` up to date after that layer's tokens moved (recall rewrote
    its pages and `plan.starts[seq][layer]`), in place: the other layers are left as built."""
    spans = plan.spans
    device = plan.new_slots.device
    plan.new_slots[layer] = torch.cat([
        records[s][layer].slots(plan.starts[s][layer], plan.starts[s][layer] + n)
        for s, _, n in spans]).to(device)
    for group in plan.groups:
        past = [plan.starts[s][layer] for s in group.seq_ids]
        totals = [p + n for p, n in zip(past, group.counts)]
        group.totals[layer] = totals
        group.widths[layer] = -(-max(totals) // page_size)
        if group.widths[layer] > group.tables.shape[2]:
            grown = group.tables.new_zeros(*group.tables.shape[:2], group.widths[layer])
            grown[:, :, : group.tables.shape[2]] = group.tables
            group.tables = grown
        table = torch.zeros(len(group.seq_ids), group.tables.shape[2], dtype=torch.int32)
        for i, (s, total) in enumerate(zip(group.seq_ids, totals)):
            used = -(-total // page_size)
            table[i, :used] = torch.tensor(records[s][layer].pages[:used], dtype=torch.int32)
        group.tables[layer] = table.to(device)
        group.lengths[layer] = torch.tensor(totals, dtype=torch.int32).to(device)
        group.past[layer] = torch.tensor(past, dtype=torch.int32).to(device)
        group.positions[layer] = torch.cat([
            torch.arange(p, p + n) for p, n in zip(past, group.counts)]).to(device)


def decode_view(plan: AttentionPlan, kv: PagedKV,
                rotary_tables: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                page_size: int, wants_mass: bool) -> PagedDecodeView | None:
    """The view of `plan` when it is one group of decode rows in batch order, else None;
    `rotary_tables(length)` gives cos/sin covering `length` positions."""
    if len(plan.groups) != 1 or not plan.groups[0].decode:
        return None
    group = plan.groups[0]
    cos, sin = rotary_tables(group.tables.shape[2] * page_size)
    return PagedDecodeView(kv, plan.new_slots, group.tables, group.lengths, cos, sin, page_size,
                           wants_mass)
