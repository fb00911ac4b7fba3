"""Parking a detached session's KV in host memory: pages freed, the sequence back exactly."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
import torch
from helpers import tiny_config
from test_paged_cache import append_random

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.engine import Engine, EngineConfig
from streamgrok.errors import CacheFullError, StreamgrokError
from streamgrok.model.sampling import SamplingParams

CFG = tiny_config()
GREEDY = SamplingParams(max_tokens=12)


def check_pool(cache: PagedKVCache) -> None:
    """Every page is referenced refcount times by the unparked sequences; parked ones
    hold none."""
    owners = [0] * cache.pool.num_pages
    for seq_id, seq in cache.sequences.items():
        for layer in seq.layers:
            expected = 0 if seq_id in cache.parked else math.ceil(layer.length / 16)
            assert len(layer.pages) == expected
            for page in layer.pages:
                owners[page] += 1
    assert owners == cache.pool.refcount


def stored(cache: PagedKVCache, seq: int) -> list[tuple[torch.Tensor, ...]]:
    return [cache.pool.gather_raw(layer.slots()) for layer in cache.sequences[seq].layers]


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_park_frees_every_page_and_unpark_restores_the_entries(kv_dtype):
    cache = PagedKVCache(CFG, CacheConfig(policy="full", budget_tokens=None, kv_dtype=kv_dtype),
                         num_pages=64)
    cache.add_sequence(1)
    cache.add_sequence(2)
    append_random(cache, 1, 37, seed=1)
    append_random(cache, 2, 20, seed=2)
    before = stored(cache, 1)
    used = cache.pool.used_pages
    parked = cache.park(1)
    assert parked == sum(t.numel() * t.element_size() for layer in before for t in layer)
    assert cache.parked_bytes == parked
    assert cache.pool.used_pages == used - cache.pages_to_unpark(1)
    assert all(not layer.pages for layer in cache.sequences[1].layers)
    append_random(cache, 2, 30, seed=3)  # others reuse the freed pages meanwhile
    cache.evict()  # a parked sequence is never evicted
    cache.unpark(1)
    check_pool(cache)
    assert cache.parked_bytes == 0
    for layer_before, layer_after in zip(before, stored(cache, 1)):
        for a, b in zip(layer_before, layer_after):
            assert torch.equal(a, b)
    append_random(cache, 1, 5, seed=4)  # and it goes on
    assert cache.layer_lengths(1) == [42] * CFG.num_layers


def test_unpark_without_room_leaves_it_parked_and_remove_forgets_it():
    cache = PagedKVCache(CFG, CacheConfig(policy="full", budget_tokens=None), num_pages=12)
    cache.add_sequence(1)
    append_random(cache, 1, 40, seed=1)  # 3 pages a layer
    cache.park(1)
    cache.add_sequence(2)
    append_random(cache, 2, 60, seed=2)  # takes what the parked one left
    with pytest.raises(CacheFullError):
        cache.unpark(1)
    assert 1 in cache.parked
    check_pool(cache)
    cache.remove_sequence(1)
    assert cache.parked_bytes == 0


async def test_a_parked_session_answers_as_if_it_never_left(tiny_loaded):
    cache = CacheConfig(policy="h2o", budget_tokens=96, memory_gib=0.01)

    async def answer(park: bool) -> str:
        async with Engine(tiny_loaded, cache, EngineConfig(merge_window_s=0)) as engine:
            session = engine.new_session("sys")
            await session.append_message("the code word is pelican " * 4)
            first = await session.ask("and?", GREEDY).text()
            if park:
                parked = await session.park()
                assert parked > 0 and session.parked
                snap = engine.snapshot()
                assert snap.kv_pages_used == 0 and snap.parked_bytes == parked
                await session.unpark()
                assert not session.parked
            second = await session.ask("code?", GREEDY).text()
            await session.close()
            await asyncio.sleep(0.1)
            assert engine.snapshot().kv_pages_used == 0
            assert engine.snapshot().parked_bytes == 0
            return first + "|" + second

    assert await answer(park=True) == await answer(park=False)


async def test_park_waits_for_the_running_answer_and_unpark_calls_it_off(tiny_loaded):
    cache = CacheConfig(policy="h2o", budget_tokens=96, memory_gib=0.01)
    async with Engine(tiny_loaded, cache, EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        answer = session.ask("tell me", SamplingParams(max_tokens=20))
        parking = asyncio.ensure_future(session.park())
        text = await answer.text()  # the answer runs to its end first
        assert text and await parking > 0
        await session.unpark()
        other = engine.new_session("sys")
        asked = other.ask("hello", SamplingParams(max_tokens=200))
        await asyncio.sleep(0)
        pending = asyncio.ensure_future(other.park())  # still answering: waits
        await session.close()
        await other.unpark()  # calls the pending park off
        assert await pending == 0
        asked.cancel()
        await other.close()


async def test_an_exported_session_restored_in_another_engine_answers_the_same(tiny_loaded):
    cache = CacheConfig(policy="h2o", budget_tokens=96, memory_gib=0.01)
    config = EngineConfig(merge_window_s=0)
    async with Engine(tiny_loaded, cache, config) as engine:
        session = engine.new_session("sys")
        await session.append_message("the code word is pelican " * 4)
        await session.ask("and?", GREEDY).text()
        await session.park()
        snapshot = await session.export()
        expected = await (await unparked(session)).ask("code?", GREEDY).text()
    async with Engine(tiny_loaded, cache, config) as other:  # a new process, in effect
        restored = other.restore_session("sys", snapshot)
        await restored.unpark()
        assert await restored.ask("code?", GREEDY).text() == expected
        wrong = other.restore_session("sys", replace(snapshot, layers=snapshot.layers[:1]))
        await asyncio.sleep(0.2)
        with pytest.raises(StreamgrokError, match="could not be restored"):
            wrong.ask("code?", GREEDY)


async def unparked(session):
    await session.unpark()
    return session


def test_pages_a_park_frees_give_their_memory_back(monkeypatch):
    cache = PagedKVCache(CFG, CacheConfig(policy="full", budget_tokens=None), num_pages=128)
    cache.add_sequence(1)
    cache.add_sequence(2)
    append_random(cache, 1, 300, seed=1)
    append_random(cache, 2, 20, seed=2)
    assert cache.pool.discard(list(cache.sequences[2].layers[0].pages)) == 0  # in use
    before = stored(cache, 2)
    given = []
    discard = cache.pool.discard
    monkeypatch.setattr(cache.pool, "discard", lambda pages: given.append(discard(pages)))
    cache.park(1)
    assert given and given[0] > 0  # whole OS pages of the freed KV pages went back
    for a, b in zip(before, stored(cache, 2)):
        assert all(torch.equal(x, y) for x, y in zip(a, b))  # the others are untouched
    cache.unpark(1)  # pages handed out again are zeroed, then written
    check_pool(cache)
