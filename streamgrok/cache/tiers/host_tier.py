"""The host tier: where evicted KV pages go instead of being lost, within a byte budget.

Evicted tokens of one (sequence, layer) are packed, in stream order, into host pages of
`page_size` slots (CPU memory, pinned when the working set is on CUDA), stored as the page pool
stores them or compressed to int8 with a scale per token and head. Each host page keeps a
small summary on the working-set device for recall to score without touching the page: the
mean of its (unrotated) keys per KV head and the largest distance of a key from that mean
(a ball that holds every key of the page, whatever rotation it later gets), plus the token
records (stream index, modality, time, source) it needs to be put back in stream order.

When the budget is full, the sequence (and within it the layer) holding the most host pages
loses its oldest pages: to the disk tier (memory-mapped files) when there is one, which in
turn drops its largest holder's oldest pages for good past its own budget; tokens that leave
for good are counted in `stats.dropped_tokens`.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from streamgrok.cache.tiers.page_store import PageStore, page_bytes
from streamgrok.cache.tokens import META_COLUMNS, PROTECTED, STREAM


@dataclass
class TierLayer:
    """The host pages of one (sequence, layer), in the order they arrived, with summaries."""

    pages: list[int] = field(default_factory=list)  # host page ids
    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    meta: torch.Tensor = field(  # [P, page_size, META_COLUMNS], rows past counts[p] unused
        default_factory=lambda: torch.zeros(0, 0, META_COLUMNS, dtype=torch.float64))
    centers: torch.Tensor | None = None  # [P, kv_heads, head_dim] float32, mean unrotated key
    radii: torch.Tensor | None = None  # [P, kv_heads] float32, max |key - center|
    # [P, kv_heads, head_dim / 2] float32: per rotary plane (dims j, j + D/2), the keys' mean
    # squared distance from the center in that plane, halved (kept under any rotation)
    plane_vars: torch.Tensor | None = None

    @property
    def num_pages(self) -> int:
        return len(self.pages)

    @property
    def tokens(self) -> int:
        return int(self.counts.sum())

    def first_stream(self) -> torch.Tensor:
        """Stream index of each page's first token (float64, host)."""
        return self.meta[:, 0, STREAM]

    def keep(self, index: torch.Tensor) -> None:
        """Keep only the pages at `index` (ascending), in that order."""
        self.pages = [self.pages[i] for i in index.tolist()]
        self.counts = self.counts[index]
        self.meta = self.meta[index]
        self.centers = self.centers[index.to(self.centers.device)]
        self.radii = self.radii[index.to(self.radii.device)]
        self.plane_vars = self.plane_vars[index.to(self.plane_vars.device)]


@dataclass
class TierStats:
    """What the host tier has done."""

    stored_tokens: int = 0  # evicted tokens written to the tier
    dropped_tokens: int = 0  # tokens that left the tiers for good (budgets)
    spilled_tokens: int = 0  # tokens moved from host memory to the disk tier
    recalls: int = 0
    recalled_tokens: int = 0
    recall_bytes: int = 0  # bytes read from the tier by recalls
    guard_recalls: int = 0  # recalls the hit-rate guard extended
    recall_seconds: float = 0.0
    stream_recalls: int = 0  # streamed chunks that recalled (`recall_in_stream`)
    restored_tokens: int = 0  # tokens those moved back into their sequence's working set


