"""A pool of fixed-size KV pages with a free list and reference counts."""

from __future__ import annotations

import torch

from streamgrok.errors import CacheFullError
from streamgrok.runtime import discard_rows
from streamgrok_kernels.paged_kv import PagedKV


class PagePool:
    """`num_pages` pages of `page_size` token slots, each slot [kv_heads, head_dim] for K and V.

    Slot index = page * page_size + offset. A page belongs to one (sequence, layer) unless
    shared through the prefix index, which the reference count tracks.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        compute_dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages < 1:
            raise ValueError("the KV memory budget holds no page; raise it")
        self.num_pages = num_pages
        self.page_size = page_size
        self.dtype = dtype
        self.compute_dtype = compute_dtype
        # pages are zeroed as they are handed out, so the storage is committed as it fills
        self._kv = PagedKV.unwritten(num_pages * page_size, kv_heads, head_dim, dtype,
                                     page_size, device)
        self.refcount = [0] * num_pages
        self.generation = [0] * num_pages  # bumped whenever a page's content is replaced
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        """Take `count` pages off the free list, or raise CacheFullError taking none."""
        return self.allocate_each([count])[0]

    def allocate_each(self, counts: list[int]) -> list[list[int]]:
        """Take `counts[i]` pages for each i, all or none (CacheFullError), zeroed in one
        pass: no stale or never-written entry reaches a kernel through a new page."""
        total = sum(counts)
        if total > len(self._free):
            raise CacheFullError(
                f"KV cache out of pages: {total} needed, {len(self._free)} free of "
                f"{self.num_pages}"
            )
        taken = [[self._free.pop() for _ in range(count)] for count in counts]
        fresh = [page for pages in taken for page in pages]
        for page in fresh:
            self.refcount[page] = 1
            self.generation[page] += 1
        if fresh:
            self._kv.zero_pages(torch.tensor(fresh, dtype=torch.int64))
        return taken

    def touch(self, pages: list[int]) -> None:
        """Mark pages as rewritten in place (stale for the prefix index)."""
        for page in pages:
            self.generation[page] += 1

    def share(self, page: int) -> None:
        """Add a reference to a page (prefix sharing)."""
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} is not allocated")
        self.refcount[page] += 1

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; pages reaching zero return to the free list."""
        for page in pages:
            if self.refcount[page] <= 0:
                raise ValueError(f"page {page} released twice")
            self.refcount[page] -= 1
            if self.refcount[page] == 0:
                self.generation[page] += 1  # whatever the prefix index knew of it is gone
                self._free.append(page)

    def discard(self, pages: list[int]) -> int:
        """Give the system back the memory of free `pages` (CPU pools; they are zeroed
        again when handed out); returns the bytes given back. Pages still referenced are
        left alone."""
        free = sorted(page for page in set(pages) if self.refcount[page] == 0)
        runs: list[tuple[int, int]] = []
        for page in free:
            if runs and runs[-1][1] == page * self.page_size:
                runs[-1] = (runs[-1][0], (page + 1) * self.page_size)
            else:
                runs.append((page * self.page_size, (page + 1) * self.page_size))
        return sum(discard_rows(stored, runs) for stored in self.paged_kv().tensors())

    def paged_kv(self) -> PagedKV:
        """The pool's tensors as the kernels take them (writes go through KernelOps.kv_append)."""
        return self._kv

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V at slots (any shape), dequantized to the compute dtype."""
        return self.paged_kv().read(slots, self.compute_dtype)

    def gather_raw(self, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Stored entries at slots, as stored (for moving them without requantizing)."""
        return tuple(stored[slots] for stored in self.paged_kv().tensors())

    def scatter_raw(self, slots: torch.Tensor, data: tuple[torch.Tensor, ...]) -> None:
        """Inverse of gather_raw."""
        for stored, values in zip(self.paged_kv().tensors(), data):
            stored[slots] = values

    def move_raw(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the stored entries at slots `src` [n] to slots `dst` [n], as stored (the
        two sets must not overlap)."""
        for stored in self.paged_kv().tensors():
            stored.index_copy_(0, dst, stored.index_select(0, src))

    def copy_on_write(self, page: int) -> int:
        """A private copy of a shared page: a fresh page with its entries, and one reference
        to `page` dropped. Raises CacheFullError when no page is free."""
        fresh = self.allocate(1)[0]
        rows = slice(fresh * self.page_size, (fresh + 1) * self.page_size)
        source = slice(page * self.page_size, (page + 1) * self.page_size)
        for stored in self.paged_kv().tensors():
            stored[rows] = stored[source]
        self.release([page])
        return fresh
