"""The real SmolLM2 streamed far past its trained context through a small cache."""

from __future__ import annotations

import pytest

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.cache.streaming import feed, greedy_continue

pytestmark = pytest.mark.integration

FILLER = (
    "The river runs past the old mill and the fields turn gold in the late summer sun. "
    "Farmers bring their carts to the market square, where traders call out their prices. "
)


def test_answers_about_the_last_part_after_12k_tokens(smollm2):
    tok = smollm2.tokenizer
    filler = tok.encode(FILLER)
    stream = (filler * (12_000 // len(filler) + 1))[:12_000]
    tail = tok.encode(
        " Then a visitor arrived. The visitor's name was Margaret and she came from Lisbon. "
        "Question: Which city did Margaret come from? Answer: Margaret came from"
    )
    cache = PagedKVCache(
        smollm2.config,
        CacheConfig(policy="sink_window", budget_tokens=2048, memory_gib=0.5),
    )
    cache.add_sequence(0)
    logits = feed(smollm2.model, cache, 0, stream + tail, chunk=512)
    lengths = cache.layer_lengths(0)
    assert max(lengths) <= 2048 + cache.config.slack
    assert cache.stats.evicted_tokens > 9_000
    answer = tok.decode(greedy_continue(smollm2.model, cache, 0, logits, 6, tok.stop_ids))
    assert "Lisbon" in answer
