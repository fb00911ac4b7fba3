"""Each KV cache has the members the engine and the server use of it (`cache/contract.py`):
every cache the scheduler's side, the single-process cache also parking and recall."""

from __future__ import annotations

from helpers import tiny_config

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.contract import RecallingCache, ResumableCache, SequenceCache
from streamgrok.cache.kv_group import KVGroup
from streamgrok.cache.kv_parallel import KVParallelCache
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.engine.kv_leader import LeaderCache

CONFIG = tiny_config()


def test_the_paged_cache_is_every_kind_of_cache():
    cache = PagedKVCache(CONFIG, CacheConfig(budget_tokens=64, host_tier_gib=0.01),
                         num_pages=16)
    assert isinstance(cache, SequenceCache)
    assert isinstance(cache, ResumableCache)
    assert isinstance(cache, RecallingCache) and cache.tier is not None


def test_the_kv_parallel_caches_are_sequence_caches():
    shard = KVParallelCache(CONFIG, KVGroup(), CacheConfig(budget_tokens=64), num_pages=16)
    for cache in (shard, LeaderCache(shard)):
        assert isinstance(cache, SequenceCache), type(cache)
    assert shard.tier is None  # no recall under KV parallelism (the engine checks `tier`)


def test_the_engine_annotates_its_cache_with_the_contract():
    import inspect

    from streamgrok.engine import scheduler

    source = inspect.getsource(scheduler)
    assert "PagedKVCache" not in source, "the scheduler uses the contract, not one class"


def test_the_paged_caches_model_side_is_its_own_object_over_the_same_pages():
    from streamgrok.cache.paged_attention import PagedAttention
    cache = PagedKVCache(CONFIG, CacheConfig(budget_tokens=64), num_pages=16)
    assert isinstance(cache.attention, PagedAttention)
    assert not hasattr(cache, "attend") and not hasattr(cache, "prepare")
    assert cache.attention.core is cache.core and cache.recaller.core is cache.core
