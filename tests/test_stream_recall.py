"""Recall in the stream: a session's streamed chunks recall into its own working set."""

from __future__ import annotations

import pytest
import torch
from test_kv_tier import CFG, append, full_cache, tiered

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.tiers.recaller import _query_rows
from streamgrok.cache.tokens import STREAM

CHUNK = 24


def stream_both(chunks: int, backend: str = "torch", **extra):
    """The same random stream into a recalling tiered cache and a full one; returns both
    caches and, per chunk, both caches' attention outputs of every layer."""
    tier = tiered(recall_tokens=10_000, recall_in_stream=True, backend=backend, **extra)
    full = full_cache(backend)
    outputs = []
    for cache in (tier, full):
        cache.add_sequence(0)
    for i in range(chunks):
        got = append(tier, 0, CHUNK, seed=i)
        want = append(full, 0, CHUNK, seed=i)
        outputs.append((got, want))
        tier.evict([0])
    return tier, full, outputs


def stream_indices(cache, seq: int, layer: int) -> list[int]:
    """Stream indices a layer holds in its working set and in the host tier."""
    resident = cache.sequences[seq].layers[layer].column(STREAM).long().tolist()
    tier_layer = cache.tier.layer(seq, layer)
    held = []
    for p in range(tier_layer.num_pages):
        held += tier_layer.meta[p, : int(tier_layer.counts[p]), STREAM].long().tolist()
    return sorted(resident + held)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunks_that_recall_everything_attend_as_the_full_cache(backend):
    tier, _, outputs = stream_both(6, backend)
    assert tier.stats.evicted_tokens > 0 and tier.tier.stats.stream_recalls > 0
    for got, want in outputs:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_recalled_pages_move_between_tiers_and_no_token_is_lost_or_doubled():
    tier, _, _ = stream_both(6)
    stats = tier.tier.stats
    assert stats.restored_tokens > 0 and stats.dropped_tokens == 0
    assert tier.tier.tokens == stats.stored_tokens - stats.restored_tokens
    for layer in range(CFG.num_layers):  # every token in exactly one tier
        assert stream_indices(tier, 0, layer) == list(range(6 * CHUNK))
    assert max(tier.layer_lengths(0)) <= 32 + 16  # evicted back to budget + slack
    tier.remove_sequence(0)
    assert tier.pool.used_pages == 0 and tier.tier.used_pages == 0


def test_a_failed_step_puts_every_recalled_layer_back_as_it_was():
    tier, _, _ = stream_both(4)
    before_tier = tier.tier.tokens
    before_pages = tier.pool.used_pages
    records = [(rec.column(STREAM).clone(), tier.pool.read(rec.slots())[0].clone())
               for rec in tier.sequences[0].layers]
    tier.reserve({0: CHUNK})
    append(tier, 0, CHUNK, seed=50)
    assert max(tier.layer_lengths(0)) > 32 + 16 + CHUNK  # the pass recalled
    tier.rollback()
    assert tier.tier.tokens == before_tier and tier.pool.used_pages == before_pages
    for rec, (streams, keys) in zip(tier.sequences[0].layers, records):
        assert torch.equal(rec.column(STREAM), streams)
        assert torch.equal(tier.pool.read(rec.slots())[0], keys)
    # the step again, committed this time: the pages move
    tier.reserve({0: CHUNK})
    append(tier, 0, CHUNK, seed=50)
    tier.commit()
    assert tier.tier.tokens < before_tier
    tier.evict([0])
    for layer in range(CFG.num_layers):
        assert stream_indices(tier, 0, layer) == list(range(5 * CHUNK))


def test_only_the_tiers_own_sequence_recalls_in_the_stream():
    """An answer's fork prefilling its prompt recalls only when armed for its question, and
    a one-token step does not recall."""
    tier, _, _ = stream_both(4)
    recalls = tier.tier.stats.stream_recalls
    tier.fork(0, 1)
    lengths = tier.layer_lengths(1)
    append(tier, 1, 6, seed=60)
    assert tier.layer_lengths(1) == [n + 6 for n in lengths]
    append(tier, 0, 1, seed=61)
    assert tier.tier.stats.stream_recalls == recalls


def test_without_the_option_streamed_chunks_do_not_recall():
    cache = tiered(recall_tokens=10_000)
    cache.add_sequence(0)
    for i in range(4):
        append(cache, 0, CHUNK, seed=i)
        cache.evict([0])
    assert cache.tier.stats.stream_recalls == 0 and cache.tier.stats.restored_tokens == 0


def test_a_chunks_scoring_queries_spread_over_it_and_a_questions_are_its_last():
    assert _query_rows(100, 4, spread=True).tolist() == [0, 33, 66, 99]
    assert _query_rows(100, 4, spread=False).tolist() == [96, 97, 98, 99]
    assert _query_rows(3, 8, spread=True).tolist() == [0, 1, 2]


