"""Eviction's moves: a pass over sequences, and compacting a layer to the tokens it keeps."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

import torch

from streamgrok.cache.core import CacheStats
from streamgrok.cache.pool import PagePool
from streamgrok.cache.tokens import LayerTokens
from streamgrok.errors import CacheFullError
from streamgrok_kernels.ops import KernelOps


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


def compact_layer(pool: PagePool, kernels: KernelOps, rec: LayerTokens, keep: torch.Tensor,
                  device: torch.device) -> None:
    """Move kept tokens to the front of the layer's pages on the device; free the emptied
    tail pages and copy shared pages on write.

    The moves run in place (`kernels.kv_compact`): copy-on-write pages are allocated while
    the tail is still held, so no source is overwritten before it is read. Only when the
    pool has no page left for that are the moved entries staged in a scratch copy first."""
    page_size = pool.page_size
    kept = keep.numel()
    moved = torch.nonzero(keep != torch.arange(kept)).flatten()
    first = int(moved[0]) if moved.numel() else kept
    src = rec.slot_table()[keep[first:]].to(device)
    new_count = math.ceil(kept / page_size)
    pages = list(rec.pages)
    shared = [i for i in range(first // page_size, new_count)
              if pool.refcount[pages[i]] > 1]
    staged = None
    if len(shared) > pool.free_pages:
        staged = pool.gather_raw(src)
        pool.release(pages[new_count:])
    for i in shared:
        pages[i] = pool.copy_on_write(pages[i])
    pool.touch([pages[i] for i in range(first // page_size, new_count)
                     if i not in shared])
    tail = pages[new_count:]
    rec.set_pages(pages[:new_count])
    dst = rec.slot_table()[first:kept].to(device)
    if staged is None:
        kernels.kv_compact(pool.paged_kv(), src, dst)
        pool.release(tail)
    else:
        pool.scatter_raw(dst, staged)
    rec.keep_only(keep)
