"""Pages are counted by one rule: the planner's ledger and `reserve` agree, and a span that
does not fit what is left is refused without being counted."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from hypothesis import given, settings
from hypothesis import strategies as st

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.errors import CacheFullError
from streamgrok.model.batch import BatchMetadata

CONFIG = tiny_config()
PAGE = 16


def cache_with(lengths: list[int], num_pages: int = 64) -> PagedKVCache:
    cache = PagedKVCache(CONFIG, CacheConfig(policy="full", budget_tokens=None),
                         num_pages=num_pages)
    for seq_id, length in enumerate(lengths):
        cache.add_sequence(seq_id)
        if length:
            q = torch.zeros(length, CONFIG.num_heads, CONFIG.head_dim)
            kv = torch.zeros(length, CONFIG.num_kv_heads, CONFIG.head_dim)
            batch = BatchMetadata.build([seq_id], [length])
            with torch.inference_mode():
                cache.attention.prepare(batch)
                for layer in range(CONFIG.num_layers):
                    cache.attention.attend(layer, q, kv, kv, batch)
    return cache


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=4),
       st.lists(st.integers(1, 40), min_size=1, max_size=4))
def test_reserve_allocates_exactly_what_the_ledger_counted(lengths, adds):
    cache = cache_with(lengths)
    counts = {seq_id: adds[seq_id % len(adds)] for seq_id in range(len(lengths))}
    ledger = cache.page_ledger()
    for seq_id, tokens in counts.items():
        assert ledger.take(seq_id, tokens)
    free = cache.pool.free_pages
    assert ledger.needed == cache.pages_needed(counts)
    cache.reserve(counts)
    assert free - cache.pool.free_pages == ledger.needed
    cache.rollback()
    assert cache.pool.free_pages == free


def test_a_span_that_does_not_fit_is_refused_and_not_counted():
    layers = CONFIG.num_layers
    cache = cache_with([0, 0], num_pages=3 * layers)
    ledger = cache.page_ledger()
    assert ledger.take(0, 2 * PAGE)  # two pages in every layer
    assert not ledger.take(1, 2 * PAGE)  # two more would not fit
    assert ledger.needed == 2 * layers and ledger.counts == {0: 2 * PAGE}
    assert ledger.take(1, PAGE)  # the last page of each layer
    assert ledger.needed == 3 * layers


def test_taking_a_sequence_twice_counts_the_pages_of_all_its_tokens():
    cache = cache_with([10])
    ledger = cache.page_ledger()
    assert ledger.take(0, 4)  # 14 tokens: still the first page
    assert ledger.needed == 0
    assert ledger.take(0, 4)  # 18 tokens: a second page in every layer
    assert ledger.needed == CONFIG.num_layers


def test_reserve_without_room_raises_and_changes_nothing():
    layers = CONFIG.num_layers
    cache = cache_with([0], num_pages=layers)
    free = cache.pool.free_pages
    with pytest.raises(CacheFullError):
        cache.reserve({0: 2 * PAGE})
    assert cache.pool.free_pages == free and not cache.core.reserved