def test_config_rejects_no_stream_queries():
    with pytest.raises(ValueError, match="recall_stream_queries"):
        CacheConfig(host_tier_gib=0.1, recall_stream_queries=0)


def test_config_rejects_recall_in_the_stream_without_a_host_tier():
    with pytest.raises(ValueError, match="host_tier_gib"):
        CacheConfig(recall_in_stream=True)


async def test_an_engine_sessions_stream_recalls_and_its_answers_still_work(tiny_loaded):
    """Through the engine's steps (reserved, committed): long notes recall as they stream,
    every token stays in exactly one tier, answers recall as before, closing frees all."""
    from streamgrok.engine import Engine, EngineConfig
    from streamgrok.model.sampling import SamplingParams

    cache = CacheConfig(policy="h2o", budget_tokens=128, evict_slack_tokens=16,
                        memory_gib=0.02, host_tier_gib=0.01, recall_in_stream=True)
    async with Engine(tiny_loaded, cache, EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        for i in range(10):
            await session.append_message(f"note {i}: " + "the camera saw a red car. " * 12)
        answer = session.ask("what was noted?", SamplingParams(max_tokens=6))
        assert await answer.text()
        tier = engine.snapshot().host_tier
        assert tier["stream_recalls"] > 0 and tier["restored_tokens"] > 0
        assert tier["recalls"] == 1
        kv = engine.cache
        seq_id = next(iter(engine.scheduler.sessions.values())).seq_id
        for layer in range(tiny_loaded.config.num_layers):
            held = stream_indices(kv, seq_id, layer)
            assert held == list(range(len(held)))  # no token lost or doubled
        await session.close()
        assert kv.tier.used_pages == 0 and kv.pool.used_pages == 0


def test_the_streams_own_guard_threshold_bounds_what_a_chunk_recalls():
    """Without the guard (threshold 0) a chunk recalls at most `recall_tokens` per layer;
    with the recall guard asking for everything it recalls the whole evicted history."""
    restored = {}
    for threshold in (0.0, 1.0):
        cache = tiered(recall_tokens=16, recall_in_stream=True,
                       recall_stream_min_hit_rate=threshold)
        cache.add_sequence(0)
        for i in range(4):
            append(cache, 0, CHUNK, seed=i)
            cache.evict([0])
        in_tier = cache.tier.tokens
        before = cache.tier.stats.restored_tokens
        append(cache, 0, CHUNK, seed=9)
        restored[threshold] = cache.tier.stats.restored_tokens - before
        assert 0 < restored[threshold] <= in_tier
        if threshold == 1.0:
            assert restored[threshold] == in_tier and cache.tier.tokens == 0
    assert restored[0.0] <= 16 * CFG.num_layers < restored[1.0]
    with pytest.raises(ValueError, match="recall_stream_min_hit_rate"):
        CacheConfig(host_tier_gib=0.1, recall_stream_min_hit_rate=1.5)


async def test_sessions_in_nano_batches_recall_in_their_streams_independently(tiny_loaded):
    """Two sessions streaming at once, their chunks split into two nano-batches: each stream
    recalls from its own host pages only and keeps every one of its tokens once."""
    import asyncio

    from streamgrok.engine import Engine, EngineConfig
    from streamgrok.model.sampling import SamplingParams

    cache = CacheConfig(policy="h2o", budget_tokens=128, evict_slack_tokens=16,
                        memory_gib=0.04, host_tier_gib=0.02, recall_in_stream=True)
    config = EngineConfig(merge_window_s=0, nano_batches=2)
    async with Engine(tiny_loaded, cache, config) as engine:
        sessions = [engine.new_session("sys"), engine.new_session("sys")]

        async def feed(session, word: str) -> None:
            for i in range(8):
                await session.append_message(f"{word} {i}: " + f"a {word} passed by. " * 12)

        await asyncio.gather(feed(sessions[0], "car"), feed(sessions[1], "bird"))
        answers = [s.ask("what passed by?", SamplingParams(max_tokens=3)) for s in sessions]
        for answer in answers:  # asked after the notes: they were streamed first
            assert await answer.text()
        assert engine.snapshot().host_tier["stream_recalls"] > 1
        kv = engine.cache
        # read between steps: the engine goes on streaming the remembered turns, and a step
        # that recalls holds a page in both tiers until it commits
        async with engine.paused():
            for state in engine.scheduler.sessions.values():
                for layer in range(tiny_loaded.config.num_layers):
                    held = stream_indices(kv, state.seq_id, layer)
                    assert held == list(range(len(held)))
        for session in sessions:
            await session.close()
        assert kv.tier.used_pages == 0 and kv.pool.used_pages == 0
