"""The paged caches the KV benchmarks measure, built for a loaded model."""

from __future__ import annotations

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.loading.loader import LoadedModel


def bench_cache(loaded: LoadedModel, policy: str, budget: int | None, memory_gib: float = 1.0,
                **extra) -> PagedKVCache:
    """A cache on the model's device, dtype and kernels; `extra` goes to CacheConfig."""
    config = CacheConfig(policy=policy, budget_tokens=budget, memory_gib=memory_gib, **extra)
    return PagedKVCache(loaded.config, config, loaded.model.dtype, loaded.model.device,
                        kernels=loaded.model.kernels)
