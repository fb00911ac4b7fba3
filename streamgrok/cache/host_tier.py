"""The host tier: where evicted KV pages go instead of being lost, within a byte budget.

Evicted tokens of one (sequence, layer) are packed, in stream order, into host pages of
`page_size` slots (CPU memory, pinned when the working set is on CUDA), stored as the page pool
stores them or compressed to int8 with a scale per token and head. Each host page keeps a
small summary on the working-set device for recall to score without touching the page: the
mean of its (unrotated) keys per KV head and the largest distance of a key from that mean
(a ball that holds every key of the page, whatever rotation it later gets), plus the token
records (stream index, modality, time, source) it needs to be put back in stream order.

When the budget is full, the sequence (and within it the layer) holding the most host pages
loses its oldest page for good; those tokens are counted in `stats.dropped_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kernels import kv_append
from kernels.paged_kv import PagedKV
from streamgrok.cache.tokens import META_COLUMNS, PROTECTED, STREAM

HOST_DTYPES = ("auto", "int8")


@dataclass
class TierLayer:
    """The host pages of one (sequence, layer), in the order they arrived, with summaries."""

    pages: list[int] = field(default_factory=list)  # host page ids
    counts: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    meta: torch.Tensor = field(  # [P, page_size, META_COLUMNS], rows past counts[p] unused
        default_factory=lambda: torch.zeros(0, 0, META_COLUMNS, dtype=torch.float64))
    centers: torch.Tensor | None = None  # [P, kv_heads, head_dim] float32, mean unrotated key
    radii: torch.Tensor | None = None  # [P, kv_heads] float32, max |key - center|

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


@dataclass
class TierStats:
    """What the host tier has done."""

    stored_tokens: int = 0  # evicted tokens written to the tier
    dropped_tokens: int = 0  # tokens that left the tier for good (budget)
    recalls: int = 0
    recalled_tokens: int = 0
    recall_bytes: int = 0  # bytes read from the tier by recalls
    guard_recalls: int = 0  # recalls the hit-rate guard extended
    recall_seconds: float = 0.0


class HostTier:
    """Host pages for evicted KV, owned by one PagedKVCache (on its thread)."""

    def __init__(
        self,
        capacity_bytes: float,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        store_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.store_dtype = store_dtype
        self.compute_dtype = compute_dtype
        self.device = device  # where summaries live and recalled K/V go
        self.pinned = device.type == "cuda"
        elems = page_size * kv_heads * head_dim
        if store_dtype == torch.int8:
            self.page_bytes = 2 * (elems + page_size * kv_heads * 2)
        else:
            self.page_bytes = 2 * elems * torch.empty(0, dtype=store_dtype).element_size()
        self.capacity_pages = int(capacity_bytes // self.page_bytes)
        if self.capacity_pages < 1:
            raise ValueError(
                f"the host tier budget ({capacity_bytes / 2**20:.2f} MiB) holds no page of "
                f"{self.page_bytes} bytes; raise it")
        self._kv = self._zeros(0)
        self._free: list[int] = []
        self._owner: dict[int, tuple[int, int]] = {}  # host page -> (seq id, layer)
        self.sequences: dict[int, list[TierLayer]] = {}
        self.stats = TierStats()

    # -- sequences -------------------------------------------------------------------------

    def add_sequence(self, seq_id: int, num_layers: int) -> None:
        self.sequences[seq_id] = [TierLayer() for _ in range(num_layers)]

    def remove_sequence(self, seq_id: int) -> None:
        """Free every host page of a sequence."""
        for layer in self.sequences.pop(seq_id, []):
            self._release(layer.pages)

    def layer(self, seq_id: int, layer: int) -> TierLayer | None:
        layers = self.sequences.get(seq_id)
        return None if layers is None else layers[layer]

    @property
    def used_pages(self) -> int:
        return len(self._owner)

    @property
    def used_bytes(self) -> int:
        return self.used_pages * self.page_bytes

    @property
    def tokens(self) -> int:
        return sum(layer.tokens for layers in self.sequences.values() for layer in layers)

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
        if count > self.capacity_pages:  # more than the whole tier: keep the newest
            skip = n - self.capacity_pages * self.page_size
            k, v, meta, n = k[skip:], v[skip:], meta[skip:], n - skip
            self.stats.dropped_tokens += skip
            count = self.capacity_pages
        self._make_room(count)
        pages = self._allocate(count, seq_id, layer)
        slots = (torch.tensor(pages)[:, None] * self.page_size
                 + torch.arange(self.page_size)).flatten()[:n]
        kv_append.reference(self._kv, slots, k.to("cpu"), v.to("cpu"))
        padded = torch.zeros(count * self.page_size, META_COLUMNS, dtype=torch.float64)
        padded[:n] = meta
        padded[:n, PROTECTED] = 0.0  # what comes back competes like any other token
        counts = torch.full((count,), self.page_size, dtype=torch.int64)
        counts[-1] = n - (count - 1) * self.page_size
        centers, radii = _summaries(k.float(), counts.to(k.device), self.page_size)
        rec = self.sequences[seq_id][layer]
        rec.pages += pages
        rec.counts = torch.cat([rec.counts, counts])
        rec.meta = torch.cat([rec.meta.reshape(-1, self.page_size, META_COLUMNS),
                              padded.view(count, self.page_size, META_COLUMNS)])
        centers, radii = centers.to(self.device), radii.to(self.device)
        rec.centers = centers if rec.centers is None else torch.cat([rec.centers, centers])
        rec.radii = radii if rec.radii is None else torch.cat([rec.radii, radii])
        self.stats.stored_tokens += n

    def read(self, rec: TierLayer, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
        """K, V (compute dtype, on the device) and records of the tokens of pages `index` of
        `rec`, page after page."""
        counts = rec.counts[index]
        pages = torch.tensor([rec.pages[i] for i in index.tolist()], dtype=torch.int64)
        offsets = torch.arange(self.page_size)
        valid = offsets[None, :] < counts[:, None]
        slots = (pages[:, None] * self.page_size + offsets)[valid]
        k, v = self._kv.read(slots, self.compute_dtype)
        meta = rec.meta[index][valid]
        self.stats.recall_bytes += int(counts.sum()) * self.page_bytes // self.page_size
        return (k.to(self.device, non_blocking=self.pinned),
                v.to(self.device, non_blocking=self.pinned), meta)

    # -- pages -----------------------------------------------------------------------------

    def _make_room(self, count: int) -> None:
        """Drop the oldest pages of the largest holders until `count` pages are free."""
        while (needed := count - (self.capacity_pages - self.used_pages)) > 0:
            seq_id, layer = self._largest_holder()
            rec = self.sequences[seq_id][layer]
            take = min(needed, rec.num_pages)
            oldest = torch.argsort(rec.first_stream(), stable=True)[:take]
            self.stats.dropped_tokens += int(rec.counts[oldest].sum())
            self._release([rec.pages[i] for i in oldest.tolist()])
            staying = torch.ones(rec.num_pages, dtype=torch.bool)
            staying[oldest] = False
            rec.keep(torch.nonzero(staying).flatten())

    def _largest_holder(self) -> tuple[int, int]:
        held = [(rec.num_pages, seq_id, layer)
                for seq_id, layers in self.sequences.items()
                for layer, rec in enumerate(layers) if rec.num_pages]
        _, seq_id, layer = max(held, key=lambda h: (h[0], -h[1], -h[2]))
        return seq_id, layer

    def _allocate(self, count: int, seq_id: int, layer: int) -> list[int]:
        while len(self._free) < count:
            self._grow()
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._owner[page] = (seq_id, layer)
        return pages

    def _release(self, pages: list[int]) -> None:
        for page in pages:
            del self._owner[page]
            self._free.append(page)

    def _grow(self) -> None:
        """Double the host storage (up to the budget): it is committed as it fills."""
        old = self._kv.k.shape[0] // self.page_size
        new = min(self.capacity_pages, max(64, 2 * old))
        kv = self._zeros(new)
        for dst, src in zip(kv.tensors(), self._kv.tensors()):
            dst[: src.shape[0]] = src
        self._kv = kv
        self._free.extend(range(new - 1, old - 1, -1))

    def _zeros(self, pages: int) -> PagedKV:
        kv = PagedKV.zeros(pages * self.page_size, self.kv_heads, self.head_dim,
                           self.store_dtype, self.page_size)
        if not self.pinned:
            return kv
        k, v, *scales = (t.pin_memory() for t in kv.tensors())
        return PagedKV(k, v, self.page_size, *scales)


def _summaries(k: torch.Tensor, counts: torch.Tensor, page_size: int) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
    """Per page of `page_size` consecutive tokens of k [n, kv_heads, D]: the mean key and the
    largest distance of a key from it, per KV head."""
    pages = counts.numel()
    padded = torch.zeros(pages * page_size, *k.shape[1:], dtype=k.dtype, device=k.device)
    padded[: k.shape[0]] = k
    padded = padded.view(pages, page_size, *k.shape[1:])
    valid = (torch.arange(page_size, device=k.device)[None, :] < counts[:, None])
    weights = valid.to(k.dtype)[:, :, None, None]
    centers = (padded * weights).sum(1) / counts.to(k.dtype)[:, None, None]
    distance = torch.linalg.vector_norm(padded - centers[:, None], dim=-1)  # [P, page, kvh]
    radii = distance.masked_fill(~valid[:, :, None], 0.0).amax(1)
    return centers, radii