class HostTier:
    """Host pages for evicted KV, and optionally disk pages past them; owned by one
    PagedKVCache (on its thread). Page ids below `host.capacity_pages` are in memory, the
    rest on disk."""

    def __init__(
        self,
        capacity_bytes: float,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        store_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        device: torch.device,
        disk_bytes: float | None = None,
        disk_folder: Path | None = None,
    ) -> None:
        self.page_size = page_size
        self.compute_dtype = compute_dtype
        self.device = device  # where summaries live and recalled K/V go
        self.pinned = device.type == "cuda"
        self.page_bytes = page_bytes(page_size, kv_heads, head_dim, store_dtype)
        shape = (page_size, kv_heads, head_dim, store_dtype)
        self.host = PageStore(self._pages(capacity_bytes, "host tier"), *shape,
                              pinned=self.pinned)
        self.disk = None
        if disk_bytes is not None:
            self.disk = PageStore(self._pages(disk_bytes, "disk tier"), *shape,
                                  folder=disk_folder or Path(tempfile.gettempdir()))
        self.sequences: dict[int, list[TierLayer]] = {}
        self.stats = TierStats()
        self.tokens = 0  # tokens held in every tier

    def _pages(self, budget: float, name: str) -> int:
        pages = int(budget // self.page_bytes)
        if pages < 1:
            raise ValueError(f"the {name} budget ({budget / 2**20:.2f} MiB) holds no page of "
                             f"{self.page_bytes} bytes; raise it")
        return pages

    # -- sequences -------------------------------------------------------------------------

    def add_sequence(self, seq_id: int, num_layers: int) -> None:
        self.sequences[seq_id] = [TierLayer() for _ in range(num_layers)]

    def remove_sequence(self, seq_id: int) -> None:
        """Free every host and disk page of a sequence."""
        for layer in self.sequences.pop(seq_id, []):
            self.tokens -= layer.tokens
            self._release(layer.pages)

    def layer(self, seq_id: int, layer: int) -> TierLayer | None:
        layers = self.sequences.get(seq_id)
        return None if layers is None else layers[layer]

    @property
    def capacity_pages(self) -> int:
        return self.host.capacity_pages

    @property
    def used_pages(self) -> int:
        return self.host.used_pages + (self.disk.used_pages if self.disk else 0)

    @property
    def used_bytes(self) -> int:
        return self.host.used_pages * self.page_bytes

    @property
    def disk_bytes(self) -> int:
        return self.disk.used_pages * self.page_bytes if self.disk else 0

    # -- writing ---------------------------------------------------------------------------

    @torch.inference_mode()
    def store(self, seq_id: int, layer: int, k: torch.Tensor, v: torch.Tensor,
              meta: torch.Tensor) -> None:
        """Keep evicted tokens of (seq, layer): K/V [n, kv_heads, head_dim] unrotated, in the
        compute dtype, and their records [n, META_COLUMNS], in stream order."""
        n = k.shape[0]
        if n == 0 or seq_id not in self.sequences:
            return
        count = math.ceil(n / self.page_size)
        if count > self.host.capacity_pages:  # more than the whole tier: keep the newest
            skip = n - self.host.capacity_pages * self.page_size
            k, v, meta, n = k[skip:], v[skip:], meta[skip:], n - skip
            self.stats.dropped_tokens += skip
            count = self.host.capacity_pages
        self._make_room(count)
        pages = self.host.allocate(count, (seq_id, layer))
        self.host.write(self.host.slots(pages)[:n], k, v)
        padded = torch.zeros(count * self.page_size, META_COLUMNS, dtype=torch.float64)
        padded[:n] = meta
        padded[:n, PROTECTED] = 0.0  # what comes back competes like any other token
        counts = torch.full((count,), self.page_size, dtype=torch.int64)
        counts[-1] = n - (count - 1) * self.page_size
        centers, radii, plane_vars = _summaries(k.float(), counts.to(k.device), self.page_size)
        rec = self.sequences[seq_id][layer]
        rec.pages += pages
        rec.counts = torch.cat([rec.counts, counts])
        rec.meta = torch.cat([rec.meta.reshape(-1, self.page_size, META_COLUMNS),
                              padded.view(count, self.page_size, META_COLUMNS)])
        centers, radii = centers.to(self.device), radii.to(self.device)
        plane_vars = plane_vars.to(self.device)
        rec.centers = centers if rec.centers is None else torch.cat([rec.centers, centers])
        rec.radii = radii if rec.radii is None else torch.cat([rec.radii, radii])
        rec.plane_vars = plane_vars if rec.plane_vars is None else \
            torch.cat([rec.plane_vars, plane_vars])
        self.stats.stored_tokens += n
        self.tokens += n

    def read(self, rec: TierLayer, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
        """K, V (compute dtype, on the device) and records of the tokens of pages `index` of
        `rec`, in stream order (pages evicted at different times may interleave)."""
        counts = rec.counts[index]
        pages = torch.tensor([rec.pages[i] for i in index.tolist()], dtype=torch.int64)
        valid = (torch.arange(self.page_size)[None, :] < counts[:, None]).flatten()
        meta = rec.meta[index].reshape(-1, rec.meta.shape[-1])
        slots = (pages[:, None] * self.page_size + torch.arange(self.page_size)).flatten()
        if not bool(valid.all()):
            meta, slots = meta[valid], slots[valid]
        order = torch.argsort(meta[:, STREAM], stable=True)
        meta, slots = meta[order], slots[order]
        on_disk = slots >= self.host.capacity_pages * self.page_size
        if not bool(on_disk.any()):
            k, v = self.host.read(slots, self.compute_dtype)
        else:
            k = torch.empty(slots.numel(), self.host.kv_heads, self.host.head_dim,
                            dtype=self.compute_dtype)
            v = torch.empty_like(k)
            base = self.host.capacity_pages * self.page_size
            for store, chosen, offset in ((self.host, ~on_disk, 0), (self.disk, on_disk, base)):
                if bool(chosen.any()):
                    k[chosen], v[chosen] = store.read(slots[chosen] - offset, self.compute_dtype)
        self.stats.recall_bytes += slots.numel() * self.page_bytes // self.page_size
        return (k.to(self.device, non_blocking=self.pinned),
                v.to(self.device, non_blocking=self.pinned), meta)

    def restore(self, rec: TierLayer, index: torch.Tensor) -> None:
        """Pages `index` of `rec` went back into their sequence's working set (a streamed
        chunk recalled them): they leave the tier, not counted as dropped; what the working
        set evicts again comes back through `store`."""
        self.stats.restored_tokens += self._remove(rec, index)

    # -- pages -----------------------------------------------------------------------------

    def _make_room(self, count: int) -> None:
        """Free `count` host pages: the oldest pages of the largest holders move to the disk
        tier, or, without one, leave for good."""
        while (needed := count - self.host.free_pages) > 0:
            seq_id, layer = self.host.largest_holder()
            rec = self.sequences[seq_id][layer]
            take = min(needed, self.host.held[(seq_id, layer)])
            if self.disk is None:
                self._drop(rec, _oldest(rec, self._in_host(rec), take))
                continue
            self._make_disk_room(take)  # first: it may drop pages of this very layer
            oldest = _oldest(rec, self._in_host(rec), take)
            src = [rec.pages[i] for i in oldest.tolist()]
            dst = self.disk.allocate(len(src), (seq_id, layer))
            self.host.copy_to(self.disk, src, dst)
            self.host.release(src)
            for i, page in zip(oldest.tolist(), dst):
                rec.pages[i] = page + self.host.capacity_pages
            self.stats.spilled_tokens += int(rec.counts[oldest].sum())

    def _make_disk_room(self, count: int) -> None:
        while (needed := count - self.disk.free_pages) > 0:
            seq_id, layer = self.disk.largest_holder()
            rec = self.sequences[seq_id][layer]
            self._drop(rec, _oldest(rec, ~self._in_host(rec), needed))

    def _in_host(self, rec: TierLayer) -> torch.Tensor:
        return torch.tensor(rec.pages, dtype=torch.int64) < self.host.capacity_pages

    def _drop(self, rec: TierLayer, index: torch.Tensor) -> None:
        """Pages `index` of `rec` leave the tiers for good (counted)."""
        self.stats.dropped_tokens += self._remove(rec, index)

    def _remove(self, rec: TierLayer, index: torch.Tensor) -> int:
        """Free pages `index` of `rec` and forget them; returns their tokens."""
        tokens = int(rec.counts[index].sum())
        self.tokens -= tokens
        self._release([rec.pages[i] for i in index.tolist()])
        staying = torch.ones(rec.num_pages, dtype=torch.bool)
        staying[index] = False
        rec.keep(torch.nonzero(staying).flatten())
        return tokens

    def _release(self, pages: list[int]) -> None:
        base = self.host.capacity_pages
        self.host.release([p for p in pages if p < base])
        if self.disk is not None:
            self.disk.release([p - base for p in pages if p >= base])


def _oldest(rec: TierLayer, among: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of up to `count` pages of `rec` with the lowest first stream index, among the
    pages where `among` is true."""
    first = rec.first_stream().masked_fill(~among, float("inf"))
    return torch.argsort(first, stable=True)[: min(count, int(among.sum()))]


def stand_in_layer(keys: torch.Tensor, page_size: int) -> TierLayer:
    """A tier layer of two one-token pages holding the first two of `keys` [n >= 2,
    kv_heads, D], with their summaries: the sizes and dtypes of a real one, for recall's
    rehearsal (`Recaller.rehearse`) before any page has left the working set."""
    counts = torch.ones(2, dtype=torch.int64)
    centers, radii, plane_vars = _summaries(keys[:2].float(), counts.to(keys.device), page_size)
    meta = torch.zeros(2, 1, META_COLUMNS, dtype=torch.float64)
    meta[:, 0, STREAM] = torch.arange(2, dtype=torch.float64)
    return TierLayer(pages=[0, 1], counts=counts, meta=meta, centers=centers, radii=radii,
                     plane_vars=plane_vars)


def _summaries(k: torch.Tensor, counts: torch.Tensor, page_size: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per page of `page_size` consecutive tokens of k [n, kv_heads, D]: the mean key, the
    largest distance of a key from it, per KV head, and the keys' variance per rotary plane
    (half the mean squared distance from the center in dims j and j + D/2): the rotation of a
    plane keeps it, so it holds at whatever position the page comes back to."""
    pages = counts.numel()
    padded = torch.zeros(pages * page_size, *k.shape[1:], dtype=k.dtype, device=k.device)
    padded[: k.shape[0]] = k
    padded = padded.view(pages, page_size, *k.shape[1:])
    valid = (torch.arange(page_size, device=k.device)[None, :] < counts[:, None])
    weights = valid.to(k.dtype)[:, :, None, None]
    centers = (padded * weights).sum(1) / counts.to(k.dtype)[:, None, None]
    distance = torch.linalg.vector_norm(padded - centers[:, None], dim=-1)  # [P, page, kvh]
    radii = distance.masked_fill(~valid[:, :, None], 0.0).amax(1)
    half = k.shape[-1] // 2
    squared = ((padded - centers[:, None]) ** 2) * weights
    plane_vars = (squared[..., :half] + squared[..., half:]).sum(1) / (
        2 * counts.to(k.dtype)[:, None, None])
    return centers, radii, plane_vars
