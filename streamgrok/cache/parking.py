"""Parked sequences: a detached session's KV moved out of the page pool into host memory.

A parked sequence keeps its token records (metadata, scores, stream counters) where they are
and holds no pages; its stored K/V entries (as the pool stores them: float, bfloat16, or int8
with scales) wait in host tensors until `unpark` copies them into freshly allocated pages.
Nothing is requantized, so a sequence comes back bit for bit as it left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from streamgrok.cache.pool import PagePool
from streamgrok.cache.tokens import LayerTokens


@dataclass
class ParkedKV:
    """One sequence's stored entries, per layer, in token order (host memory)."""

    layers: list[tuple[torch.Tensor, ...]]

    @property
    def nbytes(self) -> int:
        """Host bytes the parked entries hold."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)


def park_layers(pool: PagePool, layers: list[LayerTokens]) -> ParkedKV:
    """Copy every layer's live entries to host memory and release its pages."""
    stored = []
    for rec in layers:
        entries = pool.gather_raw(rec.slots().to(pool.paged_kv().k.device))
        stored.append(tuple(t.to("cpu") for t in entries))  # gathered: already a copy
    released = []
    for rec in layers:  # only after every copy: a failure above leaves the pages in place
        pool.release(rec.pages)
        released.extend(rec.pages)
        rec.set_pages([])
    pool.discard(released)  # the host copy replaces them: their memory goes back to the OS
    return ParkedKV(stored)


def pages_to_unpark(layers: list[LayerTokens], page_size: int) -> int:
    """Pages a parked sequence needs to come back."""
    return sum(math.ceil(rec.length / page_size) for rec in layers)


def unpark_layers(pool: PagePool, layers: list[LayerTokens], parked: ParkedKV) -> None:
    """Allocate pages for every layer (all or none: CacheFullError) and copy its entries
    back, in token order."""
    counts = [math.ceil(rec.length / pool.page_size) for rec in layers]
    for rec, pages, entries in zip(layers, pool.allocate_each(counts), parked.layers):
        rec.set_pages(pages)
        device = pool.paged_kv().k.device
        pool.scatter_raw(rec.slots().to(device), tuple(t.to(device) for t in entries))


@dataclass
class LayerSnapshot:
    """One layer of a parked sequence: its stored entries and token records."""

    entries: tuple[torch.Tensor, ...]
    meta: torch.Tensor  # [length, META_COLUMNS] float64
    score: torch.Tensor  # [length] float32


@dataclass
class SequenceSnapshot:
    """Everything a parked sequence is, to save it and restore it in another process."""

    layers: list[LayerSnapshot]
    stream_pos: int
    next_group: int
    last_frame_source: int | None
    pinned: int
    budget_bonus: list[int]
    frame_embeddings: dict[int, torch.Tensor]
    context_target: int | None = None
    context_slack: int | None = None


def snapshot_layers(layers: list[LayerTokens], parked: ParkedKV) -> list[LayerSnapshot]:
    """The parked entries and a host copy of each layer's records."""
    return [LayerSnapshot(entries, rec.meta[: rec.length].clone(),
                          rec.score[: rec.length].to("cpu", copy=True))
            for rec, entries in zip(layers, parked.layers)]


def check_entries(pool: PagePool, snapshot: SequenceSnapshot, num_layers: int) -> None:
    """Raise ValueError unless the snapshot's entries fit this pool (layers, shapes, dtypes)."""
    if len(snapshot.layers) != num_layers:
        raise ValueError(f"a snapshot of {len(snapshot.layers)} layers for a model of "
                         f"{num_layers}")
    stored = pool.paged_kv().tensors()
    for layer in snapshot.layers:
        if len(layer.entries) != len(stored):
            raise ValueError("the snapshot's KV format differs from this cache's")
        for entry, tensor in zip(layer.entries, stored):
            if entry.dtype != tensor.dtype or tuple(entry.shape[1:]) != tuple(tensor.shape[1:]):
                raise ValueError(f"the snapshot's KV entries ({entry.dtype}, "
                                 f"{tuple(entry.shape[1:])}) differ from this cache's "
                                 f"({tensor.dtype}, {tuple(tensor.shape[1:])})")
            if entry.shape[0] != layer.meta.shape[0]:
                raise ValueError("the snapshot's records and entries disagree")
