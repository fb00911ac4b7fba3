"""Off-working-set KV pages: host memory that grows as it fills, or memory-mapped files.

A store holds up to `capacity_pages` pages of `page_size` token slots laid out as the page
pool lays them out (`PagedKV`, with int8 scales when it stores int8), a free list, and which
(sequence, layer) owns each page. The host tier keeps one in memory and, optionally, one on
disk past it.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path

import torch

from streamgrok_kernels import kv_append
from streamgrok_kernels.paged_kv import PagedKV


def page_bytes(page_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of K+V (and int8 scales) one page of one layer takes."""
    elems = page_size * kv_heads * head_dim
    if dtype == torch.int8:
        return 2 * (elems + page_size * kv_heads * 2)
    return 2 * elems * torch.empty(0, dtype=dtype).element_size()


class PageStore:
    """Pages in host memory (grown on demand, pinned when `pinned`) or, with `folder`, in
    memory-mapped files there (unlinked at once: the space goes when the process does)."""

    def __init__(self, capacity_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, pinned: bool = False, folder: Path | None = None) -> None:
        self.capacity_pages = capacity_pages
        self.page_size = page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.pinned = pinned
        self.on_disk = folder is not None
        self._free: list[int] = []
        self.owner: dict[int, tuple[int, int]] = {}  # page -> (seq id, layer)
        self.held: Counter = Counter()  # (seq id, layer) -> pages
        if folder is None:
            self._kv = self._memory(0)
        else:
            self._kv = self._mapped(Path(folder))
            self._free = list(range(capacity_pages - 1, -1, -1))

    @property
    def used_pages(self) -> int:
        return len(self.owner)

    @property
    def free_pages(self) -> int:
        return self.capacity_pages - self.used_pages

    def allocate(self, count: int, owner: tuple[int, int]) -> list[int]:
        """`count` free pages for `owner` (the caller made room first)."""
        if count > self.free_pages:
            raise ValueError(f"{count} pages asked of a store with {self.free_pages} free")
        while len(self._free) < count:
            self._grow()
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self.owner[page] = owner
        self.held[owner] += count
        return pages

    def release(self, pages: list[int]) -> None:
        for page in pages:
            owner = self.owner.pop(page)
            self.held[owner] -= 1
            if not self.held[owner]:
                del self.held[owner]
            self._free.append(page)

    def largest_holder(self) -> tuple[int, int]:
        """The (seq id, layer) holding the most pages here (ties: the lowest)."""
        return max(self.held.items(), key=lambda item: (item[1], -item[0][0], -item[0][1]))[0]

    def slots(self, pages: list[int]) -> torch.Tensor:
        """Every slot of `pages`, page after page."""
        return (torch.tensor(pages, dtype=torch.int64)[:, None] * self.page_size
                + torch.arange(self.page_size)).flatten()

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store K/V [n, kv_heads, head_dim] (any float dtype; quantized for int8)."""
        kv_append.reference(self._kv, slots, k.to("cpu"), v.to("cpu"))

    def read(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv.read(slots, dtype)

    def copy_to(self, other: PageStore, src: list[int], dst: list[int]) -> None:
        """Copy pages as stored (same layout) into `other`."""
        src_slots, dst_slots = self.slots(src), other.slots(dst)
        for stored, target in zip(self._kv.tensors(), other._kv.tensors()):
            target[dst_slots] = stored[src_slots]

    def _grow(self) -> None:
        """Double the host storage (up to capacity): it is committed as it fills."""
        old = self._kv.k.shape[0] // self.page_size
        new = min(self.capacity_pages, max(64, 2 * old))
        kv = self._memory(new)
        for dst, src in zip(kv.tensors(), self._kv.tensors()):
            dst[: src.shape[0]] = src
        self._kv = kv
        self._free.extend(range(new - 1, old - 1, -1))

    def _memory(self, pages: int) -> PagedKV:
        kv = PagedKV.zeros(pages * self.page_size, self.kv_heads, self.head_dim, self.dtype,
                           self.page_size)
        if not self.pinned:
            return kv
        k, v, *scales = (t.pin_memory() for t in kv.tensors())
        return PagedKV(k, v, self.page_size, *scales)

    def _mapped(self, folder: Path) -> PagedKV:
        folder.mkdir(parents=True, exist_ok=True)
        slots = self.capacity_pages * self.page_size
        shapes = [((slots, self.kv_heads, self.head_dim), self.dtype)] * 2
        if self.dtype == torch.int8:
            shapes += [((slots, self.kv_heads), torch.float16)] * 2
        tensors = []
        for shape, dtype in shapes:
            numel = 1
            for n in shape:
                numel *= n
            fd, name = tempfile.mkstemp(prefix="streamgrok-kv-", suffix=".bin", dir=folder)
            with os.fdopen(fd, "wb") as handle:
                handle.truncate(numel * torch.empty(0, dtype=dtype).element_size())
            tensors.append(torch.from_file(name, shared=True, size=numel,
                                           dtype=dtype).view(shape))
            os.unlink(name)
        return PagedKV(tensors[0], tensors[1], self.page_size, *tensors[2:])
